"""Shared fixtures: demo checkpoints built once per session, offline HF settings."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(scope="session")
def demo_models(tmp_path_factory):
    """Factory: demo_models("tiny-moe") -> path of a built checkpoint (cached per session)."""
    from planaria.engine.demo_model import build_demo_model

    root = tmp_path_factory.mktemp("models")
    built: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in built:
            built[preset] = str(build_demo_model(root / preset, preset=preset, progress=lambda _: None))
        return built[preset]

    return get


@pytest.fixture(scope="session")
def tiny_moe(demo_models) -> str:
    return demo_models("tiny-moe")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly where torch sees no CUDA device."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)
