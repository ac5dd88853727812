"""Loading new weights into a running engine (EngineCore.load_weights).

    check_request(runner, dir, mode)    on the caller's thread, in milliseconds: the mode, the
                                        directory, its config.json naming the architecture and
                                        sizes being served. WeightLoadError, nothing started.
    WeightLoad.start(runner, dir, ...)  reads the checkpoint on a thread of its own: every
                                        tensor onto the CPU, checked against the model in
                                        place (names, shapes), the content version hashed;
                                        then ``on_read()`` (the engine process wakes its loop)
    WeightLoad.decide(...)              at a step boundary: "wait" | "swap"
    apply(runner, load)                 checks the fit again, then ModelRunner.replace_weights
                                        copies the tensors into the existing parameters

The busy loop never reads a checkpoint: it only looks at ``load.read_done`` at each step
boundary, and swaps (a copy into the parameters in place) once the read is done and the
mode allows. A failed read leaves the old weights serving and is reported in
``describe()`` (the ``weight_status`` utility call).

Modes: "finish_old" keeps serving while the new checkpoint is read; once it is read, no
new request is admitted, the running ones finish on the old weights, then the swap and
admission resumes. "hand_over" is "finish_old" where other engines still serve the old
weights: once the checkpoint is read, the engine offers its requests (STATUS
``handover_pending``); each frontend moves them, with their KV (engine/kv_segment.py), to an
engine on the same weight version with no load of its own in progress, and the swap
follows at once; requests no frontend takes finish here first. "continue_new" swaps at the first boundary after the read and preempts
the running requests, so their KV is recomputed with the new weights.

States of a load: reading -> ready -> applied, or reading|ready -> failed.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import time
from pathlib import Path
from typing import Callable

import structlog
import torch

from planaria.engine.errors import EngineError, WeightLoadError

log = structlog.get_logger("planaria.engine.weights")

MODES = ("finish_old", "hand_over", "continue_new")
IN_PROGRESS = "a weight load is already in progress"  # WeightLoadInProgressError: code "conflict"
_load_ids = itertools.count(1)


def content_version(model_dir: str) -> str:
    """A version id from the checkpoint's bytes (config.json and weight files)."""
    h = hashlib.sha256()
    d = Path(model_dir)
    for f in [d / "config.json", *sorted(d.glob("*.safetensors"))]:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()[:16]


def _expert_range(model) -> tuple[int, int] | None:
    for layer in getattr(model, "layers", []):
        start = getattr(layer.mlp, "expert_start", None)
        if start is not None:
            return start, layer.mlp.expert_end
    return None


def check_request(runner, model_dir: str, mode: str) -> None:
    """The checks that need no tensor read: a bad mode, a missing directory, another
    architecture or size are refused at once."""
    from planaria.engine.models.loader import load_hf_config, spec_from_config

    if mode not in MODES:
        raise WeightLoadError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if not isinstance(model_dir, str) or not model_dir:
        raise WeightLoadError(f"model_dir must be a directory path, got {model_dir!r}")
    d = Path(model_dir)
    if not d.is_dir():
        raise WeightLoadError(f"{model_dir} is not a directory")
    try:
        spec = spec_from_config(load_hf_config(model_dir))
    except EngineError as exc:
        raise WeightLoadError(f"cannot use {model_dir}: {exc}") from exc
    if spec != runner.spec:
        raise WeightLoadError(f"{model_dir} is another architecture or size than the model being "
                              f"served ({spec} vs {runner.spec}); the same architecture is required")
    if not any(d.glob("*.safetensors")):
        raise WeightLoadError(f"{model_dir}: no .safetensors weights found")


def read_weights(runner, model_dir: str, expert_range) -> tuple[dict[str, torch.Tensor], int]:
    """The new checkpoint's tensors on the CPU (by parameter name) and the bytes read,
    checked against the model in place. Reads the runner's spec, dtype and parameter
    shapes only, so it may run beside the busy loop."""
    from planaria.engine.models.loader import load_hf_config, load_model, spec_from_config

    try:
        spec = spec_from_config(load_hf_config(model_dir))
        if spec != runner.spec:
            raise WeightLoadError(f"{model_dir} is another architecture or size than the model being "
                                  f"served ({spec} vs {runner.spec}); the same architecture is required")
        model, _, _, num_bytes = load_model(model_dir, runner.dtype, torch.device("cpu"),
                                            spec.max_position_embeddings, expert_range)
    except WeightLoadError:
        raise
    except (EngineError, OSError, RuntimeError, ValueError) as exc:
        raise WeightLoadError(f"cannot load weights from {model_dir}: {exc}") from exc
    new = {n: p.detach() for n, p in model.named_parameters()}
    _check_fits(runner, new, model_dir)
    return new, num_bytes


