"""What an engine process (engine/proc.py) and the offline API (engine/llm.py) call on their
engine core. ``EngineCore`` (engine/core.py, generation) and ``PoolingEngineCore``
(engine/pooling/core.py, embeddings) implement all of it; nothing here is optional, so
callers never probe a core for a method."""

from __future__ import annotations

from typing import Callable, Protocol

from planaria.engine.messages import EngineCoreOutput, EngineCoreRequest, KVCacheEvents, SchedulerStats


class EngineCoreProtocol(Protocol):
    is_pooling: bool  # an embedding model: each request ends with a pooled vector, no tokens
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    kv_cache_bytes: int
    kv_source: str  # "profiled", "given", "reused"; "none" without a KV cache
    init_timings: dict[str, float]  # where the start-up went (seconds per phase)
    dtype_text: str  # the compute dtype and why (engine/dtype.py), for logs and status
    step_counter: int  # steps run so far: the heartbeat's progress counter

    def config_hash(self) -> str:
        """Engine config and model fingerprint: a frontend refuses an engine unlike its others."""
        ...

    # -- requests: the loop thread, except queue_aborts ------------------------------------
    def check_prompt(self, ids: list[int]) -> None:
        """InvalidRequestError for prompt token ids this core cannot take."""
        ...

    def add_request(self, ecr: EngineCoreRequest) -> None:
        """Never raises for bad input: the request gets an error output on the next step."""
        ...

    def abort_requests(self, request_ids: list[str]) -> None:
        """Each live one ends with finish_reason "abort" (output on the next step)."""
        ...

    def queue_aborts(self, request_ids: list[str]) -> None:
        """Thread-safe: abort these at the loop's next abort point (mid-step if one runs).
        Ids that are not live now are skipped (the ordered abort path handles them)."""
        ...

    def fail_requests(self, request_ids: list[str], error: str) -> None:
        """Each live one ends with finish_reason "error" and ``error`` (output on the next step)."""
        ...

    def has_unfinished_requests(self) -> bool:
        ...

    # -- steps -------------------------------------------------------------------------------
    def step(self, force_forward: bool = False) -> tuple[list[EngineCoreOutput], bool]:
        """One step: (outputs, whether a forward ran). RequestExecutionError for a fault
        pinned to some requests; any other exception is an engine-level fault."""
        ...

    def step_with_batch_queue(self) -> tuple[list[EngineCoreOutput] | None, bool]:
        """``step`` with up to EngineConfig.max_concurrent_batches batches in flight."""
        ...

    def recover_after_fault(self) -> None:
        """After an engine-level fault inside a step: roll back what that step left in
        flight, so its requests can go on ("resume") or be dropped ("reset")."""
        ...

    def record_flights_to(self, recorder) -> None:
        """Before each forward, write the requests taking their first step to ``recorder``
        (engine/flight_record.py)."""
        ...

    def inject_step_fault(self, kind: str) -> None:
        """Chaos tests: the next step raises, "fatal" (engine-level) or "request" (pinned)."""
        ...

    # -- introspection, control ----------------------------------------------------------------
    def get_stats(self) -> SchedulerStats:
        """Plain counters, read without locks (the heartbeat thread calls it too)."""
        ...

    def take_iteration_details(self) -> list | None:
        """The step records since the last call (EngineConfig.iteration_details), or None."""
        ...

    def take_kv_events(self) -> KVCacheEvents | None:
        """The prefix cache's changes since the last call (stored and evicted block
        hashes), or None; the engine process numbers them and sends them to every frontend."""
        ...

    def reset_prefix_cache(self) -> bool:
        ...

    def load_weights(self, model_dir: str, version: str | None = None, mode: str = "finish_old",
                     on_read: Callable[[], None] | None = None) -> dict:
        """Start a load of new weights (swapped in at a step boundary); WeightLoadError
        when it cannot start."""
        ...

    def weight_status(self) -> dict:
        ...

    def shutdown(self) -> None:
        ...
