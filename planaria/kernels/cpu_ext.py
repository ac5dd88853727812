"""Planaria's C++ CPU kernels (kernels/csrc/): built once at install, loaded if present.

``make venv`` runs ``python -m planaria.kernels.cpu_ext`` after installing, which compiles
csrc/*.cpp against the installed torch (g++ -O3 -march=native, no ninja, no pybind) into
``_ext/<tag>/planaria_cpu.so`` inside this package; the tag hashes the sources, the torch
version and the CPU's flags, so another torch or another host builds its own. Engines only
load it (``available()``), they never compile at start-up; where it is missing, failed to
build, or ``PLANARIA_CPU_KERNELS=0`` is set, the torch code in the kernels is used, which
is also the reference the C++ is tested against (tests/kernels/test_cpu_ext.py).

The ops: ``torch.ops.planaria.decode_attention`` (csrc/decode_attention.cpp), decode
attention read from the paged KV cache in place; ``torch.ops.planaria.fused_moe``
(csrc/fused_moe.cpp), the MoE expert MLP for small batches, streaming each expert's
weights once for all its tokens (AVX512-BF16's dot instruction where the CPU has it), and
its two halves for expert parallelism, ``fused_moe_pairs`` (each pair's output, unweighted)
and ``moe_combine`` (the weighted sum in k order, the same code as fused_moe's;
``moe_combine_routed`` finds each pair's row in a shared segment itself), and
``moe_share``, which shares a layer's experts out among the ranks of a node by load;
``torch.ops.planaria.rms_norm`` (csrc/rms_norm.cpp), RMSNorm in one op;
``torch.ops.planaria.argmax_rows`` (csrc/argmax.cpp), greedy sampling's argmax;
``torch.ops.planaria.skinny_linear`` (csrc/skinny_linear.cpp), linears at a few rows;
``torch.ops.planaria.invariant_linear`` (csrc/invariant_linear.cpp), bfloat16 linears whose
rows do not depend on each other's presence (the batch-invariant mode, kernels/linear.py);
``torch.ops.planaria.linear_argmax`` (csrc/lm_head_argmax.cpp), greedy tokens straight
from the lm_head, a vocab chunk at a time, and for an lm_head packed for oneDNN as chunks
(engine/models/packing.py) ``packed_linear_argmax`` and ``packed_linear_chunked`` (its
logits); ``torch.ops.planaria.packed_linear`` (csrc/skinny_linear.cpp), oneDNN's packed
linear under a name a compiled forward treats as opaque; ``shm_publish`` and
``shm_wait_all`` (csrc/shm_sync.cpp), the sequence flags of the shared-memory collectives of
expert-parallel ranks on one node (elastic/shm_group.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ENV = "PLANARIA_CPU_KERNELS"
SRC_DIR = Path(__file__).resolve().parent / "csrc"
EXT_DIR = Path(__file__).resolve().parent / "_ext"
_BUILD_RECIPE = "2: -ffast-math compile only"  # change it when build() changes
OPS = ("argmax_rows", "decode_attention", "fused_moe", "fused_moe_pairs", "invariant_linear", "linear_argmax",
       "moe_combine", "moe_combine_routed", "moe_share", "packed_linear", "packed_linear_argmax", "packed_linear_chunked", "rms_norm", "shm_publish",
       "shm_wait_all", "skinny_linear")
_state: dict[str, object] = {}
# PLANARIA_CPU_KERNELS, read once: ``available()`` runs a few hundred times per forward,
# and an os.environ lookup costs about a microsecond. Tests flip it (monkeypatch.setattr).
enabled: bool = os.environ.get(ENV, "1") != "0"


def cpu_flags() -> str:
    """/proc/cpuinfo's flags, sorted, space-separated ("" where unreadable)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def _sources() -> list[Path]:
    return sorted(SRC_DIR.glob("*.cpp"))


def tag() -> str:
    h = hashlib.sha256(_BUILD_RECIPE.encode())
    for src in sorted(SRC_DIR.glob("*.cpp")) + sorted(SRC_DIR.glob("*.h")):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    h.update(torch.__version__.encode() + b"\0" + cpu_flags().encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    return EXT_DIR / tag() / "planaria_cpu.so"


def build(verbose: bool = False) -> Path:
    """Compile csrc/*.cpp into library_path() (atomically: a half-written .so is never
    seen). Raises CalledProcessError with the compiler's output on failure."""
    from torch.utils import cpp_extension  # deferred: it pulls setuptools (~0.3 s); only a build needs it

    out = library_path()
    if out.is_file():
        return out
    cxx = os.environ.get("CXX", "g++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # -ffast-math when compiling only (vectorized exp and reductions; the kernels never see
    # an inf or NaN they must keep), never when linking: linked in, it adds crtfastmath's
    # constructor, which sets flush-to-zero for the whole process on load (subnormals
    # become 0 everywhere: tests/kernels/test_cpu_ext.py checks the .so leaves them alone)
    compile_cmd = [cxx, "-c", "-fPIC", "-O3", "-march=native", "-ffast-math", "-std=c++17", "-fopenmp",
                   f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_API_INCLUDE_EXTENSION_H=0"]
    compile_cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        objs, procs = [], []
        for src in _sources():  # one compiler per source, side by side
            obj = str(Path(tmp) / (src.stem + ".o"))
            objs.append(obj)
            cmd = compile_cmd + [str(src), "-o", obj]
            if verbose:
                print(" ".join(cmd), flush=True)
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for p, cmd in zip(procs, objs):
            text = p.communicate()[0]
            if p.returncode:
                raise subprocess.CalledProcessError(p.returncode, cmd, output=text, stderr=text)
        tmp_so = Path(tmp) / out.name
        link = [cxx, "-shared", "-fopenmp", *objs, "-o", str(tmp_so)]
        link += [f"-L{p}" for p in cpp_extension.library_paths()]
        link += [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
        link += ["-lc10", "-ltorch_cpu", "-ltorch"]
        subprocess.run(link, check=True, capture_output=not verbose, text=True)
        os.replace(tmp_so, out)
    for old in EXT_DIR.iterdir():  # builds for other sources / torch / hosts
        if old.is_dir() and old.name != out.parent.name:
            shutil.rmtree(old, ignore_errors=True)
    return out


def available() -> bool:
    """Loads the built library once; False (the torch code is used) when it is missing,
    cannot be loaded, or PLANARIA_CPU_KERNELS=0 (``enabled``)."""
    if not enabled:
        return False
    ok = _state.get("ok")
    if ok is None:
        ok = False
        path = library_path()
        if path.is_file():
            try:
                torch.ops.load_library(str(path))
                ok = all(hasattr(torch.ops.planaria, op) for op in OPS)
            except (OSError, RuntimeError) as exc:
                _state["error"] = f"{path}: {exc}"
        else:
            _state["error"] = f"not built ({path} missing): python -m planaria.kernels.cpu_ext"
        _state["ok"] = ok
    return ok


def status() -> str:
    """One line for logs: loaded, or why not."""
    if not enabled:
        return f"off ({ENV}=0)"
    return "loaded" if available() else str(_state.get("error"))


def main() -> int:
    try:
        path = build(verbose="-v" in sys.argv)
    except (subprocess.CalledProcessError, OSError) as exc:
        out = getattr(exc, "stderr", "") or ""
        print(f"planaria: C++ CPU kernels not built ({exc}); the torch code will be used\n{out[-4000:]}",
              file=sys.stderr)
        return 0 if "--check" not in sys.argv else 1
    print(f"planaria: C++ CPU kernels at {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
