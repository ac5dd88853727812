"""engine/core_protocol.py: both engine cores implement every method the engine process
calls, with the protocol's parameters (checked on the classes: no model is loaded)."""

from __future__ import annotations

import inspect

import pytest

from planaria.engine.core import EngineCore
from planaria.engine.core_protocol import EngineCoreProtocol
from planaria.engine.pooling import PoolingEngineCore

METHODS = sorted(name for name, value in vars(EngineCoreProtocol).items()
                 if inspect.isfunction(value) and not name.startswith("_"))


@pytest.mark.parametrize("cls", [EngineCore, PoolingEngineCore], ids=["generation", "pooling"])
@pytest.mark.parametrize("method", METHODS)
def test_core_implements_the_protocol_method(cls, method):
    impl = inspect.signature(getattr(cls, method))
    want = inspect.signature(getattr(EngineCoreProtocol, method))
    assert list(impl.parameters)[:len(want.parameters)] == list(want.parameters)


@pytest.mark.parametrize("cls, is_pooling", [(EngineCore, False), (PoolingEngineCore, True)],
                         ids=["generation", "pooling"])
def test_core_says_whether_it_pools(cls, is_pooling):
    assert cls.is_pooling is is_pooling
