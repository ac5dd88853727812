"""Prometheus figures from the engines' per-step records (EngineConfig.iteration_details).

``EngineClient.on_iteration_details`` is set to ``IterationMetrics.observe``. An
``IterationMetrics`` is a collector that ``FrontendMetrics`` registers in its registry; it
exposes nothing until the first record comes (engines run without iteration_details show
none of these). Per engine: steps, scheduled tokens, preemptions, and the last step's
index, batch size and KV usage; the step time is one histogram over all engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from planaria.engine.iteration_details import IterationDetails

STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

# name, help, the figure of an engine's last record
_LAST_STEP_GAUGES: tuple[tuple[str, str, Callable[[IterationDetails], float]], ...] = (
    ("planaria_engine_last_step_index", "Index of the engine's last recorded step.", lambda d: d.step_index),
    ("planaria_engine_last_step_num_requests", "Requests in the engine's last recorded step.",
     lambda d: len(d.request_ids)),
    ("planaria_engine_last_step_kv_usage", "KV usage after the engine's last recorded step.", lambda d: d.kv_usage),
)


class IterationMetrics(Collector):
    def __init__(self) -> None:
        # registry=None: these are exposed by collect() below, and only once records exist
        self.steps = Counter("planaria_engine_steps_total", "Engine steps recorded.", ["engine"], registry=None)
        self.tokens = Counter("planaria_engine_scheduled_tokens_total", "Tokens scheduled by engine steps.",
                              ["engine"], registry=None)
        self.preemptions = Counter("planaria_engine_step_preemptions_total", "Preemptions in engine steps.",
                                   ["engine"], registry=None)
        self.step_time = Histogram("planaria_engine_step_seconds", "Engine step time (all engines).",
                                   buckets=STEP_BUCKETS_S, registry=None)
        self._last: dict[int, IterationDetails] = {}  # engine index -> its last record

    def observe(self, engine_index: int, details: list[IterationDetails]) -> None:
        key = str(engine_index)
        steps, tokens, preemptions = self.steps.labels(key), self.tokens.labels(key), self.preemptions.labels(key)
        for d in details:
            steps.inc()
            tokens.inc(sum(d.num_scheduled_tokens))
            preemptions.inc(d.num_preemptions)
            self.step_time.observe(d.step_s)
        if details:
            self._last[engine_index] = details[-1]

    def describe(self) -> Iterable[Metric]:
        """The families (without samples), so the registry refuses a clashing name."""
        for m in (self.steps, self.tokens, self.preemptions, self.step_time):
            yield from m.describe()
        for name, help_, _ in _LAST_STEP_GAUGES:
            yield GaugeMetricFamily(name, help_, labels=["engine"])

    def collect(self) -> Iterable[Metric]:
        if not self._last:
            return
        for m in (self.steps, self.tokens, self.preemptions, self.step_time):
            yield from m.collect()
        for name, help_, get in _LAST_STEP_GAUGES:
            family = GaugeMetricFamily(name, help_, labels=["engine"])
            for index in sorted(self._last):
                family.add_metric([str(index)], get(self._last[index]))
            yield family
