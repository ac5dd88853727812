"""POST /v1/embeddings (OpenAI format) for a pooling model.

    {"model": ..., "input": str | [str] | [int] | [[int]], "encoding_format": "float" | "base64"}
    -> {"object": "list", "data": [{"object": "embedding", "index": i, "embedding": ...}],
        "model": ..., "usage": {"prompt_tokens": n, "total_tokens": n}}

Each input becomes one engine request (the engine's pooling core answers it with
``EngineCoreOutput.pooled``); they run concurrently. base64 is the little-endian float32
bytes, as the OpenAI client decodes them. An input longer than the engine's
max_model_len is a 400, as OpenAI answers it (no silent truncation); so are more inputs
than ``RequestLimits.max_embedding_inputs`` and token ids outside the vocabulary. Inputs
are tokenized off the event loop (``frontend.render``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import struct
import uuid
from typing import Any, Callable

import msgspec
from aiohttp import web

from planaria.engine.errors import EngineFaultError, NoEngineAvailableError
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams
from planaria.frontend.admission import take_sequences
from planaria.frontend.errors import (EngineRequestError, GatewayTimeoutError, NotFoundError, RequestError,
                                      ServiceUnavailableError)
from planaria.frontend.generation import engine_error
from planaria.frontend.limits import RequestLimits
from planaria.frontend.prompts import check_chars, check_token_ids
from planaria.frontend.protocol import Int, _decode
from planaria.frontend.render import PromptRenderer


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    input: str | list[Any]  # str | [str] | [int] | [[int]], checked in _inputs (msgspec allows one list type)
    model: str | None = None
    encoding_format: str = "float"
    dimensions: Int | None = None
    user: str | None = None


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _inputs(req: EmbeddingRequest, max_inputs: int | None = None) -> list[str | list[int]]:
    items = req.input
    if isinstance(items, str):
        return [items]
    if not items:
        raise RequestError("input must not be empty", param="input")
    if _is_ids(items):
        return [list(items)]
    if not (all(isinstance(x, str) for x in items) or all(_is_ids(x) for x in items)):
        raise RequestError("input must be a string, a list of strings, a list of token ids or a list of "
                           "lists of token ids", param="input")
    if max_inputs is not None and len(items) > max_inputs:
        raise RequestError(f"at most {max_inputs} inputs fit in one request, got {len(items)}", param="input")
    return list(items)


def encode_vector(vec: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode("ascii")
    return vec


class EmbeddingServing:
    def __init__(self, client, tokenizer, model_name: str, model_path: str,
                 max_model_len: Callable[[], int], is_pooling: bool, *, vocab_size: int | None = None,
                 limits: RequestLimits = RequestLimits(), renderer: PromptRenderer | None = None,
                 request_timeout_s: float = 600.0) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model_name, self.model_path = model_name, model_path
        self.max_model_len = max_model_len
        self.is_pooling = is_pooling
        self.vocab_size = vocab_size
        self.limits = limits
        self.renderer = renderer if renderer is not None else PromptRenderer(tokenizer)
        self.request_timeout_s = request_timeout_s

    async def embeddings(self, request: web.Request) -> web.Response:
        req = _decode(await request.read(), EmbeddingRequest)
        if req.model is not None and req.model not in (self.model_name, self.model_path):
            raise NotFoundError(f"The model `{req.model}` does not exist; this server serves "
                                f"`{self.model_name}`", param="model", code="model_not_found")
        if not self.is_pooling:
            raise RequestError(f"the model `{self.model_name}` does not support embeddings "
                               "(it is not a pooling model)", param="model")
        if req.encoding_format not in ("float", "base64"):
            raise RequestError("encoding_format must be 'float' or 'base64'", param="encoding_format")
        if req.dimensions is not None:
            raise RequestError("dimensions is not supported by this model", param="dimensions")
        inputs = _inputs(req, self.limits.max_embedding_inputs)
        take_sequences(request, len(inputs))  # each input is one engine request
        token_lists = await self.renderer.run(self._token_lists, inputs, self.max_model_len())
        base = f"embd-{uuid.uuid4().hex}"
        try:
            async with asyncio.timeout(self.request_timeout_s):  # cancelling aborts in the engines
                vectors = await asyncio.gather(*(self._embed(f"{base}-{i}", ids)
                                                 for i, ids in enumerate(token_lists)))
        except TimeoutError:
            raise GatewayTimeoutError(f"the request ran longer than {self.request_timeout_s:g} s "
                                      "(--request-timeout-s) and was aborted", code="request_timeout") from None
        num_tokens = sum(len(ids) for ids in token_lists)
        return web.json_response({
            "object": "list", "model": self.model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encode_vector(v, req.encoding_format)}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    def _token_lists(self, inputs: list[str | list[int]], limit: int) -> list[list[int]]:
        """Blocking (the tokenizer): runs on the renderer's pool."""
        return [self._tokens(x, i, limit) for i, x in enumerate(inputs)]

    def _tokens(self, item: Any, index: int, limit: int) -> list[int]:
        if isinstance(item, str):
            check_chars(item, self.limits.max_prompt_chars(limit), "input")
            ids = self.renderer.tokenizer.encode(item, add_special_tokens=True)
        else:
            check_token_ids(item, self.vocab_size, param="input")
            ids = item
        if not ids:
            raise RequestError(f"input[{index}] is empty", param="input")
        if len(ids) > limit:
            raise RequestError(f"input[{index}] has {len(ids)} tokens; this model's maximum is {limit}",
                               param="input")
        return ids

    async def _embed(self, request_id: str, ids: list[int]) -> list[float]:
        ecr = EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                sampling_params=SamplingParams(max_tokens=1))
        try:
            async with contextlib.aclosing(self.client.generate(ecr)) as outs:
                async for out in outs:
                    if out.finish_reason == "error":
                        raise engine_error(out, 0, param="input")
                    if out.pooled is not None:
                        return out.pooled
        except NoEngineAvailableError as exc:
            raise ServiceUnavailableError(f"no engine can take the request now: {exc}",
                                          code="no_engine_available") from exc
        except EngineFaultError as exc:
            raise ServiceUnavailableError(f"the engine serving this request failed: {exc}",
                                          code="engine_dead") from exc
        raise EngineRequestError("the engine returned no embedding")
