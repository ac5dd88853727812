"""Show the daemon's engines and frontend.

    planaria status [--json]

Wire: {"command": "status", "args": {}} -> {"status": "...", "engines": [{"engine_id",
"rank", "state", "pid", "uptime_s", "restarts", "num_running", "num_waiting",
"kv_usage", "kv_cache_bytes", "kv_source", ...}], "frontend": {...}, "scale": ...}.
The frontend's "reason" is why it last exited (a hang kill: "frontend hung: event loop
did not answer for 10.0 s (limit 10 s)"); "last_answer_age_s" how long ago its event
loop last answered the supervisor (None: not yet), "loop_lag_s" that loop's latest
stall as it measured it, "hang_timeout_s" the limit (--frontend-hang-timeout-s; 0: off).
kv_source is "profiled" (measured at start), "given" (--engine-config-json
kv_cache_bytes) or "reused" (a scale-up engine that took the running engines' figure).
"dtype" is the engine's compute dtype and why, e.g. "float32 (auto: CPU has no
amx_bf16/avx512_bf16)" (engine/dtype.py).
With --parallel ep, "ep" holds the epoch, its ranks, whether this node leads, the
cluster's desired count, the leader's placement (node -> engines, and "unplaced" when
capacity is short), the nodes (host, HTTP address, --engines, --max-engines), the active
scale op ("op") and the last finished one ("last_op", with the error of a failed one),
and every engine's etcd record (its node among them), and "etcd": the embedded etcd's
process (state, pid, restarts, endpoint, the last exit; None with --etcd-endpoints), also
while etcd is unreachable; the text view shows them above the
table, and each local engine's epoch, record state and the transport of its group ("transport":
"shm" between ranks of one node, "gloo" across nodes) in it. The table lists this
node's engines; the other nodes' are in the placement line. "standby" (EP, --standby N)
lists the warm standby processes (pid, "warming" or "ready", uptime), how many were taken
by an engine start, and when the next one starts.
"routing" is the frontend's router as its last liveness beat told it (common/liveness.py;
None until then): the policy (--routing), its decisions by reason, and per engine the
blocks of its prefix index ("num_cached_blocks") and the prefix-cache hit rate of the
requests routed there ("routed_hit_rate"); the text view shows them as the CACHED and HIT
columns and a "routing:" line (docs/routing.md).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from planaria.daemon.commands._common import add_daemon_arguments, call, fail

NAME = "status"
HELP = "show engines (state, pid, uptime, restarts, load, KV, cached prefix blocks) and the frontend"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_daemon_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def execute(supervisor, args: dict[str, Any]) -> dict[str, Any]:
    return supervisor.status()


def _fmt_s(v: float | None) -> str:
    if v is None:
        return "-"
    v = int(v)
    return f"{v // 3600}h{v % 3600 // 60:02d}m" if v >= 3600 else f"{v // 60}m{v % 60:02d}s"


def _fmt_bytes(v: int | None) -> str:
    if not v:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if v < 1024 or unit == "TiB":
            return f"{v:.0f}{unit}" if unit == "B" else f"{v:.1f}{unit}"
        v /= 1024
    return str(v)


def render(data: dict[str, Any]) -> str:
    def dash(v):
        return "-" if v is None else str(v)

    ep = data.get("ep")
    routed = (data.get("routing") or {}).get("engines")
    rows = [("ENGINE", "RANK", "STATE", "PID", "UPTIME", "RESTARTS", "RUN/WAIT", "KV USE",
             "KV CACHE", "KV SOURCE") + (("CACHED", "HIT") if routed is not None else ()) + ("DTYPE",)
            + (("EPOCH", "EP STATE", "EP LINK") if ep else ())]
    for e in data["engines"]:
        load = "-" if e["num_running"] is None else f"{e['num_running']}/{e['num_waiting']}"
        kv_use = "-" if e["kv_usage"] is None else f"{100 * e['kv_usage']:.0f}%"
        rows.append((str(e["engine_id"]), dash(e["rank"]), e["state"], dash(e["pid"]),
                     _fmt_s(e["uptime_s"]), str(e["restarts"]), load, kv_use,
                     _fmt_bytes(e["kv_cache_bytes"]), dash(e["kv_source"]))
                    + (routing_cells(routed.get(str(e["engine_id"]))) if routed is not None else ())
                    + (dash(e.get("dtype")),)
                    + ((dash(e.get("epoch")), dash(e.get("ep_state")), dash(e.get("transport"))) if ep else ()))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [data["status"]]
    fe = data["frontend"]
    lines.append(f"frontend: {fe['state']} pid {dash(fe['pid'])} on {data['http']}, "
                 f"uptime {_fmt_s(fe['uptime_s'])}, restarts {fe['restarts']}" + liveness_text(fe))
    if fe.get("reason"):
        lines.append(f"frontend last exit: {fe['reason']}")
    if data.get("scale"):
        s = data["scale"]
        lines.append(f"scaling to {s['target']} (op {s['op_id']}): adding {s['adding']}, "
                     f"removing {s['removing']}")
    if ep:
        lines += ep_lines(ep)
    if data.get("standby"):
        lines.append(standby_line(data["standby"]))
    if data.get("routing"):
        lines.append(routing_line(data["routing"]))
    if data.get("kv_segments"):
        lines.append(kv_salvage_line(data["kv_segments"], data["engines"]))
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for e in data["engines"]:
        if e["state"] in ("backoff", "failed", "drained", "waiting") and e["reason"]:
            lines.append(f"engine {e['engine_id']}: {e['reason']}")
    return "\n".join(lines)


def kv_salvage_line(segments: dict[str, Any], engines: list[dict[str, Any]]) -> str:
    """KV salvage (docs/kv_salvage.md): the segment dir, and per engine what it adopted from
    a dead or draining engine (requests/blocks) and handed over."""
    if segments.get("dir") is None:
        return f"kv salvage: off ({segments.get('error') or 'no segment dir'})"
    text = (f"kv salvage: {segments['dir']}, {segments.get('num_files', 0)} segment(s) "
            f"({segments.get('num_kept', 0)} kept for salvage), {_fmt_bytes(segments.get('bytes'))}")
    parts = [f"engine {e['engine_id']} adopted {s['blocks']} block(s) for {s['requests']} request(s), "
             f"handed {s['handed_over']} over" for e in engines if (s := e.get("salvage"))
             and (s["requests"] or s["handed_over"])]
    return text + ("; " + "; ".join(parts) if parts else "")


def routing_cells(r: dict[str, Any] | None) -> tuple[str, str]:
    """An engine's CACHED (blocks in the frontend's prefix index) and HIT (prefix-cache hit
    rate of the requests routed to it) cells."""
    if not r:
        return "-", "-"
    hit = f"{100 * r['routed_hit_rate']:.0f}%" if r.get("routed_prompt_tokens") else "-"
    return str(r.get("num_cached_blocks", "-")), hit


def routing_line(r: dict[str, Any]) -> str:
    """The frontend's routing policy and its decisions by reason."""
    decisions = ", ".join(f"{k} {v}" for k, v in sorted((r.get("decisions") or {}).items()) if v) or "none yet"
    return f"routing: {r.get('policy', '-')}; requests routed by {decisions}"