def _check_fits(runner, tensors: dict[str, torch.Tensor], model_dir: str) -> None:
    old = dict(runner.model.named_parameters())
    if set(tensors) != set(old):
        raise WeightLoadError(f"{model_dir}: parameter names differ: {sorted(set(tensors) ^ set(old))[:5]}")
    bad = [n for n, p in old.items() if p.shape != tensors[n].shape]
    if bad:
        raise WeightLoadError(f"{model_dir}: parameter shapes differ: "
                              f"{[(n, tuple(tensors[n].shape), tuple(old[n].shape)) for n in bad[:3]]}")


class WeightLoad:
    """One load: read on its own thread, swapped by the busy loop at a step boundary."""

    def __init__(self, model_dir: str, version: str | None, mode: str) -> None:
        self.load_id = f"w{next(_load_ids)}-{time.time_ns() % 10**9:09d}"
        self.model_dir = model_dir
        self.version = version  # the requested one, or the content hash once read
        self.mode = mode
        self.offered = False  # "hand_over": the requests were offered to the frontends (EngineCore)
        self.state = "reading"
        self.error: str | None = None
        self.tensors: dict[str, torch.Tensor] = {}
        self.expert_range: tuple[int, int] | None = None  # the local experts read (expert parallelism)
        self.num_bytes = 0
        self.requested_at_s = time.monotonic()
        self.read_s: float | None = None
        self._read_done = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, runner, model_dir: str, version: str | None, mode: str,
              on_read: Callable[[], None] | None = None) -> "WeightLoad":
        load = cls(model_dir, version, mode)
        load.expert_range = _expert_range(runner.model)
        load._thread = threading.Thread(target=load._read, args=(runner, on_read),
                                        name="weight-read", daemon=True)
        load._thread.start()
        return load

    def _read(self, runner, on_read) -> None:
        t0 = time.monotonic()
        try:
            self.tensors, self.num_bytes = read_weights(runner, self.model_dir, self.expert_range)
            self.version = self.version or content_version(self.model_dir)
            self.state = "ready"
        except Exception as exc:  # any failure: the old weights serve on
            self.error = str(exc) if isinstance(exc, WeightLoadError) else (
                f"cannot load weights from {self.model_dir}: {type(exc).__name__}: {exc}")
            self.tensors = {}
            self.state = "failed"
        self.read_s = time.monotonic() - t0
        if self.error is None:
            log.info("new weights read", model_dir=self.model_dir, version=self.version, mode=self.mode,
                     bytes=self.num_bytes, read_s=round(self.read_s, 3))
        else:
            log.warning("weight load failed; the old weights serve on", model_dir=self.model_dir,
                        error=self.error)
        self._read_done.set()  # after every field above is written
        if on_read is not None:
            try:
                on_read()
            except Exception:  # waking the loop is best effort: the next step sees it too
                log.exception("weight load wake-up failed")

    @property
    def read_done(self) -> bool:
        return self._read_done.is_set()

    def wait_read(self, timeout_s: float | None = None) -> bool:
        """Until the read is done (tests, the offline API); False at the timeout."""
        return self._read_done.wait(timeout_s)

    def decide(self, num_running: int, num_in_flight_batches: int) -> str:
        """"swap" when the read is done and the mode's condition holds at this step
        boundary, else "wait"."""
        if not self.read_done or num_in_flight_batches:
            return "wait"  # still reading, or a batch still runs on the old weights
        if self.mode != "continue_new" and num_running:
            return "wait"
        return "swap"

    def fail(self, error: str) -> None:
        self.state, self.error, self.tensors = "failed", error, {}
        log.warning("weight load failed; the old weights serve on", model_dir=self.model_dir, error=error)

    def describe(self) -> dict:
        return {"load_id": self.load_id, "model_dir": self.model_dir, "version": self.version,
                "mode": self.mode, "state": self.state, "error": self.error,
                "read_s": None if self.read_s is None else round(self.read_s, 3)}


def apply(runner, load: WeightLoad) -> None:
    """Copy the new tensors into the model's parameters (in place: the KV cache, buffers and
    any captured graph stay valid). All or nothing: the fit is checked again first (experts
    may have been re-homed while the checkpoint was read); WeightLoadError if it no longer fits."""
    t0 = time.monotonic()
    if _expert_range(runner.model) != load.expert_range:
        raise WeightLoadError(f"experts were re-homed while {load.model_dir} was read "
                              f"({load.expert_range} -> {_expert_range(runner.model)}); load it again")
    _check_fits(runner, load.tensors, load.model_dir)
    runner.replace_weights(load.tensors, load.model_dir)  # expert re-homing reads from there from now on
    load.tensors = {}
    load.state = "applied"
    log.info("weights swapped", version=load.version, mode=load.mode,
             swap_s=round(time.monotonic() - t0, 3),
             waited_s=round(time.monotonic() - load.requested_at_s, 3))
