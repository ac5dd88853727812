"""What a frontend's EngineClient knows of each engine (engine/client.py): its state as
this client sees it, its last STATUS, its prefix index and its routing counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from planaria.engine.messages import SchedulerStats
from planaria.engine.prefix_index import PrefixIndex


class EngineInfoState(StrEnum):
    """An engine's state as a frontend's client knows it: the state of its last STATUS
    (every engine.lifecycle.EngineState value is one), or one of the client's own.

    CONNECTING (HELLO seen) -> RUNNING (READY) | REFUSED (the handshake refused it);
    RUNNING|PAUSED|DRAINING -> UNREACHABLE (a send found it not connected to this frontend);
    any -> the state of a STATUS; any -> DEAD (ENGINE_CORE_DEAD, or the supervisor's
    report); a new incarnation's HELLO -> CONNECTING. A StrEnum: it compares, prints,
    formats and encodes (JSON, msgpack) as its value, e.g. "running"."""

    CONNECTING = "connecting"
    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    STOPPED = "stopped"
    DEAD = "dead"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"



@dataclass
class EngineInfo:
    """What the client knows of one engine."""

    index: int
    state: EngineInfoState = EngineInfoState.CONNECTING
    pid: int | None = None
    stats: SchedulerStats | None = None
    num_in_flight: int = 0  # this client's requests on it
    num_kv_blocks: int = 0
    max_model_len: int = 0
    config_hash: str = ""
    kv_cache_bytes: int = 0
    kv_source: str = ""
    kv_segment: str = ""  # its current process's KV segment (READY), named by replays of its requests
    handing_over: bool = False  # its requests were just dropped by a drain: moved, not replayed
    reason: str = ""
    num_handshakes: int = 0
    died_at_s: float = 0.0  # time.time() when this client learnt of its last death
    # the engine's time.monotonic() at the fatal fault its last ENGINE_CORE_DEAD reported
    # (comparable with this process's time.monotonic()); 0.0 when not reported
    fault_monotonic_s: float = 0.0
    ready_at_s: float = 0.0  # time.time() of its last READY
    block_size: int = 0  # tokens per KV block (READY; 0: not said)
    # the blocks this incarnation holds in its prefix cache (engine/prefix_index.py),
    # replaced whole when a new process of the engine says HELLO
    prefix: PrefixIndex = field(default_factory=PrefixIndex)
    # routing, over every incarnation: requests sent here; the prompt tokens of those that
    # answered, and of those the tokens the engine found in its prefix cache (their first
    # output's num_cached_tokens); requests sent while this client knew it down (never)
    num_routed: int = 0
    num_routed_prompt_tokens: int = 0
    num_routed_cached_tokens: int = 0
    num_routed_while_down: int = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix)

    @property
    def routed_hit_rate(self) -> float:
        """Fraction of the prompt tokens of requests routed here that were prefix-cache hits."""
        n = self.num_routed_prompt_tokens
        return self.num_routed_cached_tokens / n if n else 0.0

    @property
    def healthy(self) -> bool:
        return self.state == EngineInfoState.RUNNING

    @property
    def load(self) -> int:
        published = self.stats.num_running + self.stats.num_waiting if self.stats else 0
        return published + self.num_in_flight

