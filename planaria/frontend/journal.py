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
  Prompt logprobs arrive with the first token (``on_prompt_logprobs``): a replay made
  after that does not ask for them again, one made before any token does.
- ``FailRequest(reason, code)``: the client gets an explicit error instead of a replay:
  ``"request_done"`` (nothing is left to do), ``"quarantined"`` (the request was in flight
  on ``quarantine_after`` engines that died, 2 by default: it is likely what kills them,
  and replaying it again would take one more engine down), or ``"replay_limit"``
  (``max_replays`` replays were made). A loss counts as a death here whatever ended the
  engine, with one exception: when both the engine's death time and the time the
  request's current incarnation was sent are known (``on_sent``, ``on_engine_dead(...,
  died_monotonic_s)``: CLOCK_MONOTONIC, one clock for a machine's processes), a death
  from before the send is not counted: the request never ran there (two engines killed
  at once: the first one's requests, replayed onto the second before its death notice
  arrived, did not kill it). A death time is when the death was seen, a few ms (more on a
  loaded host) after it happened, so a death seen less than ``DEATH_TIME_SLACK_S`` after
  the send, with no token from that engine, counts as from before the send too; a request
  that kills an engine that fast is bounded by ``max_replays`` instead.
  ``quarantine_after=0`` turns the quarantine off, leaving ``max_replays`` alone to bound
  the replays.

    journal = RequestJournal(max_replays=3)
    journal.open(ecr)                         # before the first submission
    journal.on_sent(rid, time.monotonic())    # its current incarnation leaves for an engine
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

from planaria.engine.messages import REPLAY_ID_SEP, EngineCoreRequest

DEFAULT_MAX_REPLAYS = 20  # a safety net: the quarantine stops a request that kills engines
DEFAULT_QUARANTINE_AFTER = 2  # engines that died with the request in flight
# A death time is when a supervisor or the engine saw the death, which can be a few ms (more
# on a loaded host) after the death itself: a death seen less than this after the send,
# with no token from that engine, is taken as from before the send.
DEATH_TIME_SLACK_S = 0.25
# A request the dead engine's flight record pins the crash on waits this long at most for
# the cause of the death (a crash counts, a kill from outside does not) before it is decided.
HOLD_FOR_CAUSE_S = 2.0
# Several requests pinned by one crash are replayed this far apart (in their flight-record
# order), so the next crash, if one of them is a poison, names it alone; and not before two
# engines serve (for at most SUSPECT_WAIT_S), so that crash leaves a survivor for the rest.
SUSPECT_STAGGER_S = 0.3
SUSPECT_WAIT_S = 60.0


@dataclass
class JournalEntry:
    request: EngineCoreRequest  # as first submitted
    engine_index: int | None = None  # where its current incarnation runs
    engine_request_id: str = ""  # the id of the current incarnation in the engine
    output_token_ids: list[int] = field(default_factory=list)  # streamed to the client
    num_replays: int = 0
    num_engine_deaths: int = 0  # engines lost with this request in flight (decide counts them)
    lost_at_s: float | None = None  # when its engine's loss became known (journal clock)
    sent_monotonic_s: float | None = None  # when the current incarnation was sent (on_sent)
    died_monotonic_s: float | None = None  # when the engine it was lost with died, if known
    tokens_since_sent: int = 0  # tokens from the current incarnation (it ran there)
    lost_incarnation: str | None = None  # the engine request id whose loss was last marked
    lost_pid: int | None = None  # the pid of the engine its current incarnation was lost with
    death_pids: list[int | None] = field(default_factory=list)  # engines counted so far
    lost_kv_segment: str = ""  # the KV segment of the engine it was lost with (engine/kv_segment.py)
    lost_planned: bool = False  # its engine handed it over (a drain): no fault of anyone's
    num_moves: int = 0  # replays after a handover (counted in num_replays too, not in the limit)
    awaiting_first_token: bool = False  # replayed, no token from the replay yet
    prompt_logprobs_received: bool = False  # a replay must not compute them again

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
    planned: bool = False  # a handover by a draining engine, not a fault


