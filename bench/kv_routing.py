"""KV-aware routing against least-loaded routing, side by side in one run, on real
`planaria serve` daemons with SmolLM2 (docs/routing.md).

    .venv/bin/python -m bench.kv_routing [--engines 2,3] [--users 32] [--turns 6]
        [--system-tokens 1000] [--user-tokens 40] [--max-tokens 128] [--think-s 1.0]
        [--dtype bfloat16] [--unique-requests 2] [--no-faults] [--model DIR] [--out FILE]

For each engine count and each router (`planaria serve --routing kv|least-loaded`), a fresh
daemon runs:

- the multi-turn chat: ``--users`` conversations at once, each sharing one system prompt
  of about ``--system-tokens`` tokens, ``--turns`` turns each (the history grows: every
  turn sends all earlier turns and replies), streamed, greedy; each user pauses before a
  turn (``--think-s``, exponential, the same pauses for every router), as people do
  (users in lockstep would make least-loaded routing send each one to the same engine
  every turn by accident). Measured: the prompt tokens
  the engines actually prefilled (the sum of planaria_engine_prefill_tokens over the run),
  against the ideal (each conversation's tokens once, plus one copy of the system prompt per
  engine: sum over users of (last prompt - system prompt) + engines x system prompt), and
  against the floor no router can go below (each turn's tokens that no earlier turn of its
  user sent or got back as a reply, plus the system prompt once per engine: replies are
  cached as they are generated, so the floor is below the ideal); TTFT
  p50/p99 of the first turns and of the later ones; output tokens/s over the run;
- no shared prefixes: ``--users`` clients, each sending ``--unique-requests`` prompts of
  unique text (about the system prompt's length), TTFT p50/p99: routing must cost nothing
  where there is nothing to find.

Then (unless --no-faults) the chat again on the largest engine count with kv routing, with
engine 0 SIGKILLed a third into the run and the highest engine scaled away (`planaria
scale`) at two thirds: requests failed (must be 0) and requests routed to an engine after
its death was reported (must be 0; ``num_routed_while_down`` in `planaria status`).

Goals (issue 30): prefilled tokens within 1.15x of the ideal with kv, and at least 2x
fewer than least-loaded; TTFT p50 of the later turns at least 1.5x lower; throughput not
lower; no TTFT regression without shared prefixes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from bench.serve_stack import ServeStack

REPO = Path(__file__).resolve().parents[1]
TOPICS = ("lighthouses", "bread baking", "glaciers", "chess openings", "bees", "railways", "tides", "volcanoes",
          "paper making", "owls", "sundials", "coral reefs", "bicycles", "comets", "olive trees", "typefaces")


@dataclass
class Workload:
    users: int
    turns: int
    system_tokens: int
    user_tokens: int
    user_words: int  # user_message's words for about user_tokens tokens (user_words_for)
    max_tokens: int
    unique_requests: int
    think_s: float = 1.0  # mean pause before each turn (exponential, seeded per user)


@dataclass
class ChatResult:
    wall_s: float = 0.0
    num_requests: int = 0
    num_failed: int = 0
    output_tokens: int = 0
    ttft_first_s: list[float] = field(default_factory=list)  # first turns
    ttft_later_s: list[float] = field(default_factory=list)  # turns after the first
    last_prompt_tokens: dict[int, int] = field(default_factory=dict)  # user -> its last turn's prompt
    new_tokens: int = 0  # prompt tokens no earlier turn of the user sent or got back (its prompt + reply)
    errors: list[str] = field(default_factory=list)


# -- prompts ------------------------------------------------------------------------------
def system_prompt(tokenizer, num_tokens: int) -> str:
    """A long, fixed system prompt of about ``num_tokens`` tokens."""
    rules, i = [], 0
    text = "You are a patient assistant for a museum of everyday things. Follow these house rules.\n"
    while len(tokenizer.encode(text + "".join(rules))) < num_tokens:
        i += 1
        rules.append(f"Rule {i}: when a visitor asks about exhibit {i * 7 % 97}, answer in plain words, "
                     f"name the hall ({'north south east west'.split()[i % 4]}), and keep it short.\n")
    return text + "".join(rules)


def user_message(user: int, turn: int, num_words: int) -> str:
    topic = TOPICS[(user + turn) % len(TOPICS)]
    words = " ".join(f"detail{(user * 31 + turn * 7 + k) % 997}" for k in range(max(0, num_words - 12)))
    return f"Visitor {user}, question {turn}: tell me something about {topic}. Context: {words}."


def user_words_for(tokenizer, num_tokens: int) -> int:
    """How many user_message words make ``num_tokens`` tokens in the first user's first
    message (a "detailNNN" word is 1-4 tokens, the fixed part about 18); the others' run
    longer (at 40: 40-61 tokens, 58 on average over 32 users x 6 turns)."""
    for words in range(12, 1000):
        if len(tokenizer.encode(user_message(0, 0, words), add_special_tokens=False)) >= num_tokens:
            return words
    return 1000


def unique_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(f"{rng.choice(TOPICS).split()[0]}{rng.randrange(1000)}" for _ in range(num_words))


def words_for(tokenizer, num_tokens: int) -> int:
    """How many unique_prompt words make about ``num_tokens`` tokens."""
    per_word = len(tokenizer.encode(unique_prompt(random.Random(0), 200), add_special_tokens=False)) / 200
    return max(1, int(num_tokens / per_word))


# -- clients ------------------------------------------------------------------------------
async def stream_chat(session: aiohttp.ClientSession, base: str, body: dict) -> tuple[float | None, str, dict]:
    """(TTFT, the reply's text, usage) of one streamed chat completion."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    async with session.post(f"{base}/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            for choice in chunk.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(delta)
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft, "".join(parts), usage


async def run_chat(base: str, model: str, w: Workload, system: str, res: ChatResult | None = None) -> ChatResult:
    """Every user's conversation at once; ``res`` is filled as they go (a fault injector
    may watch its request count)."""
    res = res if res is not None else ChatResult()

    async def user(session, u: int) -> None:
        messages = [{"role": "system", "content": system}]
        rng = random.Random(u)  # the same pauses whatever the router
        seen = None  # the previous turn's prompt + reply tokens
        for t in range(w.turns):
            if w.think_s > 0:  # users read, then type: they do not move in lockstep
                await asyncio.sleep(rng.uniform(0, w.think_s) if t == 0 else rng.expovariate(1 / w.think_s))
            messages.append({"role": "user", "content": user_message(u, t, w.user_words)})
            body = {"model": model, "messages": messages, "max_tokens": w.max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}}
            res.num_requests += 1
            try:
                ttft, text, usage = await stream_chat(session, base, body)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                res.num_failed += 1
                res.errors.append(f"user {u} turn {t}: {exc}")
                return
            (res.ttft_first_s if t == 0 else res.ttft_later_s).append(ttft if ttft is not None else float("nan"))
            res.output_tokens += usage.get("completion_tokens", 0)
            res.last_prompt_tokens[u] = prompt = usage.get("prompt_tokens", 0)
            res.new_tokens += prompt - (seen if seen is not None else 0)
            seen = prompt + usage.get("completion_tokens", 0)
            messages.append({"role": "assistant", "content": text})

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(session, u) for u in range(w.users)))
        res.wall_s = time.perf_counter() - t0
    return res


