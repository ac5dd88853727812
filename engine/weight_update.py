"""Loading new weights into a running engine (EngineCore.load_weights).

    read_weights(runner, dir)  reads the new checkpoint on the CPU and checks it fits the
                               model in place (same architecture, names and shapes); any
                               failure is a WeightLoadError and the old weights stay
    WeightUpdate.decide(...)   at a step boundary: "wait" | "swap"
    apply(runner, update)      copies the tensors into the existing parameters

Modes: "finish_old" stops admitting new requests, lets the running ones finish on the old
weights, then swaps and resumes; "continue_new" swaps at the next boundary and preempts
the running requests so their KV is recomputed with the new weights.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from engine.errors import EngineError, WeightLoadError

log = structlog.get_logger("planaria.engine.weights")

MODES = ("finish_old", "continue_new")


@dataclass
class WeightUpdate:
    model_dir: str
    version: str
    mode: str
    tensors: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)  # CPU, by parameter name
    requested_at_s: float = field(default_factory=time.monotonic)

    def decide(self, num_running: int, num_in_flight_batches: int) -> str:
        """"swap" when the mode's condition holds at this step boundary, else "wait"."""
        if num_in_flight_batches:
            return "wait"  # a batch still runs on the old weights
        if self.mode == "finish_old" and num_running:
            return "wait"
        return "swap"


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


def read_weights(runner, model_dir: str, version: str | None, mode: str) -> WeightUpdate:
    """The new checkpoint, read and checked against the model in place."""
    from engine.models.loader import load_hf_config, load_model, spec_from_config

    if mode not in MODES:
        raise WeightLoadError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    t0 = time.monotonic()
    try:
        spec = spec_from_config(load_hf_config(model_dir))
        if spec != runner.spec:
            raise WeightLoadError(f"{model_dir} is another architecture or size than the model being "
                                  f"served ({spec} vs {runner.spec}); the same architecture is required")
        model, _, _, num_bytes = load_model(model_dir, runner.dtype, torch.device("cpu"),
                                            spec.max_position_embeddings, _expert_range(runner.model))
        version = version or content_version(model_dir)
    except WeightLoadError:
        raise
    except (EngineError, OSError, RuntimeError, ValueError) as exc:
        raise WeightLoadError(f"cannot load weights from {model_dir}: {exc}") from exc
    new = dict(model.named_parameters())
    old = dict(runner.model.named_parameters())
    if set(new) != set(old):
        raise WeightLoadError(f"{model_dir}: parameter names differ: {sorted(set(new) ^ set(old))[:5]}")
    bad = [n for n, p in old.items() if p.shape != new[n].shape]
    if bad:
        raise WeightLoadError(f"{model_dir}: parameter shapes differ: {bad[:5]}")
    log.info("new weights read", model_dir=model_dir, version=version, mode=mode, bytes=num_bytes,
             read_s=round(time.monotonic() - t0, 3))
    return WeightUpdate(model_dir, version, mode, {n: t.detach() for n, t in new.items()})


def apply(runner, update: WeightUpdate) -> None:
    """Copy the new tensors into the model's parameters (in place: the KV cache, buffers and
    any captured graph stay valid)."""
    t0 = time.monotonic()
    with torch.no_grad():
        for name, p in runner.model.named_parameters():
            p.copy_(update.tensors[name])
    update.tensors.clear()
    log.info("weights swapped", version=update.version, mode=update.mode,
             swap_s=round(time.monotonic() - t0, 3),
             waited_s=round(time.monotonic() - update.requested_at_s, 3))
