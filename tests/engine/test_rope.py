"""Rotary frequencies from a checkpoint config (engine/models/rope.py): every rope_type
against transformers' Llama rotary embedding, and "dynamic" refused."""

import pytest
import torch

from planaria.engine.errors import UnsupportedModelError
from planaria.engine.models.rope import compute_inv_freq, rotary_from_config
from tests.kernels._cases import rope_config, rope_frequencies, rope_reference


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3", "yarn"])
def test_frequencies_and_tables_match_transformers(rope_type):
    cfg = rope_config(rope_type)
    inv_freq, scaling = compute_inv_freq(cfg)
    want_inv_freq, want_scaling = rope_frequencies(cfg)
    torch.testing.assert_close(inv_freq, want_inv_freq, rtol=1e-6, atol=0)
    assert scaling == pytest.approx(want_scaling)
    g = torch.Generator().manual_seed(1)
    positions = torch.tensor([0, 1, 2, 17, 255, 256, 1000, 2047, 5])
    q = torch.randn(len(positions), 4, 32, generator=g)
    k = torch.randn(len(positions), 2, 32, generator=g)
    oq, ok = rotary_from_config(cfg, 2048, torch.float32)(positions, q, k)
    rq, rk = rope_reference(cfg, positions, q, k)
    torch.testing.assert_close(oq, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ok, rk, rtol=1e-5, atol=1e-5)


def test_default_frequencies():
    inv_freq, scaling = compute_inv_freq(rope_config("default"))
    expected = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    torch.testing.assert_close(inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert scaling == 1.0


def test_dynamic_rope_is_refused():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        compute_inv_freq(cfg)
