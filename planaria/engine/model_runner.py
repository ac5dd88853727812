"""Runs one scheduled batch: lays it out (engine/batch_layout.py, a pure function), builds
the input tensors and attention metadata, runs the model and its lm head, samples, and puts
the tokens back in ``scheduled`` order. Owns the model weights and the paged KV cache tensors.

Fault injection is no part of it: engine/fault_injection.py wraps ``execute`` when a chaos
test asks for faults."""

from __future__ import annotations

import mmap
import time
from typing import TYPE_CHECKING, NamedTuple

import structlog
import torch

from planaria.engine import batch_invariance, kv_segment, prompt_logprobs
from planaria.engine.batch_layout import BatchLayout, layout_batch
from planaria.engine.config import EngineConfig
from planaria.engine.dtype import choose_dtype
from planaria.engine.errors import KVCacheTooSmallError, RequestExecutionError
from planaria.engine.memory import MemoryProfile, device_memory_bytes, measure_peak, tune_cpu_allocator
from planaria.engine.messages import Logprobs
from planaria.engine.models import packing
from planaria.engine.models.loader import load_model, refresh_node_experts
from planaria.engine.request import Request
from planaria.engine.sampler import Sampler
from planaria.engine.sampling_metadata import SamplingMetadata
from planaria.engine.scheduler import SchedulerOutput
from planaria.kernels import cpu_ext
from planaria.kernels.attention import AttentionMetadata, build_metadata, long_tensor

if TYPE_CHECKING:  # the manager is EngineCore's (attach_structured); the runner only calls it
    from planaria.engine.structured_output import StructuredOutputManager