async def run_unique(base: str, model: str, w: Workload, num_words: int) -> list[float]:
    """TTFTs of prompts that share nothing (beyond the chat template's few tokens); a
    failed request counts as nan."""
    ttfts: list[float] = []

    async def client(session, u: int) -> None:
        rng = random.Random(1000 + u)
        for _ in range(w.unique_requests):
            body = {"model": model, "messages": [{"role": "user", "content": unique_prompt(rng, num_words)}],
                    "max_tokens": 16, "temperature": 0.0, "stream": True}
            try:
                ttft, _, _ = await stream_chat(session, base, body)
            except Exception as exc:  # noqa: BLE001 - reported, the run goes on
                print(f"  no-shared-prefix request failed: {exc}", flush=True)
                ttft = None
            ttfts.append(ttft if ttft is not None else float("nan"))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session, u) for u in range(w.users)))
    return ttfts


# -- one daemon ---------------------------------------------------------------------------
def prefill_tokens(stack: ServeStack) -> int:
    return int(sum(v for k, v in stack.metrics().items() if k.startswith("planaria_engine_prefill_tokens{")))


def routing_decisions(stack: ServeStack) -> dict[str, int]:
    return {k.split('"')[1]: int(v) for k, v in stack.metrics().items()
            if k.startswith("planaria_routing_decisions_total{")}


