"""Load a Hugging Face model directory (config.json + safetensors) into DecoderModel.

transformers is used for the config only; weights are read tensor by tensor from the
memory-mapped safetensors files (sharded checkpoints via model.safetensors.index.json).
The model is built on the meta device (no memory, no random init) and every parameter is
then filled from its plan: a list of checkpoint tensors and the region of the parameter
each one fills (fused qkv, gate/up and stacked experts are copied once, straight into the
parameter on its device; a whole tensor on the CPU is used in place, no copy). A tensor
the checkpoint lacks, or one of the wrong shape, is a ModelLoadError naming it. An
expert-parallel rank passes ``expert_range`` and reads only its own experts.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from planaria.engine.errors import ModelLoadError, UnsupportedModelError
from planaria.engine.models import expert_cache
from planaria.engine.models.decoder import DecoderModel, ModelSpec
from planaria.engine.models.rope import rotary_from_config

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
    # deferred: transformers is heavy (seconds); importing the engine must not pay it
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
    """Checkpoint tensors by name, as views on the memory-mapped safetensors files (safe_open
    maps each file once; get_tensor copies nothing)."""

    def __init__(self, model_dir: Path) -> None:
        self.where = _tensor_files(model_dir)
        self._open: dict[Path, object] = {}
        self.num_bytes = 0  # bytes of the parameters filled, in the model's dtype

    def has(self, name: str) -> bool:
        return name in self.where

    def view(self, piece: Piece) -> torch.Tensor:
        name = piece.name
        if name not in self.where:
            raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
        f = self.where[name]
        if f not in self._open:
            try:
                self._open[f] = safe_open(str(f), "pt")
            except Exception as exc:  # safetensors raises its own error types for bad files
                raise ModelLoadError(f"{f}: cannot open safetensors file: {exc}") from exc
        t = self._open[f].get_tensor(name)
        return t[piece.src] if piece.src else t


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor (``src``: an index into it) and the region of the parameter it
    fills (``dst``: an index into the parameter; () is the whole of it)."""

    name: str
    src: tuple = ()
    dst: tuple = ()


def _rows(names: list[str], sizes: list[int]) -> list[Piece]:
    """Checkpoint tensors stacked along dim 0 into one fused parameter (qkv, gate/up)."""
    out, at = [], 0
    for name, n in zip(names, sizes):
        out.append(Piece(name, dst=(slice(at, at + n),)))
        at += n
    return out


def _expert_plan(rd: _Reader, spec: ModelSpec, i: int, start: int, end: int) -> dict[str, list[Piece]]:
    """w13 [E_local, 2I, H] (gate rows, then up rows) and w2 [E_local, H, I] of experts [start, end)."""
    p, o = f"model.layers.{i}.", f"layers.{i}."
    if spec.arch == "mixtral":
        base, gate, up, down = p + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        base, gate, up, down = p + "mlp.", "gate_proj", "up_proj", "down_proj"
    if rd.has(base + "experts.gate_up_proj"):  # fused layout [E, 2I, H] / [E, H, I]
        return {o + "mlp.w13": [Piece(base + "experts.gate_up_proj", src=(slice(start, end),))],
                o + "mlp.w2": [Piece(base + "experts.down_proj", src=(slice(start, end),))]}
    inter = spec.moe_intermediate_size
    w13, w2 = [], []
    for j, e in enumerate(range(start, end)):
        ep = f"{base}experts.{e}."
        w13 += [Piece(ep + f"{gate}.weight", dst=(j, slice(0, inter))),
                Piece(ep + f"{up}.weight", dst=(j, slice(inter, 2 * inter)))]
        w2.append(Piece(ep + f"{down}.weight", dst=(j,)))
    return {o + "mlp.w13": w13, o + "mlp.w2": w2}


