"""Chat-template rendering and tokenizing, off the event loop and under a time limit.

``PromptRenderer.run(fn, *args)`` runs a blocking prompt function (``prompts.tokenize_*``)
on a bounded thread pool and waits at most ``timeout_s`` for it, queueing included. On
expiry the request gets 503 ``render_timeout``; why 5xx and not 4xx: the template is the
operator's, not the client's (``chat_template_kwargs`` is allow-listed, text length is
capped before rendering), so a render that runs out of time is the server's capacity or
its template at fault, and the same request may pass on a less busy server.

A Python thread cannot be stopped: a runaway render keeps its worker until it ends, and
``threads`` bounds how many can run at once (later renders wait, then time out). The
event loop never waits on one, so /health and streams already running are unaffected
(the GIL is shared, so they may slow, not stop).

The tokenizer is handed to the functions behind ``LockedEncoder``: a Hugging Face fast
tokenizer's Rust object can raise "Already borrowed" when two threads encode while one
changes its truncation settings, so ``encode`` is serialized (it is the cheap part; the
template render, the part that can be slow, runs in parallel).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from planaria.frontend.errors import ServiceUnavailableError


class LockedEncoder:
    """The tokenizer calls prompts.py and frontend.tokenization make; the Rust ones under a lock."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def apply_chat_template(self, messages, **kwargs) -> Any:
        return self._tokenizer.apply_chat_template(messages, **kwargs)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        with self._lock:
            return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        with self._lock:
            return list(self._tokenizer.convert_ids_to_tokens(token_ids))

    @property
    def chat_template(self) -> str | dict | None:
        """The template's source (frontend/tool_prompts.py asks whether it knows tools)."""
        return self._tokenizer.chat_template


class PromptRenderer:
    def __init__(self, tokenizer, timeout_s: float = 20.0, threads: int = 4) -> None:
        if timeout_s <= 0 or threads < 1:
            raise ValueError(f"render timeout_s must be > 0 and threads >= 1, got {timeout_s}, {threads}")
        self.tokenizer = LockedEncoder(tokenizer)
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="planaria-render")

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on the pool; its exceptions propagate (RequestError: 400)."""
        future = self._pool.submit(fn, *args, **kwargs)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            future.cancel()  # still queued: never runs; already running: runs on, unwatched
            raise ServiceUnavailableError(
                f"rendering and tokenizing the prompt took longer than {self.timeout_s:g} s "
                "(--render-timeout-s)", code="render_timeout") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