@dataclass(frozen=True)
class Hold:
    """Ask again shortly (``until_s``, journal clock, at the latest): the dead engine's flight
    record pins the death on this request, and what ended the engine is not known yet."""

    until_s: float


@dataclass(frozen=True)
class FailRequest:
    """Do not replay: the request ends with an explicit error (``code`` for the metrics)."""

    reason: str
    code: str  # "request_done" | "quarantined" | "replay_limit"


class RequestJournal:
    def __init__(self, max_replays: int = DEFAULT_MAX_REPLAYS,
                 clock: Callable[[], float] = time.monotonic,
                 quarantine_after: int = DEFAULT_QUARANTINE_AFTER,
                 cause_of: Callable[[int], str | None] = lambda pid: None,
                 suspects_of: Callable[[int], list[str] | None] = lambda pid: None,
                 num_healthy: Callable[[], int] = lambda: 2) -> None:
        if max_replays < 0:
            raise ValueError(f"max_replays must be >= 0, got {max_replays}")
        if quarantine_after < 0:
            raise ValueError(f"quarantine_after must be >= 0, got {quarantine_after}")
        self.max_replays = max_replays
        self.quarantine_after = quarantine_after
        self._cause_of = cause_of  # engine pid -> "external" | "fault" | None (not known)
        self._suspects_of = suspects_of  # engine pid -> its flight record's first-step requests
        self._num_healthy = num_healthy  # engines serving now
        self._two_since: float | None = None  # since when two engines serve (_two_serving_since)
        self._seen_fewer = False
        self._clock = clock
        self._entries: dict[str, JournalEntry] = {}
        self.num_replays_total = 0
        self.num_quarantined_total = 0

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

    def on_sent(self, request_id: str, monotonic_s: float) -> None:
        """Its current incarnation is being sent to an engine (time.monotonic())."""
        entry = self._entries[request_id]
        entry.sent_monotonic_s, entry.died_monotonic_s = monotonic_s, None
        entry.tokens_since_sent = 0

    def unplaced(self) -> list[JournalEntry]:
        """Entries whose current incarnation is not known lost and whose engine is not
        recorded yet (a replay on its way: its engine is known to the client only)."""
        return [e for e in self._entries.values()
                if e.engine_index is None and e.lost_incarnation != e.engine_request_id]

    def on_submitted(self, request_id: str, engine_index: int | None) -> None:
        self._entries[request_id].engine_index = engine_index

    def on_tokens(self, request_id: str, token_ids: list[int]) -> None:
        """Tokens that reached the client (after the caller's detokenizer took them)."""
        entry = self._entries[request_id]
        entry.output_token_ids.extend(token_ids)
        entry.tokens_since_sent += len(token_ids)

    def on_prompt_logprobs(self, request_id: str) -> None:
        """The request's prompt logprobs arrived (with its first token): its replays do not
        ask for them (their prompt also holds streamed tokens, which are no prompt)."""
        self._entries[request_id].prompt_logprobs_received = True

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
    def on_engine_dead(self, engine_index: int, died_monotonic_s: float | None = None,
                       pid: int | None = None, kv_segment: str = "", planned: bool = False) -> list[str]:
        """Mark every request on that engine lost; returns their ids (to replay).
        ``died_monotonic_s``: when the engine died (time.monotonic()), if known; ``pid``:
        the dead engine process (its cause of death, once known, decides whether the
        death counts toward the quarantine); ``kv_segment``: its KV segment, which the
        replays name for the survivor to adopt their blocks from; ``planned``: the engine
        did not die but handed its requests over (a drain): no death, no replay counted."""
        now = self._clock()
        lost = []
        for entry in self._entries.values():
            if entry.engine_index == engine_index:
                self._mark_lost(entry, now)
                entry.died_monotonic_s = died_monotonic_s
                entry.lost_pid = pid
                entry.lost_kv_segment = kv_segment
                entry.lost_planned = planned
                lost.append(entry.request_id)
        return lost

    def on_lost(self, request_id: str) -> None:
        """This one request lost its engine (the first notice's time is kept)."""
        entry = self._entries[request_id]
        if entry.engine_index is not None or entry.lost_at_s is None:
            self._mark_lost(entry, self._clock())

    def _mark_lost(self, entry: JournalEntry, now: float) -> None:
        entry.lost_kv_segment, entry.lost_planned = "", False  # on_engine_dead sets them
        entry.engine_index = None
        entry.lost_incarnation = entry.engine_request_id
        if entry.lost_at_s is None:
            entry.lost_at_s = now

    def _two_serving_since(self, now: float) -> float | None:
        """Since when (journal clock) two or more engines serve, as seen from the calls made
        here; None while fewer do."""
        if self._num_healthy() < 2:
            self._two_since = None
        elif self._two_since is None:
            self._two_since = now if self._seen_fewer else 0.0  # never seen fewer: since always
        self._seen_fewer = self._seen_fewer or self._two_since is None
        return self._two_since

    @staticmethod
    def _died_before_sent(entry: JournalEntry) -> bool:
        """The engine was (very likely) dead before this incarnation reached it: its death was
        seen before the send, or within DEATH_TIME_SLACK_S after it with no token from it."""
        if entry.died_monotonic_s is None or entry.sent_monotonic_s is None:
            return False
        if entry.died_monotonic_s < entry.sent_monotonic_s:
            return True
        return (entry.tokens_since_sent == 0
                and entry.died_monotonic_s - entry.sent_monotonic_s < DEATH_TIME_SLACK_S)

    def decide(self, request_id: str) -> Replay | FailRequest | Hold:
        """Call once per loss of the request's current incarnation (its engine died), and
        again after a ``Hold``."""
        entry = self._entries[request_id]
        if entry.lost_at_s is None:
            self.on_lost(request_id)
        if entry.lost_planned:
            return self._move(entry)
        pid = entry.lost_pid
        # The dead engine's flight record, when it has one, names the requests that were
        # taking their first step in the batch it died in. A crash is pinned on them: the
        # others had been running there and are replayed without it counting. A pinned one
        # waits (briefly) for the cause, and is quarantined at once when it was alone there
        # and the engine crashed: replayed, it would take a survivor and its requests down.
        suspects = self._suspects_of(pid) if pid is not None else None
        pinned = bool(suspects) and entry.lost_incarnation in suspects
        cause = self._cause_of(pid) if pid is not None else None
        now = self._clock()
        if pinned and cause is None and now < entry.lost_at_s + HOLD_FOR_CAUSE_S:
            return Hold(entry.lost_at_s + HOLD_FOR_CAUSE_S)
        if pinned and cause == "fault" and len(suspects) > 1:
            # Several requests started in the batch that crashed: replayed together, they
            # would crash the next engine together again. Each waits its turn (after the
            # death's bystanders, which go at once), so the next crash names one alone.
            order = 1 + suspects.index(entry.lost_incarnation)
            waited_out = now >= entry.lost_at_s + SUSPECT_WAIT_S
            two = self._two_serving_since(now)
            if two is None and not waited_out:
                return Hold(min(now + SUSPECT_STAGGER_S, entry.lost_at_s + SUSPECT_WAIT_S))
            turn = max(entry.lost_at_s, two or 0.0) + SUSPECT_STAGGER_S * order
            if now < turn and not waited_out:
                return Hold(turn)
        # Deaths from outside (a SIGKILL that was not the engine's crash, a stopped process
        # the watchdog killed) are not the request's doing and do not count. A death's
        # cause comes with the supervisor's notice after it reaped the engine, just after
        # its first notice: not known yet (this death, usually), it counts. A request the
        # flight record pins ran there (its first step was in the crashing batch), however
        # soon after the send the engine died.
        if (pinned or not self._died_before_sent(entry)) and (not suspects or pinned):
            entry.death_pids.append(pid)
        entry.num_engine_deaths = sum(1 for pid in entry.death_pids
                                      if pid is None or self._cause_of(pid) != "external")
        sole_crash = pinned and cause == "fault" and len(suspects) == 1
        p = entry.request.sampling_params
        n = entry.num_output_tokens
        if p.max_tokens is not None and n >= p.max_tokens:
            return FailRequest(f"all {p.max_tokens} tokens were already produced", "request_done")
        if self.quarantine_after and sole_crash:
            self.num_quarantined_total += 1
            return FailRequest("request quarantined: its engine crashed during its first step, the "
                               "only request starting there; it is not replayed", "quarantined")
        if self.quarantine_after and entry.num_engine_deaths >= self.quarantine_after:
            self.num_quarantined_total += 1
            return FailRequest(f"request quarantined: in flight on {entry.num_engine_deaths} engines "
                               "that died; it is not replayed again", "quarantined")
        if entry.num_replays - entry.num_moves >= self.max_replays:
            return FailRequest(f"the request's engine failed {entry.num_replays + 1} times "
                               f"(replay limit {self.max_replays})", "replay_limit")
        return self._replay(entry)

    def _move(self, entry: JournalEntry) -> Replay | FailRequest:
        """A handover of a draining engine: replayed at once, no death, no replay counted."""
        p = entry.request.sampling_params
        if p.max_tokens is not None and entry.num_output_tokens >= p.max_tokens:
            return FailRequest(f"all {p.max_tokens} tokens were already produced", "request_done")
        entry.num_moves += 1
        return self._replay(entry, planned=True)

    def _replay(self, entry: JournalEntry, planned: bool = False) -> Replay:
        entry.lost_pid = None
        entry.sent_monotonic_s = entry.died_monotonic_s = None
        entry.tokens_since_sent = 0
        entry.num_replays += 1
        if not planned:
            self.num_replays_total += 1
        entry.awaiting_first_token = True
        n = entry.num_output_tokens
        # Prompt logprobs come with the first token: once tokens were streamed they were
        # delivered (or never will be: the replay's prompt holds output tokens too).
        req = replay_request(entry.request, entry.output_token_ids, entry.num_replays,
                             with_prompt_logprobs=not (entry.prompt_logprobs_received or n),
                             kv_salvage=entry.lost_kv_segment)
        entry.engine_request_id = req.request_id
        return Replay(req, entry.num_replays, planned)


