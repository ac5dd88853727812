"""RMSNorm and rotary embeddings (kernels/norm.py, kernels/rotary.py) on CPU against a
float64 formula and against transformers' Llama implementations."""

import pytest
import torch

from planaria.kernels.norm import RMSNorm, rms_norm
from planaria.kernels.rotary import RotaryEmbedding, compute_inv_freq
from tests.kernels._cases import rms_norm_reference, rope_config, rope_reference


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_rms_norm_matches_formula(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 3, 64, generator=g) * 5).to(dtype)
    w = torch.randn(64, generator=g).to(dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), rms_norm_reference(x, w, 1e-6), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    x = torch.randn(11, 128).to(dtype)
    ours, theirs = RMSNorm(128, 1e-5), LlamaRMSNorm(128, eps=1e-5)
    with torch.no_grad():
        ours.weight.copy_(torch.rand(128) + 0.5)
        theirs.weight.copy_(ours.weight)
    ours, theirs = ours.to(dtype), theirs.to(dtype)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_rotary_matches_transformers(rope_type):
    cfg = rope_config(rope_type)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 17, 255, 256, 1000, 2047, 5])  # any order, as in a batch
    q = torch.randn(len(positions), 4, 32, generator=g)
    k = torch.randn(len(positions), 2, 32, generator=g)
    rope = RotaryEmbedding(cfg, 2048, torch.float32)
    oq, ok = rope(positions, q, k)
    rq, rk = rope_reference(cfg, positions, q, k)
    torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)


def test_rotary_default_frequencies_and_norm():
    cfg = rope_config("default")
    inv_freq, scaling = compute_inv_freq(cfg)
    expected = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert scaling == 1.0
    rope = RotaryEmbedding(cfg, 64, torch.float32)
    q = torch.randn(3, 4, 32)
    oq, _ = rope(torch.tensor([0, 7, 63]), q, q[:, :2])
    assert torch.equal(oq[0], q[0])  # position 0 is the identity
    torch.testing.assert_close(oq.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths


def test_dynamic_rope_is_refused():
    from planaria.engine.errors import UnsupportedModelError
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        compute_inv_freq(cfg)
