"""Prometheus figures from the engines' per-step records (EngineConfig.iteration_details).

``EngineClient.on_iteration_details`` is set to ``IterationMetrics.observe``; ``render``
appends to FrontendMetrics' exposition. Per engine: steps, step time (histogram),
scheduled tokens, preemptions, and the last step's index, batch size and KV usage.
"""

from __future__ import annotations

from planaria.frontend.metrics import PREFIX, Histogram, LabeledCounter, _fmt, _labels

STEP_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class IterationMetrics:
    def __init__(self) -> None:
        p = PREFIX
        self.steps = LabeledCounter(f"{p}_engine_steps_total", "Engine steps recorded.", "engine")
        self.tokens = LabeledCounter(f"{p}_engine_scheduled_tokens_total", "Tokens scheduled by engine steps.",
                                     "engine")
        self.preemptions = LabeledCounter(f"{p}_engine_step_preemptions_total", "Preemptions in engine steps.",
                                          "engine")
        self.step_time = Histogram(f"{p}_engine_step_seconds", "Engine step time (all engines).", STEP_BUCKETS_S)
        self.last: dict[int, object] = {}  # engine index -> its last IterationDetails

    def observe(self, engine_index: int, details) -> None:
        key = str(engine_index)
        for d in details:
            self.steps.inc(key)
            self.tokens.inc(key, sum(d.num_scheduled_tokens))
            self.preemptions.inc(key, d.num_preemptions)
            self.step_time.observe(d.step_s)
        if details:
            self.last[engine_index] = details[-1]

    def render(self, lines: list[str]) -> None:
        if not self.last:
            return
        for c in (self.steps, self.tokens, self.preemptions):
            c.render(lines)
        self.step_time.render(lines)
        for name, help_, get in (
                ("engine_last_step_index", "Index of the engine's last recorded step.", lambda d: d.step_index),
                ("engine_last_step_num_requests", "Requests in the engine's last recorded step.",
                 lambda d: len(d.request_ids)),
                ("engine_last_step_kv_usage", "KV usage after the engine's last recorded step.",
                 lambda d: d.kv_usage)):
            lines.append(f"# HELP {PREFIX}_{name} {help_}")
            lines.append(f"# TYPE {PREFIX}_{name} gauge")
            for index in sorted(self.last):
                lines.append(f"{PREFIX}_{name}{_labels([('engine', index)])} {_fmt(get(self.last[index]))}")
