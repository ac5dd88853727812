"""The table bench/membership_scale.py prints for one N: event times, etcd's load per
phase (from bench/membership_probe.py's windows), what grew, the goals."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

LOAD_COLUMNS = (("rpc/s", "rpc_per_s", 1.0, 0), ("txn/s", "txn_per_s", 1.0, 0),
                ("range/s", "range_per_s", 1.0, 0), ("keepalive/s", "keepalive_per_s", 1.0, 0),
                ("watch ev/s", "watch_events_per_s", 1.0, 0), ("rev/s", "revisions_per_s", 1.0, 0),
                ("MB/s out", "sent_bytes_per_s", 1e-6, 2), ("etcd cpu", "etcd_cpu", 1.0, 2))


def host() -> str:
    """The CPU model and count (lscpu's "Model name"), for the figures' record."""
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs"


def _row(label: str, seconds: float) -> str:
    return f"{label:<46}{seconds:>9.2f}"


def report(r: dict[str, Any]) -> list[str]:
    """The table of one N: event times, etcd's load per phase, growth, goals."""
    lines = [f"\nmembership at scale: {r['nodes']} nodes in {r['workers']} worker(s), lease TTL {r['ttl_s']} s, "
             f"view {r['view']}; {host()}", f"{'event':<46}{'seconds':>9}"]
    return lines + _event_lines(r) + [""] + _load_lines(r) + [
        "goals: " + ", ".join(f"{k} {'PASS' if v else 'FAIL'}" for k, v in r["goals"].items())]


def _event_lines(r: dict[str, Any]) -> list[str]:
    n, f = r["nodes"], r["form"]
    lines = [_row(f"first epoch ({f['first_epoch_ranks']} ranks), from the first start", f["first_epoch_s"]),
             _row(f"first epoch naming all {n}", f["full_epoch_s"]),
             _row(f"  all {n} SERVING in it", f["all_serving_s"])]
    if "loss" in r:
        x = r["loss"]
        lines += [_row("node loss, from its lease expiry: key deleted", x["key_deleted_s"]),
                  _row("  epoch without it", x["epoch_s"]), _row("  survivors SERVING", x["served_s"]),
                  _row("  rejoin, from its restart: epoch with it", x["rejoin"]["epoch_s"]),
                  _row("  rejoin: served", x["rejoin"]["served_s"])]
    if "failover" in r:
        x = r["failover"]
        lines += [_row("leader failover, from lease expiry: key gone", x["key_deleted_s"]),
                  _row("  new leader", x["new_leader_s"]),
                  _row("  its first epoch" + (" (re-form)" if x["reform"] else ""), x["epoch_s"]),
                  _row("  served", x["served_s"]),
                  f"  campaigns from the crash to 1 s after the new leader: {x['campaigns']} txn by "
                  f"{x['campaigners']} node(s), at most {x['campaigns_max_per_100ms']} in 100 ms; leader puts "
                  f"{x['leader_puts']}; believed leaders {x['believed_leaders']}"]
    for key, label in (("scale_down", f"scale {n} -> {n - 1}"), ("scale_up", f"scale {n - 1} -> {n}")):
        if key in r:
            x = r[key]
            lines += [_row(f"{label}: epoch written", x["epoch_s"]), _row("  served", x["served_s"]),
                      _row(f"  op {x['phase'].upper()}", x["done_s"])]
    return lines


def _load_lines(r: dict[str, Any]) -> list[str]:
    windows = [("first epoch", r["form"]["load"])]
    for key, label in (("steady", "steady"), ("loss", "node loss"), ("failover", "failover"),
                       ("scale_down", "scale down"), ("scale_up", "scale up"), ("idle", "idle after")):
        if key in r:
            windows.append((f"{label} ({r[key]['load']['seconds']:.1f} s)", r[key]["load"]))
    if "failover" in r:
        windows.append(("failover 1st second", r["failover"]["load_first_second"]))
    lines = [f"{'etcd load':<22}" + "".join(f"{c:>12}" for c, *_ in LOAD_COLUMNS)]
    lines += [f"{label:<22}" + "".join(f"{w[k] * scale:>12.{digits}f}" for _c, k, scale, digits in LOAD_COLUMNS)
              for label, w in windows]
    grants = [f"{label} {w['leases_granted']:.0f}" for label, w in windows if w["leases_granted"]]
    lines.append("leases granted (a node's first, or again after one ran out): " + (", ".join(grants) or "none"))
    a, b = r["etcd_start"], r["etcd_end"]
    lines.append(f"etcd: revision {a['revision']} -> {b['revision']}, db {a['db_bytes'] / 2**20:.2f} -> "
                 f"{b['db_bytes'] / 2**20:.2f} MiB (in use {b['db_in_use_bytes'] / 2**20:.2f} MiB)")
    for key in ("steady", "idle"):
        if key in r:
            w = r[key]
            lines.append(f"{key}: revisions {w['load']['revisions']:.0f}, keys {w['load']['keys_delta']:+.0f}, "
                         f"db in use {w['load']['db_in_use_delta']:+.0f} B, campaigns {w['campaigns_per_s']:.1f}/s, "
                         f"ops/ keys {w['ops_keys']}")
    if r.get("settle_s"):
        lines.append("waited for etcd to go quiet before each phase: "
                     + ", ".join(f"{k} {v:.1f} s" for k, v in r["settle_s"].items()))
    if "usage" in r:
        u = r["usage"]
        lines.append(f"workers: {u['workers_cpu_s']:.0f} CPU s, {u['threads_per_worker']} threads per worker, "
                     f"{u['workers_rss_bytes'] / 2**20:.0f} MiB max RSS in all")
    return lines
