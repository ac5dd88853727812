"""Load a sentence-transformers / BERT directory into BertEncoder plus its pooling setup.

Weights: *.safetensors, else pytorch_model.bin (torch.load with weights_only=True). The
pooling mode and normalisation come from modules.json (sentence-transformers' Pooling and
Normalize modules) and the Pooling module's config.json; the longest input from
sentence_bert_config.json (max_seq_length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from planaria.engine.errors import ModelLoadError, UnsupportedModelError
from planaria.engine.pooling.bert import BertEncoder, BertSpec, hf_state_dict

POOLING_ARCHITECTURES = ("BertModel",)
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "mean"  # "mean" | "cls" | "max"
    normalize: bool = True
    max_seq_length: int | None = None


def read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from exc


def is_bert_config(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return any(a in POOLING_ARCHITECTURES for a in archs) or (not archs and cfg.get("model_type") == "bert")


def pooling_config(model_dir: Path) -> PoolingConfig:
    """sentence-transformers' modules.json; without one: mean pooling, normalised."""
    sbert = read_json(model_dir / "sentence_bert_config.json") or {}
    max_len = sbert.get("max_seq_length")
    modules = read_json(model_dir / "modules.json")
    if not modules:
        return PoolingConfig(max_seq_length=max_len)
    mode, normalize = "mean", False
    for m in modules:
        kind = m.get("type", "")
        if kind.endswith(".Pooling"):
            pc = read_json(model_dir / m.get("path", "") / "config.json") or {}
            chosen = [name for key, name in _MODES.items() if pc.get(key)]
            if len(chosen) != 1 or any(pc.get(k) for k in pc if k.startswith("pooling_mode") and k not in _MODES):
                raise UnsupportedModelError(f"pooling config {pc} is not supported (one of mean, cls, max)")
            mode = chosen[0]
        elif kind.endswith(".Normalize"):
            normalize = True
        elif not kind.endswith(".Transformer"):
            raise UnsupportedModelError(f"sentence-transformers module {kind!r} is not supported")
    return PoolingConfig(mode, normalize, max_len)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for name in fh.keys():
                    state[name] = fh.get_tensor(name)
    elif (model_dir / "pytorch_model.bin").is_file():
        state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{model_dir}: no .safetensors or pytorch_model.bin weights found")
    # BertFor* checkpoints prefix the encoder with "bert."
    return {(n[5:] if n.startswith("bert.") else n): t for n, t in state.items()}


def load_bert(model_dir: str, dtype: torch.dtype, device: torch.device):
    """Returns (model, spec, pooling config, bytes loaded)."""
    d = Path(model_dir)
    cfg = read_json(d / "config.json")
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    if not is_bert_config(cfg):
        raise UnsupportedModelError(f"pooling runner supports {', '.join(POOLING_ARCHITECTURES)}; "
                                    f"got {cfg.get('architectures') or cfg.get('model_type')!r}")
    spec = BertSpec.from_config(cfg)
    raw = _read_weights(d)

    def read(name: str) -> torch.Tensor:
        if name not in raw:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        return raw[name].to(dtype)

    with torch.device("meta"):
        model = BertEncoder(spec)
    state = hf_state_dict(read, spec)
    model.load_state_dict(state, strict=True, assign=True)
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    return model.to(device).eval(), spec, pooling_config(d), num_bytes
