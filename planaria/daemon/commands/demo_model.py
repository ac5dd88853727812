"""Write a demo model directory: seeded random weights plus a byte-level BPE tokenizer.

    planaria demo-model PATH [--preset tiny-moe] [--seed 0] [--dtype float32] [--force]

The directory is an ordinary Hugging Face checkpoint (config.json, model.safetensors,
tokenizer.json, chat template) that loads offline with ``from_pretrained``. The output
is meaningless text, but the same preset and seed always give the same weights, so it
serves for tests and benchmarks without any download. Exit codes: 0 written, 2 refused
(PATH exists and is not empty; pass --force to overwrite).
"""

from __future__ import annotations

import argparse
import sys

from planaria.engine.demo_model import DTYPES, PRESETS

NAME = "demo-model"
HELP = "write a seeded random demo model (HF format) with a trained BPE tokenizer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    presets = "; ".join(f"{name}: {p.description}" for name, p in PRESETS.items())
    parser.add_argument("path", metavar="PATH", help="output directory")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-moe",
                        help=f"architecture and size ({presets})")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="stored weight dtype (default float32; CPU wants float32)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite PATH even if it exists and is not empty")


def main(args: argparse.Namespace) -> int:
    # torch and transformers load here, not at import, so `planaria --help` stays fast.
    from planaria.engine.demo_model import build_demo_model
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        path = build_demo_model(args.path, preset=args.preset, seed=args.seed,
                                dtype=args.dtype, overwrite=args.force,
                                progress=lambda line: print(line, flush=True))
    except FileExistsError as exc:
        print(f"planaria demo-model: refused: {exc}", file=sys.stderr)
        return 2
    print(f"done: {path} (preset {args.preset}, seed {args.seed}, {args.dtype})")
    return 0