def _layer_plan(rd: _Reader, spec: ModelSpec, i: int, expert_range: tuple[int, int]) -> dict[str, list[Piece]]:
    p, o = f"model.layers.{i}.", f"layers.{i}."
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    attn = p + "self_attn."
    plan = {
        o + "input_norm.weight": [Piece(p + "input_layernorm.weight")],
        o + "post_norm.weight": [Piece(p + "post_attention_layernorm.weight")],
        o + "attn.qkv.weight": _rows([attn + f"{n}_proj.weight" for n in "qkv"], [q, kv, kv]),
        o + "attn.o_proj.weight": [Piece(attn + "o_proj.weight")],
    }
    if spec.qkv_bias:
        plan[o + "attn.qkv.bias"] = _rows([attn + f"{n}_proj.bias" for n in "qkv"], [q, kv, kv])
    if spec.qk_norm:
        plan[o + "attn.q_norm.weight"] = [Piece(attn + "q_norm.weight")]
        plan[o + "attn.k_norm.weight"] = [Piece(attn + "k_norm.weight")]
    if i in spec.sparse_layers:
        router = p + ("block_sparse_moe." if spec.arch == "mixtral" else "mlp.") + "gate.weight"
        plan[o + "mlp.router.weight"] = [Piece(router)]
        plan.update(_expert_plan(rd, spec, i, *expert_range))
    else:
        inter = spec.intermediate_size
        plan[o + "mlp.gate_up.weight"] = _rows([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [inter, inter])
        plan[o + "mlp.down.weight"] = [Piece(p + "mlp.down_proj.weight")]
    return plan


def _materialize(rd: _Reader, name: str, like: torch.Tensor, pieces: list[Piece],
                 dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Parameter ``name`` (shaped like ``like``) from its pieces. A whole tensor already in
    place (CPU, same dtype, contiguous) is used as is: the mapped file, no copy. Otherwise
    the parameter is allocated once and each piece copied (and cast) into its region: one
    copy per byte, straight to ``device``. A shape that does not fit is an error, never a
    broadcast."""
    shape = tuple(like.shape)
    if len(pieces) == 1 and pieces[0].dst == ():
        t = rd.view(pieces[0])
        if tuple(t.shape) != shape:
            raise ModelLoadError(f"{pieces[0].name}: shape {tuple(t.shape)} does not fit {name} {shape}")
        if t.device != device or t.dtype != dtype or not t.is_contiguous():
            t = t.to(device=device, dtype=dtype, memory_format=torch.contiguous_format, copy=True)
        rd.num_bytes += t.numel() * t.element_size()
        return t
    out = torch.empty(shape, dtype=dtype, device=device)
    filled = 0
    for piece in pieces:
        src, region = rd.view(piece), out[piece.dst]
        if src.shape != region.shape:
            raise ModelLoadError(f"{piece.name}: shape {tuple(src.shape)} does not fit its part of "
                                 f"{name} ({tuple(region.shape)})")
        region.copy_(src)
        filled += src.numel()
    if filled != out.numel():  # a plan bug, never a checkpoint's: refuse rather than serve garbage
        raise ModelLoadError(f"{name}: {filled} of {out.numel()} elements filled from the checkpoint")
    rd.num_bytes += out.numel() * out.element_size()
    return out


def _assign(model: torch.nn.Module, name: str, t: torch.Tensor) -> None:
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    setattr(mod, leaf, torch.nn.Parameter(t, requires_grad=False))


def load_model(model_dir: str, dtype: torch.dtype, device: torch.device, max_positions: int,
               expert_range: tuple[int, int] | None = None, progress=None, hf_config=None,
               timings: dict | None = None, batch_invariant: bool = False):
    """Returns (model, hf_config, spec, bytes_loaded). ``hf_config``: the config already
    read (else read here); ``timings`` gets build_s, read_s (and config_s if read here);
    ``batch_invariant``: the model's kernels (engine/models/decoder.py)."""
    t0 = time.monotonic()
    cfg = hf_config if hf_config is not None else load_hf_config(model_dir)
    spec = spec_from_config(cfg)
    if expert_range is not None and not spec.is_moe:
        raise UnsupportedModelError("expert parallelism needs a mixture-of-experts model")
    t1 = time.monotonic()
    rotary = rotary_from_config(cfg, max_positions, dtype).to(device)  # computed, on the device
    with torch.device("meta"):  # shapes only: no memory, no init; every parameter is filled below
        model = DecoderModel(spec, rotary, dtype, expert_range, batch_invariant)
    t2 = time.monotonic()
    rd = _Reader(Path(model_dir))
    plan = {"embed.weight": [Piece("model.embed_tokens.weight")],
            "norm.weight": [Piece("model.norm.weight")]}
    if not spec.tie_word_embeddings:
        plan["lm_head.weight"] = [Piece("lm_head.weight")]
    params = dict(model.named_parameters())
    for name, pieces in plan.items():
        _assign(model, name, _materialize(rd, name, params[name], pieces, dtype, device))
    cache = _expert_cache(model_dir, spec, dtype) if expert_range is not None else None
    for i, layer in enumerate(model.layers):
        experts = (layer.mlp.expert_start, layer.mlp.expert_end) if i in spec.sparse_layers else None
        for name, pieces in _layer_plan(rd, spec, i, experts).items():
            if cache is not None and name in expert_cache.tensor_names(i):
                continue  # from the cache below: a view, no read, no cast
            _assign(model, name, _materialize(rd, name, params[name], pieces, dtype, device))
        if cache is not None and experts is not None:
            _assign_cached_experts(model, cache, rd, i, experts, params, dtype, device)
        if progress:
            progress(i + 1, spec.num_layers)
    if cache is not None:
        attach_node_experts(model, cache, spec, dtype, device)
    missing = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if missing:
        raise ModelLoadError(f"parameters not loaded from the checkpoint: {missing[:5]}")
    if timings is not None:
        if hf_config is None:
            timings["config_s"] = t1 - t0
        timings.update(build_s=t2 - t1, read_s=time.monotonic() - t2)
    return model.eval(), cfg, spec, rd.num_bytes


def load_expert_weights(model, model_dir: str, spec: ModelSpec, dtype, device, expert_range: tuple[int, int]) -> int:
    """Replace every MoE layer's local experts with [start, end): views of the node's expert
    cache (engine/models/expert_cache.py), else read from the checkpoint. Returns the bytes
    the experts now take (read or mapped)."""
    start, end = expert_range
    rd = _Reader(Path(model_dir))
    cache = _expert_cache(model_dir, spec, dtype)
    n_local = end - start
    for i, layer in enumerate(model.layers):
        if i not in spec.sparse_layers:
            continue
        moe = layer.mlp
        shapes = {f"layers.{i}.mlp.w13": torch.empty((n_local, *moe.w13.shape[1:]), device="meta"),
                  f"layers.{i}.mlp.w2": torch.empty((n_local, *moe.w2.shape[1:]), device="meta")}
        if cache is not None:
            _assign_cached_experts(model, cache, rd, i, expert_range, shapes, dtype, device)
        else:
            for name, pieces in _expert_plan(rd, spec, i, start, end).items():
                _assign(model, name, _materialize(rd, name, shapes[name], pieces, dtype, device))
        moe.expert_start, moe.expert_end = start, end
    attach_node_experts(model, cache, spec, dtype, device)
    return rd.num_bytes


def refresh_node_experts(model, model_dir: str, spec: ModelSpec, dtype, device) -> None:
    """After a weight swap copied ``model_dir``'s weights into the parameters: a rank that
    had views of the node's experts takes them from ``model_dir``'s cache (the old file
    holds the old experts); a model without them (one engine) is left alone."""
    if any(getattr(layer.mlp, "node_key", 0) for layer in model.layers):
        attach_node_experts(model, _expert_cache(model_dir, spec, dtype), spec, dtype, device)


def attach_node_experts(model, cache: expert_cache.ExpertCache | None, spec: ModelSpec, dtype, device) -> None:
    """Give every MoE layer of an expert-parallel rank views of all its experts in the
    node's expert cache (``SparseMoE.node_w13``/``node_w2``/``node_key``), or take them away
    (``cache`` None, another device or dtype: views only, never a copy). They cost no memory
    of their own: the file's pages are the node's page cache, which the rank's own experts
    (a range of the same views) already share."""
    usable = cache is not None and device.type == "cpu"
    for i, layer in enumerate(model.layers):
        moe = layer.mlp
        if i not in spec.sparse_layers:
            continue
        moe.node_w13 = moe.node_w2 = None
        moe.node_key = 0
        if usable:
            w13, w2 = cache.view(i, 0, spec.num_experts)
            if w13.dtype == dtype and w2.dtype == dtype and w13.is_contiguous() and w2.is_contiguous():
                moe.node_w13, moe.node_w2, moe.node_key = w13, w2, cache.contents_id()


def _expert_cache(model_dir: str, spec: ModelSpec, dtype) -> expert_cache.ExpertCache | None:
    """The node's cache of this checkpoint's experts in ``dtype`` (built from the checkpoint
    the first time), or None when it is turned off."""
    build_rd = _Reader(Path(model_dir))  # its byte count is the build's, not the model's

    def build_layer(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        plan = _expert_plan(build_rd, spec, i, 0, spec.num_experts)
        inter, hidden = spec.moe_intermediate_size, spec.hidden_size
        like = {f"layers.{i}.mlp.w13": torch.empty((spec.num_experts, 2 * inter, hidden), device="meta"),
                f"layers.{i}.mlp.w2": torch.empty((spec.num_experts, hidden, inter), device="meta")}
        w13, w2 = (_materialize(build_rd, name, like[name], plan[name], dtype, torch.device("cpu"))
                   for name in expert_cache.tensor_names(i))
        return w13, w2

    return expert_cache.open_or_build(model_dir, dtype, sorted(spec.sparse_layers), build_layer)


def _assign_cached_experts(model, cache: expert_cache.ExpertCache, rd: _Reader, i: int,
                           expert_range: tuple[int, int], like: dict[str, torch.Tensor], dtype, device) -> None:
    """Layer ``i``'s experts [start, end) as views of the cache (a copy only to another device)."""
    w13, w2 = cache.view(i, *expert_range)
    for name, t in zip(expert_cache.tensor_names(i), (w13, w2)):
        if tuple(t.shape) != tuple(like[name].shape):
            raise ModelLoadError(f"expert cache {cache.path}: {name} shaped {tuple(t.shape)}, "
                                 f"the model wants {tuple(like[name].shape)}")
        if t.device != device or t.dtype != dtype:
            t = t.to(device=device, dtype=dtype, copy=True)
        rd.num_bytes += t.numel() * t.element_size()
        _assign(model, name, t)


def model_fingerprint(model_dir: str) -> str:
    """Stable id of a checkpoint: config plus weight file names and sizes."""
    h = hashlib.sha256()
    d = Path(model_dir)
    h.update((d / "config.json").read_bytes())
    for f in sorted(d.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(os.path.getsize(f)).encode())
    return h.hexdigest()[:16]
