"""The frontend's hardening against a real engine: a tiny-moe model whose chat template
is slow for one message (an operator's heavy template), one engine-core process, the
frontend process started with PLANARIA_API_KEY in its environment and a short
--render-timeout-s. Then the HTTP API fuzz (tests/frontend/_http_fuzz.py): a few hundred
hypothesis-drawn hostile bodies, no 5xx, every rejection an OpenAI error with a reason,
the engine alive at the end. bench/http_fuzz.py runs the same fuzz at 10,000+ requests."""

from __future__ import annotations

import collections
import json
import time
import urllib.request

import pytest
from hypothesis import HealthCheck, example, given, settings

from tests.frontend._http_fuzz import Case, cases, describe, problems, send
from tests.frontend._stack import serving

pytest.importorskip("planaria.engine.detokenizer", reason="engine/detokenizer.py is not there yet")

API_KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SLOW = "slow-render-please"
# 60M Jinja loop steps when the first message is SLOW: about 6 s of CPU (unloaded)
SLOW_PREFIX = ("{% if messages[0]['content'] == '" + SLOW + "' %}{% for i in range(100000) %}"
               "{% for j in range(600) %}{% set x = i + j %}{% endfor %}{% endfor %}{% endif %}")
ENGINE_CONFIG = dict(kv_cache_bytes=16 * 2**20, max_model_len=256, max_num_seqs=16,
                     max_num_batched_tokens=512, num_threads=1)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("frontend-hardening")
    model = build_demo_model(root / "tiny-moe", "tiny-moe")
    template = model / "chat_template.jinja"
    template.write_text(SLOW_PREFIX + template.read_text())
    with serving(root, model, 1, ENGINE_CONFIG, frontend_args=["--render-timeout-s", "2"],
                 frontend_env={"PLANARIA_API_KEY": API_KEY}) as s:
        yield s


def _get(stack, path: str, headers=None) -> tuple[int, bytes]:
    req = urllib.request.Request(stack.base + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _chat(content: str, **extra) -> Case:
    return Case("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": content}],
                                                    "max_tokens": 2, **extra}).encode())


def test_api_key_from_the_environment(stack):
    status, body = _get(stack, "/v1/models")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert _get(stack, "/v1/models", AUTH)[0] == 200
    assert _get(stack, "/health")[0] == 200 and _get(stack, "/metrics")[0] == 200
    assert send(stack.base, _chat("hi")).status == 401
    assert send(stack.base, _chat("hi"), AUTH).status == 200


def test_health_answers_fast_while_the_template_renders_slowly(stack):
    import threading

    result = {}
    slow = threading.Thread(target=lambda: result.update(out=send(stack.base, _chat(SLOW), AUTH)))
    t0 = time.monotonic()
    slow.start()
    time.sleep(0.3)
    worst = 0.0
    while slow.is_alive() and time.monotonic() - t0 < 60:
        t = time.monotonic()
        assert _get(stack, "/health")[0] == 200
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.1)
    slow.join(60)
    out = result["out"]
    assert out.status == 503 and json.loads(out.body)["error"]["code"] == "render_timeout", describe(out)
    assert worst < 2.0, f"/health took {worst:.2f} s during the render"
    # the template's own keys cannot be replaced by the client
    out = send(stack.base, _chat("hi", chat_template_kwargs={"chat_template": "{{ 1 }}"}), AUTH)
    assert out.status == 400 and json.loads(out.body)["error"]["param"] == "chat_template_kwargs.chat_template"


def test_fuzz_http_api_no_5xx_and_the_engine_survives(stack):
    engine_pid = stack.engines[0].pid
    statuses: collections.Counter = collections.Counter()
    bad: list[str] = []

    @settings(max_examples=200, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    # found by bench/http_fuzz.py at 10,000 requests (500s): a repetition penalty that is 0
    # in float32 made grammar-masked logits NaN (-inf * 0), and argmax took one
    @example(case=Case("/v1/completions", b'{"prompt": "@=\\u00cd\\udacc\\udc079C", "temperature": 5e-324, '
                       b'"repetition_penalty": 5e-324, "top_k": 9223372036854775807, '
                       b'"guided_choice": ["aaaaaaaaaaaaaaaa"], "max_tokens": 4}'))
    @example(case=Case("/v1/completions", b'{"frequency_penalty": 1.9999999999999998, "repetition_penalty": 5e-324, '
                       b'"guided_choice": ["\\u00db\\ud8a4\\ude74\\ud81d\\ude47;7~9"], "min_tokens": 4, '
                       b'"temperature": 1.9999999999999998, "prompt": [72, 1, 105, 234], "max_tokens": 6}'))
    @example(case=Case("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], '
                       b'"repetition_penalty": 1e300, "temperature": 1e300, "max_tokens": 4}'))
    def one(case):
        out = send(stack.base, case, AUTH)
        statuses[out.status] += 1
        if problems(out):
            bad.append(describe(out))

    t0 = time.monotonic()
    one()
    assert not bad, f"{len(bad)} bad answers, e.g.:\n" + "\n".join(bad[:10]) + f"\n{stack.log()}"
    assert stack.engines[0].poll() is None and stack.engines[0].pid == engine_pid, stack.log()
    status, metrics = _get(stack, "/metrics")
    assert status == 200 and b"planaria_engine_deaths_total 0" in metrics
    assert _get(stack, "/health")[0] == 200
    assert statuses[200] > 0 and sum(n for s, n in statuses.items() if 400 <= s < 500) > 0, statuses
    print(f"fuzz: {sum(statuses.values())} requests in {time.monotonic() - t0:.1f} s: {dict(statuses)}")
