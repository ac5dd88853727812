"""Rotary frequencies from a checkpoint's config: the rope_type it declares -> the inverse
frequencies and attention scaling that kernels/rotary.py turns into cos/sin tables.

The frequencies come from transformers' ROPE_INIT_FUNCTIONS so every rope_type a
checkpoint declares (default, linear, dynamic-free llama3, yarn, ...) is computed the same
way the reference does; "dynamic" (frequencies that change with the sequence length) is
refused.
"""

from __future__ import annotations

import torch

from planaria.engine.errors import UnsupportedModelError
from planaria.kernels.rotary import RotaryEmbedding


def compute_inv_freq(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] float32, attention scaling) for ``hf_config``'s rope_parameters."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise UnsupportedModelError("rope_type 'dynamic' is not supported")
    # deferred: transformers is heavy (seconds); importing the engine must not pay it
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
    return inv_freq, float(scaling)


def rotary_from_config(hf_config, max_positions: int, dtype: torch.dtype) -> RotaryEmbedding:
    """The rotary tables (on the CPU) for positions [0, max_positions) of ``hf_config``."""
    inv_freq, scaling = compute_inv_freq(hf_config)
    return RotaryEmbedding(inv_freq, max_positions, dtype, scaling)
