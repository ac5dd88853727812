"""The node's expert cache (engine/models/expert_cache.py): what an EP rank loads and
re-homes is views of one mapped file, equal to the checkpoint's experts; it follows the
checkpoint, refuses a file of another, is built once under concurrency, and can be off."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from planaria.engine.errors import ModelLoadError
from planaria.engine.models import expert_cache
from planaria.engine.models.loader import load_expert_weights, load_model, refresh_node_experts


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "experts"
    monkeypatch.setenv(expert_cache.DIR_ENV, str(d))
    monkeypatch.delenv(expert_cache.SWITCH_ENV, raising=False)
    return d


def _experts(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.mlp.w13, layer.mlp.w2) for layer in model.layers if hasattr(layer.mlp, "w13")]


def _load(model_dir, experts, dtype=torch.bfloat16):
    return load_model(model_dir, dtype, torch.device("cpu"), 64, experts)


def test_experts_are_views_of_one_file_and_equal_the_checkpoints(tiny_moe, cache_dir, monkeypatch):
    model, _cfg, spec, _ = _load(tiny_moe, (2, 6))
    files = list(cache_dir.glob("experts-*.safetensors"))
    assert len(files) == 1
    monkeypatch.setenv(expert_cache.SWITCH_ENV, "0")  # the same load straight from the checkpoint
    plain = _load(tiny_moe, (2, 6))[0]
    for (w13, w2), (p13, p2) in zip(_experts(model), _experts(plain)):
        assert torch.equal(w13, p13) and torch.equal(w2, p2)
    assert not list(cache_dir.glob(".*.tmp"))
    monkeypatch.delenv(expert_cache.SWITCH_ENV)
    # Re-homing maps other rows of the same file: no read, no cast, no copy.
    load_expert_weights(model, tiny_moe, spec, torch.bfloat16, torch.device("cpu"), (0, 8))
    again = load_expert_weights(model, tiny_moe, spec, torch.bfloat16, torch.device("cpu"), (4, 8))
    cache = expert_cache.ExpertCache(files[0], expert_cache.cache_key(tiny_moe, torch.bfloat16))
    full13, _ = cache.view(spec.sparse_layers[0], 0, spec.num_experts)
    w13 = _experts(model)[0][0]
    # a slice of the whole layer's mapped tensor (all its experts), not a copy of 4 of them
    assert w13.untyped_storage().nbytes() == full13.untyped_storage().nbytes() == full13.numel() * 2
    assert w13.storage_offset() == 4 * full13[0].numel() and w13.shape[0] == 4
    assert torch.equal(w13, full13[4:8])
    assert again == sum(t.numel() * t.element_size() for pair in _experts(model) for t in pair)


def test_a_rank_maps_every_expert_of_the_node_and_follows_a_weight_swap(tiny_moe, tmp_path, cache_dir,
                                                                       monkeypatch):
    import shutil

    model, _cfg, spec, _ = _load(tiny_moe, (2, 6))
    plain = _load(tiny_moe, None)[0]  # one engine: every expert, no node views
    assert all(layer.mlp.node_w13 is None for layer in plain.layers if hasattr(layer.mlp, "w13"))
    keys = set()
    for layer, ref in zip(model.layers, plain.layers):
        moe = layer.mlp
        if not hasattr(moe, "w13"):
            continue
        # all experts, equal to the checkpoint's, in the same mapping as the rank's own
        assert torch.equal(moe.node_w13, ref.mlp.w13) and torch.equal(moe.node_w2, ref.mlp.w2)
        assert moe.node_w13.untyped_storage().data_ptr() == moe.w13.untyped_storage().data_ptr()
        keys.add(moe.node_key)
    assert len(keys) == 1 and 0 not in keys
    # a weight swap from another checkpoint: the views follow it (the old file has old experts)
    other = tmp_path / "other"
    shutil.copytree(tiny_moe, other)
    for f in other.glob("*.safetensors"):
        os.utime(f, ns=(time.time_ns(), time.time_ns() + 10**9))
    _load(str(other), (2, 6))  # what read_weights does: builds the other file
    refresh_node_experts(model, str(other), spec, torch.bfloat16, torch.device("cpu"))
    new_keys = {layer.mlp.node_key for layer in model.layers if hasattr(layer.mlp, "w13")}
    assert len(new_keys) == 1 and new_keys != keys and 0 not in new_keys
    # no expert cache: no views (the ranks' owners compute their own experts)
    monkeypatch.setenv(expert_cache.SWITCH_ENV, "0")
    off = _load(tiny_moe, (2, 6))[0]
    assert all(layer.mlp.node_w13 is None and layer.mlp.node_key == 0
               for layer in off.layers if hasattr(layer.mlp, "w13"))
    refresh_node_experts(off, tiny_moe, spec, torch.bfloat16, torch.device("cpu"))  # nothing to follow
    assert all(layer.mlp.node_w13 is None for layer in off.layers if hasattr(layer.mlp, "w13"))


def test_a_changed_checkpoint_gets_a_new_file(tiny_moe, tmp_path, cache_dir):
    import shutil

    copy = tmp_path / "model"
    shutil.copytree(tiny_moe, copy)
    _load(copy, (0, 4))
    key = expert_cache.cache_key(copy, torch.bfloat16)
    weights = next(copy.glob("*.safetensors"))
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))  # rewritten in place
    assert expert_cache.cache_key(copy, torch.bfloat16) != key
    _load(copy, (0, 4))
    assert len(list(cache_dir.glob("experts-*.safetensors"))) == 2
    assert expert_cache.cache_key(copy, torch.float32) != expert_cache.cache_key(copy, torch.bfloat16)


def test_a_file_of_another_checkpoint_is_refused(tiny_moe, cache_dir):
    _load(tiny_moe, (0, 4))
    path = next(cache_dir.glob("experts-*.safetensors"))
    with pytest.raises(ModelLoadError, match="another checkpoint"):
        expert_cache.ExpertCache(path, "not-its-key")
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")  # a stranger's file under the name
    with pytest.raises(ModelLoadError):
        _load(tiny_moe, (0, 4))


def test_old_files_are_pruned(tmp_path, cache_dir):
    cache_dir.mkdir(parents=True)
    for i in range(expert_cache.MAX_FILES + 2):
        f = cache_dir / f"experts-old{i}.safetensors"
        f.write_bytes(b"x")
        os.utime(f, (1000 + i, 1000 + i))
    keep = cache_dir / "experts-new.safetensors"
    keep.write_bytes(b"x")
    expert_cache._prune(cache_dir, keep)
    left = sorted(f.name for f in cache_dir.glob("experts-*.safetensors"))
    assert len(left) == expert_cache.MAX_FILES and "experts-new.safetensors" in left
    assert "experts-old0.safetensors" not in left


def _build_in_child(model_dir: str, out) -> None:
    model = load_model(model_dir, torch.bfloat16, torch.device("cpu"), 64, (0, 8))[0]
    out.put(float(sum(w13.float().sum() + w2.float().sum() for w13, w2 in _experts(model))))


def test_concurrent_engines_build_it_once(tiny_moe, cache_dir):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(tiny_moe, q)) for _ in range(2)]
    for p in procs:
        p.start()
    sums = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0] and sums[0] == sums[1]
    assert len(list(cache_dir.glob("experts-*.safetensors"))) == 1 and not list(cache_dir.glob(".*.tmp"))