def pct(values: list[float], q: float) -> float:
    vals = sorted(v for v in values if v == v)
    if not vals:
        return float("nan")
    return vals[min(len(vals) - 1, int(round(q * (len(vals) - 1))))]


def start(root: Path, model: Path, engines: int, routing: str, engine_config: dict, max_engines: int) -> ServeStack:
    root.mkdir(parents=True, exist_ok=True)
    stack = ServeStack(root, num_engines=engines, model=str(model), engine_config=engine_config, threads=None,
                       hang_timeout_s=60.0, serve_args=("--routing", routing, "--max-engines", str(max_engines),
                                                        "--heartbeat-interval-s", "0.5"))
    stack.start(timeout_s=900)
    return stack


def summarize(res: ChatResult, prefilled: int, ideal: int, engines: int, routing: str,
              unique_ttfts: list[float], decisions: dict[str, int]) -> dict:
    return {"engines": engines, "routing": routing, "requests": res.num_requests, "failed": res.num_failed,
            "prefilled_tokens": prefilled, "ideal_tokens": ideal,
            "prefilled_over_ideal": round(prefilled / ideal, 3) if ideal else None,
            "ttft_first_p50_s": round(pct(res.ttft_first_s, 0.5), 4),
            "ttft_later_p50_s": round(pct(res.ttft_later_s, 0.5), 4),
            "ttft_later_p99_s": round(pct(res.ttft_later_s, 0.99), 4),
            "output_tok_s": round(res.output_tokens / res.wall_s, 2) if res.wall_s else 0.0,
            "wall_s": round(res.wall_s, 1),
            "unique_ttft_p50_s": round(pct(unique_ttfts, 0.5), 4) if unique_ttfts else None,
            "unique_ttft_p99_s": round(pct(unique_ttfts, 0.99), 4) if unique_ttfts else None,
            "decisions": decisions, "errors": res.errors[:5]}


def one_run(root: Path, model: Path, w: Workload, engines: int, routing: str, engine_config: dict,
            system: str, system_len: int, unique_words: int) -> dict:
    stack = start(root / f"{routing}-{engines}", model, engines, routing, engine_config, engines)
    try:
        name = Path(model).resolve().name
        asyncio.run(run_unique(stack.base, name, Workload(**{**asdict(w), "users": 1, "unique_requests": 1}), 8))
        before = prefill_tokens(stack)
        res = asyncio.run(run_chat(stack.base, name, w, system))
        prefilled = prefill_tokens(stack) - before
        ideal = sum(n - system_len for n in res.last_prompt_tokens.values()) + engines * system_len
        unique = asyncio.run(run_unique(stack.base, name, w, unique_words))
        out = summarize(res, prefilled, ideal, engines, routing, unique, routing_decisions(stack))
        # what no router can avoid: each turn's tokens that no earlier turn of the user sent or
        # got back as its reply, plus the system prompt once per engine
        out["floor_tokens"] = floor = res.new_tokens - len(res.last_prompt_tokens) * system_len + engines * system_len
        out["prefilled_over_floor"] = round(prefilled / floor, 3) if floor > 0 else None
        out["routing_status"] = stack.status().get("routing")
        out["peer_kv_blocks"] = int(sum(v for k, v in stack.metrics().items()
                                        if k.startswith("planaria_engine_peer_kv_blocks{")))
        return out
    finally:
        stack.close()


