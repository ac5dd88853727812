"""Model loading (engine/models/loader.py): the model is built without random init and
filled from the checkpoint, so every parameter must equal its checkpoint tensors (fused
and stacked as planned, for a subset of experts and another dtype too), the rotary tables
must be computed, and a missing or misshapen tensor must be a clear error. An engine start
imports neither torch._dynamo nor sympy nor transformers' model code."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.errors import ModelLoadError
from planaria.engine.models.loader import load_expert_weights, load_model
from planaria.engine.models.rope import rotary_from_config

REPO = Path(__file__).resolve().parents[2]


def _checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _copy_with(src: str, dst: Path, change) -> str:
    """A copy of checkpoint ``src`` whose tensors went through ``change(dict)``."""
    shutil.copytree(src, dst)
    tensors = _checkpoint(src)
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def _expected(ck: dict[str, torch.Tensor], spec, start: int, end: int) -> dict[str, torch.Tensor]:
    exp = {"embed.weight": ck["model.embed_tokens.weight"], "norm.weight": ck["model.norm.weight"]}
    if "lm_head.weight" in ck and not spec.tie_word_embeddings:
        exp["lm_head.weight"] = ck["lm_head.weight"]
    for i in range(spec.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        exp[o + "input_norm.weight"] = ck[p + "input_layernorm.weight"]
        exp[o + "post_norm.weight"] = ck[p + "post_attention_layernorm.weight"]
        exp[o + "attn.qkv.weight"] = torch.cat([ck[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        exp[o + "attn.o_proj.weight"] = ck[p + "self_attn.o_proj.weight"]
        if spec.qk_norm:
            exp[o + "attn.q_norm.weight"] = ck[p + "self_attn.q_norm.weight"]
            exp[o + "attn.k_norm.weight"] = ck[p + "self_attn.k_norm.weight"]
        if i in spec.sparse_layers:
            exp[o + "mlp.router.weight"] = ck[p + "mlp.gate.weight"]
            ex = p + "mlp.experts."
            exp[o + "mlp.w13"] = torch.stack([torch.cat([ck[f"{ex}{e}.gate_proj.weight"], ck[f"{ex}{e}.up_proj.weight"]])
                                              for e in range(start, end)])
            exp[o + "mlp.w2"] = torch.stack([ck[f"{ex}{e}.down_proj.weight"] for e in range(start, end)])
        else:
            exp[o + "mlp.gate_up.weight"] = torch.cat([ck[p + "mlp.gate_proj.weight"], ck[p + "mlp.up_proj.weight"]])
            exp[o + "mlp.down.weight"] = ck[p + "mlp.down_proj.weight"]
    return exp


def _assert_params(model, expected: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    for name, want in expected.items():
        got = params[name]
        assert got.dtype == dtype and tuple(got.shape) == tuple(want.shape), name
        assert torch.equal(got, want.to(dtype)), name


@pytest.mark.parametrize("dtype, experts", [(torch.float32, None), (torch.bfloat16, (2, 6))])
def test_every_parameter_equals_its_checkpoint_tensors(tiny_moe, dtype, experts):
    model, cfg, spec, num_bytes = load_model(tiny_moe, dtype, torch.device("cpu"), 128, experts)
    start, end = experts or (0, spec.num_experts)
    _assert_params(model, _expected(_checkpoint(tiny_moe), spec, start, end), dtype)
    assert num_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    # rotary tables are computed on the device, not left from the (meta) build
    ref = rotary_from_config(cfg, 128, dtype)
    assert not model.rotary.cos.is_meta and torch.equal(model.rotary.cos, ref.cos)
    assert torch.equal(model.rotary.sin, ref.sin) and torch.isfinite(model.rotary.cos).all()
    # re-homing experts fills the same way
    load_expert_weights(model, tiny_moe, spec, dtype, torch.device("cpu"), (4, 8))
    _assert_params(model, _expected(_checkpoint(tiny_moe), spec, 4, 8), dtype)


def test_fused_expert_layout_loads_the_same(tiny_moe, tmp_path):
    """A checkpoint with experts stored fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj)."""
    def fuse(t):
        for i in range(4):
            ex = f"model.layers.{i}.mlp.experts."
            n = sum(1 for k in t if k.startswith(ex) and k.endswith(".down_proj.weight"))
            t[ex + "gate_up_proj"] = torch.stack([torch.cat([t.pop(f"{ex}{e}.gate_proj.weight"),
                                                             t.pop(f"{ex}{e}.up_proj.weight")]) for e in range(n)])
            t[ex + "down_proj"] = torch.stack([t.pop(f"{ex}{e}.down_proj.weight") for e in range(n)])

    fused = _copy_with(tiny_moe, tmp_path / "fused", fuse)
    model, _, spec, _ = load_model(fused, torch.float32, torch.device("cpu"), 64, (3, 7))
    _assert_params(model, _expected(_checkpoint(tiny_moe), spec, 3, 7), torch.float32)


@pytest.mark.parametrize("missing", ["model.layers.1.mlp.experts.5.up_proj.weight",
                                     "model.layers.2.self_attn.k_proj.weight", "model.norm.weight",
                                     "lm_head.weight"])
def test_missing_tensor_is_a_clear_error(tiny_moe, tmp_path, missing):
    broken = _copy_with(tiny_moe, tmp_path / "broken", lambda t: t.pop(missing))
    with pytest.raises(ModelLoadError, match=f"missing tensor '{missing}'"):
        EngineCore(EngineConfig(model=broken, kv_cache_bytes=2**20, max_model_len=64))


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.mlp.experts.0.gate_proj.weight", (1, 128)),  # would broadcast into its rows
    ("model.layers.3.self_attn.v_proj.weight", (32, 128)),  # fewer rows than the fused qkv expects
    ("model.layers.1.self_attn.q_norm.weight", (1,)),  # would broadcast over the whole parameter
])
def test_misshapen_tensor_is_a_clear_error(tiny_moe, tmp_path, name, shape):
    def shrink(t):
        t[name] = torch.ones(shape)

    broken = _copy_with(tiny_moe, tmp_path / "broken", shrink)
    with pytest.raises(ModelLoadError, match=re.escape(f"{name}: shape {tuple(shape)} does not fit")):
        load_model(broken, torch.float32, torch.device("cpu"), 64)


def test_engine_start_imports_no_compiler_or_model_code(tiny_moe):
    """torch._dynamo and sympy (pulled in by nn.init on the meta device) and transformers'
    modeling code are not needed to start an engine (transformers.models.auto's name
    tables are: the config class's docstring decorator imports them)."""
    code = (
        "import json, sys\n"
        "from planaria.engine.config import EngineConfig\n"
        "from planaria.engine.core import EngineCore\n"
        f"core = EngineCore(EngineConfig(model={tiny_moe!r}, max_model_len=128, max_num_seqs=4, "
        "max_num_batched_tokens=128, num_threads=1))\n"  # profiling: one forward too
        "bad = [m for m in sys.modules if m.startswith(('torch._dynamo', 'sympy', 'torch._inductor'))"
        " or (m.startswith('transformers.models.') and '.modeling_' in m and '.auto.' not in m)]\n"
        "print(json.dumps(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
