"""EngineCore: scheduler + KV cache + model runner, stepped by a busy loop (engine/proc.py)
or by the offline LLM API (engine/llm.py). Fault injection (chaos tests, poison requests)
wraps the runner's ``execute`` (engine/fault_injection.py); a core never asked for faults
runs its runner bare. KV blocks taken from other engines' segments (salvage, handover
pre-copy, a live peer's prefix) are engine/kv_adoption.py's, a mixin of EngineCore."""

from __future__ import annotations

import queue
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import structlog

from planaria.engine import envs, prompt_logprobs
from planaria.engine.config import EngineConfig
from planaria.engine.core_protocol import EngineCoreProtocol
from planaria.engine.errors import (EngineError, InvalidRequestError, KVCacheTooSmallError, WeightLoadError,
                                    WeightLoadInProgressError)
from planaria.engine.fault_injection import FaultInjectingRunner, StepRunner
from planaria.engine.iteration_details import IterationRecorder, scheduler_dump
from planaria.engine.kv_adoption import KVAdoption, SalvageStats
from planaria.engine.kv_cache_manager import KVCacheManager
from planaria.engine.messages import (MAX_CACHE_SALT_CHARS, MAX_KV_EVENT_HASHES, EngineCoreOutput,
                                     EngineCoreRequest, KVCacheEvents, OutputErrorCode, SchedulerStats)
from planaria.engine.model_runner import ModelRunner
from planaria.engine.models.loader import load_hf_config, model_fingerprint, sliding_window_limit
from planaria.engine.request import FINISH_REASONS, Request, RequestStatus
from planaria.engine.sampling_metadata import PRIOR_OUTPUT_TOKENS_KEY
from planaria.engine.scheduler import Scheduler, SchedulerOutput
from planaria.engine.structured_output import StructuredOutputManager

log = structlog.get_logger("planaria.engine")
_ERROR_CODE_KEY = "_error_code"  # Request.extra: the OutputErrorCode of a request failed with an error


def admission_error(request_id, exc: Exception) -> EngineCoreOutput:
    """The error output of a request that could not be admitted or prepared: INVALID_REQUEST
    when the request is at fault (InvalidRequestError, or RecursionError: input nested past
    the interpreter's limit), else INTERNAL (logged with its traceback)."""
    rid = request_id if isinstance(request_id, str) else str(request_id)
    if isinstance(exc, InvalidRequestError):
        code, text = OutputErrorCode.INVALID_REQUEST, str(exc)
    elif isinstance(exc, RecursionError):
        code, text = OutputErrorCode.INVALID_REQUEST, "request is nested too deeply to process"
    else:
        log.exception("could not admit a request", request_id=rid)
        code, text = OutputErrorCode.INTERNAL, f"internal error preparing the request: {type(exc).__name__}: {exc}"
    return EngineCoreOutput(request_id=rid, finish_reason="error", error=text, error_code=code.value)


