"""PoolingEngineCore: EngineCore's interface for embedding models.

No KV cache and no chunking: each step takes whole waiting prompts (at most max_num_seqs
of them and max_num_batched_tokens tokens, always at least one), runs one padded encoder
forward and ends every request with its pooled vector (``EngineCoreOutput.pooled``,
finish_reason "stop").
"""

from __future__ import annotations

import queue
import time
from pathlib import Path

import structlog
import torch

from planaria.engine.config import EngineConfig
from planaria.engine.errors import (InvalidRequestError, RequestExecutionError, UnsupportedModelError,
                                    WeightLoadError)
from planaria.engine.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from planaria.engine.dtype import choose_dtype
from planaria.engine.models.loader import model_fingerprint
from planaria.engine.pooling.loader import is_bert_config, load_bert, read_json
from planaria.kernels.pooling import POOLERS, l2_normalize

log = structlog.get_logger("planaria.engine.pooling")


def is_pooling_model(config: EngineConfig) -> bool:
    if config.runner_type is not None:
        return config.runner_type == "pooling"
    cfg = read_json(Path(config.model) / "config.json")
    return isinstance(cfg, dict) and is_bert_config(cfg)


class PoolingEngineCore:
    """Embeddings: implements engine.core_protocol.EngineCoreProtocol (no KV cache: zero
    blocks, kv_source "none"; nothing is ever running between steps, only waiting)."""

    is_pooling = True

    def __init__(self, config: EngineConfig, expert_range=None, progress=None) -> None:
        config.validate()
        if expert_range is not None:
            raise UnsupportedModelError("expert parallelism needs a mixture-of-experts model")
        if config.enable_chunked_prefill:
            log.warning("Chunked prefill is not supported for pooling models; disabling")
        self.config = config
        self.device = torch.device(config.device)
        choice = choose_dtype(config.dtype, self.device)
        self.dtype, self.dtype_text = choice.dtype, f"{choice.name} ({choice.reason})"
        t0 = time.monotonic()
        self.model, self.spec, self.pooling, self.weights_bytes = load_bert(config.model, self.dtype, self.device)
        self.init_timings = {"weights_s": time.monotonic() - t0}
        log.info("pooling model loaded", load_s=round(self.init_timings["weights_s"], 3),
                 pooling=self.pooling.mode, normalize=self.pooling.normalize)
        limit = self.pooling.max_seq_length or self.spec.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, self.spec.max_position_embeddings)
        self.vocab_size = self.spec.vocab_size
        self.model_fingerprint = model_fingerprint(config.model)
        self.weight_version = self.model_fingerprint
        self.num_kv_blocks, self.kv_cache_bytes, self.kv_source, self.profile = 0, 0, "none", None
        # Aborts from another thread (queue_aborts), applied at the start of the next step.
        self.aborts_queue: queue.Queue[list[EngineCoreRequest]] = queue.Queue()
        self.waiting: dict[str, EngineCoreRequest] = {}  # request id -> request, in arrival order
        self._pending_outputs: list[EngineCoreOutput] = []
        self._fault_next_step: str | None = None  # fault injection (inject_step_fault)
        self.step_counter = 0
        self.num_embedded = 0

    # -- requests ---------------------------------------------------------------------------
    def check_prompt(self, ids) -> None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers")
        if not ids:
            raise InvalidRequestError("input is empty")
        if len(ids) > self.max_model_len:
            raise InvalidRequestError(f"input has {len(ids)} tokens; the maximum is {self.max_model_len}")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise InvalidRequestError(f"input token ids must be in [0, {self.vocab_size})")

    def add_request(self, ecr: EngineCoreRequest) -> None:
        try:
            if not isinstance(ecr.request_id, str) or not ecr.request_id:
                raise InvalidRequestError("request_id must be a non-empty string")
            if ecr.request_id in self.waiting:
                raise InvalidRequestError(f"request id {ecr.request_id!r} is already in use")
            self.check_prompt(ecr.prompt_token_ids)
        except InvalidRequestError as exc:
            self._pending_outputs.append(self._out(str(getattr(ecr, "request_id", "")), "error", error=str(exc)))
            return
        self.waiting[ecr.request_id] = ecr

    def abort_requests(self, request_ids: list[str]) -> None:
        self._drop(request_ids, "abort", None)

    def queue_aborts(self, request_ids: list[str]) -> None:
        """Thread-safe: resolved to the live requests now (dict reads), applied at the start
        of the next step only to those same requests (never to a later one reusing an id)."""
        reqs = [r for r in map(self.waiting.get, request_ids) if r is not None]
        if reqs:
            self.aborts_queue.put(reqs)

    def fail_requests(self, request_ids: list[str], error: str) -> None:
        self._drop(request_ids, "error", error)

    def _drop(self, request_ids, reason: str, error: str | None) -> None:
        for rid in dict.fromkeys(request_ids):
            if self.waiting.pop(rid, None) is not None:
                self._pending_outputs.append(self._out(rid, reason, error=error))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting) or bool(self._pending_outputs)

    # -- stepping ---------------------------------------------------------------------------
    def step(self, force_forward: bool = False) -> tuple[list[EngineCoreOutput], bool]:
        outputs, self._pending_outputs = self._pending_outputs, []
        self._process_aborts_queue()
        outputs += self._pending_outputs
        self._pending_outputs = []
        if not self.waiting:
            return outputs, False
        batch, num_tokens = [], 0
        for r in self.waiting.values():
            n = len(r.prompt_token_ids)
            if batch and (len(batch) == self.config.max_num_seqs
                          or num_tokens + n > self.config.max_num_batched_tokens):
                break
            batch.append(r)
            num_tokens += n
        fault, self._fault_next_step = self._fault_next_step, None
        if fault == "fatal":
            raise RuntimeError("injected fatal fault")
        vectors = self.embed([r.prompt_token_ids for r in batch])  # a failure leaves them waiting
        if fault == "request":
            raise RequestExecutionError([batch[0].request_id], "injected request fault")
        for r in batch:
            del self.waiting[r.request_id]
        self.step_counter += 1
        self.num_embedded += len(batch)
        for r, v in zip(batch, vectors.tolist()):
            outputs.append(self._out(r.request_id, "stop", pooled=v))
        return outputs, True

    step_with_batch_queue = step

    def record_flights_to(self, recorder) -> None:
        """Not kept: an embedding request runs whole in one forward and a crash there is
        pinned by the journal's count of engines lost with it (frontend/journal.py)."""

    def inject_step_fault(self, kind: str) -> None:
        """Chaos tests: the next step raises before its forward ("fatal"), or fails its
        first request after it ("request")."""
        self._fault_next_step = kind

    def recover_after_fault(self) -> None:
        """Nothing is in flight between steps: a failed step's requests are still waiting."""

    def embed(self, batch: list[list[int]]) -> torch.Tensor:
        """Pooled (and, per the model's config, normalised) vectors [B, H], float32 on CPU."""
        longest = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), longest), self.spec.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.bool)
        for i, seq in enumerate(batch):
            ids[i, :len(seq)] = torch.tensor(seq, dtype=torch.long)
            mask[i, :len(seq)] = True
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.inference_mode():
            hidden = self.model(ids, mask)  # [B, S, H]
            pooled = POOLERS[self.pooling.mode](hidden.float(), mask)
            if self.pooling.normalize:
                pooled = l2_normalize(pooled)
        return pooled.cpu()

    def _out(self, rid: str, reason: str, pooled=None, error=None) -> EngineCoreOutput:
        return EngineCoreOutput(request_id=rid, finish_reason=reason, pooled=pooled, error=error,
                                weight_version=self.weight_version)

    def _process_aborts_queue(self) -> None:
        while True:
            try:
                reqs = self.aborts_queue.get_nowait()
            except queue.Empty:
                return
            self.abort_requests([r.request_id for r in reqs if self.waiting.get(r.request_id) is r])

    # -- introspection (EngineCore's) -------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=0, num_waiting=len(self.waiting))

    def take_iteration_details(self) -> list | None:
        """Embedding steps keep no step records."""
        return None

    def take_kv_events(self) -> None:
        """No KV cache, so no prefix cache to report."""
        return None

    def config_hash(self) -> str:
        return self.config.hash() + self.model_fingerprint[:8]

    def kv_figures(self) -> dict:
        return {"kv_cache_bytes": 0, "num_kv_blocks": 0, "block_size": self.config.block_size,
                "kv_source": self.kv_source, "max_model_len": self.max_model_len}

    def load_weights(self, model_dir: str, version: str | None = None, mode: str = "finish_old",
                     on_read=None) -> dict:
        raise WeightLoadError("loading new weights into a running pooling model is not supported; "
                              "restart the engine with the new model")

    def weight_status(self) -> dict:
        return {"version": self.weight_version, "model_dir": self.config.model, "load": None}

    def reset_prefix_cache(self) -> bool:
        return True  # no KV cache, so no prefix cache: nothing to empty

    def shutdown(self) -> None:
        self.waiting.clear()
