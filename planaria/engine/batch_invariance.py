"""Whether an engine runs its batch-invariant kernels: ``EngineConfig.batch_invariant``
(``planaria serve --batch-invariant on|off|auto``), None meaning "auto", the default.

In the batch-invariant mode every kernel on the serving path gives a token the same bits
whatever its batch-mates (how many, which, prefilling or decoding) and whether its
position was prefilled (in any chunks, after a prefix-cache hit or not) or decoded
(engine/models/decoder.py lists the kernels; docs/performance.md, "Batch invariance",
states the guarantee). It needs the C++ CPU kernels, and it runs no compiled forward.

"auto" turns it on where its kernels were measured no slower than the default ones
(bench/batch_invariance.py; a 2-vCPU AMD EPYC with AVX512-BF16: 0.9-1.3x the default's
output tokens/s at 1-64 sequences in bf16 and float32): a CPU with the C++ kernels and
the AVX-512 tile for the dtype (AVX512-BF16 for bfloat16, AVX-512 for float32), no AMX
(oneDNN's AMX GEMM is kept there: not measured against), and no compiled forward asked
for. ``PLANARIA_BATCH_INVARIANT`` (1 / 0) decides "auto" for a whole host or test run
without changing any engine config, as ``PLANARIA_CPU_DTYPE`` does for the dtype; an
explicit True / False in the config always wins. True where the kernels are missing is
an error at start, not a silent fallback: the replay guarantee would not hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

from planaria.engine.errors import EngineError
from planaria.kernels import cpu_ext
from planaria.kernels.linear import invariant_available

ENV = "PLANARIA_BATCH_INVARIANT"


@dataclass(frozen=True)
class InvarianceChoice:
    on: bool
    reason: str  # e.g. "config" / "auto: AVX512-BF16, no AMX"


def choose(setting: bool | None, device: torch.device, dtype: torch.dtype, compile_: bool = False,
           environ: Mapping[str, str] = os.environ) -> InvarianceChoice:
    """The mode for an engine: ``setting`` (the config's), else the environment, else auto."""
    if setting is None and environ.get(ENV):
        value = environ[ENV]
        if value not in ("0", "1"):
            raise EngineError(f"{ENV} must be 0 or 1, got {value!r}")
        setting, source = value == "1", ENV
    else:
        source = "config"
    if setting is not None:
        if setting and not invariant_available(device, dtype):
            raise EngineError(f"batch_invariant needs the C++ CPU kernels on the CPU (device {device}, {dtype}, "
                              f"kernels: {cpu_ext.status()})")
        return InvarianceChoice(setting, source)
    if compile_:
        return InvarianceChoice(False, "auto: a compiled forward was asked for")
    if not invariant_available(device, dtype):
        return InvarianceChoice(False, f"auto: no C++ CPU kernels for {device.type} {dtype}")
    flags = set(cpu_ext.cpu_flags().split())
    if "amx_bf16" in flags:
        return InvarianceChoice(False, "auto: AMX (oneDNN's AMX GEMM kept)")
    if dtype == torch.bfloat16 and "avx512_bf16" in flags:
        return InvarianceChoice(True, "auto: AVX512-BF16, no AMX")
    if dtype == torch.float32 and "avx512f" in flags:
        return InvarianceChoice(True, "auto: AVX-512, no AMX")
    return InvarianceChoice(False, f"auto: no AVX-512 tile for {dtype}")
