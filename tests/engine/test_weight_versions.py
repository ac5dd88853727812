"""EngineCore.load_weights: two demo checkpoints of different seeds, both swap modes; the
checkpoint is read on a thread while the engine steps, and swapped at a step boundary."""

from __future__ import annotations

import pytest

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.errors import WeightLoadError
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams

PROMPT = list(range(5, 21))
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

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


def _read(core) -> dict:
    """Wait for the load's read thread (the busy loop never does; tests step by hand)."""
    assert core._weight_update.wait_read(60)
    return core._weight_update.describe()


def test_continue_new_swaps_mid_request_and_recomputes(ckpts):
    core = _core(ckpts["a"])
    old_version = core.weight_version
    core.add_request(_req("r"))
    seen: dict = {}
    for _ in range(5):
        _step(core, seen)
    k = len(seen["r"])
    started = core.load_weights(ckpts["b"], version="v2", mode="continue_new")
    assert started["state"] == "reading" and started["version"] == "v2"  # returned before the read
    assert core.weight_version == old_version
    assert _read(core)["state"] == "ready"
    _drain(core, seen)
    assert core.scheduler.num_preemptions == 1  # its KV is recomputed on the new weights
    tokens = [t for t, _ in seen["r"]]
    versions = [v for _, v in seen["r"]]
    assert versions == [old_version] * k + ["v2"] * (MAX_TOKENS - k)
    assert tokens[:k] == _greedy(ckpts["a"], PROMPT, k)
    assert tokens[k:] == _greedy(ckpts["b"], PROMPT + tokens[:k], MAX_TOKENS - k)
    status = core.weight_status()
    assert status["version"] == "v2" and status["model_dir"] == ckpts["b"]
    assert status["load"]["state"] == "applied" and status["load"]["load_id"] == started["load_id"]


def test_steps_go_on_while_the_checkpoint_is_read(ckpts):
    """The read is not on the stepping thread: the engine serves the old weights until the
    read is done, whatever the read's duration."""
    core = _core(ckpts["a"])
    old_version = core.weight_version
    core.add_request(_req("r", max_tokens=40))
    seen: dict = {}
    _step(core, seen)
    woken = []
    core.load_weights(ckpts["b"], version="v2", mode="continue_new", on_read=lambda: woken.append(1))
    load = core._weight_update
    while not load.read_done:  # steps during the read: all on the old weights
        _step(core, seen)
    assert woken == [1] and core.has_unfinished_requests()
    _drain(core, seen)
    versions = [v for _, v in seen["r"]]
    n_old = versions.count(old_version)
    assert n_old >= 1 and versions == [old_version] * n_old + ["v2"] * (40 - n_old)


def test_finish_old_lets_running_requests_finish_first(ckpts):
    core = _core(ckpts["a"])
    old_version = core.weight_version
    core.add_request(_req("old"))
    seen: dict = {}
    _step(core, seen)
    started = core.load_weights(ckpts["b"], mode="finish_old")  # version from the bytes, once read
    assert started["version"] is None and started["state"] == "reading"
    version = _read(core)["version"]
    assert version and version != old_version
    core.add_request(_req("new"))
    while "old" in core.scheduler.requests:
        _step(core, seen)
        assert "new" not in seen  # not admitted while the old request runs
    _drain(core, seen)
    assert seen["old"] == [(t, old_version) for t in _greedy(ckpts["a"], PROMPT, MAX_TOKENS)]
    assert seen["new"] == [(t, version) for t in _greedy(ckpts["b"], PROMPT, MAX_TOKENS)]
    assert core.weight_version == version and core.scheduler.admit_new


def test_idle_engine_swaps_at_the_next_step_and_prefix_cache_is_dropped(ckpts):
    core = _core(ckpts["a"])
    seen: dict = {}
    core.add_request(_req("warm"))
    _drain(core, seen)  # its blocks are now in the prefix cache
    core.load_weights(ckpts["b"], version="v2")
    assert not core.has_unfinished_requests() or core._weight_update.read_done
    _read(core)
    assert core.has_unfinished_requests()  # the swap is due: an idle loop steps once
    assert core.step() == ([], False) and core.weight_version == "v2"
    assert not core.has_unfinished_requests()
    core.add_request(_req("after"))
    _drain(core, seen)
    assert [t for t, _ in seen["after"]] == _greedy(ckpts["b"], PROMPT, MAX_TOKENS)
    assert {v for _, v in seen["after"]} == {"v2"}


