"""/metrics through prometheus_client: one registry per server, the process and GC
collectors, integral values printed as integers, no import cycle; and every planaria_*
metric that the docs (docs/metrics.md lists them all), README.md, the Grafana dashboard
and the alert rules name is in a real exposition of a server over fakes
(tests/frontend/_fake_server.py)."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from pathlib import Path

import aiohttp
import yaml

from planaria.engine.iteration_details import IterationDetails
from planaria.engine.messages import SchedulerStats
from planaria.frontend.metrics import FrontendMetrics
from tests.frontend._fake_server import serve_fake
from tests.frontend._fakes import FakeEngineClient, FakeEngineInfo

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "planaria.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
METRICS_DOC = REPO / "docs" / "metrics.md"
DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]  # every planaria_* they name is a metric
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def _families(text: str) -> dict[str, str]:
    """name -> type, from the exposition's # TYPE lines."""
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def _exprs(node) -> list[str]:
    """Every "expr" string in a parsed dashboard or rules file."""
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + \
            [e for k, v in node.items() if k != "expr" for e in _exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _exprs(v)]
    return []


def _missing(names: set[str], families: dict[str, str]) -> set[str]:
    """Names that are neither a family nor a histogram family's series."""
    def exposed(name: str) -> bool:
        if name in families:
            return True
        return any(name.endswith(s) and families.get(name[:-len(s)]) == "histogram" for s in HISTOGRAM_SUFFIXES)
    return {n for n in names if not exposed(n)}


def _names(texts: list[str]) -> set[str]:
    return {n for t in texts for n in re.findall(r"\bplanaria_\w+", t)}


async def _scrape_fake_server() -> str:
    client = FakeEngineClient()
    client.engines.append(FakeEngineInfo(1, stats=SchedulerStats(num_running=1, kv_usage=0.5)))
    async with serve_fake(client) as served:
        # what EngineClient.on_iteration_details delivers (create_server wires it so)
        served.server.metrics.iterations.observe(0, [IterationDetails(
            step_index=0, request_ids=["a"], num_scheduled_tokens=[3], step_s=0.002, kv_usage=0.1)])
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"{served.base}/v1/completions", json={"model": "fake", "prompt": "hi", "max_tokens": 3})
            assert r.status == 200
            r = await s.get(f"{served.base}/metrics")
            assert r.status == 200
            return await r.text()


def test_every_metric_the_dashboard_alerts_and_docs_name_is_exposed():
    text = asyncio.run(_scrape_fake_server())
    families = _families(text)
    dashboard_exprs = _exprs(json.loads(DASHBOARD.read_text()))
    alert_exprs = _exprs(yaml.safe_load(ALERTS.read_text()))
    assert len(dashboard_exprs) > 30 and len(alert_exprs) >= 6
    for where, names in (("dashboard", _names(dashboard_exprs)), ("alerts", _names(alert_exprs)),
                         ("docs/metrics.md", _names([METRICS_DOC.read_text()])),
                         ("docs/*.md and README.md", _names([p.read_text() for p in DOCS]))):
        assert names, where
        assert _missing(names, families) == set(), f"{where} names metrics that /metrics lacks"
    # and the other way: every planaria_* family is documented
    documented = _names([METRICS_DOC.read_text()])
    exposed = {n for n in families if n.startswith("planaria_") and not n.endswith("_created")}
    assert exposed - documented == set()
    assert 'planaria_engine_healthy{engine="1"} 1' in text and 'planaria_kv_cache_usage_perc{engine="1"} 0.5' in text
    assert re.search(r"^planaria_time_to_first_token_seconds_count 1$", text, re.M)
    assert re.search(r"^process_cpu_seconds_total \S+$", text, re.M)
    assert "# TYPE python_gc_collections_total counter" in text


