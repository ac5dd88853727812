"""`planaria serve`'s frontend flags reach the frontend's command line, and the API key
its environment only (never a command line, never the engines)."""

from __future__ import annotations

import argparse

import pytest

from planaria.daemon import config as config_mod
from planaria.daemon.launch import Launcher
from planaria.frontend.main import build_parser, server_limits


def _config(tmp_path, argv: list[str], environ: dict[str, str]) -> config_mod.ServeConfig:
    parser = argparse.ArgumentParser()
    config_mod.add_serve_arguments(parser)
    flags = config_mod.given_flags(parser.parse_args(["--model", str(tmp_path), *argv]))
    return config_mod.build(flags, environ)


def test_flags_pass_to_the_frontend_and_the_key_only_through_its_environment(tmp_path):
    cfg = _config(tmp_path, ["--max-inflight-requests", "7", "--request-timeout-s", "9",
                             "--max-body-bytes", "1000", "--max-connections", "11", "--body-read-timeout-s", "3",
                             "--keep-alive-timeout-s", "2", "--render-timeout-s", "4",
                             "--engine-wait-s", "12", "--api-key-protects-metrics", "--tool-call-parser", "none"],
                  {"PLANARIA_API_KEY": "k-123", "STATE_DIRECTORY": str(tmp_path)})
    assert cfg.api_key == "k-123" and cfg.api_key_protects_metrics
    launcher = Launcher(cfg, environ={"PATH": "/bin", "PLANARIA_API_KEY": "k-123"})
    spec = launcher.frontend(2)
    assert "k-123" not in " ".join(spec.argv) and spec.env["PLANARIA_API_KEY"] == "k-123"
    assert "PLANARIA_API_KEY" not in launcher.engine(0).env
    args = build_parser().parse_args(spec.argv[3:])
    limits = server_limits(args, environ=spec.env)
    assert (limits.max_inflight_requests, limits.request_timeout_s, limits.max_body_bytes, limits.max_connections,
            limits.body_read_timeout_s, limits.keep_alive_timeout_s, limits.render_timeout_s,
            limits.engine_wait_s) == (7, 9.0, 1000, 11, 3.0, 2.0, 4.0, 12.0)
    assert limits.api_key == "k-123" and limits.api_key_protects_metrics and args.tool_call_parser == "none"


def test_defaults_no_key_and_inflight_sized_to_the_engines(tmp_path):
    cfg = _config(tmp_path, ["--engine-config-json", '{"max_num_seqs": 32}'], {"STATE_DIRECTORY": str(tmp_path)})
    spec = Launcher(cfg, environ={"PATH": "/bin"}).frontend(3)
    assert "PLANARIA_API_KEY" not in spec.env
    limits = server_limits(build_parser().parse_args(spec.argv[3:]), environ=spec.env)
    assert limits.api_key is None and not limits.api_key_protects_metrics
    assert limits.max_inflight_requests == 4 * 32 * 3 and limits.max_body_bytes == 4 * 2**20
    assert build_parser().parse_args(spec.argv[3:]).tool_call_parser == "hermes"


def test_an_unknown_tool_call_parser_is_a_config_error(tmp_path):
    with pytest.raises(config_mod.ConfigError, match="--tool-call-parser must be one of hermes, none"):
        _config(tmp_path, ["--tool-call-parser", "mistral"], {"STATE_DIRECTORY": str(tmp_path)})


def test_the_key_from_the_env_file(tmp_path):
    env_file = tmp_path / "planaria.env"
    env_file.write_text("PLANARIA_API_KEY=from-file\nPLANARIA_ARGS=--engines 1\n")
    assert config_mod.env_file_flags(env_file)["api_key"] == "from-file"


def test_compile_flag_reaches_every_engine_with_the_cache_in_the_state_dir(tmp_path):
    import json

    from planaria.engine.config import EngineConfig

    def engine_config(spec):
        return EngineConfig(**json.loads(spec.argv[spec.argv.index("--config-json") + 1]))

    cfg = _config(tmp_path, ["--compile"], {"STATE_DIRECTORY": str(tmp_path)})
    launcher = Launcher(cfg, environ={"PATH": "/bin"})
    spec = launcher.engine(1)
    assert engine_config(spec).compile
    assert spec.env["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "compile-cache").resolve())
    off = Launcher(_config(tmp_path, [], {"STATE_DIRECTORY": str(tmp_path)}), environ={"PATH": "/bin"}).engine(0)
    assert not engine_config(off).compile
    # an operator's own cache location wins
    mine = Launcher(cfg, environ={"PATH": "/bin", "TORCHINDUCTOR_CACHE_DIR": "/var/cache/x"}).engine(0)
    assert mine.env["TORCHINDUCTOR_CACHE_DIR"] == "/var/cache/x"


def test_engines_share_the_nodes_cores_unless_told_otherwise(tmp_path, monkeypatch):
    """Two engines of torch's default threads each on a 2-core node oversubscribe it, and
    lockstep EP ranks then stall streams for seconds (bench/scale_cycles.py): an engine's
    num_threads, unless configured, is the node's cores divided among its engines."""
    import json
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(8)))
    env = {"STATE_DIRECTORY": str(tmp_path)}

    def threads(spec):
        return json.loads(spec.argv[spec.argv.index("--config-json") + 1]).get("num_threads")

    launcher = Launcher(_config(tmp_path, [], env), environ={"PATH": "/bin"})
    assert [threads(launcher.engine(0, num_engines=n)) for n in (1, 2, 3, 8, 20)] == [8, 4, 2, 1, 1]
    mine = Launcher(_config(tmp_path, ["--engine-config-json", '{"num_threads": 5}'], env), environ={"PATH": "/bin"})
    assert threads(mine.engine(0, num_engines=4)) == 5
    gpu = Launcher(_config(tmp_path, ["--engine-config-json", '{"device": "cuda"}'], env), environ={"PATH": "/bin"})
    assert threads(gpu.engine(0, num_engines=4)) is None


def test_batch_invariant_flag_reaches_every_engine(tmp_path):
    import json

    from planaria.engine.config import EngineConfig

    def engine_config(argv):
        spec = Launcher(_config(tmp_path, argv, {"STATE_DIRECTORY": str(tmp_path)}), environ={"PATH": "/bin"}).engine(0)
        return EngineConfig(**json.loads(spec.argv[spec.argv.index("--config-json") + 1]))

    assert engine_config(["--batch-invariant", "on"]).batch_invariant is True
    assert engine_config(["--batch-invariant", "off"]).batch_invariant is False
    assert engine_config([]).batch_invariant is None  # auto: each engine decides (engine/batch_invariance.py)
    with pytest.raises(config_mod.ConfigError, match="on, off or auto"):
        _config(tmp_path, ["--batch-invariant", "yes"], {"STATE_DIRECTORY": str(tmp_path)})
