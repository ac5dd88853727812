"""The two generation endpoints: request -> engine requests -> JSON body or SSE stream.

``OpenAIServing`` holds what both need (tokenizer, model facts, the ``Generator``); the
per-endpoint differences (body shapes, logprobs format, chat's role chunk) live in the
two renders of ``frontend.choices``. With tools in effect (frontend/tools.py) a chat choice
reads tool calls out of its text as it streams (frontend/tool_calls.py). Errors raised
before the first token become an HTTP error status even for streams (the first delta is
awaited before the SSE headers go out); later ones become an SSE error event followed by
``[DONE]``.

Prompts are rendered and tokenized off the event loop (``frontend.render``). Every
request has a deadline, ``request_timeout_s`` after it arrived: past it the engine
requests are aborted and the client gets 504 ``request_timeout`` (an SSE error event
once streaming).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import msgspec
from aiohttp import web

from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import sibling_params
from planaria.frontend import responses as R
from planaria.frontend.admission import check_priority, take_sequences
from planaria.frontend.choices import ChatRender, Choice, CompletionRender, best_choices
from planaria.frontend.errors import FrontendError, GatewayTimeoutError, NotFoundError
from planaria.frontend.generation import GenerationDelta, Generator
from planaria.frontend.limits import RequestLimits
from planaria.frontend.logprobs import TokenTexts
from planaria.frontend.params import (check_bad_words, check_prompt_logprobs_size, fit_max_tokens, num_choices,
                                      sampling_params, structured_output)
from planaria.frontend.prompts import Prompt, tokenize_bad_words, tokenize_chat, tokenize_completion
from planaria.frontend.protocol import ChatCompletionRequest, decode_chat, decode_completion
from planaria.frontend.render import PromptRenderer
from planaria.frontend.tool_parsers import get_tool_parser
from planaria.frontend.tools import ToolPlan, tool_plan

DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_WRITE_TIMEOUT_S = 30.0

_json = msgspec.json.Encoder()
_END = object()


@dataclass
class ModelInfo:
    name: str  # the served model name
    path: str
    vocab_size: int | None
    max_model_len: int  # from config; the engines' own figure wins when known
    eos_token_id: int | None
    extra_eos_token_ids: list[int] = field(default_factory=list)  # generation_config's others
    max_logprobs: int = 20


class OpenAIServing:
    def __init__(self, generator: Generator, tokenizer, model: ModelInfo,
                 engine_max_model_len: Callable[[], int | None] = lambda: None, *,
                 limits: RequestLimits = RequestLimits(), renderer: PromptRenderer | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
                 tool_call_parser: str | None = "hermes") -> None:
        """``tool_call_parser``: the name of the parser reading calls out of
        ``tool_choice: "auto"`` answers (frontend/tool_parsers.py); None: "auto" is off.
        ``write_timeout_s``: how long one SSE write may wait for a client that does not
        read (its buffers full) before the request is aborted (``SlowReaderError``)."""
        self.generator = generator
        self.tokenizer = tokenizer
        self.model = model
        self._engine_max_model_len = engine_max_model_len
        self.token_text = TokenTexts(tokenizer)
        self.limits = limits
        self.renderer = renderer if renderer is not None else PromptRenderer(tokenizer)
        self.request_timeout_s = request_timeout_s
        self.write_timeout_s = write_timeout_s
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None

    @property
    def max_model_len(self) -> int:
        return self._engine_max_model_len() or self.model.max_model_len

    # -- request -> engine requests -------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model.name, self.model.path):
            raise NotFoundError(f"The model `{name}` does not exist; this server serves "
                                f"`{self.model.name}`", param="model", code="model_not_found")

    async def _bad_words(self, req) -> list[list[int]] | None:
        """``req.bad_words`` as token sequences, tokenized off the event loop; None if none."""
        words = check_bad_words(req.bad_words, self.limits)
        return await self.renderer.run(tokenize_bad_words, words, self.renderer.tokenizer) if words else None

    def _engine_requests(self, req, prompts: list[Prompt], base_id: str, so: dict | None,
                         bad_words_token_ids: list[list[int]] | None = None) -> list[EngineCoreRequest]:
        """``so``: the structured output (the request's own, or a forced tool choice's).
        ``best_of`` (default ``n``) engine requests per prompt, prompt i's j-th at index
        ``i * best_of + j``; siblings share a ``group_id`` (one prefill) and seed ``seed + j``."""
        n, best_of = num_choices(req, len(prompts), self.limits)
        params = sampling_params(req, vocab_size=self.model.vocab_size, max_logprobs=self.model.max_logprobs,
                                 limits=self.limits, bad_words_token_ids=bad_words_token_ids)
        if self.model.extra_eos_token_ids and not params.ignore_eos:
            params = msgspec.structs.replace(
                params, stop_token_ids=params.stop_token_ids | frozenset(self.model.extra_eos_token_ids))
        if best_of > n and params.logprobs is None:
            params = msgspec.structs.replace(params, logprobs=0)  # ranks by the sampled tokens' logprobs
        # Prompt logprobs are the prompt's, the same for every choice: one sibling (the first,
        # the group's leader: the others then take its prompt from the prefix cache) computes
        # them and the render shares them. Only an echo with logprobs puts them in every
        # choice's own logprobs, so there each sibling asks.
        echo_logprobs = bool(getattr(req, "echo", False)) and req.logprobs is not None
        check_prompt_logprobs_size(params.prompt_logprobs, [len(p.token_ids) for p in prompts],
                                   best_of if echo_logprobs else 1, self.limits)
        arrival = time.monotonic()
        out = []
        for i, p in enumerate(prompts):
            fitted = fit_max_tokens(params, len(p.token_ids), self.max_model_len)
            for j in range(best_of):
                sp = sibling_params(fitted, j)
                if j and sp.prompt_logprobs is not None and not echo_logprobs:
                    sp = msgspec.structs.replace(sp, prompt_logprobs=None)
                out.append(EngineCoreRequest(
                    request_id=f"{base_id}-{i * best_of + j}", prompt_token_ids=p.token_ids,
                    sampling_params=sp, eos_token_id=self.model.eos_token_id, arrival_time=arrival,
                    priority=req.priority or 0, structured_output=so,
                    group_id=f"{base_id}-{i}" if best_of > 1 else None, cache_salt=req.cache_salt))
        return out

    # -- endpoints ------------------------------------------------------------------------
    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.request_timeout_s

    async def completions(self, request: web.Request) -> web.StreamResponse:
        deadline = self._deadline()
        req = decode_completion(await request.read())
        self.check_model(req.model)
        prompts = await self.renderer.run(
            tokenize_completion, req.prompt, self.renderer.tokenizer, self.model.vocab_size,
            self.limits.max_prompt_chars(self.max_model_len), self.limits.max_prompts)
        response_id = req.request_id or R.new_id("cmpl")
        check_priority(request, req.priority)
        ecrs = self._engine_requests(req, prompts, R.new_id("cmpl"), structured_output(req),
                                     await self._bad_words(req))
        take_sequences(request, len(ecrs))
        k = len(ecrs) // len(prompts)  # best_of
        choices = [Choice(i * k + j, len(p.token_ids), prefix=self._echo_text(p) if req.echo else "",
                          first_prompt_token=p.token_ids[0], counts_prompt=j == 0, prompt=i)
                   for i, p in enumerate(prompts) for j in range(k)]
        render = CompletionRender(choices, self.token_text, req.logprobs, echo=bool(req.echo),
                                  num_prompt_top=None if req.stream else req.prompt_logprobs)
        if k > (req.n or 1):
            render.best_of = (req.n or 1, k)
        return await self._serve(request, req, ecrs, render, response_id, deadline)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        deadline = self._deadline()
        req: ChatCompletionRequest = decode_chat(await request.read())
        self.check_model(req.model)
        tools, prompt = await self.renderer.run(_plan_and_render, req, self.renderer.tokenizer,
                                                self.limits.max_prompt_chars(self.max_model_len), self.tool_parser)
        response_id = req.request_id or R.new_id("chatcmpl")
        so = tools.structured_output(structured_output(req))
        check_priority(request, req.priority)
        ecrs = self._engine_requests(req, [prompt], R.new_id("chatcmpl"), so, await self._bad_words(req))
        take_sequences(request, len(ecrs))
        choices = [Choice(j, len(prompt.token_ids), counts_prompt=j == 0) for j in range(len(ecrs))]
        render = ChatRender(choices, self.token_text, ecrs[0].sampling_params.logprobs,
                            num_prompt_top=None if req.stream else req.prompt_logprobs, tool_calls=tools.output())
        return await self._serve(request, req, ecrs, render, response_id, deadline)

    def _echo_text(self, p: Prompt) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.token_ids, skip_special_tokens=False)

    # -- running --------------------------------------------------------------------------
    async def _serve(self, request: web.Request, req, ecrs, render, response_id: str,
                     deadline: float) -> web.StreamResponse:
        created = R.now_s()
        name = self.model.name
        version = None  # weight_version of the latest delta (responses.py)
        async with contextlib.aclosing(self._merged(ecrs)) as merged:
            async def next_delta():
                """The next (index, delta), or _END; past the deadline GatewayTimeoutError (the
                cancelled generator has aborted its engine requests on the way out)."""
                try:
                    async with asyncio.timeout_at(deadline):
                        return await anext(merged, _END)
                except TimeoutError:
                    raise GatewayTimeoutError(
                        f"the request ran longer than {self.request_timeout_s:g} s (--request-timeout-s) "
                        "and was aborted", code="request_timeout") from None

            if not req.stream:
                while (item := await next_delta()) is not _END:
                    i, d = item
                    render.delta(render.choices[i], d)
                    version = d.weight_version or version
                if render.num_prompt_top is not None:
                    await asyncio.to_thread(render.build_prompt_logprobs)
                cs = render.choices
                u = _usage(cs)  # best_of: every generated token counts, as OpenAI bills them
                shown = best_choices(cs, *render.best_of) if render.best_of else cs
                body = render.body(response_id, created, name, [render.final(c) for c in shown], u, version)
                return web.json_response(body, dumps=lambda o: _json.encode(o).decode())
            first = await next_delta()  # an error before any output is still an HTTP status
            if first is not _END:
                version = first[1].weight_version
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": response_id})
            out = SSEWriter(request, resp, self.write_timeout_s)
            try:
                await out.prepare()

                def running_usage():
                    return _usage(render.choices)

                for choices in render.first_chunks():
                    await out.send(render.chunk(response_id, created, name, choices,
                                                running_usage() if continuous else None, version))
                try:
                    item = first
                    while item is not _END:
                        i, d = item
                        version = d.weight_version or version
                        choice = render.delta(render.choices[i], d)
                        if choice is not None:
                            await out.send(render.chunk(response_id, created, name, [choice],
                                                        running_usage() if continuous else None, version))
                        item = await next_delta()
                except FrontendError as exc:
                    await out.send(exc.body())
                else:
                    if include_usage:
                        await out.send(render.chunk(response_id, created, name, [], running_usage(), version))
                await out.finish()
            except ConnectionResetError:
                pass  # the client went away (or stopped reading); leaving the `async with` aborts in the engine
            return resp

    async def _merged(self, ecrs: list[EngineCoreRequest]) -> AsyncIterator[tuple[int, GenerationDelta]]:
        """(choice index, delta) from every engine request; the first error is raised."""
        if len(ecrs) == 1:
            async with contextlib.aclosing(self.generator.generate(ecrs[0])) as gen:
                async for d in gen:
                    yield 0, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, ecr: EngineCoreRequest) -> None:
            try:
                async with contextlib.aclosing(self.generator.generate(ecr)) as gen:
                    async for d in gen:
                        queue.put_nowait((i, d))
            except Exception as exc:
                queue.put_nowait(exc)
            finally:
                queue.put_nowait(_END)

        tasks = [asyncio.create_task(pump(i, e)) for i, e in enumerate(ecrs)]
        try:
            num_open = len(tasks)
            while num_open:
                item = await queue.get()
                if item is _END:
                    num_open -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _plan_and_render(req: ChatCompletionRequest, tokenizer, max_chars: int | None,
                     parser) -> tuple[ToolPlan, Prompt]:
    """The request's tools checked (a forced choice compiles its schemas: llguidance), then
    its prompt rendered with them: both blocking, both on the render pool."""
    plan = tool_plan(req, parser)
    return plan, tokenize_chat(req, tokenizer, max_chars, plan.template_tools)


def _usage(choices: list[Choice]) -> dict:
    """A prompt counts once however many choices it has (n, best_of), as OpenAI counts it."""
    return R.usage(sum(c.num_prompt_tokens for c in choices if c.counts_prompt),
                   sum(c.num_output_tokens for c in choices))


class SlowReaderError(ConnectionResetError):
    """The client did not take a write within the write deadline; its connection is gone."""


class SSEWriter:
    """An SSE response whose every write has a deadline. A write waits only when the
    client's socket and aiohttp's buffer are full, i.e. the client stopped reading; past
    ``timeout_s`` the connection is dropped (abort: nothing more is flushed to it) and
    ``SlowReaderError`` raised, so the handler leaves, its engine requests are aborted and
    its admission slot is freed. (The request deadline covers only the wait for the next
    token; without this a client that never reads held its slot for ever.)"""

    def __init__(self, request: web.Request, resp: web.StreamResponse, timeout_s: float) -> None:
        self.request, self.resp, self.timeout_s = request, resp, timeout_s

    async def _bounded(self, aw) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await aw
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise SlowReaderError(f"the client took no data for {self.timeout_s:g} s (--write-timeout-s)") from None

    async def prepare(self) -> None:
        await self._bounded(self.resp.prepare(self.request))

    async def send(self, obj: dict) -> None:
        await self._bounded(self.resp.write(b"data: " + _json.encode(obj) + b"\n\n"))

    async def finish(self) -> None:
        await self._bounded(self.resp.write(b"data: [DONE]\n\n"))
        await self._bounded(self.resp.write_eof())
