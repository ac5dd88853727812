"""The engine's dtype choice: "auto" is bfloat16 where the CPU has AMX or AVX512-BF16 and
on GPUs, float32 on other CPUs; PLANARIA_CPU_DTYPE and an explicit dtype override it."""

from __future__ import annotations

import pytest
import torch

from planaria.engine.dtype import CPU_DTYPE_ENV, choose_dtype, cpu_flags

CPU = torch.device("cpu")
AMX = frozenset({"avx512f", "amx_tile", "amx_bf16", "amx_int8"})
ZEN4 = frozenset({"avx512f", "avx512_bf16"})
EPYC_ZEN2 = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("flags, want, why", [
    (AMX, torch.bfloat16, "auto: CPU has amx_bf16"),
    (ZEN4, torch.bfloat16, "auto: CPU has avx512_bf16"),
    (EPYC_ZEN2, torch.float32, "auto: CPU has no amx_bf16/avx512_bf16"),
    (frozenset(), torch.float32, "auto: CPU has no amx_bf16/avx512_bf16"),
])
@pytest.mark.parametrize("config_dtype", [None, "auto"])
def test_auto_follows_the_cpu(flags, want, why, config_dtype):
    choice = choose_dtype(config_dtype, CPU, flags=flags, environ={})
    assert (choice.dtype, choice.reason) == (want, why)


def test_gpu_is_bfloat16_and_explicit_dtype_wins():
    assert choose_dtype(None, torch.device("cuda"), flags=frozenset(), environ={}).dtype is torch.bfloat16
    choice = choose_dtype("float32", CPU, flags=AMX, environ={CPU_DTYPE_ENV: "bfloat16"})
    assert (choice.dtype, choice.reason, choice.name) == (torch.float32, "config", "float32")


def test_environment_overrides_auto_on_cpu_only():
    assert choose_dtype(None, CPU, flags=AMX, environ={CPU_DTYPE_ENV: "float32"}).dtype is torch.float32
    assert choose_dtype("auto", CPU, flags=EPYC_ZEN2, environ={CPU_DTYPE_ENV: "bfloat16"}).dtype is torch.bfloat16
    assert choose_dtype(None, torch.device("cuda"), environ={CPU_DTYPE_ENV: "float32"}).dtype is torch.bfloat16


@pytest.mark.parametrize("bad", ["fp32", "int8", "float64"])
def test_unknown_names_are_refused(bad):
    with pytest.raises(ValueError, match="auto or one of float32, bfloat16, float16"):
        choose_dtype(bad, CPU, environ={})
    with pytest.raises(ValueError, match=CPU_DTYPE_ENV):
        choose_dtype(None, CPU, environ={CPU_DTYPE_ENV: bad})


def test_cpu_flags_reads_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu sse2 amx_bf16 avx512_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(str(x86)) == {"fpu", "sse2", "amx_bf16", "avx512_bf16"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 sve\n")
    assert cpu_flags(str(arm)) == {"fp", "asimd", "bf16", "sve"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()
