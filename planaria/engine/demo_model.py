"""Demo checkpoints: a seeded random model plus a byte-level BPE tokenizer, written as an
ordinary Hugging Face directory (config.json, generation_config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) that loads offline with ``from_pretrained``.

No hub access is needed: the tokenizer is trained on the Python standard library's own
sources and cached under ``~/.cache/planaria/tokenizer-v1/<key>/`` (``$XDG_CACHE_HOME`` or
``$PLANARIA_CACHE_DIR`` move it), so only the first build pays the few seconds of training.

Random weights at the usual init (std 0.02) give nearly flat logits, and greedy decoding
then flips between two correct implementations on rounding noise. The presets use a wider
init (``initializer_range``, saved in config.json) so the top-1/top-2 logit gap is large
on typical greedy steps while generations still vary; see ``DECISIVE_INIT_RANGE``.

Importing this module imports neither torch nor transformers (the CLI lists presets).
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

VOCAB_SIZE = 4096
TOKENIZER_CACHE_VERSION = "tokenizer-v1"
# Training input cap: the first bytes of the sorted stdlib .py files. Enough for 4096
# merges; keeps training to a few seconds on two cores.
TOKENIZER_CORPUS_BYTES = 3 * 1024 * 1024

# Weight init std for every Linear/Embedding. At the transformers default (0.02) about
# 15% of greedy steps of tiny-moe have a top-1/top-2 logit gap under 1e-2 and many
# generations loop on a few tokens. At 0.2 (measured: 5 prompts x 64 greedy steps,
# tiny-moe / tiny-dense / bench-moe) 98.8-99.4% of steps have a gap over 1e-2, the
# median gap is 0.36-0.85, and 61-64 of the 64 generated tokens are distinct. Argmax is
# scale-invariant, so what protects parity tests is the gap relative to the logit scale;
# the gaps of random logits are roughly exponential, so a few near-ties remain: compare
# implementations in float32, over several prompts, and allow the rare near-tie flip.
DECISIVE_INIT_RANGE = 0.2

CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=2048,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
    rms_norm_eps=1e-6,
    initializer_range=DECISIVE_INIT_RANGE,
    tie_word_embeddings=False,
)
_TINY = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=256,
)


@dataclass(frozen=True)
class DemoPreset:
    """One demo architecture: a transformers ``model_type`` and its config values."""

    model_type: str
    description: str
    config: dict = field(default_factory=dict)


PRESETS: dict[str, DemoPreset] = {
    "tiny-moe": DemoPreset(
        "qwen3_moe",
        "Qwen3-MoE, hidden 128, 4 layers, 8 experts top-2 (2.8M params)",
        {**_COMMON, **_TINY, "num_experts": 8, "num_experts_per_tok": 2,
         "moe_intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [],
         "norm_topk_prob": True},
    ),
    "bench-moe": DemoPreset(
        "qwen3_moe",
        "Qwen3-MoE, hidden 512, 8 layers, 16 experts top-2 (111M params)",
        {**_COMMON, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 1024,
         "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 512,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    ),
    "tiny-dense": DemoPreset(
        "llama", "Llama, hidden 128, 4 layers (1.6M params)", {**_COMMON, **_TINY},
    ),
    # Qwen2 always has q/k/v biases (no config switch); head_dim is hidden/heads = 32.
    "tiny-qwen2": DemoPreset(
        "qwen2", "Qwen2 (q/k/v bias), hidden 128, 4 layers (1.6M params)", {**_COMMON, **_TINY},
    ),
    "tiny-qwen3": DemoPreset(
        "qwen3", "Qwen3 (q/k norm), hidden 128, 4 layers (1.6M params)", {**_COMMON, **_TINY},
    ),
    "tiny-mixtral": DemoPreset(
        "mixtral", "Mixtral, hidden 128, 4 layers, 8 experts top-2 (2.8M params)",
        {**_COMMON, **_TINY, "intermediate_size": 128, "num_local_experts": 8,
         "num_experts_per_tok": 2},
    ),
}

DTYPES = ("float32", "bfloat16", "float16")

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def tokenizer_cache_dir() -> Path:
    """Root of the trained-tokenizer cache (``.../planaria/tokenizer-v1``)."""
    if os.environ.get("PLANARIA_CACHE_DIR"):
        root = Path(os.environ["PLANARIA_CACHE_DIR"])
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "planaria"
    return root / TOKENIZER_CACHE_VERSION


def _stdlib_corpus(max_bytes: int) -> list[str]:
    """The first ``max_bytes`` of the stdlib's .py files, in sorted path order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    texts: list[str] = []
    num_bytes = 0
    for path in sorted(stdlib.rglob("*.py")):
        if skip.intersection(path.relative_to(stdlib).parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        texts.append(text)
        num_bytes += len(text.encode("utf-8"))
        if num_bytes >= max_bytes:
            break
    return texts


def train_tokenizer(vocab_size: int = VOCAB_SIZE, progress: Progress = _quiet) -> Path:
    """Train (or fetch from cache) the byte-level BPE; returns the cached tokenizer.json.

    The cache key hashes the settings and the corpus itself, so a different Python
    install (different stdlib) trains its own tokenizer rather than reusing a stale one.
    """
    # deferred: tokenizers is heavy; the CLI imports this module at --help
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = _stdlib_corpus(TOKENIZER_CORPUS_BYTES)
    key = hashlib.sha256()
    key.update(json.dumps({"vocab_size": vocab_size, "special": SPECIAL_TOKENS,
                           "corpus_bytes": TOKENIZER_CORPUS_BYTES}).encode())
    for text in texts:
        key.update(hashlib.sha256(text.encode("utf-8")).digest())
    cached = tokenizer_cache_dir() / key.hexdigest()[:16] / "tokenizer.json"
    if cached.is_file():
        progress(f"tokenizer: cached {cached}")
        return cached

    progress(f"tokenizer: training byte-level BPE (vocab {vocab_size}) "
             f"on {len(texts)} stdlib files")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"tokenizer.json.{os.getpid()}.tmp")
    tok.save(str(tmp))
    os.replace(tmp, cached)  # atomic: a concurrent build never reads half a file
    progress(f"tokenizer: cached {cached}")
    return cached