def test_alert_rules_cover_deaths_restarts_floor_429s_and_ttft():
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    by_name = {r["alert"]: r for r in rules}
    assert len(by_name) == len(rules)
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
        assert r["expr"].count("(") == r["expr"].count(")") and r["expr"].count("[") == r["expr"].count("]")
    assert "planaria_engine_deaths_total" in by_name["PlanariaEngineDied"]["expr"]
    assert "planaria_engine_last_ready_timestamp_seconds" in by_name["PlanariaEngineRestartLoop"]["expr"]
    assert "planaria_engine_healthy" in by_name["PlanariaEnginesBelowFloor"]["expr"]
    assert 'kind="overloaded"' in by_name["PlanariaOverloaded"]["expr"]
    assert "planaria_time_to_first_token_seconds_bucket" in by_name["PlanariaTTFTP99High"]["expr"]


def test_each_server_has_its_own_registry():
    a, b = FrontendMetrics("a"), FrontendMetrics("b")  # no clash in prometheus_client's registries
    a.record_error("overloaded")
    a.record_request(finish_reason="stop", num_prompt_tokens=5, num_output_tokens=2, e2e_s=0.25, ttft_s=0.1,
                     itl_s=[0.02])
    text_a, text_b = a.render(), b.render()
    assert 'planaria_request_errors_total{kind="overloaded"} 1' in text_a
    assert "planaria_request_errors_total{" not in text_b and "planaria_prompt_tokens_total 0" in text_b
    for text in (text_a, text_b):
        assert "# TYPE process_resident_memory_bytes gauge" in text
        assert "# TYPE python_gc_objects_collected_total counter" in text


def test_values_print_as_before_integers_without_a_point():
    m = FrontendMetrics()
    m.record_request(finish_reason="length", num_prompt_tokens=7, num_output_tokens=3, e2e_s=0.5, ttft_s=0.125,
                     itl_s=[0.01, 0.02])
    info = FakeEngineInfo(0, stats=SchedulerStats(num_running=2, kv_usage=0.25))
    text = m.render([info], num_in_flight=4, max_in_flight=64)
    for line in ("planaria_prompt_tokens_total 7", "planaria_inter_token_latency_seconds_count 2",
                 "planaria_time_to_first_token_seconds_sum 0.125", 'planaria_num_requests_running{engine="0"} 2',
                 'planaria_kv_cache_usage_perc{engine="0"} 0.25', "planaria_http_requests_in_flight 4",
                 "planaria_http_max_requests_in_flight 64",
                 'planaria_time_to_first_token_seconds_bucket{le="0.25"} 1'):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
    assert "planaria_http_max_requests_in_flight" not in m.render([info])  # no bound given: none shown


def test_engine_gauges_are_read_at_scrape_time():
    m = FrontendMetrics()
    info = FakeEngineInfo(0, stats=SchedulerStats(num_waiting=3))
    assert 'planaria_num_requests_waiting{engine="0"} 3' in m.render([info])
    info.stats = SchedulerStats(num_waiting=1)
    info.state = "dead"
    text = m.render([info])
    assert 'planaria_num_requests_waiting{engine="0"} 1' in text
    assert 'planaria_engine_healthy{engine="0"} 0' in text and "planaria_engine_deaths_total 1" in text


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) for each import in a file; `if TYPE_CHECKING:` counts as
    module level."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    top |= {id(n) for s in tree.body if isinstance(s, ast.If) for n in s.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            out.append((node.module or "", id(node) in top))
        elif isinstance(node, ast.Import):
            out.extend((a.name, id(node) in top) for a in node.names)
    return out


def test_no_import_cycle_between_the_metrics_modules():
    pkg = REPO / "planaria" / "frontend"
    assert all(mod != "planaria.frontend.metrics" for mod, _ in _imports(pkg / "iteration_metrics.py"))
    assert all(top for _, top in _imports(pkg / "metrics.py")), "a function-level import hides a cycle"
    assert all(top for _, top in _imports(pkg / "iteration_metrics.py"))
