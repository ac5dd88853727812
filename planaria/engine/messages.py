"""Typed messages between frontends and engine cores (msgspec; never pickle).

This module holds the request/output structs the engine core itself produces and
consumes. The socket layer (engine/proc.py) adds the one-byte type frame and the
handshake/utility messages.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from planaria.engine.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    client_index: int = 0  # which frontend gets the outputs
    # Structured output spec, e.g. {"type": "json_schema", "value": "..."} (issue 6).
    structured_output: dict | None = None
    # Replay: tokens already generated under structured_output (the prompt's tail); the
    # grammar consumes them before the first new token.
    structured_output_prefix_tokens: list[int] | None = None
    # A replay (frontend/journal.py): the last N prompt tokens are output the request already
    # produced elsewhere; seeded sampling, presence/frequency penalties and bad words count
    # them as output.
    num_prior_output_tokens: int = 0
    # n > 1 (frontend/params.py): the sibling requests of one prompt share this id; an engine
    # holds a sibling back until the first one's prompt is computed, so the others take its
    # prompt's KV blocks from the prefix cache instead of prefilling again (engine/scheduler.py).
    group_id: str | None = None
    # A tenant's secret (vLLM's field, 1 to MAX_CACHE_SALT_CHARS characters): it seeds the
    # request's block hash chain, so its prefix-cache blocks are never shared with another
    # salt's (engine/block_pool.py chain_root); the frontend's router hashes with it too.
    cache_salt: str | None = None
    # A replay (frontend/journal.py) of a request whose engine on this node died or handed it
    # over: the name of that engine's KV segment (engine/kv_segment.py), whose committed
    # blocks of this request's prefix the receiving engine adopts instead of computing them.
    kv_salvage: str | None = None
    # A live engine of this node whose prefix cache holds more of this prompt than the
    # receiving engine's (the router sent it elsewhere for balance): the name of its KV
    # segment, whose committed blocks of the prompt the receiving engine copies instead of
    # computing them (a node-wide prefix cache; docs/routing.md). A hint: a block is copied
    # only under the hash of exactly these tokens (salt included) and only if it stayed
    # valid during the copy; anything else is computed.
    kv_peer: str | None = None


MAX_CACHE_SALT_CHARS = 256
# A replay's request id: the original's, this, and the replay's number (frontend/journal.py)
REPLAY_ID_SEP = "~r"
# A batch of KV cache events holds at most this many hashes per list; an engine cuts its
# snapshot to it, and a frontend refuses a longer one (msgspec, at decode).
MAX_KV_EVENT_HASHES = 1 << 18
BlockHash = Annotated[int, msgspec.Meta(ge=0)]  # msgpack has no int past 2**64 - 1


class KVCacheEvents(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How an engine's prefix cache changed since its previous batch, sent once per step
    (with the step's outputs, to every frontend) when it changed. Block hashes are
    engine/block_pool.py's chained hashes. ``seq`` counts the batches of this engine
    process (``pid``) from 1: a frontend that sees a gap forgets what it knew of the
    engine. ``cleared``: forget every block of the engine first (a prefix-cache reset,
    or the engine's pending changes overflowed and ``stored`` is a snapshot)."""

    seq: int
    pid: int = 0
    cleared: bool = False
    stored: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_KV_EVENT_HASHES)] = []
    removed: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_KV_EVENT_HASHES)] = []


class Logprobs(msgspec.Struct, array_like=True):
    """Logprobs for one generated token: the sampled token first, then the top-n (for a
    prompt position: the prompt token that follows it first)."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class OutputErrorCode(str, enum.Enum):
    """Why the engine finished a request with an error (``EngineCoreOutput.error_code``)."""

    INVALID_REQUEST = "invalid_request"  # the request itself is at fault (HTTP 400)
    OVERLOADED = "overloaded"            # the engine's waiting queue is full (HTTP 429)
    INTERNAL = "internal"                # preparing or running it failed (HTTP 500)

    @classmethod
    def of(cls, value: str | None) -> "OutputErrorCode":
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int] = []
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    new_logprobs: list[Logprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason == "error"
    # With finish_reason == "error": why, for the frontend's status code (ErrorCode below);
    # absent from older engines: read it with OutputErrorCode.of.
    error_code: str | None = None
    weight_version: str | None = None
    pooled: list[float] | None = None  # pooling runner: the request's embedding
    # SamplingParams.prompt_logprobs: sent once, with the request's first token. Entry i is
    # prompt token i + 1 (token_ids[0], its rank in sampled_rank) and the top-n at that
    # position; the first prompt token has none (len(prompt) - 1 entries).
    prompt_logprobs: list[Logprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_preemptions: int = 0
    prefix_cache_hit_rate: float = 0.0
    # prompt tokens run through the model since the engine started (prefix-cache hits and
    # recomputes after a preemption excluded): n siblings sharing one prefill add one prompt
    num_prefill_tokens: int = 0
    # replays that named a dead or handing-over engine's KV segment (engine/kv_segment.py):
    # those whose blocks were adopted, those refused (recomputed), and the blocks adopted
    num_salvaged_requests: int = 0
    num_salvage_refused: int = 0
    num_salvaged_blocks: int = 0
    # requests that named a live peer's segment (kv_peer) and the blocks copied from it
    num_peer_requests: int = 0
    num_peer_blocks: int = 0


class EngineCoreOutputs(msgspec.Struct, kw_only=True, omit_defaults=True):
    engine_index: int = 0
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    iteration_details: list[IterationDetails] | None = None  # EngineConfig.iteration_details
    kv_events: KVCacheEvents | None = None  # the prefix cache's changes in this step


class IterationDetails(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One engine step, for diagnosis (opt-in: EngineConfig.iteration_details)."""

    step_index: int
    request_ids: list[str] = []
    num_scheduled_tokens: list[int] = []  # aligned with request_ids
    step_s: float = 0.0
    kv_usage: float = 0.0
    num_preemptions: int = 0  # in this step
    num_running: int = 0
    num_waiting: int = 0
