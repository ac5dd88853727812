"""Engine start-up: the clear error for an unsupported architecture (in-process and from
an engine process), and KV sizing by profiling (the formula checked against the recorded
figures) versus a given figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.errors import UnsupportedModelError
from planaria.engine.proc import EXIT_DEAD
from planaria.engine.wire import HandshakeInit, MsgType
from tests.engine._engine_procs import RawFrontend, engine_config, spawn_engine, stop_engine


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory) -> str:
    from transformers import GPT2Config

    d = tmp_path_factory.mktemp("gpt2")
    GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=100,
               architectures=["GPT2LMHeadModel"]).save_pretrained(d)
    return str(d)


def test_unsupported_architecture_is_a_clear_error(gpt2_dir):
    with pytest.raises(UnsupportedModelError) as info:
        EngineCore(EngineConfig(model=gpt2_dir, kv_cache_bytes=2**20))
    msg = str(info.value)
    assert "unsupported architecture" in msg and "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                 "MixtralForCausalLM"):
        assert arch in msg  # the error lists what is supported


def test_engine_process_reports_unsupported_architecture(gpt2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("u")
    fe = RawFrontend(tmp)
    proc = spawn_engine(0, fe.input_addr, tmp, engine_config(Path(gpt2_dir)))
    try:
        _, t, _ = fe.recv_router()  # HELLO; the config comes on the command line
        assert t == MsgType.HELLO
        fe.send(0, MsgType.HANDSHAKE_INIT, HandshakeInit(addresses={"output": fe.output_addr}))
        t, dead = fe.recv_pull(60)
        assert t == MsgType.ENGINE_CORE_DEAD
        assert "UnsupportedModelError" in dead.reason and "GPT2LMHeadModel" in dead.reason
        assert proc.wait(30) == EXIT_DEAD
    finally:
        stop_engine(proc)
        fe.close()


def test_profiled_kv_cache_follows_the_formula(tiny_moe):
    base = dict(model=tiny_moe, max_model_len=512, max_num_seqs=64, max_num_batched_tokens=256, num_threads=1)
    given = EngineCore(EngineConfig(**base, kv_cache_bytes=4 * 2**20))
    assert given.kv_source == "given" and given.profile is None
    assert given.kv_cache_bytes == 4 * 2**20 // given.runner.bytes_per_block * given.runner.bytes_per_block
    weights = given.runner.weights_bytes
    assert weights > 0
    utilization = 0.5
    budget = int((weights + 16 * 2**20) / utilization)  # ~16 MB left for activations + KV

    core = EngineCore(EngineConfig(**base, memory_budget_bytes=budget, memory_utilization=utilization))
    prof, per_block = core.profile, core.runner.bytes_per_block
    assert core.kv_source == "profiled"
    assert prof.budget_bytes == budget and prof.weights_bytes == weights
    assert 0 <= prof.peak_activation_bytes < 16 * 2**20
    assert prof.kv_cache_bytes == int(budget * utilization) - weights - prof.peak_activation_bytes
    assert core.num_kv_blocks == prof.kv_cache_bytes // per_block
    assert core.kv_cache_bytes == core.num_kv_blocks * per_block
    figures = core.kv_figures()
    assert figures["kv_source"] == "profiled" and figures["kv_cache_bytes"] == core.kv_cache_bytes
    assert figures["weights_bytes"] == weights
    assert figures["peak_activation_bytes"] == prof.peak_activation_bytes
    assert "profile_s" in core.init_timings

    # the recorded figure, handed to a new engine (as a scale-up does), skips profiling
    reused = EngineCore(EngineConfig(**base, kv_cache_bytes=core.kv_cache_bytes, kv_source="reused"))
    assert reused.profile is None and reused.kv_source == "reused"
    assert reused.num_kv_blocks == core.num_kv_blocks


def test_kv_cache_starts_zeroed_one_tensor_per_layer_and_kind(tiny_moe):
    """Attention reads slots it masks (padded block tables, a last block's tail) and a NaN
    there would spread into outputs, so the cache must start as zeros: on the CPU it is one
    anonymous mapping the kernel zero-fills; each layer's K and V are views that never overlap."""
    core = EngineCore(EngineConfig(model=tiny_moe, kv_cache_bytes=2 * 2**20, max_model_len=128, num_threads=1))
    runner, spec = core.runner, core.runner.spec
    caches = runner.kv_caches
    assert len(caches) == spec.num_layers
    slots = core.num_kv_blocks * core.config.block_size
    for k, v in caches:
        assert k.shape == v.shape == (slots, spec.num_kv_heads, spec.head_dim)
        assert k.dtype == v.dtype == runner.dtype and k.is_contiguous() and v.is_contiguous()
        assert k.count_nonzero() == 0 and v.count_nonzero() == 0
    caches[1][0].fill_(1.0)  # layer 1's K only
    touched = [(i, j) for i, kv in enumerate(caches) for j, t in enumerate(kv) if t.count_nonzero()]
    assert touched == [(1, 0)]
