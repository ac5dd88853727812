"""Prometheus metrics (prometheus_client), one CollectorRegistry per FrontendMetrics.

Each server owns its registry (tests build several servers in one process; nothing goes in
prometheus_client's global default registry). Request-side figures are recorded by
``frontend.generation``; the engine-side gauges and the in-flight count are read when
scraped (``ScrapeCollector``, from ``EngineClient.engines``); the engines' step records come
through ``IterationMetrics``; the process and GC collectors add ``process_*`` and
``python_gc_*``. Engine deaths are counted from what the client shows: an engine seen
entering "dead", or coming back with a new pid, died once. Replays (frontend/journal.py): a
counter, the replay latency (the loss notice to the replayed request's first token), and
wall-clock timestamps of the last death notice, READY, replay start and replay first token,
so a benchmark can line them up with a kill's time. Routing (engine/kv_router.py): the
decisions by reason, and per engine the blocks of its prefix index and the prefix-cache hit
rate of the requests routed there. docs/metrics.md lists every metric.

What tells how much of a prompt an engine had cached (per-engine prefill counters, hit
rates, index sizes, routing reasons, the engines' scheduled tokens: ``CACHE_FAMILIES``) is
left out of a scrape that lacks the API key when one is set (``render(cache_figures=False)``):
watching them while sending a probe would tell whether another tenant sent that prompt.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram, ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from planaria.frontend.iteration_metrics import IterationMetrics

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                     1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
RECOMPUTED_TOKENS_BUCKETS = (0, 1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)

# name, help, the figure of one engine (EngineInfo in engine/client.py). The test fakes of
# EngineInfo carry no death or READY times nor routing figures, hence the getattr defaults there.
_ENGINE_GAUGES: tuple[tuple[str, str, Callable[[object], float]], ...] = (
    ("planaria_num_requests_running", "Requests running in the engine.",
     lambda e: e.stats.num_running if e.stats else 0),
    ("planaria_num_requests_waiting", "Requests waiting in the engine.",
     lambda e: e.stats.num_waiting if e.stats else 0),
    ("planaria_kv_cache_usage_perc", "Fraction of the engine's KV blocks in use.",
     lambda e: e.stats.kv_usage if e.stats else 0.0),
    ("planaria_engine_prefill_tokens", "Prompt tokens the engine ran through the model since it started "
     "(prefix-cache hits and recomputes excluded).", lambda e: e.stats.num_prefill_tokens if e.stats else 0),
    ("planaria_prefix_cache_hit_rate", "Fraction of the engine's prefix-cache block lookups that hit.",
     lambda e: e.stats.prefix_cache_hit_rate if e.stats else 0.0),
    ("planaria_engine_salvaged_requests", "Replays of a dead or drained engine's requests that adopted its KV "
     "blocks (engine/kv_segment.py), since the engine started.",
     lambda e: getattr(e.stats, "num_salvaged_requests", 0) if e.stats else 0),
    ("planaria_engine_salvaged_blocks", "KV blocks adopted from a dead or drained engine's segment instead of "
     "computed, since the engine started.", lambda e: getattr(e.stats, "num_salvaged_blocks", 0) if e.stats else 0),
    ("planaria_engine_peer_kv_blocks", "KV blocks a request routed away from the engine holding more of its "
     "prompt copied from that live engine's segment (a node-wide prefix cache) instead of computing them, "
     "since the engine started.", lambda e: getattr(e.stats, "num_peer_blocks", 0) if e.stats else 0),
    ("planaria_engine_salvage_refused", "Replays whose named KV segment could not be used (gone, other "
     "weights, inconsistent): computed as plain replays.",
     lambda e: getattr(e.stats, "num_salvage_refused", 0) if e.stats else 0),
    ("planaria_engine_healthy", "1 while the engine is running.", lambda e: 1 if e.healthy else 0),
    ("planaria_engine_last_death_timestamp_seconds", "Wall time this frontend learnt of the engine's last death.",
     lambda e: getattr(e, "died_at_s", 0.0)),
    ("planaria_engine_last_ready_timestamp_seconds", "Wall time of the engine's last READY.",
     lambda e: getattr(e, "ready_at_s", 0.0)),
    ("planaria_engine_cached_blocks", "KV blocks this frontend's prefix index holds for the engine "
     "(from the engine's KV events; emptied when it dies, restarts, drains or leaves).",
     lambda e: getattr(e, "num_cached_blocks", 0)),
    ("planaria_routed_prefix_hit_rate", "Fraction of the prompt tokens of requests this frontend routed to "
     "the engine that were prefix-cache hits there.", lambda e: getattr(e, "routed_hit_rate", 0.0)),
)
_ROUTING = ("planaria_routing_decisions", "Requests routed to an engine, by the router's reason "
            "(prefix, balance, no_prefix, least_loaded, group).")
# families that tell how much of a prompt an engine had cached: only for a scrape with the key
CACHE_FAMILIES = frozenset({"planaria_engine_prefill_tokens", "planaria_prefix_cache_hit_rate",
                            "planaria_engine_cached_blocks", "planaria_routed_prefix_hit_rate",
                            _ROUTING[0], "planaria_engine_scheduled_tokens"})
_IN_FLIGHT = ("planaria_http_requests_in_flight", "Generation requests this frontend is serving.")
_MAX_IN_FLIGHT = ("planaria_http_max_requests_in_flight",
                  "The bound beyond which requests get 429 (--max-inflight-requests).")

# A sample line whose value is integral: "name{...} 3.0". prometheus_client prints every value
# as a float; the Go client, and this frontend before it used prometheus_client, print 3.
_INTEGRAL_SAMPLE = re.compile(r"^([^#\n][^\n]* -?\d+)\.0$", re.M)


class ScrapeCollector(Collector):
    """Figures read when scraped: per-engine gauges from the client's engine views, the
    frontend's in-flight count and its bound. ``view`` hands it one scrape's figures."""

    def __init__(self) -> None:
        self._engines: tuple = ()
        self._num_in_flight = 0
        self._max_in_flight: int | None = None
        self._routing: dict[str, int] = {}

    def view(self, engines: Iterable, num_in_flight: int, max_in_flight: int | None,
             routing_decisions: dict[str, int] | None = None) -> None:
        self._engines = tuple(engines)
        self._num_in_flight, self._max_in_flight = num_in_flight, max_in_flight
        self._routing = dict(routing_decisions or {})

    def describe(self) -> Iterable[Metric]:
        """The families (without samples), so the registry refuses a clashing name."""
        for name, help_, _ in _ENGINE_GAUGES:
            yield GaugeMetricFamily(name, help_, labels=["engine"])
        for name, help_ in (_IN_FLIGHT, _MAX_IN_FLIGHT):
            yield GaugeMetricFamily(name, help_)
        yield CounterMetricFamily(*_ROUTING, labels=["reason"])

    def collect(self) -> Iterable[Metric]:
        for name, help_, get in _ENGINE_GAUGES:
            family = GaugeMetricFamily(name, help_, labels=["engine"])
            for e in self._engines:
                family.add_metric([str(e.index)], get(e))
            yield family
        yield GaugeMetricFamily(*_IN_FLIGHT, value=self._num_in_flight)
        if self._max_in_flight is not None:
            yield GaugeMetricFamily(*_MAX_IN_FLIGHT, value=self._max_in_flight)
        routing = CounterMetricFamily(*_ROUTING, labels=["reason"])
        for reason, count in sorted(self._routing.items()):
            routing.add_metric([reason], count)
        yield routing


class _WithoutCacheFigures:
    """A registry's view without CACHE_FAMILIES, for generate_latest."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return (m for m in self._registry.collect() if m.name not in CACHE_FAMILIES)


class FrontendMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("planaria_time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=LATENCY_BUCKETS_S, registry=r)
        self.itl = Histogram("planaria_inter_token_latency_seconds", "Time between successive generated tokens.",
                             buckets=ITL_BUCKETS_S, registry=r)
        self.e2e = Histogram("planaria_e2e_request_latency_seconds", "Time from arrival to the request's end.",
                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.replay_latency = Histogram(
            "planaria_replay_latency_seconds", "Time from an engine loss notice to the replayed request's first token.",
            buckets=LATENCY_BUCKETS_S, registry=r)
        self.replay_recomputed = Histogram(
            "planaria_replay_recomputed_tokens",
            "Prompt tokens a replayed or moved request computed again on its new engine (the rest came from "
            "its prefix cache or from the lost engine's KV).", buckets=RECOMPUTED_TOKENS_BUCKETS, registry=r)
        self.success = Counter("planaria_request_success_total", "Requests finished, by finish reason.",
                               ["finished_reason"], registry=r)
        self.errors = Counter("planaria_request_errors_total", "Requests failed, by kind.", ["kind"], registry=r)
        self.prompt_tokens = Counter("planaria_prompt_tokens_total", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("planaria_generation_tokens_total", "Tokens generated.", registry=r)
        self.engine_deaths = Counter("planaria_engine_deaths_total", "Engine deaths seen by this frontend.",
                                     registry=r)
        self.replays = Counter("planaria_request_replays_total",
                               "Requests resubmitted to another engine after an engine fault.", registry=r)
        self.moves = Counter("planaria_request_moves_total",
                             "Requests handed to another engine by a draining one (with their KV where it "
                             "outlives the engine: same node).", registry=r)
        self.last_replay_start = Gauge("planaria_replay_last_start_timestamp_seconds",
                                       "Wall time of the last replay submission.", registry=r)
        self.last_replay_token = Gauge("planaria_replay_last_first_token_timestamp_seconds",
                                       "Wall time of the last replay's first token.", registry=r)
        self._scrape = ScrapeCollector()
        r.register(self._scrape)
        self.iterations = IterationMetrics()  # engines' step records (EngineConfig.iteration_details)
        r.register(self.iterations)
        ProcessCollector(registry=r)
        GCCollector(registry=r)
        self._seen: dict[int, tuple[int | None, str]] = {}  # engine index -> (pid, state)

    # -- recorders (frontend.generation) ---------------------------------------------------
    def record_request(self, *, finish_reason: str, num_prompt_tokens: int, num_output_tokens: int,
                       e2e_s: float, ttft_s: float | None, itl_s: list[float]) -> None:
        self.success.labels(finish_reason).inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        for v in itl_s:
            self.itl.observe(v)

    def record_error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def record_replay(self) -> None:
        self.replays.inc()
        self.last_replay_start.set_to_current_time()

    def record_move(self) -> None:
        self.moves.inc()
        self.last_replay_start.set_to_current_time()

    def record_replay_latency(self, latency_s: float, num_recomputed_tokens: int | None = None) -> None:
        self.replay_latency.observe(latency_s)
        self.last_replay_token.set_to_current_time()
        if num_recomputed_tokens is not None:
            self.replay_recomputed.observe(num_recomputed_tokens)

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
    def render(self, engines=(), num_in_flight: int = 0, max_in_flight: int | None = None,
               routing_decisions: dict[str, int] | None = None, cache_figures: bool = True) -> str:
        """The text exposition (format 0.0.4) of this frontend's registry; ``engines`` is
        the client's engine list, read once here; ``cache_figures`` False leaves out
        CACHE_FAMILIES (a scrape without the API key, when one is set)."""
        engines = tuple(engines)
        self.observe_engines(engines)
        self._scrape.view(engines, num_in_flight, max_in_flight, routing_decisions)
        text = generate_latest(self.registry if cache_figures else _WithoutCacheFigures(self.registry)).decode()
        return _INTEGRAL_SAMPLE.sub(r"\1", text)
