"""EngineCore.load_weights: two demo checkpoints of different seeds, both swap modes."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import WeightLoadError
from engine.messages import EngineCoreRequest
from engine.sampling_params import SamplingParams

PROMPT = list(range(5, 21))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("weights")
    return {name: str(build_demo_model(root / name, preset, seed=seed))
            for name, preset, seed in (("a", "tiny-moe", 0), ("b", "tiny-moe", 1), ("dense", "tiny-dense", 0))}


def _core(model: str) -> EngineCore:
    return EngineCore(EngineConfig(model=model, num_kv_blocks=64, max_model_len=256))


def _req(rid: str, prompt=PROMPT, max_tokens: int = MAX_TOKENS) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt),
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


def _greedy(model: str, prompt, max_tokens: int) -> list[int]:
    core = _core(model)
    core.add_request(_req("ref", prompt, max_tokens))
    tokens = []
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            tokens += o.new_token_ids
    return tokens


def _drain(core, seen: dict) -> None:
    while core.has_unfinished_requests():
        _step(core, seen)


def _step(core, seen: dict) -> None:
    for o in core.step()[0]:
        seen.setdefault(o.request_id, []).extend((t, o.weight_version) for t in o.new_token_ids)


def test_continue_new_swaps_mid_request_and_recomputes(ckpts):
    core = _core(ckpts["a"])
    old_version = core.weight_version
    core.add_request(_req("r"))
    seen: dict = {}
    for _ in range(5):
        _step(core, seen)
    k = len(seen["r"])
    result = core.load_weights(ckpts["b"], version="v2", mode="continue_new")
    assert result == {"version": "v2", "mode": "continue_new", "applied": True}
    assert core.scheduler.num_preemptions == 1  # its KV is recomputed on the new weights
    _drain(core, seen)
    tokens = [t for t, _ in seen["r"]]
    versions = [v for _, v in seen["r"]]
    assert versions == [old_version] * k + ["v2"] * (MAX_TOKENS - k)
    assert tokens[:k] == _greedy(ckpts["a"], PROMPT, k)
    assert tokens[k:] == _greedy(ckpts["b"], PROMPT + tokens[:k], MAX_TOKENS - k)


def test_finish_old_lets_running_requests_finish_first(ckpts):
    core = _core(ckpts["a"])
    old_version = core.weight_version
    core.add_request(_req("old"))
    seen: dict = {}
    _step(core, seen)
    result = core.load_weights(ckpts["b"], mode="finish_old")  # version from the bytes
    assert not result["applied"] and result["version"] != old_version
    core.add_request(_req("new"))
    while "old" in core.scheduler.requests:
        _step(core, seen)
        assert "new" not in seen  # not admitted while the old request runs
    _drain(core, seen)
    assert seen["old"] == [(t, old_version) for t in _greedy(ckpts["a"], PROMPT, MAX_TOKENS)]
    assert seen["new"] == [(t, result["version"]) for t in _greedy(ckpts["b"], PROMPT, MAX_TOKENS)]
    assert core.weight_version == result["version"] and core.scheduler.admit_new


def test_idle_engine_swaps_at_once_and_prefix_cache_is_dropped(ckpts):
    core = _core(ckpts["a"])
    seen: dict = {}
    core.add_request(_req("warm"))
    _drain(core, seen)  # its blocks are now in the prefix cache
    assert core.load_weights(ckpts["b"], version="v2")["applied"]
    core.add_request(_req("after"))
    _drain(core, seen)
    assert [t for t, _ in seen["after"]] == _greedy(ckpts["b"], PROMPT, MAX_TOKENS)
    assert {v for _, v in seen["after"]} == {"v2"}


def test_incompatible_checkpoint_is_refused_and_old_weights_serve_on(ckpts, tmp_path):
    core = _core(ckpts["a"])
    version = core.weight_version
    with pytest.raises(WeightLoadError, match="architecture"):
        core.load_weights(ckpts["dense"], mode="continue_new")
    with pytest.raises(WeightLoadError):
        core.load_weights(str(tmp_path), mode="continue_new")  # no config.json
    with pytest.raises(WeightLoadError, match="mode"):
        core.load_weights(ckpts["b"], mode="sometime")
    seen: dict = {}
    core.add_request(_req("r"))
    _drain(core, seen)
    assert seen["r"] == [(t, version) for t in _greedy(ckpts["a"], PROMPT, MAX_TOKENS)]


def test_load_weights_is_a_utility_call(ckpts):
    from engine.proc import EngineCoreProc
    from engine.wire import UtilityCall

    proc = EngineCoreProc(0, ["ipc:///nonexistent"], None)
    proc.core = _core(ckpts["a"])
    ok = proc._utility(UtilityCall(call_id=1, method="load_weights",
                                   args={"model_dir": ckpts["b"], "version": "v9", "mode": "continue_new"}))
    assert ok.ok and ok.result["version"] == "v9" and proc.core.weight_version == "v9"
    bad = proc._utility(UtilityCall(call_id=2, method="load_weights", args={"model_dir": ckpts["dense"]}))
    assert not bad.ok and "WeightLoadError" in bad.error and proc.core.weight_version == "v9"
