"""max_model_len auto-fit: lowered to what the KV cache holds, or refused when strict; the
READY handshake and the frontend use the engine's final figure."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from planaria.engine.config import EngineConfig
from planaria.engine.core import EngineCore
from planaria.engine.errors import KVCacheTooSmallError


def test_lowered_to_the_kv_capacity(tiny_moe):
    core = EngineCore(EngineConfig(model=tiny_moe, num_kv_blocks=8, block_size=16, max_model_len=1024))
    assert core.max_model_len == 128 and core.scheduler.max_model_len == 128


def test_strict_refuses_with_a_clear_message(tiny_moe):
    with pytest.raises(KVCacheTooSmallError, match=r"holds 128 tokens.*max_model_len=1024.*strict_max_model_len"):
        EngineCore(EngineConfig(model=tiny_moe, num_kv_blocks=8, block_size=16, max_model_len=1024,
                                strict_max_model_len=True))
    ok = EngineCore(EngineConfig(model=tiny_moe, num_kv_blocks=8, block_size=16, max_model_len=128,
                                 strict_max_model_len=True))
    assert ok.max_model_len == 128


def test_ready_carries_the_final_figure(tiny_moe):
    from planaria.engine.proc import EngineCoreProc

    proc = EngineCoreProc(0, ["ipc:///nonexistent"], None)
    proc.core = EngineCore(EngineConfig(model=tiny_moe, num_kv_blocks=8, block_size=16, max_model_len=1024))
    assert proc._ready().max_model_len == 128


def test_frontend_uses_the_engines_figure(tiny_moe):
    from planaria.engine.client import EngineInfo, EngineInfoState
    from planaria.frontend.server import create_server

    engines = [EngineInfo(index=0, state=EngineInfoState.RUNNING, max_model_len=128),
               EngineInfo(index=1, state=EngineInfoState.RUNNING, max_model_len=96)]
    client = SimpleNamespace(engines=engines)
    server = create_server(client, tiny_moe, max_model_len=1024)
    assert server.serving.max_model_len == 96  # the smallest healthy engine's
    engines[1].state = EngineInfoState.DEAD
    assert server.serving.max_model_len == 128
