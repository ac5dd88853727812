"""Load a Hugging Face model directory (config.json + safetensors) into DecoderModel.

transformers is used for the config only; weights are read tensor by tensor from the
safetensors files (sharded checkpoints via model.safetensors.index.json). An expert-
parallel rank passes ``expert_range`` and reads only its own experts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.models.decoder import DecoderModel, ModelSpec
from kernels.rotary import RotaryEmbedding

SUPPORTED = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


def load_hf_config(model_dir: str):
    if not (Path(model_dir) / "config.json").is_file():
        raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_dir)
    except Exception as exc:  # transformers raises many types for bad configs
        raise ModelLoadError(f"{model_dir}: cannot read config.json: {exc}") from exc


def spec_from_config(cfg) -> ModelSpec:
    archs = getattr(cfg, "architectures", None) or []
    arch = next((SUPPORTED[a] for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise UnsupportedModelError(
            f"unsupported architecture {archs or cfg.model_type!r}; supported: {', '.join(SUPPORTED)}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kw = dict(
        arch=arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim, intermediate_size=getattr(cfg, "intermediate_size", 0),
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
    if arch == "llama" and (getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)):
        raise UnsupportedModelError("Llama with attention_bias/mlp_bias is not supported")
    if arch == "qwen2":
        kw["qkv_bias"] = True
    if arch in ("qwen3", "qwen3_moe"):
        kw["qk_norm"] = True
        kw["qkv_bias"] = bool(getattr(cfg, "attention_bias", False))
    if arch == "qwen3_moe":
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        dense = set(getattr(cfg, "mlp_only_layers", []) or [])
        kw.update(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                  moe_intermediate_size=cfg.moe_intermediate_size,
                  renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
                  sparse_layers=tuple(i for i in range(cfg.num_hidden_layers)
                                      if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0))
    if arch == "mixtral":
        kw.update(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                  moe_intermediate_size=cfg.intermediate_size, renormalize=True,
                  sparse_layers=tuple(range(cfg.num_hidden_layers)))
    return ModelSpec(**kw)


def sliding_window_limit(cfg) -> int | None:
    """The longest context the checkpoint can attend to without sliding-window support."""
    if getattr(cfg, "use_sliding_window", False) or getattr(cfg, "model_type", "") == "mixtral":
        win = getattr(cfg, "sliding_window", None)
        return int(win) if win else None
    return None


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / f for name, f in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no .safetensors weights found")
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                out[name] = f
    return out


class _Reader:
    def __init__(self, model_dir: Path) -> None:
        self.where = _tensor_files(model_dir)
        self._open: dict[Path, object] = {}
        self.num_bytes = 0

    def has(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.where:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        f = self.where[name]
        if f not in self._open:
            self._open[f] = safe_open(str(f), "pt")
        t = self._open[f].get_tensor(name).to(dtype)
        self.num_bytes += t.numel() * t.element_size()
        return t


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               expert_range: tuple[int, int] | None = None, progress=None):
    """Returns (model, hf_config, spec, bytes_loaded)."""
    cfg = load_hf_config(model_dir)
    spec = spec_from_config(cfg)
    if expert_range is not None and not spec.is_moe:
        raise UnsupportedModelError("expert parallelism needs a mixture-of-experts model")
    rotary = RotaryEmbedding(cfg, max_positions, dtype)  # computed, not loaded
    with torch.device("meta"):  # shapes only: no memory, no init; every parameter is loaded below
        model = DecoderModel(spec, rotary, dtype, expert_range)
    rd = _Reader(Path(model_dir))
    state: dict[str, torch.Tensor] = {}

    state["embed.weight"] = rd.get("model.embed_tokens.weight", dtype)
    state["norm.weight"] = rd.get("model.norm.weight", dtype)
    if not spec.tie_word_embeddings:
        state["lm_head.weight"] = rd.get("lm_head.weight", dtype)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        o = f"layers.{i}."
        state[o + "input_norm.weight"] = rd.get(p + "input_layernorm.weight", dtype)
        state[o + "post_norm.weight"] = rd.get(p + "post_attention_layernorm.weight", dtype)
        state[o + "attn.qkv.weight"] = torch.cat([rd.get(p + f"self_attn.{n}_proj.weight", dtype) for n in "qkv"])
        if spec.qkv_bias:
            state[o + "attn.qkv.bias"] = torch.cat([rd.get(p + f"self_attn.{n}_proj.bias", dtype) for n in "qkv"])
        state[o + "attn.o_proj.weight"] = rd.get(p + "self_attn.o_proj.weight", dtype)
        if spec.qk_norm:
            state[o + "attn.q_norm.weight"] = rd.get(p + "self_attn.q_norm.weight", dtype)
            state[o + "attn.k_norm.weight"] = rd.get(p + "self_attn.k_norm.weight", dtype)
        if i in spec.sparse_layers:
            state.update(_load_experts(rd, spec, p, o, dtype, layer.mlp.expert_start, layer.mlp.expert_end))
        else:
            state[o + "mlp.gate_up.weight"] = torch.cat(
                [rd.get(p + "mlp.gate_proj.weight", dtype), rd.get(p + "mlp.up_proj.weight", dtype)])
            state[o + "mlp.down.weight"] = rd.get(p + "mlp.down_proj.weight", dtype)
        if progress:
            progress(i + 1, spec.num_layers)
    model.load_state_dict(state, strict=False, assign=True)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ModelLoadError(f"parameters not loaded from the checkpoint: {missing[:5]}")
    model = model.to(device).eval()
    return model, cfg, spec, rd.num_bytes


def _load_experts(rd: _Reader, spec: ModelSpec, p: str, o: str, dtype, start: int, end: int):
    if spec.arch == "mixtral":
        base, gate, up, down = p + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        base, gate, up, down = p + "mlp.", "gate_proj", "up_proj", "down_proj"
    out = {o + "mlp.router.weight": rd.get(base + "gate.weight", dtype)}
    if rd.has(base + "experts.gate_up_proj"):  # fused layout [E, 2I, H] / [E, H, I]
        out[o + "mlp.w13"] = rd.get(base + "experts.gate_up_proj", dtype)[start:end].contiguous()
        out[o + "mlp.w2"] = rd.get(base + "experts.down_proj", dtype)[start:end].contiguous()
        return out
    w13, w2 = [], []
    for e in range(start, end):
        ep = f"{base}experts.{e}."
        w13.append(torch.cat([rd.get(ep + f"{gate}.weight", dtype), rd.get(ep + f"{up}.weight", dtype)]))
        w2.append(rd.get(ep + f"{down}.weight", dtype))
    out[o + "mlp.w13"] = torch.stack(w13)
    out[o + "mlp.w2"] = torch.stack(w2)
    return out


def load_expert_weights(model, model_dir: str, spec: ModelSpec, dtype, device, expert_range: tuple[int, int]) -> int:
    """Replace every MoE layer's local experts with [start, end) read from the checkpoint."""
    start, end = expert_range
    rd = _Reader(Path(model_dir))
    for i, layer in enumerate(model.layers):
        if i not in spec.sparse_layers:
            continue
        p, o = f"model.layers.{i}.", f"layers.{i}."
        st = _load_experts(rd, spec, p, o, dtype, start, end)
        moe = layer.mlp
        moe.w13 = torch.nn.Parameter(st[o + "mlp.w13"].to(device), requires_grad=False)
        moe.w2 = torch.nn.Parameter(st[o + "mlp.w2"].to(device), requires_grad=False)
        moe.expert_start, moe.expert_end = start, end
    return rd.num_bytes


def model_fingerprint(model_dir: str) -> str:
    """Stable id of a checkpoint: config plus weight file names and sizes."""
    import hashlib

    h = hashlib.sha256()
    d = Path(model_dir)
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(os.path.getsize(f)).encode())
    return h.hexdigest()[:16]
