"""One import namespace: everything of ours is `planaria.*`, and the generic names others
ship (Hugging Face's `kernels`, which transformers imports) work beside it in one venv."""
import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_LEVEL_DIRS_ALLOWED = {"planaria", "tests", "bench"}

_PROBE = r"""
import json, sys
import kernels, transformers
from kernels import CUDAProperties, Device
from transformers.utils.import_utils import is_kernels_available
import transformers.integrations.hub_kernels as hub_kernels
is_kernels_available.cache_clear()
import planaria.kernels, planaria.engine
from planaria.engine import LLM, SamplingParams
print(json.dumps({
    "kernels": kernels.__file__, "planaria_kernels": planaria.kernels.__file__,
    "available": is_kernels_available(), "device": str(Device(type="cpu").type),
    "hub_kernels": hub_kernels.__name__, "sys_path0": sys.path[0],
}))
"""


def test_hf_kernels_imports_and_works_beside_planaria():
    # From the repository root, where a top-level `kernels/` of ours used to shadow it.
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "site-packages" in got["kernels"]
    assert not got["kernels"].startswith(str(REPO / "kernels"))
    assert got["planaria_kernels"].startswith(str(REPO / "planaria" / "kernels"))
    assert got["available"] is True and got["device"] == "cpu"


def test_no_top_level_package_but_planaria():
    pkgs = {p.name for p in REPO.iterdir() if (p / "__init__.py").is_file()}
    assert pkgs <= TOP_LEVEL_DIRS_ALLOWED, pkgs - TOP_LEVEL_DIRS_ALLOWED
    # What the installed distribution maps as importable top-level names (the dist-info,
    # not the egg-info that an editable build leaves in the checkout).
    (dist,) = [d for d in importlib.metadata.distributions(name="planaria") if d.read_text("RECORD")]
    tops = set()
    for f in dist.files or ():
        if f.name.startswith("__editable__") and f.suffix == ".py":  # an editable install's finder
            text = f.read_text()
            mapping = ast.literal_eval(text.split("MAPPING: dict[str, str] = ", 1)[1].split("\n", 1)[0])
            tops |= set(mapping)
        elif f.suffix == ".py" and len(f.parts) > 1 and not f.parts[0].endswith(".dist-info"):
            tops.add(f.parts[0])
    assert tops == {"planaria"}, tops
    (script,) = tuple(dist.entry_points.select(group="console_scripts", name="planaria"))
    assert script.value == "planaria.daemon.cli:main"
