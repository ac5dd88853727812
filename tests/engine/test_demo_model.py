"""engine/demo_model.py and `planaria demo-model`: offline HF checkpoints from a seed."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from planaria.daemon import cli  # noqa: E402
from planaria.engine.demo_model import (  # noqa: E402
    DECISIVE_INIT_RANGE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    PRESETS,
    build_demo_model,
    train_tokenizer,
)

UNICODE_TEXT = (
    "def f(x):\n\treturn x ** 2  # ünïcödé\r\n"
    "日本語のテキスト, 中文, 한국어, עברית, العربية\n"
    "emoji 🦀🐍👩‍👩‍👧 e\u0301 \u200b\x00\x01\x7f\ufeff end  \n\n"
)


@pytest.fixture(scope="module")
def offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def built(tmp_path_factory, offline):
    """tiny-moe via the library, tiny-dense via the CLI; shares the tokenizer cache."""
    root = tmp_path_factory.mktemp("demo")
    moe = build_demo_model(root / "tiny-moe", preset="tiny-moe", seed=0)
    assert cli.main(["demo-model", str(root / "tiny-dense"), "--preset", "tiny-dense"]) == 0
    return {"tiny-moe": moe, "tiny-dense": root / "tiny-dense", "root": root}


def _load(path):
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    return tok, model


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_config_matches_preset(built, preset):
    cfg = AutoConfig.from_pretrained(built[preset], local_files_only=True)
    spec = PRESETS[preset]
    assert cfg.model_type == spec.model_type
    for key, want in spec.config.items():
        assert getattr(cfg, key) == want, key
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (4096, 2048)
    assert cfg.rope_parameters["rope_theta"] == 10000.0
    assert cfg.rms_norm_eps == 1e-6
    assert cfg.initializer_range == DECISIVE_INIT_RANGE
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (128, 4, 32)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)
    assert cfg.tie_word_embeddings is False


def test_tiny_moe_expert_fields(built):
    cfg = AutoConfig.from_pretrained(built["tiny-moe"], local_files_only=True)
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size) == (128, 256)
    assert cfg.decoder_sparse_step == 1 and cfg.mlp_only_layers == []
    assert cfg.norm_topk_prob is True


def test_bench_moe_size():
    spec = PRESETS["bench-moe"]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(spec.model_type, **spec.config))
    num_params = sum(p.numel() for p in model.parameters())
    assert 105e6 < num_params < 115e6


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_special_tokens_and_stops(built, preset):
    tok, model = _load(built[preset])
    eot, im_end = tok.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    assert tok.eos_token == ENDOFTEXT and tok.pad_token == ENDOFTEXT
    assert model.config.eos_token_id == eot and model.config.bos_token_id == eot
    assert model.config.pad_token_id == eot
    assert list(model.generation_config.eos_token_id) == [eot, im_end]
    assert len(tok) == 4096


@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense"])
def test_greedy_generate_is_decisive_and_varied(built, preset):
    tok, model = _load(built[preset])
    gaps, num_distinct = [], []
    for prompt in ["def fibonacci(n):\n    ", "The quick brown fox"]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 output_scores=True, return_dict_in_generate=True)
        new = out.sequences[0, ids.shape[1]:].tolist()
        assert len(new) == 32 and all(0 <= t < 4096 for t in new)
        num_distinct.append(len(set(new)))
        gaps += [(s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in out.scores]
    frac_decisive = sum(g > 1e-2 for g in gaps) / len(gaps)
    assert frac_decisive >= 0.9, gaps
    assert min(num_distinct) >= 16, num_distinct
    again = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None)
    assert again[0, ids.shape[1]:].tolist() == new


def test_tokenizer_round_trips_unicode(built):
    tok = AutoTokenizer.from_pretrained(built["tiny-moe"], local_files_only=True)
    assert tok.unk_token_id is None
    for text in [UNICODE_TEXT, "".join(chr(c) for c in range(1, 0x3000, 7)), ""]:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 4096 for i in ids)
        assert tok.decode(ids) == text
    every_byte = bytes(range(256)).decode("latin-1")
    assert tok.decode(tok.encode(every_byte, add_special_tokens=False)) == every_byte


def test_chat_template_renders_chatml(built):
    tok = AutoTokenizer.from_pretrained(built["tiny-moe"], local_files_only=True)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi{IM_END}\n"
                    f"{IM_START}assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.convert_tokens_to_ids(IM_START)) == 3
    assert ids.count(tok.convert_tokens_to_ids(IM_END)) == 2


def test_same_seed_same_tensors(built):
    again = build_demo_model(built["root"] / "tiny-moe-again", preset="tiny-moe", seed=0)
    other = build_demo_model(built["root"] / "tiny-moe-seed1", preset="tiny-moe", seed=1)
    first = load_file(built["tiny-moe"] / "model.safetensors")
    second = load_file(again / "model.safetensors")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    third = load_file(other / "model.safetensors")
    assert not torch.equal(first["lm_head.weight"], third["lm_head.weight"])


def test_tokenizer_training_is_deterministic(built, tmp_path, monkeypatch):
    shared = train_tokenizer()
    monkeypatch.setenv("PLANARIA_CACHE_DIR", str(tmp_path))
    fresh = train_tokenizer()
    assert fresh != shared and fresh.is_relative_to(tmp_path)
    assert fresh.read_bytes() == shared.read_bytes()


@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-mixtral"])
def test_other_architectures_load_and_run(built, preset):
    path = build_demo_model(built["root"] / preset, preset=preset)
    tok, model = _load(path)
    assert model.config.model_type == PRESETS[preset].model_type
    with torch.no_grad():
        logits = model(tok("x = 1", return_tensors="pt").input_ids).logits
    assert logits.shape[-1] == 4096 and torch.isfinite(logits).all()


def test_refuses_non_empty_dir(tmp_path, capsys):
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    assert cli.main(["demo-model", str(target)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (target / "keep.txt").read_text() == "precious"
    with pytest.raises(FileExistsError):
        build_demo_model(target)
