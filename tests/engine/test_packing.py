"""oneDNN-packed linears and experts (engine/models/packing.py): bf16 the same results as
F.linear, bit for bit, float32 the same to float32 rounding (its packed GEMM sums in
another order); counted in the weights; off for float16 and by the environment switch; a
tiny-moe engine (its decode takes the per-expert loop without the C++ kernels) generates
the same greedy tokens packed and unpacked, and a weight swap re-packs, so it then
generates the new checkpoint's tokens; an expert-parallel rank's experts stay unpacked;
float32 at a few rows on an AVX2 host takes the C++ kernel only up to 4 rows of a packed
weight (the packed GEMM is faster past them)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.models import packing
from planaria.kernels import cpu_ext
from planaria.kernels import linear as lin
from planaria.kernels.linear import packed_linear
from planaria.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
DTYPES = [pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
              not packing.available(CPU, torch.bfloat16),
              reason="no oneDNN bf16 weight packing here (no oneDNN, or an AVX2-only CPU)")),
          pytest.param(torch.float32, marks=pytest.mark.skipif(
              not packing.available(CPU, torch.float32), reason="no oneDNN float32 weight packing here"))]


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_linear_equals_f_linear(dtype):
    g = torch.Generator().manual_seed(0)
    for n, k, bias in ((960, 576, False), (64, 48, True), (3, 7, True)):
        w = torch.randn(n, k, generator=g).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        p = packing.pack(w)
        for m in (1, 5, 64):
            x = torch.randn(m, k, generator=g).to(dtype)
            if dtype == torch.bfloat16:
                assert torch.equal(packed_linear(x, p, b), F.linear(x, w, b))
            else:
                torch.testing.assert_close(packed_linear(x, p, b), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_bf16_and_float32_on_cpu_and_the_switch_turns_it_off(monkeypatch):
    assert not packing.available(CPU, torch.float16)
    assert not packing.available(torch.device("meta"), torch.bfloat16)
    assert packing.available(CPU, torch.float32) == (torch.backends.mkldnn.is_available()
                                                     and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    monkeypatch.setenv(packing.ENV, "0")
    assert not packing.available(CPU, torch.bfloat16)
    assert not packing.available(CPU, torch.float32)


@pytest.mark.skipif(not cpu_ext.available() or "avx512f" in cpu_ext.cpu_flags().split()
                    or not {"avx2", "fma"} <= set(cpu_ext.cpu_flags().split()),
                    reason="the AVX2 float32 switch (an AVX2 + FMA host without AVX-512, the C++ kernels)")
def test_float32_on_avx2_takes_the_packed_weight_past_4_rows(monkeypatch):
    calls = []
    real = torch.ops.planaria.skinny_linear
    monkeypatch.setattr(torch.ops.planaria, "skinny_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = torch.randn(96, 64)
    p = packing.pack(w)
    assert lin.max_rows(torch.float32, packed=True) == 4 and lin.max_rows(torch.float32) == 16
    for m in (1, 4, 5, 16):
        x = torch.randn(m, 64)
        torch.testing.assert_close(lin.linear(x, w, None, p), F.linear(x, w), rtol=1e-5, atol=1e-4)
        lin.linear(x, w)  # unpacked: the C++ kernel up to 16 rows
    assert calls == [1, 1, 4, 4, 5, 16]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("packing")
    return {name: str(build_demo_model(root / name, "tiny-moe", seed=seed)) for name, seed in (("a", 0), ("b", 1))}


def _greedy(core: EngineCore, rid: str) -> list[int]:
    core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=list(range(5, 21)),
                                       sampling_params=SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    out = []
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            out += o.new_token_ids
    return out


def _core(model: str, monkeypatch, packed: bool, dtype: torch.dtype = torch.bfloat16) -> EngineCore:
    monkeypatch.setenv(packing.ENV, "1" if packed else "0")
    # oneDNN's packing: the batch-invariant mode packs for its own kernel (tests/engine/test_batch_invariance.py)
    return EngineCore(EngineConfig(model=model, num_kv_blocks=64, max_model_len=256,
                                   dtype=str(dtype).removeprefix("torch."), batch_invariant=False))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cpp", [False, True])
def test_engine_packs_and_a_weight_swap_repacks(ckpts, monkeypatch, cpp, dtype):
    # without the C++ kernels the experts are packed for the per-expert loop; with them
    # the fused MoE kernel reads the parameters and the experts are not packed
    if cpp:
        cpu_ext.build()
        monkeypatch.setattr(cpu_ext, "enabled", True)
    else:
        monkeypatch.setattr(cpu_ext, "enabled", False)
    core = _core(ckpts["a"], monkeypatch, packed=True, dtype=dtype)
    runner = core.runner
    linears = [m for m in runner.model.modules() if getattr(m, "packed", None) is not None]
    assert linears and runner.model.lm_head_packed is not None
    moes = [m for m in runner.model.modules() if getattr(m, "packed_experts", None) is not None]
    if cpp:
        assert not moes
    else:
        assert moes and all(len(m.packed_experts) == m.w13.shape[0] for m in moes)  # all experts here: packed
    assert runner.packed_bytes >= sum(m.weight.numel() * m.weight.element_size() for m in linears)
    plain_b = _greedy(_core(ckpts["b"], monkeypatch, packed=False, dtype=dtype), "plain")
    assert _greedy(core, "before") == _greedy(_core(ckpts["a"], monkeypatch, packed=False, dtype=dtype), "plain-a")
    core.load_weights(ckpts["b"], version="b")
    assert core._weight_update.wait_read(60)
    core.step()  # the swap, at a step boundary
    assert core.weight_version == "b"
    assert _greedy(core, "after") == plain_b  # the packed copies follow the new weights


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_expert_parallel_rank_does_not_pack_its_experts(ckpts, monkeypatch, dtype):
    from planaria.engine.model_runner import ModelRunner

    monkeypatch.setenv(packing.ENV, "1")
    runner = ModelRunner(EngineConfig(model=ckpts["a"], num_kv_blocks=8, max_model_len=64,
                                      dtype=str(dtype).removeprefix("torch."), batch_invariant=False), 64, (0, 4))
    assert all(getattr(m, "packed_experts", None) is None for m in runner.model.modules())
    assert any(getattr(m, "packed", None) is not None for m in runner.model.modules())  # linears are
