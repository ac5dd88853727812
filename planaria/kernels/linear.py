"""Linear layers at a few rows (decode at small batches) on the CPU.

At a few rows a linear reads each weight once and uses it a few times, so its speed is
how fast it streams the weight; torch's GEMM (MKL / oneDNN) streams it at a fraction of
what memory gives at one to a few rows (bench/README.md). ``torch.ops.planaria.
skinny_linear`` (csrc/skinny_linear.cpp) reads each tile of four weight rows once and
meets every row of x with it from L1. ``linear`` takes it for up to ``max_rows(dtype,
packed)`` rows and F.linear (or the oneDNN-packed weight) otherwise:

- float32 with AVX-512: up to 64 rows (1.0-2.4x torch's float32 GEMM at 1-64 rows;
  from about 16 rows both are bound by arithmetic, where this kernel comes closer to
  the FMA peak);
- float32 with AVX2 + FMA and no AVX-512: up to 16 rows (AMD EPYC, 2 vCPUs:
  1.5-3x torch's GEMM at 1-4 rows, 1.0-1.15x at 16, 0.6-0.9x at 64; bench/cpu_kernels.py),
  up to 4 where the weight has a oneDNN-packed copy (engine/models/packing.py): the
  packed float32 GEMM is 1.1-1.4x this kernel from 6-8 rows on, and 1.1-2.2x torch's
  unpacked GEMM at 17-64 rows, on that host at SmolLM2's shapes;
- bfloat16 with AVX512-BF16 and no AMX: up to 8 rows (1.1-1.3x the oneDNN-packed GEMM;
  past 16 rows oneDNN is faster);
  with AMX, oneDNN's AMX GEMM is kept (not measured against it);
- float16, or a CPU without those instructions, or the C++ kernels not loaded: never.

The lm_head has functions of its own: ``lm_head_logits`` and, for greedy rows,
``linear_argmax`` (the argmax taken a vocab chunk at a time, inside the GEMM's work).

Sums are float32 in a different order from torch's GEMM, so the float32 results differ
from F.linear in the last bits; the float32 parity tests against transformers still
compare greedy tokens exactly (tests/engine/test_parity*.py).

Batch invariance (``invariant=True``, the engine's ``batch_invariant`` mode): a row's
result must not depend on how many rows share the call. The switch above between two
kernels breaks that (their sums run in different orders), and so does oneDNN's packed
bf16 GEMM alone: at K = 1536 a row's result changes with M from 7 rows on (at K = 576 it
does not; bench/batch_invariance.py). ``invariant_linear`` takes one kernel for every M
instead, the lm_head included (``lm_head_logits`` / ``linear_argmax``: the logits, then
``argmax_rows``):

- bfloat16 with AVX512-BF16: ``torch.ops.planaria.invariant_linear``
  (csrc/invariant_linear.cpp) on the weight packed by ``pack_invariant`` (at load:
  engine/models/packing.py): each output one float32 lane filled along K in a fixed
  order, oneDNN's register tile; 0.7-0.96x oneDNN's time at 16-64 rows, about the same at
  prefill sizes, and the skinny kernel's at one row (bench/batch_invariance.py);
- otherwise (float32, float16, no AVX512-BF16, no packed copy): the skinny kernel, which
  is invariant by construction too (one float32 accumulator per (weight row, x row),
  filled along K in the same order whatever the other rows, then one fixed reduction),
  ``INVARIANT_ROWS`` rows per call so the rows a weight tile meets stay in L2.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from planaria.kernels import cpu_ext
from planaria.kernels.sampling import argmax_rows

_MAX_ROWS: dict[tuple[torch.dtype, bool], int] = {}
_FUSED_ARGMAX_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SKINNY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INVARIANT_ROWS = 64  # rows of x per call of the C++ kernel in invariant mode


def max_rows(dtype: torch.dtype, packed: bool = False) -> int:
    """Up to how many rows of x ``linear`` takes the C++ kernel (0: never); ``packed``:
    for a weight with a oneDNN-packed copy (the other choice then being that copy)."""
    if not cpu_ext.available():
        return 0
    n = _MAX_ROWS.get((dtype, packed))
    if n is None:
        flags = set(cpu_ext.cpu_flags().split())
        if dtype == torch.float32 and "avx512f" in flags:
            n = 64
        elif dtype == torch.float32 and {"avx2", "fma"} <= flags:
            n = 4 if packed else 16
        elif dtype == torch.bfloat16 and "avx512_bf16" in flags and "amx_bf16" not in flags:
            n = 8
        else:
            n = 0
        _MAX_ROWS[(dtype, packed)] = n
    return n


def takes_skinny(x: torch.Tensor, weight: torch.Tensor, packed: bool = False) -> bool:
    """Whether ``linear`` runs ``x`` through the C++ kernel (reading ``weight`` itself);
    ``packed``: the weight has a oneDNN-packed copy."""
    return (x.dim() == 2 and x.device.type == "cpu" and 0 < x.shape[0] <= max_rows(weight.dtype, packed)
            and x.dtype == weight.dtype and weight.is_contiguous())


def invariant_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``invariant=True`` can keep its promise here: the C++ kernels on the CPU."""
    return device.type == "cpu" and dtype in _SKINNY_DTYPES and cpu_ext.available()


def invariant_packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``invariant_linear`` has a packed kernel here (bfloat16 with AVX512-BF16),
    so weights are worth ``pack_invariant``."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and cpu_ext.available()
            and "avx512_bf16" in cpu_ext.cpu_flags().split())


