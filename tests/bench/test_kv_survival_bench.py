"""bench/kv_survival.py's pure parts: the prompts, the per-stream stall and decode step,
the KV sizing, the table's rows and the goal lines. No daemon, nothing timed."""

from __future__ import annotations

import json

import pytest

from bench import kv_survival as ks


def _encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token a character: exact lengths, visible openings


def test_prompts_exact_length_distinct_openings_deterministic():
    prompts = ks.make_prompts(_encode, 300, 4)
    assert [len(p) for p in prompts] == [300] * 4
    assert len({p[0] for p in prompts}) == 4  # different first tokens: no prefix block shared
    assert ks.make_prompts(_encode, 300, 4) == prompts
    other = ks.make_prompts(_encode, 600, 4)
    assert all(a[:16] != b[:16] for a, b in zip(prompts, other))  # nor across contexts
    many = ks.make_prompts(_encode, 100, len(ks.OPENINGS) + 2)
    assert len({tuple(p[:16]) for p in many}) == len(many)


def test_stall_is_the_longest_of_the_first_gaps_after_the_fault():
    times = [0.0, 0.02, 0.04, 0.06, 1.06, 1.08, 1.10, 5.0]
    assert ks.gaps_after(times, 0.05) == pytest.approx([0.02, 1.0, 0.02])
    assert ks.stall_of(times, 0.05) == pytest.approx(1.0)
    # one more token from the departing engine, then the move: still found
    assert ks.stall_of([0.0, 0.02, 0.04, 0.3, 0.32], 0.03) == pytest.approx(0.26)
    assert ks.stall_of(times, 10.0) is None  # nothing after the fault
    assert ks.stall_of(times, -1.0) is None  # nothing before it
    assert ks.stall_of([], 0.0) is None


def test_decode_step_is_the_median_of_the_last_gaps_before_the_fault():
    times = [0.0, 0.5] + [0.5 + 0.02 * i for i in range(1, 20)] + [3.0]
    assert ks.decode_step(times, 2.0) == pytest.approx(0.02)
    assert ks.decode_step([0.0], 1.0) is None
    assert ks.pct([0.3, None, 0.1, 0.2], 0.5) == 0.2
    assert ks.pct([0.3, 0.1, 0.2], 0.99) == 0.3
    assert ks.pct([], 0.5) is None
    assert ks.ms(0.0004) == "0.4" and ks.ms(0.25) == "250" and ks.ms(None) == "-"


def test_warm_prefix_is_whole_blocks_within_the_prompt():
    for context in (64, 256, 512, 1024, 8192):
        n = ks.warm_len(context)
        assert n < context and (n - 8) % 16 == 0 and n - 8 <= 256


def test_engine_config_fits_the_streams(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 576, "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3}))
    cfg = ks.engine_config_for(tmp_path, [1024, 8192], 3, 128, 2, None)
    assert cfg["max_model_len"] == 8192 + 128
    per_token = 2 * 30 * 3 * 64 * 2
    assert cfg["kv_cache_bytes"] >= 1.5 * 3 * cfg["max_model_len"] * per_token
    assert ks.engine_config_for(tmp_path, [1024], 3, 128, 2, 12345)["kv_cache_bytes"] == 12345


def test_rows_and_goal_lines():
    def trial(scenario, mode, stalls, step=0.02, **kw):
        t = ks.Trial(scenario, 8192, mode, len(stalls), placed=len(stalls), stalls=stalls,
                     steps=[step] * len(stalls), tokens_after=[50] * len(stalls), **kw)
        return t.row()

    rows = [trial("kill", "on", [0.10, 0.12, 0.11], detect_s=0.002),
            trial("kill", "off", [2.0, 2.1, 2.2], detect_s=0.002),
            trial("drain", "on", [0.03, 0.035, 0.05], gone_s=0.2),
            trial("drain", "off", [0.02, 0.02, 0.02], gone_s=3.0)]
    assert rows[0]["stall_p99_s"] == 0.12 and rows[0]["stalled"] == 3 and rows[0]["affected"] == 3
    assert rows[3]["stalled"] == 0
    lines = ks.comparisons(rows)
    kill = next(line for line in lines if line.startswith("kill at 8192"))
    assert "replay/salvage 18.3x (goal >= 10x at the largest context: meets)" in kill
    assert "detection + 250 ms = 252 ms (meets)" in kill
    drain = next(line for line in lines if line.startswith("drain at 8192"))
    assert "2.5 decode steps (goal <= 2: misses)" in drain
    assert any(line.startswith("salvage on: 0 streams differ") for line in lines)


def test_arguments():
    args = ks.parse_args(["--quick", "--modes", "off", "--scenarios", "kill,scale"])
    assert args.contexts == [256, 512] and args.modes == ["off"] and args.scenarios == ["kill", "scale"]
    assert ks.parse_args([]).contexts == [1024, 4096, 8192]
    for bad in (["--modes", "maybe"], ["--scenarios", "reboot"], ["--max-tokens", "20"], ["--contexts", "32"]):
        with pytest.raises(SystemExit):
            ks.parse_args(bad)
