"""The one place the frontend calls ``EngineClient.generate``.

``Generator.generate(request)`` turns the engine's token outputs into text deltas
(incremental detokenizer, stop strings), records latency metrics, and turns engine
failures into frontend errors. A ``RequestJournal`` that replays a request on a surviving
engine (prompt + tokens emitted so far, remaining max_tokens) belongs exactly here: it
would catch ``EngineFaultError`` inside ``_engine_outputs`` and resubmit, and the HTTP
layer above would never notice.

Leaving the iteration early (client disconnect, stop string) closes the engine stream,
which aborts the request in the engine (``EngineClient.generate``'s contract).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from engine.errors import EngineFaultError, NoEngineAvailableError
from engine.messages import EngineCoreOutput, EngineCoreRequest, Logprobs
from engine.sampling_params import SamplingParams
from frontend.errors import EngineRequestError, FrontendError, RequestError, ServiceUnavailableError

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


@dataclass
class _Timing:
    arrival_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    itl_s: list[float] = field(default_factory=list)


class Generator:
    def __init__(self, client, make_detokenizer: DetokenizerFactory, metrics=None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._client = client
        self._make_detokenizer = make_detokenizer
        self._metrics = metrics
        self._clock = clock

    async def _engine_outputs(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """The engine's outputs for ``request``; faults become frontend errors (the journal's seam)."""
        try:
            async with contextlib.aclosing(self._client.generate(request)) as outs:
                async for out in outs:
                    yield out
        except NoEngineAvailableError as exc:
            self._error("no_engine")
            raise ServiceUnavailableError(f"no engine can take the request now: {exc}",
                                          code="no_engine_available") from exc
        except EngineFaultError as exc:
            self._error("engine_dead")
            raise ServiceUnavailableError(f"the engine serving this request failed: {exc}",
                                          code="engine_dead") from exc

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
                    if num_output == 0:  # refused before generating: the request was at fault
                        raise RequestError(out.error or "the engine rejected the request")
                    raise EngineRequestError(out.error or "the engine failed the request")
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
                                      stop_reason=stop_reason, num_cached_tokens=out.num_cached_tokens)
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


def _flush(detok) -> str:
    """Text the detokenizer held back (a possible stop-string prefix) once the request ends."""
    tail = detok.flush()
    return (tail if isinstance(tail, str) else "") + detok.get_delta_text()
