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
# With FAULT_INJECTION only: comma-separated token ids; an engine that schedules the first
# chunk of a prompt holding them in a row dies at once, as from a native crash (a poison
# request: bench/mttr.py). Ignored without FAULT_INJECTION.
POISON_TOKENS = "PLANARIA_POISON_TOKENS"


@dataclass(frozen=True)
class Envs:
    fault_injection: bool = False
    gc_freeze: bool = True
    poison_tokens: tuple[int, ...] = ()


def read(environ: Mapping[str, str] = os.environ) -> Envs:
    fault_injection = environ.get(FAULT_INJECTION) == "1"
    poison: tuple[int, ...] = ()
    if fault_injection and environ.get(POISON_TOKENS):
        try:
            poison = tuple(int(t) for t in environ[POISON_TOKENS].split(","))
        except ValueError:
            raise ValueError(f"{POISON_TOKENS} must be comma-separated token ids, "
                             f"got {environ[POISON_TOKENS]!r}") from None
    return Envs(fault_injection=fault_injection, gc_freeze=environ.get(GC_FREEZE, "1") != "0",
                poison_tokens=poison)


_cached: Envs | None = None


def get() -> Envs:
    global _cached
    if _cached is None:
        _cached = read()
    return _cached
