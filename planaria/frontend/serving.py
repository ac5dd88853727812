"""The two generation endpoints: request -> engine requests -> JSON body or SSE stream.

``OpenAIServing`` holds what both need (tokenizer, model facts, the ``Generator``); the
per-endpoint differences (body shapes, logprobs format, chat's role chunk) live in the
two ``_Render`` classes. With tools in effect (frontend/tools.py) a chat choice reads tool
calls out of its text as it streams (frontend/tool_calls.py). Errors raised before the
first token become an HTTP error status even for streams (the first delta is awaited
before the SSE headers go out); later ones become an SSE error event followed by ``[DONE]``.

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
from planaria.frontend import responses as R
from planaria.frontend.errors import FrontendError, GatewayTimeoutError, NotFoundError
from planaria.frontend.generation import GenerationDelta, Generator
from planaria.frontend.limits import RequestLimits
from planaria.frontend.logprobs import ChatLogprobs, CompletionLogprobs, TokenTexts, merge_completion_logprobs
from planaria.frontend.params import fit_max_tokens, sampling_params, structured_output
from planaria.frontend.prompts import Prompt, tokenize_chat, tokenize_completion
from planaria.frontend.protocol import ChatCompletionRequest, decode_chat, decode_completion
from planaria.frontend.render import PromptRenderer
from planaria.frontend.tool_calls import ToolCallOutput
from planaria.frontend.tool_calls import finish_reason as tool_finish_reason
from planaria.frontend.tool_parsers import get_tool_parser
from planaria.frontend.tools import ToolPlan, tool_plan

DEFAULT_REQUEST_TIMEOUT_S = 600.0

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


@dataclass
class _Choice:
    index: int
    num_prompt_tokens: int
    prefix: str = ""  # echo: the prompt text, sent before the first delta
    texts: list[str] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    lp_builder: object = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    tool_calls: ToolCallOutput | None = None  # chat with tools in effect: reads calls from the text

    def take(self, d: GenerationDelta) -> str:
        text, self.prefix = self.prefix + d.text, ""
        self.texts.append(text)
        self.num_output_tokens = d.num_output_tokens
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        return text


class _CompletionRender:
    chunk, body = staticmethod(R.completion_chunk), staticmethod(R.completion)

    def __init__(self, choices: list[_Choice], token_text, num_top: int | None) -> None:
        self.choices = choices
        for c in choices:
            if num_top is not None:
                c.lp_builder = CompletionLogprobs(token_text, num_top, text_offset=len(c.prefix))

    def first_chunks(self) -> list[list[dict]]:
        return []

    def delta(self, c: _Choice, d: GenerationDelta) -> dict | None:
        text = c.take(d)
        lp = c.lp_builder.add(d.logprobs or []) if c.lp_builder is not None else None
        if lp is not None:
            c.logprobs.append(lp)
        if not text and d.finish_reason is None and not (lp and lp["tokens"]):
            return None
        return R.completion_choice(c.index, text, lp, d.finish_reason, d.stop_reason)

    def final(self, c: _Choice) -> dict:
        lp = merge_completion_logprobs(c.logprobs) if c.lp_builder is not None else None
        return R.completion_choice(c.index, "".join(c.texts), lp, c.finish_reason, c.stop_reason)


class _ChatRender:
    chunk, body = staticmethod(R.chat_chunk), staticmethod(R.chat_completion)

    def __init__(self, choices: list[_Choice], token_text, num_top: int | None,
                 tool_calls: Callable[[], ToolCallOutput] | None = None) -> None:
        self.choices = choices
        for c in choices:
            if num_top is not None:
                c.lp_builder = ChatLogprobs(token_text, num_top)
            if tool_calls is not None:
                c.tool_calls = tool_calls()

    def first_chunks(self) -> list[list[dict]]:
        return [[R.chat_chunk_choice(c.index, {"role": "assistant", "content": ""})] for c in self.choices]

    def delta(self, c: _Choice, d: GenerationDelta) -> dict | None:
        text = c.take(d)
        lp = c.lp_builder.add(d.logprobs or []) if c.lp_builder is not None else None
        if lp:
            c.logprobs.extend(lp)
        finish = d.finish_reason
        if c.tool_calls is not None:
            out = c.tool_calls.feed(text, finish is not None)
            delta = ({"content": out.content} if out.content else {}) | (
                {"tool_calls": out.tool_calls} if out.tool_calls else {})
            finish = tool_finish_reason(finish, c.tool_calls.num_calls)
        else:
            delta = {"content": text} if text or finish is None else {}
        if not delta and finish is None and not lp:
            return None
        return R.chat_chunk_choice(c.index, delta, lp, finish, d.stop_reason)

    def final(self, c: _Choice) -> dict:
        lp = c.logprobs if c.lp_builder is not None else None
        if c.tool_calls is None:
            return R.chat_choice(c.index, "".join(c.texts), lp, c.finish_reason, c.stop_reason)
        content, calls = c.tool_calls.message()  # what the deltas fed it: a stream's sum
        return R.chat_choice(c.index, content, lp, tool_finish_reason(c.finish_reason, len(calls)),
                             c.stop_reason, calls)


class OpenAIServing:
    def __init__(self, generator: Generator, tokenizer, model: ModelInfo,
                 engine_max_model_len: Callable[[], int | None] = lambda: None, *,
                 limits: RequestLimits = RequestLimits(), renderer: PromptRenderer | None = None,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 tool_call_parser: str | None = "hermes") -> None:
        """``tool_call_parser``: the name of the parser reading calls out of
        ``tool_choice: "auto"`` answers (frontend/tool_parsers.py); None: "auto" is off."""
        self.generator = generator
        self.tokenizer = tokenizer
        self.model = model
        self._engine_max_model_len = engine_max_model_len
        self.token_text = TokenTexts(tokenizer)
        self.limits = limits
        self.renderer = renderer if renderer is not None else PromptRenderer(tokenizer)
        self.request_timeout_s = request_timeout_s
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None

    @property
    def max_model_len(self) -> int:
        return self._engine_max_model_len() or self.model.max_model_len

    # -- request -> engine requests -------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model.name, self.model.path):
            raise NotFoundError(f"The model `{name}` does not exist; this server serves "
                                f"`{self.model.name}`", param="model", code="model_not_found")

    def _engine_requests(self, req, prompts: list[Prompt], base_id: str,
                         so: dict | None) -> list[EngineCoreRequest]:
        """``so``: the structured output (the request's own, or a forced tool choice's)."""
        params = sampling_params(req, vocab_size=self.model.vocab_size, max_logprobs=self.model.max_logprobs,
                                 limits=self.limits)
        if self.model.extra_eos_token_ids and not params.ignore_eos:
            params = msgspec.structs.replace(
                params, stop_token_ids=params.stop_token_ids | frozenset(self.model.extra_eos_token_ids))
        arrival = time.monotonic()
        out = []
        for i, p in enumerate(prompts):
            fitted = fit_max_tokens(params, len(p.token_ids), self.max_model_len)
            out.append(EngineCoreRequest(
                request_id=f"{base_id}-{i}", prompt_token_ids=p.token_ids, sampling_params=fitted,
                eos_token_id=self.model.eos_token_id, arrival_time=arrival, priority=req.priority or 0,
                structured_output=so))
        return out

    # -- endpoints ------------------------------------------------------------------------
    def _deadline(self) -> float:
        return asyncio.get_running_loop().time() + self.request_timeout_s

    async def completions(self, request: web.Request) -> web.StreamResponse:
        deadline = self._deadline()
        req = decode_completion(await request.read())
        self._check_model(req.model)
        prompts = await self.renderer.run(
            tokenize_completion, req.prompt, self.renderer.tokenizer, self.model.vocab_size,
            self.limits.max_prompt_chars(self.max_model_len), self.limits.max_prompts)
        response_id = req.request_id or R.new_id("cmpl")
        ecrs = self._engine_requests(req, prompts, R.new_id("cmpl"), structured_output(req))
        choices = [_Choice(i, len(p.token_ids), prefix=self._echo_text(p) if req.echo else "")
                   for i, p in enumerate(prompts)]
        render = _CompletionRender(choices, self.token_text, req.logprobs)
        return await self._serve(request, req, ecrs, render, response_id, deadline)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        deadline = self._deadline()
        req: ChatCompletionRequest = decode_chat(await request.read())
        self._check_model(req.model)
        tools, prompt = await self.renderer.run(_plan_and_render, req, self.renderer.tokenizer,
                                                self.limits.max_prompt_chars(self.max_model_len), self.tool_parser)
        response_id = req.request_id or R.new_id("chatcmpl")
        so = tools.structured_output(structured_output(req))
        ecrs = self._engine_requests(req, [prompt], R.new_id("chatcmpl"), so)
        choices = [_Choice(0, len(prompt.token_ids))]
        render = _ChatRender(choices, self.token_text, ecrs[0].sampling_params.logprobs, tools.output())
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
                cs = render.choices
                u = R.usage(sum(c.num_prompt_tokens for c in cs), sum(c.num_output_tokens for c in cs))
                body = render.body(response_id, created, name, [render.final(c) for c in cs], u, version)
                return web.json_response(body, dumps=lambda o: _json.encode(o).decode())
            first = await next_delta()  # an error before any output is still an HTTP status
            if first is not _END:
                version = first[1].weight_version
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": response_id})
            try:
                await resp.prepare(request)

                def running_usage():
                    cs = render.choices
                    return R.usage(sum(c.num_prompt_tokens for c in cs), sum(c.num_output_tokens for c in cs))

                for choices in render.first_chunks():
                    await _sse(resp, render.chunk(response_id, created, name, choices,
                                                  running_usage() if continuous else None, version))
                try:
                    item = first
                    while item is not _END:
                        i, d = item
                        version = d.weight_version or version
                        choice = render.delta(render.choices[i], d)
                        if choice is not None:
                            await _sse(resp, render.chunk(response_id, created, name, [choice],
                                                          running_usage() if continuous else None, version))
                        item = await next_delta()
                except FrontendError as exc:
                    await _sse(resp, exc.body())
                else:
                    if include_usage:
                        await _sse(resp, render.chunk(response_id, created, name, [], running_usage(), version))
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client went away; leaving the `async with` aborts in the engine
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


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + _json.encode(obj) + b"\n\n")
