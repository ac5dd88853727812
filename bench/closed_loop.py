"""A closed-loop streaming load through the HTTP frontend, on a thread of its own.

    load = ClosedLoopLoad(base_url, bodies, num_streams=6).start()
    ...                        # scale, kill, restart etcd: the load keeps going
    records = load.stop()      # waits for the requests in flight, returns every request

Each of ``num_streams`` streams sends its next body (round-robin over ``bodies``) as soon
as its previous request ended, until ``stop()``; so requests are in flight at every moment
of whatever happens meanwhile. Every request is kept as a ``LoadRecord`` (which body, wall
clock start and end, the result of ``stream_completion``), so a test can check each text
against a fault-free run and find the requests that spanned an event
(``in_flight_across``). ``metric(name)`` reads one counter of the frontend's /metrics.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request
from dataclasses import dataclass

import aiohttp

from bench.streaming_load import stream_completion


@dataclass
class LoadRecord:
    body_index: int
    started_at: float   # time.time()
    ended_at: float
    result: dict        # {"text", "finish_reason", "error", "status"}


class ClosedLoopLoad:
    def __init__(self, base_url: str, bodies: list[dict], num_streams: int = 6,
                 request_timeout_s: float = 300.0) -> None:
        if not bodies or num_streams < 1:
            raise ValueError("need at least one body and one stream")
        self.base_url, self.bodies = base_url, bodies
        self.num_streams, self.request_timeout_s = num_streams, request_timeout_s
        self.records: list[LoadRecord] = []
        self._lock = threading.Lock()
        self._next = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="closed-loop-load", daemon=True)
        self._error: BaseException | None = None
        self._live: dict[int, LoadRecord] = {}  # requests in flight (ended_at 0.0, chunk times so far)
        self._live_ids = 0

    def start(self) -> "ClosedLoopLoad":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 300.0) -> list[LoadRecord]:
        """No new requests; wait for those in flight; every request, in start order."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"requests still in flight {timeout_s} s after stop()")
        if self._error is not None:
            raise self._error
        return sorted(self.records, key=lambda r: r.started_at)

    @property
    def num_done(self) -> int:
        with self._lock:
            return len(self.records)

    def wait_done(self, num: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_done < num:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise TimeoutError(f"only {self.num_done}/{num} requests done")
            time.sleep(0.05)

    def in_flight_across(self, start_s: float, end_s: float | None = None) -> list[LoadRecord]:
        """The requests that started before ``start_s`` and ended after ``end_s``
        (default ``start_s``): in flight during the whole of [start_s, end_s]."""
        end_s = start_s if end_s is None else end_s
        with self._lock:
            return [r for r in self.records if r.started_at < start_s and r.ended_at > end_s]

    def _take(self) -> int:
        with self._lock:
            i = self._next % len(self.bodies)
            self._next += 1
            return i

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - handed to stop()'s caller
            self._error = exc

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._stream(session) for _ in range(self.num_streams)))

    def in_flight(self) -> list[LoadRecord]:
        """The requests in flight now (``ended_at`` 0.0; ``result["chunk_times"]`` so far)."""
        with self._lock:
            return [LoadRecord(r.body_index, r.started_at, 0.0, {"chunk_times": list(r.result["chunk_times"])})
                    for r in self._live.values()]

    async def _stream(self, session: aiohttp.ClientSession) -> None:
        while not self._stop.is_set():
            i = self._take()
            t0 = time.time()
            times: list[float] = []
            with self._lock:
                self._live_ids += 1
                key = self._live_ids
                self._live[key] = LoadRecord(i, t0, 0.0, {"chunk_times": times})
            try:
                result = await stream_completion(session, self.base_url, self.bodies[i], chunk_times=times)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                result = {"text": "", "finish_reason": None, "error": f"{type(exc).__name__}: {exc}",
                          "status": 0, "chunk_times": times}
            with self._lock:
                del self._live[key]
                self.records.append(LoadRecord(i, t0, time.time(), result))


def metric(base_url: str, name: str) -> float:
    """The value of an unlabelled counter or gauge on the frontend's /metrics (0 if absent)."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def mismatches(records: list[LoadRecord], reference: list[str]) -> list[tuple[int, dict]]:
    """The requests that failed or whose text differs from the fault-free run's."""
    return [(r.body_index, r.result) for r in records
            if r.result["status"] != 200 or r.result["error"] or r.result["text"] != reference[r.body_index]]


def offline_reference(model: str, bodies: list[dict], kv_cache_bytes: int = 32 * 2**20,
                      max_model_len: int = 1024) -> list[str]:
    """Each body's text from the offline single engine (no EP, no faults), in one batch."""
    from planaria.engine import LLM, SamplingParams

    llm = LLM(model, kv_cache_bytes=kv_cache_bytes, max_model_len=max_model_len)
    params = [SamplingParams(temperature=b["temperature"], top_p=b.get("top_p", 1.0), seed=b.get("seed"),
                             max_tokens=b["max_tokens"], ignore_eos=True) for b in bodies]
    return [o.text for o in llm.generate([b["prompt"] for b in bodies], params)]
