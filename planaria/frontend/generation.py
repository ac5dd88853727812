"""The one place the frontend calls ``EngineClient.generate``.

``Generator.generate(request)`` turns the engine's token outputs into text deltas
(incremental detokenizer, stop strings), records latency metrics, and turns engine
failures into frontend errors.

Engine faults are invisible above this module: ``_engine_outputs`` journals every request
(frontend/journal.py) and, when its engine dies (``EngineFaultError``), resubmits it to a
healthy engine as prompt + tokens already streamed with the remaining budget, and goes on
yielding outputs from there; the detokenizer is the same one throughout, so the client's
stream has no gap and no repeat. When no engine is running, a replay waits up to
``replay_wait_s`` for one to come back (the supervisor restarts engines). Past the replay
limit, or with no engine back in time, the request ends with a 503 (an SSE error event
once streaming). A new request that finds no running engine still gets 503 at once.

An engine that finishes a request with an error says why (``EngineCoreOutput.error_code``,
``engine_error``): ``invalid_request`` is a 400, ``overloaded`` a 429 with Retry-After,
``internal`` a 500. An older engine sends no code: then an error before any token is a
400 (the request was refused) and one after tokens a 500.

Leaving the iteration early (client disconnect, stop string) closes the engine stream,
which aborts the request in the engine (``EngineClient.generate``'s contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from planaria.engine.errors import EngineFaultError, EngineHandshakeError, NoEngineAvailableError
from planaria.engine.messages import EngineCoreOutput, EngineCoreRequest, Logprobs, OutputErrorCode
from planaria.engine.sampling_params import SamplingParams
from planaria.frontend.errors import (EngineRequestError, FrontendError, RequestError, ServiceUnavailableError,
                                      TooManyRequestsError)
from planaria.frontend.journal import FailRequest, Hold, RequestJournal

log = logging.getLogger(__name__)

DEFAULT_REPLAY_WAIT_S = 30.0
HOLD_POLL_S = 0.02  # a request held for its death's cause asks the journal again this often

# make_detokenizer(prompt_token_ids, params) -> an object with update(ids) -> stop str | None,
# get_delta_text() -> str, flush() (see engine/detokenizer.py)
DetokenizerFactory = Callable[[list[int], SamplingParams], object]


@dataclass
class GenerationDelta:
    """What one engine output became, ready for an HTTP chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprobs] | None
    num_prompt_tokens: int
    num_output_tokens: int  # so far, this one included
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the last delta
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    weight_version: str | None = None  # the engine weights that produced these tokens
    # SamplingParams.prompt_logprobs: on the delta of the first token only (entry i: prompt token i + 1)
    prompt_logprobs: list[Logprobs] | None = None


@dataclass
class _Timing:
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


