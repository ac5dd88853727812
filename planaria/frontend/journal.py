"""RequestJournal: what the frontend remembers of each in-flight request so that an engine's
death does not end it. Pure logic: no sockets, no asyncio; the clock is injected.

For every request it keeps the original ``EngineCoreRequest`` (prompt token ids, sampling
params), the tokens already streamed to the client, the engine it runs on and how often it
was replayed. When an engine dies the requests it held are marked lost; for each one
``decide(request_id)`` returns an action (decide, then act):

- ``Replay(request)``: a new ``EngineCoreRequest`` for a healthy engine whose prompt is the
  original prompt plus every token already streamed, with the remaining budget
  (``max_tokens - streamed``, ``min_tokens - streamed`` floored at 0), the same seed, and
  ``num_prior_output_tokens`` = streamed, so the engine counts those prompt-tail tokens as
  output for seeded sampling (the draw for output position k is seeded by (seed, k)) and
  presence/frequency penalties. Greedy or seeded requests continue exactly as a
  fault-free run would. Its request id is new (``<id>~r<n>``): a late output of the old
  incarnation can never be mistaken for the replay's. The detokenizer is not the
  journal's: the caller keeps feeding the same one, so stop strings are checked over the
  whole text and nothing is re-emitted. A structured-output request also carries the
  streamed tokens as ``structured_output_prefix_tokens``, so its grammar resumes there.
- ``FailRequest(reason, code)``: the replay limit is reached (or nothing is left to do);
  the client gets an explicit error.

    journal = RequestJournal(max_replays=3)
    journal.open(ecr)                         # before the first submission
    journal.on_submitted(rid, engine_index)   # the engine it went to
    journal.on_tokens(rid, out.new_token_ids)  # after each output reaches the client
    lost = journal.on_engine_dead(0)          # ids of requests that were on engine 0
    action = journal.decide(rid)              # Replay(...) | FailRequest(...)
    journal.on_replay_token(rid)              # first token of the replay: latency, or None
    journal.close(rid)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from planaria.engine.messages import EngineCoreRequest

DEFAULT_MAX_REPLAYS = 3
REPLAY_ID_SEP = "~r"


@dataclass
class JournalEntry:
    request: EngineCoreRequest  # as first submitted
    engine_index: int | None = None  # where its current incarnation runs
    engine_request_id: str = ""  # the id of the current incarnation in the engine
    output_token_ids: list[int] = field(default_factory=list)  # streamed to the client
    num_replays: int = 0
    lost_at_s: float | None = None  # when its engine's loss became known (journal clock)
    awaiting_first_token: bool = False  # replayed, no token from the replay yet

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)


@dataclass(frozen=True)
class Replay:
    request: EngineCoreRequest
    num_replays: int  # this one included


@dataclass(frozen=True)
class FailRequest:
    """Do not replay: the request ends with an explicit error (``code`` for the metrics)."""

    reason: str
    code: str  # "replay_limit" | "request_done"


class RequestJournal:
    def __init__(self, max_replays: int = DEFAULT_MAX_REPLAYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_replays < 0:
            raise ValueError(f"max_replays must be >= 0, got {max_replays}")
        self.max_replays = max_replays
        self._clock = clock
        self._entries: dict[str, JournalEntry] = {}
        self.num_replays_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def get(self, request_id: str) -> JournalEntry | None:
        return self._entries.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._entries)

    # -- recording ----------------------------------------------------------------------
    def open(self, request: EngineCoreRequest) -> JournalEntry:
        rid = request.request_id
        if rid in self._entries:
            raise ValueError(f"request id {rid!r} is already in the journal")
        entry = self._entries[rid] = JournalEntry(request=request, engine_request_id=rid)
        return entry

    def close(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def on_submitted(self, request_id: str, engine_index: int | None) -> None:
        self._entries[request_id].engine_index = engine_index

    def on_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens that reached the client (after the caller's detokenizer took them)."""
        self._entries[request_id].output_token_ids.extend(token_ids)

    def on_replay_token(self, request_id: str) -> float | None:
        """Call on every output with tokens; the first after a replay returns the time from
        the loss notice to now (the replay latency), else None."""
        entry = self._entries[request_id]
        if not entry.awaiting_first_token:
            return None
        entry.awaiting_first_token = False
        lost_at, entry.lost_at_s = entry.lost_at_s, None
        return None if lost_at is None else self._clock() - lost_at

    # -- faults -------------------------------------------------------------------------
    def on_engine_dead(self, engine_index: int) -> list[str]:
        """Mark every request on that engine lost; returns their ids (to replay)."""
        now = self._clock()
        lost = []
        for entry in self._entries.values():
            if entry.engine_index == engine_index:
                self._mark_lost(entry, now)
                lost.append(entry.request_id)
        return lost

    def on_lost(self, request_id: str) -> None:
        """This one request lost its engine (the first notice's time is kept)."""
        entry = self._entries[request_id]
        if entry.engine_index is not None or entry.lost_at_s is None:
            self._mark_lost(entry, self._clock())

    def _mark_lost(self, entry: JournalEntry, now: float) -> None:
        entry.engine_index = None
        if entry.lost_at_s is None:
            entry.lost_at_s = now

    def decide(self, request_id: str) -> Replay | FailRequest:
        entry = self._entries[request_id]
        if entry.lost_at_s is None:
            self.on_lost(request_id)
        p = entry.request.sampling_params
        n = entry.num_output_tokens
        if p.max_tokens is not None and n >= p.max_tokens:
            return FailRequest(f"all {p.max_tokens} tokens were already produced", "request_done")
        if entry.num_replays >= self.max_replays:
            return FailRequest(f"the request's engine failed {entry.num_replays + 1} times "
                               f"(replay limit {self.max_replays})", "replay_limit")
        entry.num_replays += 1
        self.num_replays_total += 1
        entry.awaiting_first_token = True
        req = replay_request(entry.request, entry.output_token_ids, entry.num_replays)
        entry.engine_request_id = req.request_id
        return Replay(req, entry.num_replays)


def replay_request(original: EngineCoreRequest, streamed: list[int], num_replays: int) -> EngineCoreRequest:
    """``original`` continued after ``streamed``: prompt + streamed, the remaining budget,
    the output count carried in ``num_prior_output_tokens``; a fresh request id."""
    p = original.sampling_params
    n = len(streamed)
    params = msgspec.structs.replace(
        p, max_tokens=None if p.max_tokens is None else p.max_tokens - n,
        min_tokens=max(0, p.min_tokens - n))
    extra = {}
    if original.structured_output is not None:  # the grammar consumes the prior output first
        extra["structured_output_prefix_tokens"] = (
            list(original.structured_output_prefix_tokens or []) + list(streamed))
    return msgspec.structs.replace(
        original, request_id=f"{original.request_id}{REPLAY_ID_SEP}{num_replays}",
        prompt_token_ids=list(original.prompt_token_ids) + list(streamed), sampling_params=params,
        num_prior_output_tokens=original.num_prior_output_tokens + n, **extra)