log = structlog.get_logger("planaria.engine.runner")


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The compute dtype (engine/dtype.py: "auto" is bfloat16 where the CPU has AMX or
    AVX512-BF16 and on GPUs, float32 elsewhere)."""
    return choose_dtype(config.dtype, device).dtype


class StepResult(NamedTuple):
    """What ``ModelRunner.execute`` returns for one scheduled batch."""

    sampled: list[int]  # aligned with sched.scheduled; -1 where no token is sampled
    logprobs: list[Logprobs | None] | None  # aligned likewise; None when no row asked
    prompt_logprobs: prompt_logprobs.StepPromptLogprobs | None  # slot -> (first position, entries)


class _Head(NamedTuple):
    """The lm head's output for the sampled rows: greedy tokens taken inside it, or logits."""

    smd: SamplingMetadata
    greedy_tokens: list[int] | None  # plain greedy rows, no grammar: the argmax, chunk by chunk
    logits: torch.Tensor | None  # [rows, V] otherwise (grammar-masked), for the sampler


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int, expert_range=None, progress=None,
                 hf_config=None) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.dtype_choice = choose_dtype(config.dtype, self.device)
        self.dtype = self.dtype_choice.dtype
        if self.device.type == "cpu":
            tune_cpu_allocator()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
            if self.dtype != torch.float32:  # bf16/fp16 decode attention: C++ or torch code
                log.info("C++ CPU kernels: %s", cpu_ext.status())
        # the batch-invariant kernels, or not (engine/batch_invariance.py: "auto" by default)
        self.invariance = batch_invariance.choose(config.batch_invariant, self.device, self.dtype, config.compile)
        log.info("batch-invariant mode %s (%s)", "on" if self.invariance.on else "off", self.invariance.reason)
        t0 = time.monotonic()
        self.load_timings: dict[str, float] = {}  # build_s, read_s (engine/models/loader.py)
        self.model, self.hf_config, self.spec, self.weights_bytes = load_model(
            config.model, self.dtype, self.device, max_model_len, expert_range, progress,
            hf_config=hf_config, timings=self.load_timings, batch_invariant=self.invariance.on)
        # bf16 / float32 linears on the CPU get packed copies (for oneDNN, or for the batch-invariant
        # kernel), counted before the memory profile
        self.packed_bytes = packing.pack_linears(self.model, self.device, self.dtype, experts=expert_range is None)
        self.weights_bytes += self.packed_bytes
        self.load_s = time.monotonic() - t0
        self.expert_range = expert_range  # not None: an expert-parallel rank's share
        self._model_dir = config.model  # where the weights in place came from (replace_weights moves it)
        self.block_size = config.block_size
        self.max_positions = max_model_len  # rows of the rotary tables
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.sampler = Sampler()
        self.forward_s = 0.0  # cumulative time in the model forward and lm head, not the sampler (bench/ reads it)
        self.last_num_tokens = 0
        self._structured: StructuredOutputManager | None = None  # attach_structured
        self.compiled = None  # engine.compiled.CompiledDecode, once warmed up (config.compile)
        self.kv_segment: kv_segment.KVSegment | None = None  # init_kv_cache
        self.compile_status = "off"  # shown by `planaria status`: off, on (warm-up seconds), or why not

    @property
    def model_dir(self) -> str:
        """Where the weights in place came from: the start-up checkpoint, or the last one
        swapped in (replace_weights)."""
        return self._model_dir

    # -- KV cache sizing -------------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        s = self.spec
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * s.num_layers * self.block_size * s.num_kv_heads * s.head_dim * elem

    def profile(self) -> MemoryProfile:
        """Dummy forward at max_num_batched_tokens; kv = budget*util - weights - peak."""
        t0 = time.monotonic()
        n = self.config.max_num_batched_tokens
        num_dummy_blocks = -(-n // self.block_size)
        self._allocate_kv(num_dummy_blocks, lazy=False)  # touched before the baseline is read
        with measure_peak(self.device) as m, torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            pos = torch.arange(n, dtype=torch.long, device=self.device) % self.max_positions
            md = build_metadata([], [], [(list(range(num_dummy_blocks)), 0, n)], self.block_size, self.device)
            hidden = self.model(ids, pos, self.kv_caches, md)
            self.model.compute_logits(hidden[-self.config.max_num_seqs:])
            del hidden
        self.kv_caches = []
        budget = self.config.memory_budget_bytes or device_memory_bytes(self.device)
        peak = m["peak_bytes"]
        kv = int(budget * self.config.memory_utilization) - self.weights_bytes - peak
        if self.device.type == "cpu":
            # No more than the running sequences can ever use (zeroing RAM is not free).
            usable_blocks = -(-self.config.max_num_seqs * self.max_positions // self.block_size)
            kv = min(kv, self.config.max_cpu_kv_cache_bytes, usable_blocks * self.bytes_per_block)
        return MemoryProfile(budget, self.weights_bytes, peak, kv, time.monotonic() - t0)

    def init_kv_cache(self, kv_cache_bytes: int, segment_model_id: str | None = None) -> int:
        """``segment_model_id``: put the cache in a segment that outlives this process
        (engine/kv_segment.py) when the supervisor gave a directory for it, under this
        model identity (the weights' fingerprint)."""
        num_blocks = kv_cache_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise KVCacheTooSmallError(
                f"kv_cache_bytes={kv_cache_bytes} holds no block of {self.bytes_per_block} bytes; "
                "raise memory_budget_bytes/memory_utilization or lower the model size")
        self.num_blocks = num_blocks
        directory = kv_segment.segment_dir() if segment_model_id is not None and self.device.type == "cpu" else None
        if directory is not None:
            try:
                self._allocate_kv_segment(num_blocks, directory, segment_model_id)
                return num_blocks
            except OSError as exc:  # a full /dev/shm, a foreign directory: private memory instead
                log.warning("KV segment not created; the KV cache will not outlive this process",
                            directory=str(directory), error=str(exc))
        self._allocate_kv(num_blocks)
        return num_blocks

    @property
    def kv_layout(self) -> kv_segment.KVLayout:
        s = self.spec
        return kv_segment.KVLayout(num_layers=s.num_layers, block_size=self.block_size, num_kv_heads=s.num_kv_heads,
                                   head_dim=s.head_dim, dtype=str(self.dtype).removeprefix("torch."),
                                   num_blocks=self.num_blocks)

    def kv_fingerprint(self, model_id: str) -> bytes:
        return kv_segment.fingerprint(model_id, "", self.kv_layout)

    def _allocate_kv_segment(self, num_blocks: int, directory, model_id: str) -> None:
        import os

        engine_id = int(os.environ.get("PLANARIA_ENGINE_ID", "0") or 0)
        seg = kv_segment.KVSegment(directory, engine_id, self.kv_layout, self.kv_fingerprint(model_id))
        self.kv_segment = seg
        kv = seg.kv
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(self.spec.num_layers)]
        log.info("KV cache in a segment that outlives the process", path=str(seg.path), blocks=num_blocks)

    def compile_decode(self) -> None:
        """config.compile: compile the decode forward now (engine/compiled.py), or say why not."""
        from planaria.engine.compiled import CompiledDecode, compilable

        why = compilable(self.model, expert_parallel=self.expert_range is not None)
        if why is not None:
            self.compiled, self.compile_status = None, f"off: {why}"
            log.warning("compiled decode forward off", reason=why)
            return
        compiled = CompiledDecode(self.model)
        try:
            seconds = compiled.warm_up(self.kv_caches, self.block_size, self.config.max_num_seqs, self.device)
        except Exception as exc:  # torch.compile's own failure: the engine serves eager
            self.compiled, self.compile_status = None, f"off: compiling failed ({type(exc).__name__})"
            log.error("compiled decode forward failed; running eager", error=str(exc)[:2000])
            return
        self.compiled, self.compile_status = compiled, f"on (compiled in {seconds:.1f} s)"
        log.info("compiled decode forward ready", seconds=round(seconds, 1))

    def _allocate_kv(self, num_blocks: int, lazy: bool = True) -> None:
        """Zeroed K and V caches, [slots, Hkv, D] per layer. Zeros, not torch.empty: attention
        reads slots it masks out (a decode batch pads block tables with block 0, and a last
        block's tail is gathered too), and a masked NaN still spreads (0 * NaN = NaN).
        On the CPU (``lazy``) the caches are one private anonymous mapping: the kernel hands
        out zero pages on first touch, so start-up writes no zeros and touches no pages (a
        memset of a few hundred MB costs a reused-KV start 0.1-0.5 s on this host)."""
        s = self.spec
        shape = (num_blocks * self.block_size, s.num_kv_heads, s.head_dim)
        if lazy and self.device.type == "cpu":
            elem = torch.empty((), dtype=self.dtype).element_size()
            nbytes = s.num_layers * 2 * num_blocks * self.block_size * s.num_kv_heads * s.head_dim * elem
            buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)  # anonymous: zero-filled by the kernel
            kv = torch.frombuffer(buf, dtype=self.dtype).view(s.num_layers, 2, *shape)  # keeps buf alive
        else:
            kv = torch.zeros((s.num_layers, 2, *shape), dtype=self.dtype, device=self.device)
        self.kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(s.num_layers)]

    # -- execution --------------------------------------------------------------------------
    def attach_structured(self, structured: StructuredOutputManager) -> None:
        """Grammar masks for the sampled rows of requests with a structured output, filled
        on a thread while the model runs (EngineCore attaches its manager once)."""
        self._structured = structured

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Runs the batch: samples the requests whose step ends at their last known token,
        and computes the prompt logprobs of the chunks that want them
        (engine/prompt_logprobs.py). Lay out, forward (model and lm head), sample, scatter."""
        scheduled = sched.scheduled
        layout = layout_batch(sched, self.block_size)
        md = build_metadata(layout.decode_block_table, layout.decode_ctx_lens, layout.prefills,
                            self.block_size, self.device, decode_slots=layout.decode_slots)
        reqs: list[Request] = [scheduled[i].req for i in layout.sample_slots]
        with torch.inference_mode():
            input_ids = long_tensor(layout.token_ids, self.device)
            positions = long_tensor(layout.positions, self.device)
            # grammar masks fill on a thread while the model runs (None: no grammar in the batch)
            grammar = self._structured.start_bitmask(reqs) if self._structured is not None and reqs else None
            f0 = time.perf_counter()
            hidden = self._forward(layout, input_ids, positions, md)
            head = self._lm_head(hidden, layout.logit_rows, reqs, grammar) if reqs else None
            self.forward_s += time.perf_counter() - f0  # the model and the lm head, not the sampler
            if head is None:
                sampled, logprobs = [-1] * len(scheduled), None
            else:
                tokens, row_logprobs = self._sample(head, reqs)
                sampled = layout.by_slot(tokens, -1)
                logprobs = layout.by_slot(row_logprobs, None) if row_logprobs is not None else None
            # at most max_num_seqs logit rows at once, as many as the memory profile's
            prompt_lps = (prompt_logprobs.compute(self.model, hidden, layout.prompt_plan, self.config.max_num_seqs)
                          if layout.prompt_plan is not None else None)
        return StepResult(sampled, logprobs, prompt_lps)

    def _forward(self, layout: BatchLayout, input_ids: torch.Tensor, positions: torch.Tensor,
                 md: AttentionMetadata) -> torch.Tensor:
        """The hidden states [T, H]: a decode-only batch through the compiled graphs, if any."""
        if self.compiled is not None and layout.decode_only:
            hidden = self.compiled(input_ids, positions, self.kv_caches, md)
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, md)
        self.last_num_tokens = layout.num_tokens
        return hidden

    def _lm_head(self, hidden: torch.Tensor, logit_rows: list[int], reqs: list[Request], grammar) -> _Head:
        """The sampled rows through the lm head: greedy tokens taken inside it (plain greedy,
        no grammar: no logits written out), else the logits, grammar-masked."""
        smd = SamplingMetadata.build(reqs, self.spec.vocab_size, self.device)
        if len(logit_rows) == hidden.shape[0]:  # every row samples (a decode-only batch)
            last = hidden
        else:
            last = hidden.index_select(0, torch.tensor(logit_rows, dtype=torch.long, device=self.device))
        if smd.plain_greedy and grammar is None:
            return _Head(smd, self.model.greedy_tokens(last).tolist(), None)
        # argmax alone reads the logits in the model's dtype (no float32 copy)
        logits = self.model.compute_logits(last, float32=grammar is not None or not smd.plain_greedy)
        if grammar is not None:
            grammar.apply(logits, reqs)
        return _Head(smd, None, logits)

    def _sample(self, head: _Head, reqs: list[Request]) -> tuple[list[int], list[Logprobs] | None]:
        """One token per sampled row (and its logprobs, if any row asked); RequestExecutionError
        for rows where no token can be sampled, or where sampling produced no token of the vocabulary."""
        smd, tokens, row_logprobs = head.smd, head.greedy_tokens, None
        if tokens is None:
            out = self.sampler(head.logits, smd)
            tokens = out.sampled_token_ids.tolist()
            row_logprobs = out.logprobs
            stuck = out.rows_without_token()
            if stuck:  # the request's own contradiction: e.g. allowed_token_ids all bad words
                raise RequestExecutionError(
                    [reqs[j].request_id for j in stuck],
                    "no token can be sampled: allowed_token_ids, bad_words, min_tokens and the "
                    "structured output grammar together exclude every token", request_fault=True)
        # an argmax over vocab_size columns is always a token; sampling may not be
        if not smd.plain_greedy or self.model.lm_head_weight().shape[0] > self.spec.vocab_size:
            bad = [r.request_id for r, t in zip(reqs, tokens) if not 0 <= t < self.spec.vocab_size]
            if bad:
                raise RequestExecutionError(bad, "sampling produced an invalid token (non-finite logits?)")
        return tokens, row_logprobs

    def execute_dummy(self) -> None:
        """A forward over zero tokens: an idle expert-parallel rank still takes part in
        every collective of the step, so its peers never wait on it."""
        md = build_metadata([], [], [], self.block_size, self.device)
        with torch.inference_mode():
            empty = torch.empty(0, dtype=torch.long, device=self.device)
            self.model(empty, empty, self.kv_caches, md)

    # -- weights ----------------------------------------------------------------------------
    def replace_weights(self, tensors: dict[str, torch.Tensor], model_dir: str) -> None:
        """Copy ``tensors`` (by parameter name, checked to fit by engine/weight_update.py)
        into the parameters in place, so the KV cache, buffers and any compiled graph stay
        valid; packed linears follow their new weights. Expert re-homing reads from
        ``model_dir`` from now on."""
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(tensors[name])
        packing.repack(self.model)
        self._model_dir = model_dir
        refresh_node_experts(self.model, model_dir, self.spec, self.dtype, self.device)

    def reload_experts(self, expert_range: tuple[int, int]) -> int:
        """Re-home experts: load [start, end) of every MoE layer from the checkpoint the
        weights in place came from (the latest swapped-in one, not the start-up one).
        Returns the bytes read."""
        from planaria.engine.models.loader import load_expert_weights

        return load_expert_weights(self.model, self.model_dir, self.spec, self.dtype, self.device, expert_range)
