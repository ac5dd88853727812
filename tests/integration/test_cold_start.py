"""Cold starts of `planaria serve --parallel ep` (the `make serve` shape): a fresh state
dir each time, the embedded etcd, two EP ranks of tiny-moe. Every start must end with both
engines ready, none restarted or exited (by a signal or otherwise), and none of gRPC's
fork-handler noise in any log. Engines used to die with SIGABRT here, when gRPC's fork
support ran its handlers in children forked while the supervisor's etcd client had
threads running (planaria.elastic forces GRPC_ENABLE_FORK_SUPPORT off;
tests/elastic/test_grpc_fork.py shows the mechanism).

One start in the suite; thirty under the ``slow`` marker (`pytest -m slow
tests/integration/test_cold_start.py -s` prints the wall time and the counts).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from pathlib import Path

import pytest

from tests.integration.test_supervisor import Daemon, _stop_tree

FORK_NOISE = ("skipping fork() handlers", "epoll_wait", "Bad file descriptor", "Fork support")


@dataclasses.dataclass
class ColdStart:
    ready_s: float = 0.0
    num_ready: int = 0
    num_restarts: int = 0
    num_exits: int = 0  # child exits logged by the supervisor before the stop
    exit_code: int | None = None
    noise: list[str] = dataclasses.field(default_factory=list)
    error: str = ""

    @property
    def clean(self) -> bool:
        return (self.num_ready == 2 and self.num_restarts == 0 and self.num_exits == 0
                and self.exit_code == 0 and not self.noise and not self.error)


def _exits(serve_log: str) -> list[dict]:
    events = []
    for line in serve_log.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "exited":
            events.append(event)
    return events


def _all_logs(d: Daemon) -> dict[str, str]:
    logs = {"serve": d.log_path.read_text(errors="replace")}
    for path in sorted((d.state / "logs").glob("*.log")):
        logs[path.name] = path.read_text(errors="replace")
    return logs


def cold_start(model: str, root: Path) -> ColdStart:
    """One start from nothing to an EP group of 2 serving, then a clean stop."""
    result = ColdStart()
    started = time.monotonic()
    d = Daemon(model, root, extra_args=("--parallel", "ep"))
    try:
        status = d.wait(lambda s: s["num_up"] == 2 and (s.get("ep") or {}).get("world_size") == 2
                        and all(e["state"] == "serving" for e in s["ep"]["engines"].values()),
                        180, "EP group of 2")
        result.ready_s = time.monotonic() - started
        result.num_ready = status["num_up"]
        result.num_restarts = sum(e["restarts"] for e in status["engines"])
        result.num_exits = len(_exits(d.log_path.read_text(errors="replace")))
    except AssertionError as exc:
        result.error = str(exc)[-3000:]
    finally:
        result.exit_code = _stop_tree(d.proc)
        shutil.rmtree(d.runtime, ignore_errors=True)
    for name, text in _all_logs(d).items():
        result.noise += [f"{name}: {marker}" for marker in FORK_NOISE if marker in text]
    if not result.clean and not result.error:
        result.error = "\n".join(f"--- {n}\n{t[-2000:]}" for n, t in _all_logs(d).items())
    return result


def run_cold_starts(model: str, root: Path, num_starts: int) -> list[ColdStart]:
    results = []
    t0 = time.monotonic()
    for i in range(num_starts):
        results.append(cold_start(model, root / f"start{i}"))
        r = results[-1]
        print(f"start {i + 1}/{num_starts}: ready in {r.ready_s:.1f}s, {r.num_ready} ready, "
              f"{r.num_restarts} restarts, {r.num_exits} exits, exit code {r.exit_code}, "
              f"noise {r.noise}", flush=True)
    wall_s = time.monotonic() - t0
    bad = [i for i, r in enumerate(results) if not r.clean]
    print(f"{num_starts} cold starts in {wall_s:.0f}s: {num_starts - len(bad)} clean, "
          f"{sum(r.num_restarts for r in results)} engine restarts, "
          f"{sum(r.num_exits for r in results)} child exits, "
          f"{sum(bool(r.noise) for r in results)} with fork noise", flush=True)
    assert not bad, "\n".join(f"start {i}: {results[i]}" for i in bad)
    return results


@pytest.mark.timeout(900)
def test_a_cold_start_is_clean(tiny_moe, tmp_path):
    run_cold_starts(tiny_moe, tmp_path, 1)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_thirty_cold_starts_are_clean(tiny_moe, tmp_path):
    run_cold_starts(tiny_moe, tmp_path, 30)