def liveness_text(fe: dict[str, Any]) -> str:
    """The frontend line's tail on its event loop's last liveness beat, e.g. ``, event loop
    answered 0.4s ago (limit 10s)`` (daemon/frontend_watch.py); empty while it is down."""
    if fe.get("pid") is None or "last_answer_age_s" not in fe:
        return ""
    if fe["last_answer_age_s"] is None:
        return ", event loop not answered yet"
    text = f", event loop answered {fe['last_answer_age_s']:.1f}s ago"
    if fe.get("hang_timeout_s"):
        text += f" (limit {fe['hang_timeout_s']:g}s)"
    return text


def standby_line(sb: dict[str, Any]) -> str:
    """The warm standby processes: pid, warming or ready, age; when the next one starts."""
    procs = ", ".join(f"pid {p['pid']} {p['state']} ({_fmt_s(p['uptime_s'])})" for p in sb["processes"]) or "none"
    line = f"standby: {procs}; {sb['num_taken']} taken"
    if sb.get("next_start_in_s") is not None:
        line += f"; next starts in {sb['next_start_in_s']:.0f}s"
    return line


def etcd_line(etcd: dict[str, Any]) -> str:
    """The embedded etcd child: state, pid, uptime, restarts, and why it last exited."""
    line = f"etcd (embedded): {etcd['state']}"
    if etcd.get("pid") is not None:
        line += f" pid {etcd['pid']}"
    if etcd.get("endpoint"):
        line += f" on {etcd['endpoint']}"
    if etcd.get("uptime_s") is not None:
        line += f", uptime {_fmt_s(etcd['uptime_s'])}"
    line += f", restarts {etcd.get('restarts', 0)}"
    if etcd.get("last_exit"):
        line += f" (last exit: {etcd['last_exit']})"
    if etcd.get("restart_in_s") is not None:
        line += f"; restarting in {etcd['restart_in_s']:.1f}s"
    return line


def ep_lines(ep: dict[str, Any]) -> list[str]:
    """The expert-parallel summary: epoch and ranks, the active op, the last finished one."""
    etcd = [etcd_line(ep["etcd"])] if ep.get("etcd") else []
    if ep.get("error"):
        return [f"expert parallel: {ep['error']}", *etcd]
    epoch = "-" if ep.get("epoch") is None else ep["epoch"]
    ranks = ", ".join(ep.get("ranks") or []) or "none"
    lines = [f"expert parallel: epoch {epoch}, {ep.get('world_size', 0)} rank(s): {ranks}"
             + ("; this node leads" if ep.get("leader") else ""), *etcd]
    if ep.get("placement") is not None:
        nodes = ep.get("nodes") or {}
        placed = ", ".join(f"{n} {c}" + (f"/{nodes[n]['max_engines']}" if nodes.get(n, {}).get("max_engines")
                                         else "") + (f" ({nodes[n]['host']})" if nodes.get(n, {}).get("host") else "")
                           for n, c in sorted(ep["placement"].items()))
        desired = ep.get("desired")
        lines.append(f"placement: {placed or 'none'}"
                     + (f"; desired {desired}" if desired is not None else "; desired not set (the nodes' --engines)")
                     + (f"; {ep['unplaced']} engine(s) fit no node" if ep.get("unplaced") else ""))

    def op_line(label: str, op: dict[str, Any]) -> str:
        line = f"{label} {op['op_id']}: {op['phase']}, to {op['target']} engine(s)"
        if op.get("progress"):
            line += f" ({op['progress']})"
        if op.get("error"):
            line += f": {op['error']}"
        return line

    lines.append(op_line("op", ep["op"]) if ep.get("op") else "op: none in progress")
    last = ep.get("last_op")
    if last and not ep.get("op"):
        lines.append(op_line("last op", last))
    return lines


def main(args: argparse.Namespace) -> int:
    try:
        data = call(args, NAME)
    except Exception as exc:  # noqa: BLE001 - fail() re-raises what it does not know
        return fail(NAME, exc)
    print(json.dumps(data, indent=2) if args.json else render(data))
    return 0
