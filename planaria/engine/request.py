"""Scheduler-side request state. Pure Python: no torch, no sockets."""

from __future__ import annotations

import enum
import time

from planaria.engine.sampling_params import SamplingParams


class RequestStatus(str, enum.Enum):
    """Lifecycle of a request inside one engine core.

    WAITING -> RUNNING -> FINISHED_*; RUNNING -> PREEMPTED -> RUNNING (recompute);
    WAITING_FOR_GRAMMAR -> WAITING once its structured-output grammar compiled;
    WAITING_FOR_PREFIX -> WAITING once the first request of its group (``group_id``, n > 1)
    has its prompt computed, so its prompt blocks are prefix-cache hits.
    """

    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING_FOR_PREFIX = "waiting_for_prefix"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


# finish_reason strings as the OpenAI API spells them
FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id",
        "arrival_time", "priority", "status", "output_token_ids", "all_token_ids",
        "num_computed_tokens", "num_cached_tokens", "block_hashes", "max_tokens",
        "stop_reason", "error", "num_preemptions", "in_flight", "lora", "extra",
        "output_logprobs", "structured", "prompt_logprobs", "group_id", "cache_salt",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        max_tokens: int,
        arrival_time: float | None = None,
        priority: int = 0,
        group_id: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.max_tokens = max_tokens  # resolved: never None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_hashes: list[int] = []
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.in_flight = False  # scheduled in a batch whose output is not back yet
        self.output_logprobs: list | None = None
        # Prompt logprobs computed so far (engine.prompt_logprobs): a list while they are
        # still to be sent, None when not asked for or already sent with the first token.
        self.prompt_logprobs: list | None = None
        self.structured = None  # engine.structured_output state, when used
        self.extra: dict = {}
        self.lora = None
        self.group_id = group_id  # n > 1: siblings share the prompt's KV (engine/scheduler.py)
        # a tenant's secret: seeds the request's block hash chain (engine/block_pool.py), so
        # its blocks never match another salt's in the prefix cache
        self.cache_salt = cache_salt

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are still owed: every prompt position must run through the
        model (no prefix-cache hit may skip one)."""
        return self.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __lt__(self, other: "Request") -> bool:  # priority scheduling: lower first
        return (self.priority, self.arrival_time) < (other.priority, other.arrival_time)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
