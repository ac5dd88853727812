"""Streaming completions through the HTTP frontend, as a client sees them.

``stream_completion`` reads one SSE stream to its end; ``request_bodies`` makes greedy
and seeded requests whose output is reproducible, so a run under faults can be compared
with a fault-free run text for text.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp


async def stream_completion(session: aiohttp.ClientSession, base: str, body: dict,
                            first_text: asyncio.Event | None = None,
                            chunk_times: list[float] | None = None) -> dict:
    """One streaming completion; returns {"text", "finish_reason", "error", "status",
    "chunk_times"} (``time.time()`` of each chunk that carried text, appended as they come
    to ``chunk_times`` when given, so a caller can watch a stream in flight). ``first_text``
    is set when its first text arrives."""
    text, finish, error = [], None, None
    times = chunk_times if chunk_times is not None else []
    async with session.post(f"{base}/v1/completions", json={**body, "stream": True}) as r:
        if r.status != 200:
            return {"text": "", "finish_reason": None, "error": await r.text(), "status": r.status,
                "chunk_times": []}
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]
                continue
            if any(c.get("text") for c in obj.get("choices", [])):
                times.append(time.time())
            for c in obj.get("choices", []):
                text.append(c.get("text", ""))
                finish = c.get("finish_reason") or finish
                if first_text is not None and c.get("text"):
                    first_text.set()
    return {"text": "".join(text), "finish_reason": finish, "error": error, "status": 200,
            "chunk_times": times}


def request_bodies(num: int, max_tokens: tuple[int, int] = (32, 64), seed: int = 0) -> list[dict]:
    """Greedy (even) and seeded (odd) requests, ignore_eos, of varying length."""
    rng = random.Random(seed)
    words = "the of and a to in is you that it he was for on are as with his they at".split()
    out = []
    for i in range(num):
        body = {"model": "tiny-moe", "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))),
                "max_tokens": rng.randint(*max_tokens), "ignore_eos": True}
        if i % 2:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
        else:
            body.update(temperature=0.0)
        out.append(body)
    return out