def fault_run(root: Path, model: Path, w: Workload, engines: int, engine_config: dict, system: str) -> dict:
    """kv routing with engine 0 SIGKILLed and the highest engine scaled away mid-run."""
    from planaria.daemon.control import ControlClient

    stack = start(root / f"faults-{engines}", model, engines, "kv", engine_config, engines)
    try:
        name = Path(model).resolve().name
        times = {"kill": None, "scale": None}
        res = ChatResult()
        total = w.users * w.turns

        async def chaos() -> None:
            loop = asyncio.get_running_loop()
            while res.num_requests < total // 3:
                await asyncio.sleep(0.05)
            fault = await loop.run_in_executor(None, stack.fault, 0, "kill")
            times["kill"] = fault.at
            print(f"  SIGKILLed engine 0 (pid {fault.pid}) after {res.num_requests} requests", flush=True)
            while res.num_requests < 2 * total // 3:
                await asyncio.sleep(0.05)
            client = ControlClient(stack.runtime, timeout_s=10)
            reply = await loop.run_in_executor(None, lambda: client.call("scale", action="to", engines=engines - 1))
            times["scale"] = time.time()
            print(f"  scaling to {engines - 1} after {res.num_requests} requests: removing {reply.get('removing')}",
                  flush=True)

        async def main() -> None:
            await asyncio.gather(run_chat(stack.base, name, w, system, res), chaos())

        asyncio.run(main())
        status = stack.status()
        routing = status.get("routing") or {}
        while_down = sum(e.get("num_routed_while_down", 0) for e in (routing.get("engines") or {}).values())
        return {"engines": engines, "routing": "kv", "requests": res.num_requests, "failed": res.num_failed,
                "routed_after_death_reported": while_down, "killed_at": times["kill"],
                "scaled_at": times["scale"], "errors": res.errors[:5],
                "decisions": routing_decisions(stack), "routing_status": routing,
                "ttft_later_p50_s": round(pct(res.ttft_later_s, 0.5), 4),
                "output_tok_s": round(res.output_tokens / res.wall_s, 2) if res.wall_s else 0.0}
    finally:
        stack.close()


