"""Prometheus metrics in the text exposition format (0.0.4), written by hand: no dependency.

Request-side figures are recorded by ``frontend.generation``; engine-side gauges are read
from ``EngineClient.engines`` when scraped. Engine deaths are counted from what the
client shows: an engine seen entering "dead", or coming back with a new pid, died once.
Replays (frontend/journal.py): a counter, the replay latency (the loss notice to the
replayed request's first token), and wall-clock timestamps of the last death notice, READY,
replay start and replay first token, so a benchmark can line them up with a kill's time.
"""

from __future__ import annotations

import math
import time
from typing import Iterable

PREFIX = "planaria"

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                     1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _fmt(v: float) -> str:
    f = float(v)
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(pairs: Iterable[tuple[str, object]]) -> str:
    items = [f'{k}="{_escape(v)}"' for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1

    def render(self, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help}")
        lines.append(f"# TYPE {self.name} histogram")
        for b, c in zip(self.buckets, self.counts):
            lines.append(f'{self.name}_bucket{{le="{_fmt(b)}"}} {c}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_fmt(self.sum)}")
        lines.append(f"{self.name}_count {self.count}")


class LabeledCounter:
    def __init__(self, name: str, help_: str, label: str | None = None) -> None:
        self.name, self.help, self.label = name, help_, label
        self.values: dict[str, float] = {}

    def inc(self, label_value: str = "", amount: float = 1.0) -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def render(self, lines: list[str]) -> None:
        lines.append(f"# HELP {self.name} {self.help}")
        lines.append(f"# TYPE {self.name} counter")
        if self.label is None:
            lines.append(f"{self.name} {_fmt(self.values.get('', 0.0))}")
            return
        for value in sorted(self.values):
            lines.append(f"{self.name}{_labels([(self.label, value)])} {_fmt(self.values[value])}")


class FrontendMetrics:
    def __init__(self, model_name: str = "") -> None:
        p = PREFIX
        self.model_name = model_name
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              LATENCY_BUCKETS_S)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "Time between successive generated tokens.",
                             ITL_BUCKETS_S)
        self.e2e = Histogram(f"{p}_e2e_request_latency_seconds", "Time from arrival to the request's end.",
                             LATENCY_BUCKETS_S)
        self.success = LabeledCounter(f"{p}_request_success_total", "Requests finished, by finish reason.",
                                      "finished_reason")
        self.errors = LabeledCounter(f"{p}_request_errors_total", "Requests failed, by kind.", "kind")
        self.prompt_tokens = LabeledCounter(f"{p}_prompt_tokens_total", "Prompt tokens of finished requests.")
        self.generation_tokens = LabeledCounter(f"{p}_generation_tokens_total", "Tokens generated.")
        self.engine_deaths = LabeledCounter(f"{p}_engine_deaths_total", "Engine deaths seen by this frontend.")
        self.replays = LabeledCounter(f"{p}_request_replays_total",
                                      "Requests resubmitted to another engine after an engine fault.")
        self.replay_latency = Histogram(f"{p}_replay_latency_seconds",
                                        "Time from an engine loss notice to the replayed request's first token.",
                                        LATENCY_BUCKETS_S)
        self.last_replay_start_at_s = 0.0  # time.time() of the last replay submission
        self.last_replay_token_at_s = 0.0  # time.time() of the last replay's first token
        self._seen: dict[int, tuple[int | None, str]] = {}  # engine index -> (pid, state)
        from planaria.frontend.iteration_metrics import IterationMetrics

        self.iterations = IterationMetrics()  # engines' step records (EngineConfig.iteration_details)

    # -- recorders (frontend.generation) ---------------------------------------------------
    def record_request(self, *, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                       e2e_s: float, ttft_s: float | None, itl_s: list[float]) -> None:
        self.success.inc(finish_reason)
        self.prompt_tokens.inc(amount=num_prompt_tokens)
        self.generation_tokens.inc(amount=num_output_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for v in itl_s:
            self.itl.observe(v)

    def record_error(self, kind: str) -> None:
        self.errors.inc(kind)

    def record_replay(self) -> None:
        self.replays.inc()
        self.last_replay_start_at_s = time.time()

    def record_replay_latency(self, latency_s: float) -> None:
        self.replay_latency.observe(latency_s)
        self.last_replay_token_at_s = time.time()

    def observe_engines(self, engines) -> None:
        """Count deaths from the client's view of its engines; call often (and at scrape)."""
        for e in engines:
            prev = self._seen.get(e.index)
            if prev is not None:
                prev_pid, prev_state = prev
                if e.state == "dead" and prev_state != "dead":
                    self.engine_deaths.inc()
                elif (prev_state != "dead" and e.pid is not None and prev_pid is not None
                      and e.pid != prev_pid):
                    self.engine_deaths.inc()  # restarted between two looks: it died unseen
            elif e.state == "dead":
                self.engine_deaths.inc()
            self._seen[e.index] = (e.pid, e.state)

    # -- exposition ------------------------------------------------------------------------
    def render(self, engines=(), num_in_flight: int = 0, max_in_flight: int | None = None) -> str:
        self.observe_engines(engines)
        lines: list[str] = []
        for h in (self.ttft, self.itl, self.e2e, self.replay_latency):
            h.render(lines)
        for c in (self.success, self.errors, self.prompt_tokens, self.generation_tokens, self.engine_deaths,
                  self.replays):
            c.render(lines)
        p = PREFIX
        for name, help_, value in (
                ("replay_last_start_timestamp_seconds", "Wall time of the last replay submission.",
                 self.last_replay_start_at_s),
                ("replay_last_first_token_timestamp_seconds", "Wall time of the last replay's first token.",
                 self.last_replay_token_at_s)):
            lines.append(f"# HELP {p}_{name} {help_}")
            lines.append(f"# TYPE {p}_{name} gauge")
            lines.append(f"{p}_{name} {_fmt(value)}")
        gauges = (
            ("num_requests_running", "Requests running in the engine.", lambda e: e.stats.num_running if e.stats else 0),
            ("num_requests_waiting", "Requests waiting in the engine.", lambda e: e.stats.num_waiting if e.stats else 0),
            ("kv_cache_usage_perc", "Fraction of the engine's KV blocks in use.",
             lambda e: e.stats.kv_usage if e.stats else 0.0),
            ("engine_prefill_tokens", "Prompt tokens the engine ran through the model since it started "
             "(prefix-cache hits and recomputes excluded).", lambda e: e.stats.num_prefill_tokens if e.stats else 0),
            ("prefix_cache_hit_rate", "Fraction of the engine's prefix-cache block lookups that hit.",
             lambda e: e.stats.prefix_cache_hit_rate if e.stats else 0.0),
            ("engine_healthy", "1 while the engine is running.", lambda e: 1 if e.healthy else 0),
            ("engine_last_death_timestamp_seconds", "Wall time this frontend learnt of the engine's last death.",
             lambda e: getattr(e, "died_at_s", 0.0)),
            ("engine_last_ready_timestamp_seconds", "Wall time of the engine's last READY.",
             lambda e: getattr(e, "ready_at_s", 0.0)),
        )
        for name, help_, get in gauges:
            lines.append(f"# HELP {p}_{name} {help_}")
            lines.append(f"# TYPE {p}_{name} gauge")
            for e in engines:
                lines.append(f"{p}_{name}{_labels([('engine', e.index)])} {_fmt(get(e))}")
        lines.append(f"# HELP {p}_http_requests_in_flight Generation requests this frontend is serving.")
        lines.append(f"# TYPE {p}_http_requests_in_flight gauge")
        lines.append(f"{p}_http_requests_in_flight {num_in_flight}")
        if max_in_flight is not None:
            lines.append(f"# HELP {p}_http_max_requests_in_flight The bound beyond which requests get 429 "
                         "(--max-inflight-requests).")
            lines.append(f"# TYPE {p}_http_max_requests_in_flight gauge")
            lines.append(f"{p}_http_max_requests_in_flight {max_in_flight}")
        self.iterations.render(lines)
        return "\n".join(lines) + "\n"
