"""RMSNorm and rotary embeddings (kernels/norm.py, kernels/rotary.py) on CPU against a
float64 formula and against transformers' Llama implementations. The rotary kernel is
given transformers' own frequencies; the frequencies planaria computes from a config
(engine/models/rope.py) are tested in tests/engine/test_rope.py."""

import pytest
import torch

from planaria.kernels.norm import RMSNorm, rms_norm
from planaria.kernels.rotary import RotaryEmbedding
from tests.kernels._cases import rms_norm_reference, rope_config, rope_frequencies, rope_reference


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_formula(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 64, generator=g) * 5).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rms_norm_reference(x, w, 1e-6), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [False, True])
def test_rms_norm_equals_transformers(dtype, kernels, monkeypatch):
    """The torch code is transformers' to the bit; the C++ kernel (kernels/csrc/rms_norm.cpp)
    too in bfloat16, and within a float32 ulp or two in float32 (its sum of squares runs
    in another order)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from planaria.kernels import cpu_ext

    if kernels and not cpu_ext.available():
        pytest.skip(f"C++ kernels not loaded: {cpu_ext.status()}")
    monkeypatch.setattr(cpu_ext, "enabled", kernels)
    x = torch.randn(11, 128).to(dtype)
    ours, theirs = RMSNorm(128, 1e-5), LlamaRMSNorm(128, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(128) + 0.5)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    tol = 1e-6 if kernels and dtype == torch.float32 else 0
    torch.testing.assert_close(ours(x), theirs(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_rotary_matches_transformers(rope_type):
    cfg = rope_config(rope_type)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 17, 255, 256, 1000, 2047, 5])  # any order, as in a batch
    q = torch.randn(len(positions), 4, 32, generator=g)
    k = torch.randn(len(positions), 2, 32, generator=g)
    inv_freq, scaling = rope_frequencies(cfg)
    rope = RotaryEmbedding(inv_freq, 2048, torch.float32, scaling)
    oq, ok = rope(positions, q, k)
    rq, rk = rope_reference(cfg, positions, q, k)
    torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)


def test_rotary_is_a_rotation():
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float) / 32)
    rope = RotaryEmbedding(inv_freq, 64, torch.float32)
    q = torch.randn(3, 4, 32)
    oq, _ = rope(torch.tensor([0, 7, 63]), q, q[:, :2])
    assert torch.equal(oq[0], q[0])  # position 0 is the identity
    torch.testing.assert_close(oq.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths


@pytest.mark.parametrize("inv_freq, max_positions", [(torch.ones(2, 8), 16), (torch.ones(0), 16),
                                                     (torch.arange(8), 16), (torch.ones(8), 0)],
                         ids=["2-d", "empty", "integer", "no-positions"])
def test_rotary_rejects_bad_arguments(inv_freq, max_positions):
    with pytest.raises(ValueError):
        RotaryEmbedding(inv_freq, max_positions, torch.float32)
