"""PLANARIA_* environment variables, read once into a frozen object.

    from planaria.engine import envs
    envs.get().fault_injection

``get()`` reads the environment on its first call (engine start) and returns the same
object after that, so a busy loop never looks an environment variable up, and a setting
cannot change under a running engine. Tests pass their own mapping to ``read``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

FAULT_INJECTION = "PLANARIA_FAULT_INJECTION"  # "1": the fault_inject utility call works (chaos tests)
GC_FREEZE = "PLANARIA_GC_FREEZE"  # "0": skip gc.freeze() after the engine process starts


@dataclass(frozen=True)
class Envs:
    fault_injection: bool = False
    gc_freeze: bool = True


def read(environ: Mapping[str, str] = os.environ) -> Envs:
    return Envs(fault_injection=environ.get(FAULT_INJECTION) == "1",
                gc_freeze=environ.get(GC_FREEZE, "1") != "0")


_cached: Envs | None = None


def get() -> Envs:
    global _cached
    if _cached is None:
        _cached = read()
    return _cached