def test_incompatible_checkpoint_is_refused_and_old_weights_serve_on(ckpts, tmp_path):
    core = _core(ckpts["a"])
    version = core.weight_version
    with pytest.raises(WeightLoadError, match="architecture"):
        core.load_weights(ckpts["dense"], mode="continue_new")
    with pytest.raises(WeightLoadError, match="not a directory"):
        core.load_weights(str(tmp_path / "nowhere"), mode="continue_new")
    with pytest.raises(WeightLoadError, match="config.json"):
        core.load_weights(str(tmp_path), mode="continue_new")
    with pytest.raises(WeightLoadError, match="mode"):
        core.load_weights(ckpts["b"], mode="sometime")
    assert core._weight_update is None and core.weight_status()["load"] is None
    seen: dict = {}
    core.add_request(_req("r"))
    _drain(core, seen)
    assert seen["r"] == [(t, version) for t in _greedy(ckpts["a"], PROMPT, MAX_TOKENS)]


def test_a_checkpoint_that_fails_its_read_changes_nothing(ckpts, tmp_path):
    """Same config, but a tensor of the wrong shape: refused by the read thread, reported
    in weight_status; the engine serves on with the old weights and takes the next load."""
    from safetensors.torch import load_file, save_file
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(ckpts["b"], bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = next(n for n in tensors if n.endswith("o_proj.weight"))
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    core = _core(ckpts["a"])
    version = core.weight_version
    core.load_weights(str(bad), mode="continue_new")
    failed = _read(core)
    assert failed["state"] == "failed" and "o_proj" in failed["error"]
    core.add_request(_req("r"))
    seen: dict = {}
    _drain(core, seen)
    assert seen["r"] == [(t, version) for t in _greedy(ckpts["a"], PROMPT, MAX_TOKENS)]
    assert core.weight_status()["load"]["state"] == "failed" and core.weight_version == version
    core.load_weights(ckpts["b"], version="v3", mode="continue_new")  # not stuck "in progress"
    _read(core)
    core.step()
    assert core.weight_version == "v3"


def test_a_second_load_while_one_is_in_progress_is_refused(ckpts):
    from planaria.engine.weight_update import IN_PROGRESS

    core = _core(ckpts["a"])
    core.add_request(_req("r"))
    core.step()
    core.load_weights(ckpts["b"], version="v2", mode="finish_old")
    with pytest.raises(WeightLoadError, match=IN_PROGRESS):
        core.load_weights(ckpts["b"], version="v3", mode="continue_new")
    _drain(core, {})
    assert core.weight_version == "v2"


def test_load_weights_is_a_utility_call(ckpts):
    from planaria.engine.proc import EngineCoreProc
    from planaria.engine.wire import MsgType, UtilityCall

    proc = EngineCoreProc(0, ["ipc:///nonexistent"], None)
    proc.core = _core(ckpts["a"])
    ok = proc._utility(UtilityCall(call_id=1, method="load_weights",
                                   args={"model_dir": ckpts["b"], "version": "v9", "mode": "continue_new"}))
    assert ok.ok and ok.result["version"] == "v9" and ok.result["state"] == "reading"
    assert proc.input_queue.get(timeout=60) == (None, MsgType.WAKEUP, None)  # the read woke the loop
    proc.core.step()
    status = proc._utility(UtilityCall(call_id=2, method="weight_status", args={}))
    assert status.ok and status.result["version"] == "v9" and status.result["load"]["state"] == "applied"
    bad = proc._utility(UtilityCall(call_id=3, method="load_weights", args={"model_dir": ckpts["dense"]}))
    assert not bad.ok and "WeightLoadError" in bad.error and proc.core.weight_version == "v9"


def test_expert_rehoming_after_a_swap_reads_the_new_checkpoint(ckpts):
    """An expert-parallel rank that moves to other experts after a weight swap must load
    them from the swapped-in checkpoint, not from the one it started with."""
    import torch

    from planaria.engine.model_runner import ModelRunner
    from planaria.engine.models.loader import load_model
    from planaria.engine.weight_update import WeightLoad, apply

    runner = ModelRunner(EngineConfig(model=ckpts["a"], num_kv_blocks=8, max_model_len=64), 64, (0, 4))
    load = WeightLoad.start(runner, ckpts["b"], "v2", "continue_new")
    assert load.wait_read(60) and load.error is None
    apply(runner, load)
    assert runner.model_dir == ckpts["b"]
    runner.reload_experts((4, 8))

    def experts(model_dir: str) -> list[torch.Tensor]:
        model = load_model(model_dir, runner.dtype, torch.device("cpu"), 64, (4, 8))[0]
        return [layer.mlp.w13 for layer in model.layers]

    want, stale = experts(ckpts["b"]), experts(ckpts["a"])
    for layer, w, s in zip(runner.model.layers, want, stale):
        assert (layer.mlp.expert_start, layer.mlp.expert_end) == (4, 8)
        assert torch.equal(layer.mlp.w13, w) and not torch.equal(layer.mlp.w13, s)
