"""Linear layers at a few rows (decode at small batches) on the CPU.

At a few rows a linear reads each weight once and uses it a few times, so its speed is
how fast it streams the weight; torch's GEMM (MKL / oneDNN) streams it at a fraction of
what memory gives at one to a few rows (bench/README.md). ``torch.ops.planaria.
skinny_linear`` (csrc/skinny_linear.cpp) reads each tile of four weight rows once and
meets every row of x with it from L1. ``linear`` takes it for up to ``max_rows(dtype)``
rows and F.linear (or the oneDNN-packed weight) otherwise:

- float32 with AVX-512: up to 64 rows (1.0-2.4x torch's float32 GEMM at 1-64 rows;
  from about 16 rows both are bound by arithmetic, where this kernel comes closer to
  the FMA peak);
- bfloat16 with AVX512-BF16 and no AMX: up to 8 rows (1.1-1.3x the oneDNN-packed GEMM;
  past 16 rows oneDNN is faster);
  with AMX, oneDNN's AMX GEMM is kept (not measured against it);
- float16, or a CPU without those instructions, or the C++ kernels not loaded: never.

Sums are float32 in a different order from torch's GEMM, so the float32 results differ
from F.linear in the last bits; the float32 parity tests against transformers still
compare greedy tokens exactly (tests/engine/test_parity*.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from planaria.kernels import cpu_ext

_MAX_ROWS: dict[torch.dtype, int] = {}


def max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of x ``linear`` takes the C++ kernel (0: never)."""
    if not cpu_ext.available():
        return 0
    n = _MAX_ROWS.get(dtype)
    if n is None:
        flags = set(cpu_ext.cpu_flags().split())
        if dtype == torch.float32 and "avx512f" in flags:
            n = 64
        elif dtype == torch.bfloat16 and "avx512_bf16" in flags and "amx_bf16" not in flags:
            n = 8
        else:
            n = 0
        _MAX_ROWS[dtype] = n
    return n


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]; ``packed``: the weight packed for
    oneDNN (engine/models/packing.py), used where the C++ kernel is not."""
    if (x.dim() == 2 and x.device.type == "cpu" and 0 < x.shape[0] <= max_rows(weight.dtype)
            and x.dtype == weight.dtype and weight.is_contiguous()):
        return torch.ops.planaria.skinny_linear(x.contiguous(), weight, bias)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a weight packed by ``torch.ops.mkldnn._reorder_linear_weight``. In a
    compiled forward (engine/compiled.py) the same call goes through
    ``torch.ops.planaria.packed_linear``: Inductor lowers the mkldnn op only for weights it
    packed itself."""
    if torch.compiler.is_compiling():
        return torch.ops.planaria.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
