"""bench/roofline.py at tiny sizes: the FLOP and byte counts against a hand count, and the
table it prints for a real engine on tiny-moe. Nothing here is timed against a bound."""

from __future__ import annotations

import pytest
import torch

from bench import roofline
from planaria.engine.models.decoder import ModelSpec

# 3 layers (layer 0 dense, 1 and 2 MoE), hidden 8, 2 query heads and 1 KV head of 4,
# q/k/v bias, dense MLP 16 wide, 4 experts 6 wide, top-2, vocab 100, tied embeddings
SPEC = ModelSpec(arch="llama", vocab_size=100, hidden_size=8, num_layers=3, num_heads=2, num_kv_heads=1,
                 head_dim=4, intermediate_size=16, rms_norm_eps=1e-6, max_position_embeddings=64,
                 tie_word_embeddings=True, qkv_bias=True, num_experts=4, top_k=2, moe_intermediate_size=6,
                 sparse_layers=(1, 2))


def test_step_cost_by_hand():
    # per token: qkv 8 x (8 + 4 + 4) = 128 MACs, o_proj 8 x 8 = 64, bias 16 values (read, not MACs);
    # dense MLP 3 x 8 x 16 = 384; router 8 x 4 = 32; one expert 3 x 8 x 6 = 144
    cost = roofline.step_cost(SPEC, num_seqs=3, ctx_len=10, elem_bytes=2, experts_hit=3)
    # 3 tokens x (3 layers x 192 + 1 dense x 384 + 2 MoE x (32 + top-2 x 144)) = 3 x 1600 MACs
    assert cost.linear_flops == 2 * 3 * 1600
    # 3 layers x 3 seqs x 2 heads x (QK^T + PV: 2 x 4 dims x 10 positions) MACs
    assert cost.attention_flops == 2 * 3 * 3 * 2 * 2 * 4 * 10
    assert cost.lm_head_flops == 2 * 3 * 8 * 100
    # weights read once: 3 x (192 + 16) + 384 + 2 x (32 + 3 experts hit x 144) = 1936 values, 2 bytes
    assert cost.weight_bytes == 1936 * 2
    # K and V of 1 head x 4 dims, 10 positions read + 1 written, 3 layers, 3 seqs
    assert cost.kv_bytes == 3 * 3 * 2 * 4 * 11 * 2
    assert cost.lm_head_bytes == 100 * 8 * 2
    assert cost.embed_bytes == 3 * 8 * 2
    assert cost.flops == 9600 + 2880 + 4800
    assert cost.bytes == 3872 + 1584 + 1600 + 48


def test_expected_experts_when_not_counted():
    assert roofline.expected_experts_hit(4, 2, 1) == 2
    assert roofline.expected_experts_hit(4, 2, 3) == pytest.approx(4 * (1 - 0.5 ** 3))
    cost = roofline.step_cost(SPEC, num_seqs=3, ctx_len=10, elem_bytes=2)
    assert cost.weight_bytes == (3 * 208 + 384 + 2 * (32 + 3.5 * 144)) * 2
    dense = ModelSpec(**{**SPEC.__dict__, "num_experts": 0, "top_k": 0, "moe_intermediate_size": 0,
                         "sparse_layers": ()})
    assert roofline.step_cost(dense, 1, 10, 4).weight_bytes == (3 * 208 + 3 * 384) * 4


def test_limits_at_tiny_sizes():
    peak = roofline.gemm_peak(torch.float32, sizes=(32, 64), reps=1)
    assert peak["dtype"] == "float32" and peak["peak_gflops"] > 0 and peak["path"] in peak["paths"]
    bw = roofline.memory_bandwidth(2**20, reps=1)
    assert bw["read_gb_s"] > 0 and bw["copy_gb_s"] > 0 and bw["buffer_mib"] == 1


def test_table_on_tiny_moe(tiny_moe):
    peaks = {"float32": dict(dtype="float32", peak_gflops=100.0, path="torch.mm", paths={"torch.mm": 100.0},
                             sizes=[64])}
    bandwidth = dict(read_gb_s=10.0, copy_gb_s=10.0, buffer_mib=1)
    dtype, rows, profiles = roofline.run_model(tiny_moe, [1, 4], "float32", out_len=8, skip=1, peaks=peaks,
                                               bandwidth=bandwidth, profile="always")
    assert dtype == "float32" and [r["seqs"] for r in rows] == [1, 4]
    one, four = rows
    # tiny-moe: hidden 128, 4 layers, 4 query and 2 KV heads of 32, 8 experts of 128 top-2, all MoE
    assert one["experts_hit"] == 2  # one token reads exactly its top-2
    assert 2 <= four["experts_hit"] <= 8
    per_layer = 128 * (128 + 64 + 64) + 128 * 128 + 128 * 8 + 2 * 3 * 128 * 128
    assert one["cost"]["weight_bytes"] == 4 * per_layer * 4
    assert 129 <= one["ctx_len"] <= 136  # 128 prompt tokens, past the first decode step
    assert one["cost"]["kv_bytes"] == pytest.approx(4 * 2 * 64 * (one["ctx_len"] + 1) * 4)
    for r in rows:
        assert r["steps"] >= 1 and 0 < r["forward_ms"] <= r["step_ms"]
        assert r["bandwidth_fraction"] == pytest.approx(r["mb"] * 1e6 / 10e9 / (r["step_ms"] / 1e3))
        assert r["gemm_fraction"] == pytest.approx(r["gflop"] * 1e9 / 100e9 / (r["step_ms"] / 1e3))
        assert r["bound"] == ("memory" if r["floor_ms"] >= r["compute_ms"] else "compute")
    assert one["goal"] == "bandwidth" and four["goal"] is None
    table = roofline.render_rows("tiny-moe", dtype, rows)
    assert table.count("\n") == 4 and "bandwidth >= 60%" in table
    assert set(profiles) == {1, 4}
    for prof in profiles.values():
        assert prof["steps"] >= 1 and prof["step_ms"] > 0 and prof["ops"]
        assert all(o["self_ms_per_step"] >= 0 and 0 <= o["share"] <= 1 for o in prof["ops"])
    text = roofline.render_profile("tiny-moe", one, profiles[1])
    assert "top ops by self CPU time" in text and profiles[1]["ops"][0]["op"] in text