# -- report -------------------------------------------------------------------------------
def print_table(rows: list[dict]) -> None:
    cols = [("engines", "E"), ("routing", "router"), ("requests", "reqs"), ("failed", "failed"),
            ("prefilled_tokens", "prefilled"), ("ideal_tokens", "ideal"), ("prefilled_over_ideal", "x ideal"),
            ("floor_tokens", "floor"), ("prefilled_over_floor", "x floor"),
            ("ttft_first_p50_s", "TTFT1 p50"), ("ttft_later_p50_s", "TTFT2+ p50"), ("ttft_later_p99_s", "TTFT2+ p99"),
            ("output_tok_s", "out tok/s"), ("unique_ttft_p50_s", "uniq p50"), ("unique_ttft_p99_s", "uniq p99")]
    table = [[h for _, h in cols]] + [[str(r.get(k, "-")) for k, _ in cols] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def comparisons(rows: list[dict]) -> list[str]:
    """kv against least-loaded per engine count, against the issue's goals."""
    out = []
    for e in sorted({r["engines"] for r in rows}):
        kv = next((r for r in rows if r["engines"] == e and r["routing"] == "kv"), None)
        ll = next((r for r in rows if r["engines"] == e and r["routing"] == "least-loaded"), None)
        if not kv or not ll:
            continue

        def ratio(a, b):
            return round(a / b, 2) if a and b else float("nan")

        out.append(f"{e} engines: prefilled kv/ideal {kv['prefilled_over_ideal']} (goal <= 1.15; kv/floor "
                   f"{kv['prefilled_over_floor']}, least-loaded/floor {ll['prefilled_over_floor']}), "
                   f"least-loaded/kv {ratio(ll['prefilled_tokens'], kv['prefilled_tokens'])} (goal >= 2); "
                   f"TTFT2+ p50 least-loaded/kv {ratio(ll['ttft_later_p50_s'], kv['ttft_later_p50_s'])} (goal >= 1.5); "
                   f"out tok/s kv/least-loaded {ratio(kv['output_tok_s'], ll['output_tok_s'])} (goal >= 1); "
                   f"no-shared-prefix TTFT p50 kv/least-loaded "
                   f"{ratio(kv['unique_ttft_p50_s'], ll['unique_ttft_p50_s'])} (goal <= ~1)")
    return out


def model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from bench.offline_vs_vllm import ensure_model  # .state/models/smollm2, built when missing

    return ensure_model("smollm2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_routing", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default="2,3", help="engine counts, comma-separated (default 2,3)")
    p.add_argument("--routers", default="kv,least-loaded")
    p.add_argument("--users", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--user-tokens", type=int, default=40, help="tokens of the first user's first message; the others' "
                   "run up to ~1.5x longer (default 40: 40-61, mean 58)")
    p.add_argument("--max-tokens", type=int, default=128, help="reply length bound")
    p.add_argument("--unique-requests", type=int, default=2, help="no-shared-prefix prompts per user")
    p.add_argument("--think-s", type=float, default=1.0,
                   help="mean pause of a user before each turn, exponential (0: none; users in lockstep "
                        "make least-loaded routing sticky by accident)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="per engine (default 1 GiB)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--no-faults", action="store_true", help="skip the SIGKILL + scale-down run")
    p.add_argument("--model", help="model directory (default: .state/models/smollm2)")
    p.add_argument("--root", default=str(REPO / ".state" / "bench-kv-routing"), help="daemons' state dirs")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "kv_routing.json"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    model = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    w = Workload(args.users, args.turns, args.system_tokens, args.user_tokens,
                 user_words_for(tokenizer, args.user_tokens), args.max_tokens, args.unique_requests, args.think_s)
    system = system_prompt(tokenizer, args.system_tokens)
    system_text = tokenizer.apply_chat_template([{"role": "system", "content": system}], tokenize=False,
                                                add_generation_prompt=False)
    system_len = len(tokenizer.encode(system_text, add_special_tokens=False))
    engine_config = {"dtype": args.dtype, "kv_cache_bytes": args.kv_cache_bytes, "max_model_len": args.max_model_len,
                     "max_num_seqs": max(8, args.users), "max_num_batched_tokens": 2048}
    print(f"bench.kv_routing: {model}, {w}, system prompt {system_len} tokens, engine config {engine_config}",
          flush=True)
    root = Path(args.root)
    rows = []
    counts = [int(x) for x in args.engines.split(",")]
    for engines in counts:
        for routing in args.routers.split(","):
            print(f"- {engines} engines, --routing {routing}", flush=True)
            rows.append(one_run(root, model, w, engines, routing, engine_config, system, system_len,
                                words_for(tokenizer, args.system_tokens)))
            print(f"  {json.dumps({k: v for k, v in rows[-1].items() if k != 'routing_status'})}", flush=True)
    print()
    print_table(rows)
    for line in comparisons(rows):
        print(line)
    faults = None
    if not args.no_faults:
        engines = max(counts)
        print(f"- faults: {engines} engines, --routing kv, engine 0 SIGKILLed at 1/3, scaled to {engines - 1} at 2/3",
              flush=True)
        faults = fault_run(root, model, w, engines, engine_config, system)
        print(f"faults: {faults['requests']} requests, {faults['failed']} failed, "
              f"{faults['routed_after_death_reported']} routed to an engine after its death was reported; "
              f"decisions {faults['decisions']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"workload": asdict(w), "system_prompt_tokens": system_len,
                                          "engine_config": engine_config, "runs": rows, "faults": faults}, indent=2))
    print(f"results: {args.out}")
    ok = all(r["failed"] == 0 for r in rows) and (faults is None or (
        faults["failed"] == 0 and faults["routed_after_death_reported"] == 0))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