class EngineCore(KVAdoption):
    """Generation: implements engine.core_protocol.EngineCoreProtocol."""

    is_pooling = False

    def __init__(self, config: EngineConfig, expert_range=None, progress=None) -> None:
        config.validate()
        self.config = config
        t_config = time.monotonic()
        hf_config = load_hf_config(config.model)  # the first call imports transformers
        config_s = time.monotonic() - t_config
        max_len = config.max_model_len or hf_config.max_position_embeddings
        window = sliding_window_limit(hf_config)
        if window and max_len > window:
            log.warning("capping max_model_len to the sliding window", window=window)
            max_len = window
        t_load = time.monotonic()
        self.runner = ModelRunner(config, max_len, expert_range, progress, hf_config=hf_config)
        # weights_s: model build and weight read (build_s, read_s); config_s: config.json
        self.init_timings = {"weights_s": time.monotonic() - t_load, **self.runner.load_timings,
                             "config_s": config_s}
        self.vocab_size = self.runner.spec.vocab_size
        choice = self.runner.dtype_choice
        self.dtype_text = f"{choice.name} ({choice.reason})"
        if self.runner.invariance.on:  # engine/batch_invariance.py
            self.dtype_text += f"; batch-invariant ({self.runner.invariance.reason})"
        self.model_fingerprint = model_fingerprint(config.model)
        self.weight_version = self.model_fingerprint
        self._weight_update = None  # engine.weight_update.WeightLoad: reading, or waiting for its step boundary
        self.last_weight_load = None  # the last one applied or failed (weight_status)
        self.iterations = IterationRecorder() if config.iteration_details else None

        # KV sizing: an explicit figure skips profiling (a scale-up launch reuses one).
        self.profile = None
        if config.num_kv_blocks:
            kv_bytes = config.num_kv_blocks * self.runner.bytes_per_block
            self.kv_source = config.kv_source or "given"
        elif config.kv_cache_bytes:
            kv_bytes = config.kv_cache_bytes
            self.kv_source = config.kv_source or "given"
        else:
            self.profile = self.runner.profile()
            self.init_timings["profile_s"] = self.profile.profile_s
            kv_bytes = self.profile.kv_cache_bytes
            self.kv_source = "profiled"
            log.info("memory profiled", budget_bytes=self.profile.budget_bytes,
                     weights_bytes=self.profile.weights_bytes,
                     peak_activation_bytes=self.profile.peak_activation_bytes, kv_cache_bytes=kv_bytes)
        if kv_bytes < self.runner.bytes_per_block:
            raise KVCacheTooSmallError(
                f"KV cache budget {kv_bytes} bytes is below one block ({self.runner.bytes_per_block} bytes)")
        t_kv = time.monotonic()
        from planaria.engine.kv_segment import weights_identity

        self.kv_identity = weights_identity(config.model)  # what the KV of a segment was computed with
        self.num_kv_blocks = self.runner.init_kv_cache(kv_bytes, self.kv_identity if config.enable_prefix_caching else None)
        self.init_timings["kv_alloc_s"] = time.monotonic() - t_kv
        if config.compile:  # decode graphs compiled now, not at the first steps (engine/compiled.py)
            t_compile = time.monotonic()
            self.runner.compile_decode()
            self.init_timings["compile_s"] = time.monotonic() - t_compile
            self.dtype_text += f"; compiled decode {self.runner.compile_status}"
        self.kv_cache_bytes = self.num_kv_blocks * self.runner.bytes_per_block
        capacity = self.num_kv_blocks * config.block_size
        if capacity < max_len and config.strict_max_model_len:
            raise KVCacheTooSmallError(
                f"KV cache holds {capacity} tokens ({self.num_kv_blocks} blocks of {config.block_size}), "
                f"below max_model_len={max_len}; lower max_model_len, raise the KV budget, or unset "
                "strict_max_model_len to let the engine lower max_model_len to fit")
        if capacity < max_len:
            log.warning("KV cache cannot hold one max_model_len sequence; lowering max_model_len",
                        max_model_len=max_len, kv_capacity_tokens=capacity)
            max_len = capacity
        self.max_model_len = max_len

        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.kv.record = self.runner.kv_segment  # None: private KV (no salvage of this engine)
        self.salvage = SalvageStats()
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   max_len, config.scheduling_policy, config.enable_chunked_prefill)
        self.structured = StructuredOutputManager(config.tokenizer or config.model, self.vocab_size)
        self.runner.attach_structured(self.structured)  # grammar bitmasks, filled during the forward
        # Aborts from another thread (queue_aborts), applied between a forward and its output
        # update, so an abort that arrives mid-forward yields no token of that step.
        self.aborts_queue: queue.SimpleQueue[list[Request]] = queue.SimpleQueue()
        self._pending_outputs: list[EngineCoreOutput] = []
        self.step_counter = 0
        # fault injection only: set at start for poison tokens (bench/mttr.py), else by inject_step_fault
        poison = envs.get().poison_tokens
        self._faults = FaultInjectingRunner(self.runner, poison) if poison else None
        self._step_runner: StepRunner = self._faults or self.runner  # what runs each batch
        self._flight = None  # engine.flight_record.FlightRecorder (record_flights_to)
        self._inflight: SchedulerOutput | None = None
        self.batch_queue: deque[tuple[Future, SchedulerOutput]] = deque()
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="model-exec")
                          if config.max_concurrent_batches > 1 else None)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, ecr: EngineCoreRequest) -> None:
        """Never raises: a request that cannot be admitted gets an error output on the next
        step (admission_error says whose fault it was), and the engine serves on."""
        try:
            req = self._make_request(ecr)
        except Exception as exc:  # noqa: BLE001 - one request never stops the engine
            self._pending_outputs.append(admission_error(getattr(ecr, "request_id", ""), exc))
            return
        if ecr.kv_salvage:
            self._salvage(req, ecr.kv_salvage)
        elif ecr.kv_peer:
            self._copy_from_peer(req, ecr.kv_peer)
        self.scheduler.add_request(req)

    def _make_request(self, ecr: EngineCoreRequest) -> Request:
        rid = ecr.request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request_id must be a non-empty string")
        if rid in self.scheduler.requests:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        ids = ecr.prompt_token_ids
        self.check_prompt(ids)
        params = ecr.sampling_params
        params.validate(self.vocab_size, self.config.max_logprobs)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        group = ecr.group_id
        if group is not None and (not isinstance(group, str) or not 0 < len(group) <= 256):
            raise InvalidRequestError("group_id must be a string of 1 to 256 characters")
        salt = ecr.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            raise InvalidRequestError(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")
        req = Request(rid, ids, params, ecr.eos_token_id, max_tokens, arrival_time=ecr.arrival_time or None,
                      priority=ecr.priority, group_id=group, cache_salt=salt)
        prior = ecr.num_prior_output_tokens
        if prior:
            if not isinstance(prior, int) or isinstance(prior, bool) or not 0 < prior < len(ids):
                raise InvalidRequestError(
                    f"num_prior_output_tokens must be in [0, {len(ids) - 1}], got {prior!r}")
            req.extra[PRIOR_OUTPUT_TOKENS_KEY] = prior
        if params.logprobs is not None:
            req.output_logprobs = []
        if params.prompt_logprobs is not None:
            values = (len(ids) - 1) * (params.prompt_logprobs + 1)
            if values > prompt_logprobs.MAX_VALUES:
                raise InvalidRequestError(
                    f"prompt_logprobs of {len(ids)} prompt tokens with top {params.prompt_logprobs} would send "
                    f"{values} values in one output; this engine's limit is {prompt_logprobs.MAX_VALUES}")
            req.prompt_logprobs = []  # filled chunk by chunk (engine/prompt_logprobs.py)
        if ecr.structured_output is not None:  # waits as WAITING_FOR_GRAMMAR until compiled
            self.structured.submit(req, ecr.structured_output, ecr.structured_output_prefix_tokens)
        return req

    def check_prompt(self, ids) -> None:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequestError("prompt_token_ids must be a list of integers")
        if not ids:
            raise InvalidRequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; the maximum context length is {self.max_model_len} "
                "(prompt plus at least one generated token)")
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidRequestError(
                f"prompt token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})")

    def abort_requests(self, request_ids: list[str]) -> None:
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._pending_outputs.append(self._output(req, []))

    def queue_aborts(self, request_ids: list[str]) -> None:
        """Thread-safe (the engine process's input thread calls it while the loop is in a
        forward): abort these requests at the loop's next abort point, which is between
        the running forward and its output update, or the start of the next step.

        Ids are resolved to their Request objects now (a dict read, atomic under the GIL)
        and an abort applies only if that same object is still the live request, so a
        queued abort never hits a later request that reuses the id. Unknown ids (not added
        yet, or finished) are skipped: the caller keeps its ordered abort path for those."""
        reqs = [req for req in map(self.scheduler.requests.get, request_ids) if req is not None]
        if reqs:
            self.aborts_queue.put(reqs)

    def fail_requests(self, request_ids: list[str], error: str,
                      code: OutputErrorCode = OutputErrorCode.INTERNAL) -> None:
        for req in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR):
            req.error = error
            req.extra[_ERROR_CODE_KEY] = code
            self._pending_outputs.append(self._output(req, []))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._pending_outputs) or (
            self._weight_update is not None and self._weight_update.read_done)  # a swap (or its failure) is due

    # -- stepping ---------------------------------------------------------------------------
    def step(self, force_forward: bool = False) -> tuple[list[EngineCoreOutput], bool]:
        """One scheduling step. ``force_forward`` (expert parallelism): run a forward even
        when nothing is schedulable, so every rank joins the step's collectives."""
        step_t0 = time.perf_counter()
        self._process_aborts_queue()  # those that came in since the last step
        outputs = self._take_pending()
        if self._weight_update is not None:
            self._maybe_swap_weights()
        if self.structured.num_pending:
            outputs.extend(self._poll_grammars())
        sched = self.scheduler.schedule() if self.scheduler.has_schedulable_requests() else None
        if sched is None or sched.empty:
            if force_forward:
                self.execute_dummy_step()
                return outputs, True
            return outputs, False
        self._inflight = sched
        result = self._execute_guarded(sched)
        self._inflight = None
        self._process_aborts_queue()
        outputs.extend(self._update(sched, result))
        if self.iterations is not None:
            self.iterations.record(self.step_counter - 1, sched, time.perf_counter() - step_t0, self.scheduler)
        if self._weight_update is not None:  # the last old request may just have finished
            self._maybe_swap_weights()
        return outputs + self._take_pending(), True

    def execute_dummy_step(self) -> None:
        """A forward over zero tokens, counted as a step (expert parallelism: a rank with
        nothing of its own still joins the step's collectives)."""
        self.runner.execute_dummy()
        self.step_counter += 1

    def recover_after_fault(self) -> None:
        """After an engine-level fault inside a step: roll the in-flight batch back so its
        requests recompute that step (their KV for it may be partly written)."""
        for sched in [self._inflight] + [s for _, s in self.batch_queue]:
            if sched is None:
                continue
            for sr in sched.scheduled:
                sr.req.in_flight = False
                if sr.req.status == RequestStatus.RUNNING and sr.req.num_computed_tokens > sr.start_pos:
                    sr.req.num_computed_tokens = sr.start_pos
        self._inflight = None
        self.batch_queue.clear()

    def record_flights_to(self, recorder) -> None:
        """Before each forward, write the requests taking their first step to ``recorder``
        (engine/flight_record.py: a crash is pinned on them)."""
        self._flight = recorder

    def inject_step_fault(self, kind: str) -> None:
        """Chaos tests: the next step raises before its forward ("fatal"), or fails its first
        request after it ("request"). The first call wraps the runner (engine/fault_injection.py)."""
        if self._faults is None:
            self._faults = self._step_runner = FaultInjectingRunner(self.runner)
        self._faults.inject_next_step(kind)

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput] | None, bool]:
        """Keep up to max_concurrent_batches in flight: schedule and submit a new batch
        while an earlier one runs; block only when the queue is full or nothing else
        can be scheduled."""
        if self._executor is None:
            return self.step()
        self._process_aborts_queue()
        outputs = self._take_pending()
        if self._weight_update is not None:
            self._maybe_swap_weights()
        if self.structured.num_pending:
            outputs.extend(self._poll_grammars())
        executed = False
        if len(self.batch_queue) < self.config.max_concurrent_batches and self.scheduler.has_schedulable_requests():
            sched = self.scheduler.schedule()
            if not sched.empty:
                self.batch_queue.appendleft((self._executor.submit(self._execute_guarded, sched), sched))
                executed = True
                if len(self.batch_queue) < self.config.max_concurrent_batches:
                    return outputs or None, executed
        if not self.batch_queue:
            return outputs or None, executed
        future, sched = self.batch_queue.pop()
        wait_t0 = time.perf_counter()
        result = future.result()
        self._process_aborts_queue()
        outputs.extend(self._update(sched, result))
        if self.iterations is not None:  # step_s: the wait for the batch plus its update
            self.iterations.record(self.step_counter - 1, sched, time.perf_counter() - wait_t0, self.scheduler)
        outputs.extend(self._take_pending())
        return outputs, True

    def _execute_guarded(self, sched: SchedulerOutput):
        from planaria.engine.errors import RequestExecutionError

        if self._flight is not None:  # which requests a crash in this forward would be pinned on
            self._flight.record(self.step_counter, [sr.req.request_id for sr in sched.scheduled if _first_step(sr)])
        try:
            return self._step_runner.execute(sched)
        except RequestExecutionError as exc:
            return exc  # applied in _update on the loop thread
        except Exception:
            log.error("step failed; scheduler state", step_index=self.step_counter,
                      scheduler=scheduler_dump(self.scheduler, sched))
            raise
        finally:
            self.step_counter += 1

    def _update(self, sched: SchedulerOutput, result) -> list[EngineCoreOutput]:
        from planaria.engine.errors import RequestExecutionError

        if isinstance(result, RequestExecutionError):
            failed = set(result.request_ids)
            for sr in sched.scheduled:
                sr.req.in_flight = False
                if sr.req.request_id not in failed and sr.req.status == RequestStatus.RUNNING:
                    # Roll the innocent requests back so they recompute this step.
                    sr.req.num_computed_tokens = sr.start_pos
            self.fail_requests(list(failed), str(result), OutputErrorCode.INVALID_REQUEST
                               if result.request_fault else OutputErrorCode.INTERNAL)
            return self._take_pending()
        sampled, logprobs, prompt_lps = result
        if prompt_lps:
            broken = [sched.scheduled[slot].req.request_id for slot, (start, entries) in prompt_lps.items()
                      if sched.scheduled[slot].req.status == RequestStatus.RUNNING
                      and not prompt_logprobs.accept(sched.scheduled[slot].req, start, entries)]
            if broken:  # cannot happen while each chunk's result is applied in order
                self.fail_requests(broken, "internal error: a chunk of prompt logprobs is missing")
        if logprobs is not None:
            for sr, lp in zip(sched.scheduled, logprobs):
                if lp is not None and sr.req.output_logprobs is not None:
                    sr.req.extra["_new_logprobs"] = lp
        if self.kv.record is not None:  # the step's KV is written: its full blocks are trusted
            running = RequestStatus.RUNNING
            for sr in sched.scheduled:
                if sr.req.status is running:
                    self.kv.commit(sr.req, sr.start_pos + sr.num_tokens)
        touched = self.scheduler.update_from_output(sched, sampled)
        for req in touched:
            if req.structured is not None and req.status == RequestStatus.RUNNING:
                self._advance_grammar(req)
        outs = []
        for req in touched:
            outs.append(self._output(req, [req.output_token_ids[-1]]))
        return outs

    def _output(self, req: Request, new_tokens: list[int]) -> EngineCoreOutput:
        status = req.status
        lp = req.extra.pop("_new_logprobs", None)
        if status is RequestStatus.RUNNING and lp is None and req.prompt_logprobs is None:
            # the common case, once per request per step: no more fields than it has
            return EngineCoreOutput(request_id=req.request_id, new_token_ids=new_tokens,
                                    num_cached_tokens=req.num_cached_tokens, weight_version=self.weight_version)
        reason = FINISH_REASONS.get(status)
        code = req.extra.get(_ERROR_CODE_KEY, OutputErrorCode.INTERNAL) if reason == "error" else None
        return EngineCoreOutput(
            request_id=req.request_id, new_token_ids=new_tokens, finish_reason=reason,
            stop_reason=req.stop_reason if reason == "stop" else None,
            new_logprobs=[lp] if lp is not None and new_tokens else None,
            num_cached_tokens=req.num_cached_tokens, error=req.error,
            error_code=code.value if code is not None else None, weight_version=self.weight_version,
            prompt_logprobs=prompt_logprobs.take(req) if new_tokens else None)  # with the first token

    def _poll_grammars(self) -> list[EngineCoreOutput]:
        """Compiled grammars join the waiting queue; failed ones end their request."""
        ready, failed = self.structured.take_ready()
        for req in ready:
            if req.status != RequestStatus.WAITING_FOR_GRAMMAR:
                continue  # aborted while compiling
            if req.structured.done:  # a replay prefix already completed the grammar
                self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
                self._pending_outputs.append(self._output(req, []))
            else:
                self.scheduler.grammar_ready(req)
        for req in failed:
            if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.fail_requests([req.request_id], req.structured.error, req.structured.error_code)
        return self._take_pending()

    def _advance_grammar(self, req: Request) -> None:
        verdict = self.structured.accept(req, req.output_token_ids[-1])
        if verdict == "stop":
            req.stop_reason = None
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
        elif verdict is not None:  # the grammar's dead end (the request's), or a token the mask excluded (ours)
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            req.error = verdict
            req.extra[_ERROR_CODE_KEY] = (OutputErrorCode.INVALID_REQUEST if req.structured.dead_end
                                          else OutputErrorCode.INTERNAL)

    def take_kv_events(self) -> KVCacheEvents | None:
        """The prefix cache's changes since the last call, or None (engine/block_pool.py);
        ``seq`` and ``pid`` are the engine process's to fill."""
        events = self.kv.take_events(MAX_KV_EVENT_HASHES)
        if events is None:
            return None
        return KVCacheEvents(seq=0, cleared=events.cleared, stored=events.stored, removed=events.removed)

    def take_iteration_details(self) -> list | None:
        """The steps recorded since the last call (EngineConfig.iteration_details), or None."""
        return self.iterations.take() if self.iterations is not None else None

    def _process_aborts_queue(self) -> None:
        live = self.scheduler.requests
        while not self.aborts_queue.empty():  # this thread is its only reader (twice a step: no try/except)
            reqs = self.aborts_queue.get_nowait()
            self.abort_requests([r.request_id for r in reqs if live.get(r.request_id) is r])

    def _take_pending(self) -> list[EngineCoreOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

    # -- introspection ----------------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                              kv_usage=round(self.kv.usage, 4), num_preemptions=self.scheduler.num_preemptions,
                              prefix_cache_hit_rate=round(self.kv.prefix_cache_hit_rate, 4),
                              num_prefill_tokens=self.scheduler.num_prefill_tokens,
                              num_salvaged_requests=self.salvage.num_requests - self.salvage.num_refused,
                              num_salvage_refused=self.salvage.num_refused,
                              num_salvaged_blocks=self.salvage.num_blocks,
                              num_peer_requests=self.salvage.num_peer_requests,
                              num_peer_blocks=self.salvage.num_peer_blocks)

    def config_hash(self) -> str:
        return self.config.hash() + self.model_fingerprint[:8]

    def kv_figures(self) -> dict:
        d = {"kv_cache_bytes": self.kv_cache_bytes, "num_kv_blocks": self.num_kv_blocks,
             "block_size": self.config.block_size, "kv_source": self.kv_source,
             "max_model_len": self.max_model_len}
        if self.profile is not None:
            d.update(profile_s=round(self.profile.profile_s, 3),
                     peak_activation_bytes=self.profile.peak_activation_bytes,
                     weights_bytes=self.profile.weights_bytes)
        return d

    # -- weights --------------------------------------------------------------------------
    def load_weights(self, model_dir: str, version: str | None = None, mode: str = "finish_old",
                     on_read=None) -> dict:
        """Start reading new weights (same architecture) on a thread; they are swapped in at
        a step boundary once read (engine/weight_update.py: modes, states). Returns the
        load's description at once; ``on_read()`` runs on the reading thread when it is done
        (the engine process wakes its loop). WeightLoadError at once, nothing started, for a
        bad mode or directory or another architecture; WeightLoadInProgressError (a
        WeightLoadError) for a load already in progress."""
        from planaria.engine.weight_update import IN_PROGRESS, WeightLoad, check_request

        if self._weight_update is not None:
            raise WeightLoadInProgressError(f"{IN_PROGRESS} ({self._weight_update.model_dir}, "
                                            f"{self._weight_update.state}); wait for it to finish")
        check_request(self.runner, model_dir, mode)
        self._weight_update = WeightLoad.start(self.runner, model_dir, version, mode, on_read)
        return self._weight_update.describe()

    def weight_status(self) -> dict:
        load = self._weight_update or self.last_weight_load
        return {"version": self.weight_version, "model_dir": self.runner.model_dir,
                "load": load.describe() if load is not None else None}

    def _maybe_swap_weights(self) -> None:
        from planaria.engine.weight_update import apply

        load = self._weight_update
        if not load.read_done:
            return
        if load.error is None:
            if load.mode != "continue_new":
                self.scheduler.admit_new = False  # new requests wait for the new weights
            in_flight = len(self.batch_queue) + (self._inflight is not None)
            if load.decide(self.scheduler.num_running, in_flight) != "swap":
                return
            if load.mode == "continue_new":
                self.scheduler.preempt_running()
            try:
                apply(self.runner, load)
            except WeightLoadError as exc:
                load.fail(str(exc))
            else:
                self.kv.reset_prefix_cache()  # cached blocks hold the old weights' KV
                self.weight_version = load.version
                if self.kv.record is not None:  # nothing in the segment is these weights' KV
                    from planaria.engine.kv_segment import weights_identity

                    self.kv_identity = weights_identity(self.runner.model_dir, load.version)
                    self.kv.record.invalidate_all(self.runner.kv_fingerprint(self.kv_identity))
        self._weight_update, self.last_weight_load = None, load
        self.scheduler.admit_new = True

    def weights_handover_due(self) -> bool:
        """A "hand_over" load is read and requests still run on the old weights: the engine
        process offers them to the frontends once (engine/proc.py)."""
        load = self._weight_update
        if load is None or load.mode != "hand_over" or load.offered or not load.read_done or load.error:
            return False
        load.offered = True
        return self.scheduler.num_running + self.scheduler.num_waiting > 0 and self.runner.kv_segment is not None

    def weights_handover_open(self) -> bool:
        """Requests may still be handed over for a "hand_over" load (not swapped yet)."""
        load = self._weight_update
        return load is not None and load.mode == "hand_over" and load.offered and load.error is None

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        self.batch_queue.clear()
        self.structured.shutdown()


def create_engine_core(config: EngineConfig, expert_range=None, progress=None) -> EngineCoreProtocol:
    """EngineCore, or PoolingEngineCore for runner_type "pooling" (or a BertModel checkpoint)."""
    from planaria.engine.pooling import PoolingEngineCore, is_pooling_model

    if is_pooling_model(config):
        return PoolingEngineCore(config, expert_range, progress)
    return EngineCore(config, expert_range, progress)


def _first_step(sr) -> bool:
    """The request's first chunk (after its prefix-cache hit), never run before: not a
    decode, not a later chunk, not the recompute of a preempted request."""
    req = sr.req
    return sr.start_pos == req.num_cached_tokens and not req.output_token_ids and not req.num_preemptions


__all__ = ["EngineCore", "EngineError", "create_engine_core"]

