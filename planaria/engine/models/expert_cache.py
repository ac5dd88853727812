"""A mixture-of-experts checkpoint's experts in the engine's layout and compute dtype, in
one file per (checkpoint, dtype) that every rank of the node memory-maps.

Why: an expert-parallel rank re-homes experts at every group switch (a scale-up, a
scale-down, and the re-form after a rank dies, where a survivor of two ranks suddenly needs
every expert). From the checkpoint that is a read and a cast of every byte (SmolLM2-MoE,
float32 on disk, bfloat16 in use: seconds on a busy 2-core host, all of it a stall of the
whole group); from this file it is nothing: each layer's experts are stored fused, ``w13``
``[E, 2I, H]`` (gate rows, then up rows) and ``w2`` ``[E, H, I]``, so a contiguous expert
range is a view of the mapped file, and the node's page cache holds one copy for all its
ranks. A joining rank's start-up skips the same work.

The file is ``<dir>/experts-<key>.safetensors``; ``key`` hashes the checkpoint's config,
its weight files' names, sizes, modification times and inodes, the dtype and the layout
version, so a changed checkpoint never meets an old file (the key is also stored in the
file and checked on open). It is built once per machine by the first engine that needs it,
under an exclusive lock (a concurrent engine waits, then maps it), written layer by layer
(memory: one layer's experts) to a temporary name and renamed, so a crash never leaves a
partial file under the real name; a build deletes all but the newest ``MAX_FILES`` files.
``dir``: ``$PLANARIA_EXPERT_CACHE_DIR`` (``planaria serve`` sets ``<state
dir>/expert-cache``), else ``experts`` in the planaria cache dir. The disk it takes is the
experts' size in the compute dtype (SmolLM2-MoE in bfloat16: 0.6 GB).
Because every rank maps every expert of the file, the ranks of a node also share each MoE
layer's experts out by load (elastic/shm_group.py; ``SparseMoE.node_w13``).
``PLANARIA_EXPERT_CACHE=0`` turns it off: experts are read from the checkpoint, and each
expert's owner computes its pairs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from planaria.engine.errors import ModelLoadError

LAYOUT_VERSION = "1"
MAX_FILES = 4  # cache files kept per directory (the newest); older ones go at the next build
DIR_ENV = "PLANARIA_EXPERT_CACHE_DIR"
SWITCH_ENV = "PLANARIA_EXPERT_CACHE"
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    if os.environ.get(DIR_ENV):
        return Path(os.environ[DIR_ENV])
    root = os.environ.get("PLANARIA_CACHE_DIR") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "planaria"
    return Path(root) / "experts"


def cache_key(model_dir: str | Path, dtype: torch.dtype) -> str:
    """Changes whenever the checkpoint's config or any weight file changes."""
    d = Path(model_dir)
    h = hashlib.sha256(f"layout {LAYOUT_VERSION} dtype {dtype}".encode())
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")) + sorted(d.glob("*.safetensors.index.json")):
        st = f.stat()
        h.update(f"{f.name} {st.st_size} {st.st_mtime_ns} {st.st_ino}".encode())
    return h.hexdigest()[:24]


def tensor_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.mlp.w13", f"layers.{layer}.mlp.w2"


class ExpertCache:
    """The mapped file: ``view(layer, start, end)`` -> (w13, w2) of experts [start, end)."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        try:
            self._file = safe_open(str(path), "pt")
        except Exception as exc:  # safetensors raises its own types for a bad file
            raise ModelLoadError(f"{path}: cannot open the expert cache: {exc}") from exc
        meta = self._file.metadata() or {}
        if meta.get("key") != key:
            raise ModelLoadError(f"{path}: built for another checkpoint (key {meta.get('key')!r}, want {key!r})")

    def view(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        w13, w2 = (self._file.get_tensor(n) for n in tensor_names(layer))
        return w13[start:end], w2[start:end]

    def contents_id(self) -> int:
        """A positive 60-bit number naming the file's contents (its key): what the ranks of a
        node compare before computing each other's experts."""
        return int(self.key[:15], 16) | 1


def open_or_build(model_dir: str | Path, dtype: torch.dtype, sparse_layers: list[int],
                  build_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> ExpertCache | None:
    """The cache for this checkpoint and dtype, built first if missing (``build_layer(i)``
    gives layer i's fused (w13, w2) of every expert, in ``dtype``); None when turned off or
    the dtype has no safetensors name."""
    if not enabled() or dtype not in _DTYPES or not sparse_layers:
        return None
    key = cache_key(model_dir, dtype)
    root = cache_dir()
    path = root / f"experts-{key}.safetensors"
    if not path.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".experts-{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder finishes first; then it is there
            if not path.is_file():
                _build(path, key, dtype, sparse_layers, build_layer)
                _prune(root, keep=path)
    return ExpertCache(path, key)


def _prune(root: Path, keep: Path, max_files: int = MAX_FILES) -> None:
    """Delete all but the newest ``max_files`` cache files (old checkpoints' and dtypes'). An
    engine still mapping a deleted one keeps its mapping: the data goes when it unmaps."""
    files = sorted(root.glob("experts-*.safetensors"), key=lambda f: f.stat().st_mtime, reverse=True)
    for old in [f for f in files if f != keep][max(0, max_files - 1):]:
        old.unlink(missing_ok=True)
        (root / f".{old.stem}.lock").unlink(missing_ok=True)


def _build(path: Path, key: str, dtype: torch.dtype, sparse_layers: list[int],
           build_layer: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Write the safetensors file layer by layer: the header needs every shape, so the first
    layer's shapes (all sparse layers share them) are taken from its build."""
    first = build_layer(sparse_layers[0])
    shapes = [tuple(t.shape) for t in first]
    elem = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"key": key, "layout": LAYOUT_VERSION}}
    offset = 0
    for i in sparse_layers:
        for name, shape in zip(tensor_names(i), shapes):
            size = elem
            for n in shape:
                size *= n
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            for i in sparse_layers:
                tensors = first if i == sparse_layers[0] else build_layer(i)
                for t, shape in zip(tensors, shapes):
                    if tuple(t.shape) != shape or t.dtype != dtype:
                        raise ModelLoadError(f"layer {i}: experts shaped {tuple(t.shape)} {t.dtype}, "
                                             f"the cache holds {shape} {dtype}")
                    out.write(t.contiguous().view(torch.uint8).numpy().data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