class Generator:
    def __init__(self, client, make_detokenizer: DetokenizerFactory, metrics=None,
                 clock: Callable[[], float] = time.monotonic, journal: RequestJournal | None = None,
                 replay_wait_s: float = DEFAULT_REPLAY_WAIT_S) -> None:
        self._client = client
        self._make_detokenizer = make_detokenizer
        self._metrics = metrics
        self._clock = clock
        self.journal = journal if journal is not None else RequestJournal(
            clock=clock, cause_of=getattr(client, "death_causes", {}).get,  # pid -> cause
            suspects_of=getattr(client, "death_suspects", {}).get,  # pid -> flight record
            num_healthy=lambda: sum(1 for e in client.engines if e.healthy))
        self.replay_wait_s = replay_wait_s
        listeners = getattr(client, "loss_listeners", None)
        if listeners is not None:  # the death notice's own time starts the replay clock
            listeners.append(self._on_engine_lost)

    def _on_engine_lost(self, engine_index: int, reason: str) -> None:
        engine_of = getattr(self._client, "engine_of", None)
        if engine_of is not None:
            # a replay sent since its last loss too: engine 1 killed with engine 0, its
            # death seen after engine 0's requests were replayed onto it
            for entry in self.journal.unplaced():
                self.journal.on_submitted(entry.request_id, engine_of(entry.engine_request_id))
        died_s = pid = None  # when it died: the engine's own report, else the supervisor's
        kv_segment, planned = "", False
        for info in getattr(self._client, "engines", None) or ():
            if getattr(info, "index", None) == engine_index:
                died_s = getattr(info, "fault_monotonic_s", None) or None
                pid = getattr(info, "pid", None)
                kv_segment = getattr(info, "kv_segment", "") or ""  # its KV outlives it (same node)
                planned = bool(getattr(info, "handing_over", False))
        lost = self.journal.on_engine_dead(engine_index, died_s, pid, kv_segment=kv_segment, planned=planned)
        if lost:
            log.info("engine %d %s: %d request(s) %s", engine_index, "handed its requests over" if planned else "lost",
                     len(lost), ("to move" if planned else "to replay")
                     + (f" with its KV ({kv_segment})" if kv_segment else " (recomputed: no KV segment)"))

    async def _engine_outputs(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The engine's outputs for ``request``, across engine faults (replayed elsewhere);
        a fault that cannot be replayed becomes a frontend error."""
        journal, rid = self.journal, request.request_id
        entry = journal.open(request)
        current = request
        replay_deadline = None  # loop time by which a replay must have found an engine
        try:
            while True:
                try:
                    journal.on_sent(rid, time.monotonic())
                    async with contextlib.aclosing(self._client.generate(current)) as outs:
                        async for out in outs:
                            if out.new_token_ids:
                                latency_s = journal.on_replay_token(rid)
                                if latency_s is not None and self._metrics is not None:
                                    cached = out.num_cached_tokens if isinstance(out.num_cached_tokens, int) else 0
                                    self._metrics.record_replay_latency(
                                        latency_s, max(0, len(current.prompt_token_ids) - cached))
                                journal.on_tokens(rid, out.new_token_ids)
                            if out.prompt_logprobs is not None:  # a replay does not ask again
                                journal.on_prompt_logprobs(rid)
                            yield out
                    return
                except NoEngineAvailableError as exc:
                    # a new request waits for an engine (one is restarting) as a replay does
                    new = replay_deadline is None
                    if new:
                        replay_deadline = asyncio.get_running_loop().time() + self.replay_wait_s
                    if not await self._wait_for_engine(replay_deadline):
                        self._error("no_engine")
                        what = ("no engine could take the request" if new
                                else "the request's engine failed and no engine came back")
                        raise ServiceUnavailableError(
                            f"{what} within {self.replay_wait_s} s: {exc}",
                            code="no_engine_available") from exc
                except EngineFaultError as exc:
                    action = journal.decide(rid)
                    while isinstance(action, Hold):  # pinned by the flight record: wait for the cause
                        await asyncio.sleep(HOLD_POLL_S)
                        action = journal.decide(rid)
                    if isinstance(action, FailRequest):
                        self._error(action.code)
                        raise ServiceUnavailableError(f"the engine serving this request failed: {exc}; "
                                                      f"{action.reason}", code="engine_dead") from exc
                    log.info("%s %s as %s after %d token(s)%s: %s", "moving" if action.planned else "replaying",
                             rid, action.request.request_id, entry.num_output_tokens,
                             f" with KV of {action.request.kv_salvage}" if action.request.kv_salvage else "", exc)
                    current = action.request
                    replay_deadline = asyncio.get_running_loop().time() + self.replay_wait_s
                    if self._metrics is not None:
                        if action.planned:
                            self._metrics.record_move()
                        else:
                            self._metrics.record_replay()
        finally:
            journal.close(rid)

    async def _wait_for_engine(self, deadline: float) -> bool:
        """Until some engine runs (True) or the loop time ``deadline`` passes (False)."""
        loop = asyncio.get_running_loop()
        wait = getattr(self._client, "wait_for_engines", None)
        while not any(e.healthy for e in self._client.engines):
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                if wait is None:
                    raise EngineHandshakeError("no waiter")
                await wait(1, min(left, 1.0))
            except EngineHandshakeError:  # timed out, or a refused engine: look again soon
                await asyncio.sleep(min(left, 0.05))
        return True

    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[GenerationDelta]:
        params = request.sampling_params
        detok = self._make_detokenizer(request.prompt_token_ids, params)
        timing = _Timing(arrival_s=request.arrival_time or self._clock())
        num_prompt = len(request.prompt_token_ids)
        num_output = 0
        outs = self._engine_outputs(request)
        finish_reason = None
        failed = False
        try:
            async for out in outs:
                if out.finish_reason == "error":
                    self._error("engine_error")
                    raise engine_error(out, num_output)
                self._time_tokens(timing, len(out.new_token_ids))
                num_output += len(out.new_token_ids)
                stop_str = detok.update(out.new_token_ids) if out.new_token_ids else None
                finish_reason, stop_reason = out.finish_reason, out.stop_reason
                if stop_str is not None:
                    finish_reason, stop_reason = "stop", stop_str
                text = detok.get_delta_text()
                if finish_reason is not None:
                    text += _flush(detok)
                yield GenerationDelta(text=text, token_ids=list(out.new_token_ids),
                                      logprobs=out.new_logprobs, num_prompt_tokens=num_prompt,
                                      num_output_tokens=num_output, finish_reason=finish_reason,
                                      stop_reason=stop_reason, num_cached_tokens=out.num_cached_tokens,
                                      weight_version=out.weight_version, prompt_logprobs=out.prompt_logprobs)
                if finish_reason is not None:
                    break  # a stop string: closing `outs` aborts the rest in the engine
        except FrontendError:
            failed = True
            raise
        finally:
            await outs.aclose()
            if self._metrics is not None and not failed:
                now = self._clock()
                self._metrics.record_request(
                    finish_reason=finish_reason or "abort", num_prompt_tokens=num_prompt,
                    num_output_tokens=num_output, e2e_s=now - timing.arrival_s,
                    ttft_s=None if timing.first_token_s is None else timing.first_token_s - timing.arrival_s,
                    itl_s=timing.itl_s)

    def _time_tokens(self, timing: _Timing, num_tokens: int) -> None:
        if not num_tokens:
            return
        now = self._clock()
        if timing.first_token_s is None:
            timing.first_token_s = now
        elif timing.last_token_s is not None:
            timing.itl_s.append((now - timing.last_token_s) / num_tokens)
        timing.last_token_s = now

    def _error(self, kind: str) -> None:
        if self._metrics is not None:
            self._metrics.record_error(kind)


def engine_error(out: EngineCoreOutput, num_output_tokens: int, param: str | None = None) -> FrontendError:
    """The frontend error for an output with ``finish_reason == "error"``."""
    if out.error_code is None:  # an engine from before error codes
        if num_output_tokens == 0:  # refused before generating: the request was at fault
            return RequestError(out.error or "the engine rejected the request", param=param)
        return EngineRequestError(out.error or "the engine failed the request")
    code = OutputErrorCode.of(out.error_code)
    if code is OutputErrorCode.INVALID_REQUEST:
        return RequestError(out.error or "the engine rejected the request", param=param)
    if code is OutputErrorCode.OVERLOADED:
        return TooManyRequestsError(f"the engine is overloaded: {out.error or 'its queue is full'}; retry later")
    return EngineRequestError(out.error or "the engine failed the request", code="engine_error")


def _flush(detok) -> str:
    """Text the detokenizer held back (a possible stop-string prefix) once the request ends."""
    tail = detok.flush()
    return (tail if isinstance(tail, str) else "") + detok.get_delta_text()
