"""`--extra-client-addresses` over TCP: refused without CurveZMQ keys (unless
--allow-insecure-tcp-clients), and with them the engines and standbys get the key files'
paths, never key material, and a daemon key pair made once, 0600, in the state dir."""

from __future__ import annotations

import argparse
import stat

import pytest

from planaria.common.sockets import ENGINE_CURVE_ENV, engine_curve_keys, load_curve_keypair
from planaria.daemon import config as config_mod
from planaria.daemon.admin_keys import make_keypair
from planaria.daemon.launch import ENGINE_KEYS_DIR, Launcher

TCP_CLIENT = "tcp://10.0.0.5:5555"


def _config(tmp_path, *argv: str) -> config_mod.ServeConfig:
    parser = argparse.ArgumentParser()
    config_mod.add_serve_arguments(parser)
    flags = config_mod.given_flags(parser.parse_args(["--model", str(tmp_path), *argv]))
    return config_mod.build(flags, {"STATE_DIRECTORY": str(tmp_path / "state")})


@pytest.fixture
def server_key(tmp_path):
    public, _secret = make_keypair(tmp_path / "client-keys", "tool")
    return public


def test_tcp_client_without_keys_is_refused(tmp_path):
    with pytest.raises(config_mod.ConfigError, match="--allow-insecure-tcp-clients") as err:
        _config(tmp_path, "--extra-client-addresses", TCP_CLIENT)
    assert "--extra-client-server-key" in str(err.value) and TCP_CLIENT in str(err.value)


def test_ipc_clients_need_no_keys(tmp_path):
    cfg = _config(tmp_path, "--extra-client-addresses", "ipc:///run/planaria/fe1-in")
    assert cfg.extra_client_server_keys() == {}
    assert ENGINE_CURVE_ENV not in Launcher(cfg, environ={}).engine(0).env


def test_insecure_tcp_only_when_asked_for(tmp_path):
    cfg = _config(tmp_path, "--extra-client-addresses", TCP_CLIENT, "--allow-insecure-tcp-clients")
    assert cfg.allow_insecure_tcp_clients and cfg.extra_client_server_keys() == {}
    spec = Launcher(cfg, environ={}).engine(0)
    assert TCP_CLIENT in spec.argv and ENGINE_CURVE_ENV not in spec.env


def test_the_insecure_switch_works_from_the_env_file(tmp_path):
    env_file = tmp_path / "planaria.env"
    env_file.write_text(f"PLANARIA_ARGS='--extra-client-addresses {TCP_CLIENT} "
                        "--allow-insecure-tcp-clients'\n")
    assert config_mod.env_file_flags(env_file) == {
        "extra_client_addresses": TCP_CLIENT, "allow_insecure_tcp_clients": True}


def test_keys_reach_engines_and_standbys_as_paths(tmp_path, server_key):
    cfg = _config(tmp_path, "--extra-client-addresses", f"ipc:///x/fe1-in,{TCP_CLIENT}",
                  "--extra-client-server-key", str(server_key), "--parallel", "ep")
    assert cfg.extra_client_server_keys() == {TCP_CLIENT: str(server_key)}
    launcher = Launcher(cfg, environ={})
    engine, standby = launcher.engine(0), launcher.standby(0, str(tmp_path / "s.ready"))
    secret_file = tmp_path / "state" / ENGINE_KEYS_DIR / "engine.key_secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(secret_file.parent.stat().st_mode) == 0o700
    public, secret = load_curve_keypair(secret_file)
    for spec in (engine, standby):
        assert engine_curve_keys(spec.env)[TCP_CLIENT].secret_key == secret
        words = " ".join(spec.argv) + " ".join(spec.env.values())
        assert secret.decode() not in words and public.decode() not in words
    # made once: a restarted daemon (a new launcher) keeps the pair a client authorized
    assert engine_curve_keys(Launcher(cfg, environ={}).curve_env)[TCP_CLIENT].public_key == public


def test_one_key_per_tcp_client_or_one_for_all(tmp_path, server_key):
    other, _ = make_keypair(tmp_path / "client-keys", "other")
    two = f"{TCP_CLIENT},tcp://10.0.0.6:5555"
    cfg = _config(tmp_path, "--extra-client-addresses", two,
                  "--extra-client-server-key", f"{server_key},{other}")
    assert cfg.extra_client_server_keys() == {TCP_CLIENT: str(server_key),
                                              "tcp://10.0.0.6:5555": str(other)}
    cfg = _config(tmp_path, "--extra-client-addresses", two, "--extra-client-server-key", str(server_key))
    assert set(cfg.extra_client_server_keys().values()) == {str(server_key)}
    with pytest.raises(config_mod.ConfigError, match="2 key files for 1"):
        _config(tmp_path, "--extra-client-addresses", TCP_CLIENT,
                "--extra-client-server-key", f"{server_key},{other}")


def test_bad_key_settings_are_refused(tmp_path, server_key):
    with pytest.raises(config_mod.ConfigError, match="not a file"):
        _config(tmp_path, "--extra-client-addresses", TCP_CLIENT,
                "--extra-client-server-key", str(tmp_path / "missing.key"))
    with pytest.raises(config_mod.ConfigError, match="there are none"):
        _config(tmp_path, "--extra-client-server-key", str(server_key))


def test_a_relative_key_path_is_made_absolute(tmp_path, server_key, monkeypatch):
    monkeypatch.chdir(server_key.parent)
    cfg = _config(tmp_path, "--extra-client-addresses", TCP_CLIENT,
                  "--extra-client-server-key", server_key.name)
    assert cfg.extra_client_server_key == str(server_key)  # engines run in the state dir