def pack_invariant(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bfloat16 -> [ceil(N / 16), ceil(K / 2), 16, 2]: blocks of 16 output
    columns, each holding the pairs (W[n, 2p], W[n, 2p + 1]) of its columns for p = 0, 1,
    ... (zeros past N and K), the layout csrc/invariant_linear.cpp reads."""
    n, k = weight.shape
    nb, k2 = -(-n // 16), -(-k // 2)
    padded = weight.new_zeros(nb * 16, k2 * 2)
    padded[:n, :k] = weight
    return padded.view(nb, 16, k2, 2).permute(0, 2, 1, 3).contiguous()


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     packed: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] with each row's arithmetic the same
    whatever M (the module docstring); ``packed``: ``pack_invariant(weight)``, for the
    bfloat16 kernel."""
    x = x.contiguous()
    if packed is not None:
        return torch.ops.planaria.invariant_linear(x, packed, weight.shape[0], bias)
    if x.shape[0] <= INVARIANT_ROWS:
        return torch.ops.planaria.skinny_linear(x, weight.contiguous(), bias)
    weight = weight.contiguous()
    return torch.cat([torch.ops.planaria.skinny_linear(part, weight, bias) for part in x.split(INVARIANT_ROWS)])


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]; ``packed``: the weight packed for
    oneDNN (engine/models/packing.py), used where the C++ kernel is not; ``invariant``:
    ``invariant_linear``, ``packed`` then being ``pack_invariant``'s or None (the caller
    checked ``invariant_available``)."""
    if invariant:
        return invariant_linear(x, weight, bias, packed)
    if takes_skinny(x, weight, packed is not None):
        return torch.ops.planaria.skinny_linear(x.contiguous(), weight, bias)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def lm_head_chunk(rows: int, dtype: torch.dtype) -> int:
    """Vocab rows per chunk of ``linear_argmax``: a [rows, chunk] block of logits of
    about 256 KiB (it stays in a core's L2 between the GEMM and the argmax), 256 to 4096."""
    elem = torch.empty((), dtype=dtype).element_size()
    return max(256, min(4096, (256 << 10) // max(1, rows * elem) // 256 * 256))


def lm_head_logits(x: torch.Tensor, weight: torch.Tensor, packed: list[torch.Tensor] | None = None,
                   float32: bool = True, invariant: bool = False) -> torch.Tensor:
    """The lm_head's logits [M, V], float32 or (``float32=False``) the weight's dtype.
    ``packed``: the weight packed for oneDNN as chunks of vocab rows
    (engine/models/packing.py ``pack_lm_head``); several chunks go through
    ``torch.ops.planaria.packed_linear_chunked``, which runs a chunk per thread and writes
    it (widened to float32 there, when asked) into its columns while it is in cache.
    ``invariant``: ``invariant_linear``, ``packed`` then ``[pack_invariant(weight)]`` or None."""
    if invariant:
        logits = invariant_linear(x, weight, None, packed[0] if packed is not None else None)
        return logits.float() if float32 else logits
    if packed is not None and len(packed) > 1 and not takes_skinny(x, weight, True):
        return torch.ops.planaria.packed_linear_chunked(x.contiguous(), packed, packed[0].shape[0], float32)
    logits = linear(x, weight, None, packed[0] if packed is not None and len(packed) == 1 else None)
    return logits.float() if float32 else logits


def linear_argmax(x: torch.Tensor, weight: torch.Tensor, packed: list[torch.Tensor] | None = None,
                  invariant: bool = False) -> torch.Tensor:
    """``argmax_rows(lm_head_logits(x, weight, packed))`` -> [M] int64: greedy tokens from an
    lm_head.

    With the C++ kernels and more rows than the skinny kernel takes, the logits are
    computed a vocab chunk at a time and each chunk's argmax taken while it is still in
    cache (csrc/lm_head_argmax.cpp), instead of writing [M, V] logits and reading them back
    from memory: ``torch.ops.planaria.linear_argmax`` on the weight itself, or
    ``packed_linear_argmax`` on its oneDNN-packed chunks. Otherwise (and as the reference)
    the logits are computed whole (``invariant``: by ``invariant_linear``)."""
    if invariant:
        return argmax_rows(lm_head_logits(x, weight, packed, float32=False, invariant=True))
    m = x.shape[0]
    if (x.dim() == 2 and x.device.type == "cpu" and m > max_rows(weight.dtype, packed is not None)
            and x.dtype == weight.dtype
            and x.dtype in _FUSED_ARGMAX_DTYPES and cpu_ext.available()):
        if packed is None and weight.is_contiguous():
            return torch.ops.planaria.linear_argmax(x.contiguous(), weight, lm_head_chunk(m, x.dtype))
        if packed is not None and len(packed) > 1:
            return torch.ops.planaria.packed_linear_argmax(x.contiguous(), packed, packed[0].shape[0])
    return argmax_rows(lm_head_logits(x, weight, packed, float32=False))


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with a weight packed by ``torch.ops.mkldnn._reorder_linear_weight``. In a
    compiled forward (engine/compiled.py) the same call goes through
    ``torch.ops.planaria.packed_linear``: Inductor lowers the mkldnn op only for weights it
    packed itself."""
    if torch.compiler.is_compiling():
        return torch.ops.planaria.packed_linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
