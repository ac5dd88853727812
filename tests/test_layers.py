"""Import layers, read from the source (ast), not by importing anything.

planaria.common is the bottom layer of the admin and logging plumbing: daemon and frontend
both import it and never each other (the supervisor reaches a frontend over its admin
socket, common.admin_client.FrontendAdminClient); common itself imports no other planaria
package; planaria.kernels imports no other planaria package either.
"""

from __future__ import annotations

import ast
from pathlib import Path


PLANARIA = Path(__file__).resolve().parents[1] / "planaria"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLANARIA.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(source: str, package: str) -> set[str]:
    """Every module ``source`` (a module of ``package``) imports, anywhere in it (function
    level too), relative imports resolved; ``from a import b`` counts as ``a.b`` too."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _crossings(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """{module of ``package``: the imports of it that fall in ``forbidden`` packages}."""
    out = {}
    for path in sorted((PLANARIA / package).rglob("*.py")):
        name = _module_name(path)
        package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bad = sorted(n for n in _imports(path.read_text(), package_of)
                     if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad:
            out[name] = bad
    return out


def _other_planaria_packages(package: str) -> tuple[str, ...]:
    return tuple(f"planaria.{p.name}" for p in PLANARIA.iterdir()
                 if p.is_dir() and (p / "__init__.py").is_file() and p.name != package)


def test_the_import_reader_sees_function_level_and_relative_imports():
    source = ("def f():\n    from planaria.frontend import admin\n    import planaria.daemon.cli\n"
              "from ..frontend.server import x\nfrom . import loop\n")
    assert _imports(source, "planaria.daemon") >= {
        "planaria.frontend.admin", "planaria.daemon.cli", "planaria.frontend.server", "planaria.daemon.loop"}


def test_daemon_does_not_import_frontend():
    assert _crossings("daemon", ("planaria.frontend",)) == {}


def test_frontend_does_not_import_daemon():
    assert _crossings("frontend", ("planaria.daemon",)) == {}


def test_common_imports_no_other_planaria_package():
    assert _crossings("common", _other_planaria_packages("common")) == {}


def test_kernels_import_no_other_planaria_package():
    assert _crossings("kernels", _other_planaria_packages("kernels")) == {}
