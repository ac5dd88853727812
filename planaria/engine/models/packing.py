"""oneDNN-packed weights for bfloat16 and float32 linears on the CPU.

``F.linear`` on a CPU re-lays its weight out for its GEMM on every call (bf16: oneDNN's;
float32: MKL's, whose blocking suits square matrices, not a few rows); a weight packed
once (``torch.ops.mkldnn._reorder_linear_weight``, what Inductor's freezing does) runs
oneDNN's GEMM on it directly:

- bfloat16: the same results, bit for bit, 1.2-2x faster (AMD EPYC with AVX512-BF16,
  SmolLM2's shapes: 2.2x at one token, 1.1-1.4x at 16-64);
- float32: 1.1-2.2x faster at 17-64 rows and about the same at prefill sizes (AMD EPYC
  with AVX2 and no AVX-512, SmolLM2's and bench-moe's shapes); its sums run in another
  order than MKL's, so results agree to float32 rounding (the float32 parity tests against
  transformers still compare greedy tokens exactly).

So ``pack_linears(model)`` gives every bfloat16 or float32 ``Linear`` (and the LM head,
tied or not, as chunks of vocab rows: ``pack_lm_head``) a packed copy that its forward
uses (at a few rows, where the CPU has the instructions, the C++ kernel of
kernels/linear.py reads the parameter instead: ``max_rows``); the parameters stay as they
are, for weight swaps (which pack again: ``repack``), expert re-homing and the embedding.
The copy costs the linears' weight bytes once more; the runner counts them in its weights
before the memory profile sizes the KV cache. A MoE layer's experts are packed too, for
the per-expert loop that decode at small batches takes (2.1x faster per expert GEMM in
bf16), but only when the engine holds every expert (an expert-parallel rank's experts
move at run time and are left alone) and the C++ kernels are not built: their fused MoE
(kernels/csrc/fused_moe.cpp) replaces that loop and reads the parameters themselves.
float16 stays unpacked. ``PLANARIA_CPU_PACKED_LINEAR=0`` turns it off.

A model built for the batch-invariant mode (``model.batch_invariant``) packs for its own
kernel instead (kernels/linear.py ``pack_invariant``, bfloat16 where the CPU has
AVX512-BF16): every ``Linear`` and the LM head (one chunk: the whole weight), no experts
(the fused MoE kernel reads the parameters), the same bytes as oneDNN's copy.
"""

from __future__ import annotations

import functools
import os

import torch

from planaria.kernels import cpu_ext
from planaria.kernels.linear import invariant_packs, pack_invariant

ENV = "PLANARIA_CPU_PACKED_LINEAR"


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and os.environ.get(ENV, "1") != "0"
            and _onednn_packing(dtype))


@functools.cache
def _onednn_packing(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU pack ``dtype`` weights: oneDNN's bf16 path needs AVX512-BW/VL/DQ
    or AVX-NE-CONVERT (an AVX2-only CPU raises), so a tiny weight is packed once to find out."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


# vocab rows per packed chunk of the lm_head: [64, 4096] bf16 logits are 512 KiB, in a
# core's L2 while the greedy argmax reads them (kernels/linear.py ``linear_argmax``)
LM_HEAD_CHUNK = 4096


def pack_lm_head(weight: torch.Tensor) -> list[torch.Tensor]:
    """The lm_head packed as chunks of ``LM_HEAD_CHUNK`` vocab rows (the last one shorter),
    each on its own: the C++ ops take a chunk per thread, the argmax of its logits taken in
    cache (csrc/lm_head_argmax.cpp). Without the C++ kernels, one chunk: the whole weight."""
    step = LM_HEAD_CHUNK if cpu_ext.available() else weight.shape[0]
    return [pack(weight[i:i + step]) for i in range(0, weight.shape[0], step)]


def pack_linears(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, experts: bool = True) -> int:
    """Pack every bfloat16 / float32 linear of ``model`` (modules with a ``packed`` attribute, the
    model's ``lm_head_packed``, and with ``experts`` each MoE layer's ``packed_experts``);
    returns the bytes the packed copies take (0 when off). A batch-invariant model: packed
    for its kernel (the module docstring) where it has one."""
    if model.batch_invariant:
        return _pack_invariant(model, dtype) if invariant_packs(device, dtype) else 0
    return _pack(model, dtype, experts) if available(device, dtype) else 0


def repack(model: torch.nn.Module) -> None:
    """After new values were copied into the parameters (a weight swap): pack again what
    ``pack_linears`` packed (nothing, if it packed nothing)."""
    if getattr(model, "lm_head_packed", None) is None:
        return
    if model.batch_invariant:
        _pack_invariant(model, model.lm_head_weight().dtype)
        return
    experts = any(getattr(m, "packed_experts", None) is not None for m in model.modules())
    _pack(model, model.lm_head_weight().dtype, experts)


def _pack(model: torch.nn.Module, dtype: torch.dtype, experts: bool) -> int:
    added = 0
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "packed") and getattr(m, "weight", None) is not None and m.weight.dtype == dtype:
                m.packed = pack(m.weight)
                added += m.weight.numel() * m.weight.element_size()
            if experts and hasattr(m, "packed_experts") and m.w13.dtype == dtype and not cpu_ext.available():
                m.packed_experts = _pack_experts(m)
                added += (m.w13.numel() + m.w2.numel()) * m.w13.element_size()
        if hasattr(model, "lm_head_packed"):
            w = model.lm_head_weight()
            model.lm_head_packed = pack_lm_head(w)
            if w is model.embed.weight:  # tied: a copy of its own (a packed Linear's is counted above)
                added += w.numel() * w.element_size()
    return added


def _pack_invariant(model: torch.nn.Module, dtype: torch.dtype) -> int:
    added = 0
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "packed") and getattr(m, "weight", None) is not None and m.weight.dtype == dtype:
                m.packed = pack_invariant(m.weight)
                added += m.packed.numel() * m.packed.element_size()
        w = model.lm_head_weight()
        model.lm_head_packed = [pack_invariant(w)]
        if w is model.embed.weight:  # tied: a copy of its own (a packed Linear's is counted above)
            added += model.lm_head_packed[0].numel() * w.element_size()
    return added


def _pack_experts(moe) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(pack(moe.w13[e]), pack(moe.w2[e])) for e in range(moe.w13.shape[0])]