def load_demo_tokenizer(vocab_size: int = VOCAB_SIZE, progress: Progress = _quiet):
    """The trained tokenizer wrapped as a ``PreTrainedTokenizerFast`` with ChatML."""
    # deferred: tokenizers and transformers are heavy; the CLI imports this module at --help
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer.from_file(str(train_tokenizer(vocab_size, progress)))
    return PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=ENDOFTEXT,
        eos_token=ENDOFTEXT,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep decode(encode(text)) == text
        model_max_length=_COMMON["max_position_embeddings"],
    )


def check_target(path: Path, overwrite: bool) -> None:
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{path} exists and is not empty (use --force to overwrite)")
        # Remove weights a previous, differently sharded build may have left behind.
        for stale in path.glob("*.safetensors"):
            stale.unlink()
        for stale in path.glob("*.safetensors.index.json"):
            stale.unlink()


def build_demo_model(
    path: str | os.PathLike,
    preset: str = "tiny-moe",
    seed: int = 0,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    progress: Progress = _quiet,
) -> Path:
    """Write a seeded random ``preset`` model and the demo tokenizer to ``path``.

    Same (preset, seed, dtype) gives byte-identical tensors. Raises ``KeyError`` for an
    unknown preset, ``ValueError`` for an unknown dtype, ``FileExistsError`` when
    ``path`` is non-empty and ``overwrite`` is false.
    """
    if preset not in PRESETS:
        raise KeyError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    path = Path(path)
    check_target(path, overwrite)

    # deferred: torch and transformers are heavy; the CLI imports this module at --help
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    tokenizer = load_demo_tokenizer(progress=progress)
    eot_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    im_end_id = tokenizer.convert_tokens_to_ids(IM_END)

    spec = PRESETS[preset]
    cfg = AutoConfig.for_model(
        spec.model_type,
        **spec.config,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )
    progress(f"weights: {spec.model_type} preset {preset}, seed {seed}, "
             f"init std {cfg.initializer_range}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to(getattr(torch, dtype))
    model.config.dtype = dtype
    # Completions stop at <|endoftext|>; chat turns stop at <|im_end|> as well.
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=[eot_id, im_end_id], pad_token_id=eot_id,
    )
    num_params = sum(p.numel() for p in model.parameters())
    progress(f"weights: {num_params:,} parameters ({num_params / 1e6:.1f}M)")

    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    progress(f"saved: {path}")
    return path