def replay_request(original: EngineCoreRequest, streamed: list[int], num_replays: int,
                   with_prompt_logprobs: bool = True, kv_salvage: str = "") -> EngineCoreRequest:
    """``original`` continued after ``streamed``: prompt + streamed, the remaining budget,
    the output count carried in ``num_prior_output_tokens``; a fresh request id.
    ``with_prompt_logprobs`` False: the client has the prompt logprobs already (they come
    with the first token), so the replay does not ask for them."""
    p = original.sampling_params
    n = len(streamed)
    params = msgspec.structs.replace(
        p, max_tokens=None if p.max_tokens is None else p.max_tokens - n,
        min_tokens=max(0, p.min_tokens - n),
        prompt_logprobs=p.prompt_logprobs if with_prompt_logprobs else None)
    extra = {}
    if original.structured_output is not None:  # the grammar consumes the prior output first
        extra["structured_output_prefix_tokens"] = (
            list(original.structured_output_prefix_tokens or []) + list(streamed))
    return msgspec.structs.replace(
        original, request_id=f"{original.request_id}{REPLAY_ID_SEP}{num_replays}",
        prompt_token_ids=list(original.prompt_token_ids) + list(streamed), sampling_params=params,
        num_prior_output_tokens=original.num_prior_output_tokens + n, kv_salvage=kv_salvage or None, **extra)
