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
- float32 with AVX2 + FMA and no AVX-512: up to 16 rows (AMD EPYC, 2 vCPUs:
  1.5-3x torch's GEMM at 1-4 rows, 1.0-1.15x at 16, 0.6-0.9x at 64; bench/cpu_kernels.py);
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
from planaria.kernels.sampling import argmax_rows

_MAX_ROWS: dict[torch.dtype, int] = {}
_FUSED_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def max_rows(dtype: torch.dtype) -> int:
    """Up to how many rows of x ``linear`` takes the C++ kernel (0: never)."""
    if not cpu_ext.available():
        return 0
    n = _MAX_ROWS.get(dtype)
    if n is None:
        flags = set(cpu_ext.cpu_flags().split())
        if dtype == torch.float32 and "avx512f" in flags:
            n = 64
        elif dtype == torch.float32 and {"avx2", "fma"} <= flags:
            n = 16
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


def lm_head_chunk(rows: int, dtype: torch.dtype) -> int:
    """Vocab rows per chunk of ``linear_argmax``: a [rows, chunk] block of logits of
    about 256 KiB (it stays in a core's L2 between the GEMM and the argmax), 256 to 4096."""
    elem = torch.empty((), dtype=dtype).element_size()
    return max(256, min(4096, (256 << 10) // max(1, rows * elem) // 256 * 256))


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None = None) -> torch.Tensor:
    """``argmax_rows(linear(x, weight))`` -> [M] int64: greedy tokens from an lm_head.

    With the C++ kernels, a weight that is not oneDNN-packed and more rows than the
    skinny kernel takes, ``torch.ops.planaria.linear_argmax`` (csrc/lm_head_argmax.cpp)
    computes the logits a vocab chunk at a time and takes each chunk's argmax while it is
    still in cache, instead of writing [M, V] logits and reading them back from memory.
    Otherwise (and as the reference) the logits are computed whole."""
    m = x.shape[0]
    if (packed is None and x.dim() == 2 and x.device.type == "cpu" and m > max_rows(weight.dtype)
            and x.dtype == weight.dtype and x.dtype in _FUSED_ARGMAX_DTYPES and weight.is_contiguous()
            and cpu_ext.available()):
        return torch.ops.planaria.linear_argmax(x.contiguous(), weight, lm_head_chunk(m, x.dtype))
    return argmax_rows(linear(x, weight, None, packed))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a weight packed by ``torch.ops.mkldnn._reorder_linear_weight``. In a
    compiled forward (engine/compiled.py) the same call goes through
    ``torch.ops.planaria.packed_linear``: Inductor lowers the mkldnn op only for weights it
    packed itself."""
    if torch.compiler.is_compiling():
        return torch.ops.planaria.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
