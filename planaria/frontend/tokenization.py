"""POST /tokenize and /detokenize, as ``vllm serve`` has them.

    /tokenize   {"model"?, "prompt": str, "add_special_tokens": true}
                {"model"?, "messages": [...], "add_generation_prompt": true,
                 "continue_final_message": false, "chat_template_kwargs"?, "add_special_tokens": false}
                (either form: "return_token_strs": false)
             -> {"count": n, "max_model_len": m, "tokens": [...], "token_strs": null | [...]}
    /detokenize {"model"?, "tokens": [...]} -> {"prompt": str}

The chat form renders the messages with the model's chat template exactly as
/v1/chat/completions does (``prompts.tokenize_chat``: the same allow-listed
``chat_template_kwargs``), so its tokens are the prompt a chat request would send. The
same limits as generation apply: text longer than ``max_chars_per_token`` x
``max_model_len`` is refused before tokenizing, and /detokenize takes at most that many
token ids, each inside the vocabulary (400 ``tokens``). Both run on the render pool, off
the event loop and under its time limit (``frontend.render``). The server routes them
through the same guards as generation (API key, in-flight bound, body limits).
"""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from planaria.frontend.errors import RequestError
from planaria.frontend.prompts import check_chars, check_token_ids, tokenize_chat
from planaria.frontend.protocol import ChatCompletionRequest, ChatMessage, Int, _decode
from planaria.frontend.serving import OpenAIServing


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Both of vLLM's forms in one struct: exactly one of ``prompt`` and ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages (vLLM)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[Int]
    model: str | None = None


def _encode_text(text: str, tokenizer, add_special_tokens: bool, max_chars: int) -> list[int]:
    check_chars(text, max_chars, "prompt")
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _tokenize(req: TokenizeRequest, tokenizer, max_chars: int) -> tuple[list[int], list[str] | None]:
    """(token ids, their token strings when asked); blocking, for the render pool."""
    if req.messages is not None:
        chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs)
        ids = tokenize_chat(chat, tokenizer, max_chars, add_special_tokens=bool(req.add_special_tokens)).token_ids
    else:
        add = True if req.add_special_tokens is None else req.add_special_tokens
        ids = _encode_text(req.prompt, tokenizer, add, max_chars)
    return ids, (tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None)


class TokenServing:
    """The two handlers, on the generation endpoints' tokenizer, renderer and limits."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    def _max_chars(self) -> int:
        return self.serving.limits.max_prompt_chars(self.serving.max_model_len)

    async def tokenize(self, request: web.Request) -> web.Response:
        req = _decode(await request.read(), TokenizeRequest)
        self.serving.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("send exactly one of prompt (a string) and messages (a chat)",
                               param="messages" if req.messages is not None else "prompt")
        renderer = self.serving.renderer
        ids, strs = await renderer.run(_tokenize, req, renderer.tokenizer, self._max_chars())
        return web.json_response({"count": len(ids), "max_model_len": self.serving.max_model_len,
                                  "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        req = _decode(await request.read(), DetokenizeRequest)
        self.serving.check_model(req.model)
        max_tokens = self._max_chars()
        if len(req.tokens) > max_tokens:
            raise RequestError(f"tokens holds at most {max_tokens} ids, got {len(req.tokens)}", param="tokens")
        check_token_ids(req.tokens, self.serving.model.vocab_size, param="tokens")
        renderer = self.serving.renderer
        text = await renderer.run(renderer.tokenizer.decode, list(req.tokens))
        return web.json_response({"prompt": text})
