"""The engine's compute dtype: ``EngineConfig.dtype`` "auto" (the default) picks bfloat16
where it is fast and float32 elsewhere.

On a CPU, bfloat16 matmuls are fast only with hardware for them: Intel AMX (``amx_bf16``)
or AVX512-BF16 (``avx512_bf16``), where oneDNN's bf16 GEMM ran several times faster than
fp32 (600-1650 vs 70-320 GFLOP/s on a 2-vCPU AMX Xeon). Without either, bf16 is
converted in software and is slower than fp32 (measured on an AMD EPYC without them), so
"auto" takes float32 there. On a GPU "auto" is bfloat16.

``PLANARIA_CPU_DTYPE`` (float32 / bfloat16 / float16) overrides "auto" on CPUs for a
whole host or test run without changing any engine config; an explicit ``dtype`` in the
config always wins. The choice and why is ``DtypeChoice``; the engine's ready line, its
heartbeat and ``planaria status`` show it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

import torch

CPU_DTYPE_ENV = "PLANARIA_CPU_DTYPE"
FAST_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
_NAMES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # e.g. "auto: CPU has amx_bf16" / "config"

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty if unreadable."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _named(name: str, what: str) -> torch.dtype:
    if name not in _NAMES:
        raise ValueError(f"{what} must be auto or one of {', '.join(_NAMES)}, got {name!r}")
    return getattr(torch, name)


def choose_dtype(config_dtype: str | None, device: torch.device, flags: frozenset[str] | None = None,
                 environ: Mapping[str, str] = os.environ) -> DtypeChoice:
    """The dtype for ``config_dtype`` (None or "auto": decide here) on ``device``."""
    if config_dtype and config_dtype != "auto":
        return DtypeChoice(_named(config_dtype, "dtype"), "config")
    if device.type != "cpu":
        return DtypeChoice(torch.bfloat16, f"auto: {device.type}")
    forced = environ.get(CPU_DTYPE_ENV)
    if forced:
        return DtypeChoice(_named(forced, CPU_DTYPE_ENV), CPU_DTYPE_ENV)
    have = [f for f in FAST_BF16_FLAGS if f in (cpu_flags() if flags is None else flags)]
    if have:
        return DtypeChoice(torch.bfloat16, f"auto: CPU has {'+'.join(have)}")
    return DtypeChoice(torch.float32, "auto: CPU has no amx_bf16/avx512_bf16")
