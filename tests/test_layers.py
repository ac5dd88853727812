"""Import layers, read from the source (ast), not by importing anything.

- daemon and frontend never import each other (the supervisor reaches a frontend over its
  admin socket, common.admin_client.FrontendAdminClient); frontend imports only common
  and engine;
- elastic imports neither daemon nor frontend;
- engine imports only common and kernels;
- common and kernels import no other planaria package.

planaria.common is the bottom layer of the admin and logging plumbing; planaria.kernels is
tensors in, tensors out. Every import statement counts, wherever it is (module level,
inside a function or a class), relative ones resolved, and so does
``importlib.import_module("planaria.x...")`` with a literal (or f-string) name. Test and
bench scaffolding lives in tests/ (tests/elastic/_deployment.py), outside these rules.
"""

from __future__ import annotations

import ast
from pathlib import Path


PLANARIA = Path(__file__).resolve().parents[1] / "planaria"
_IMPORT_FUNCTIONS = ("import_module", "__import__")


def _module_name(path: Path, root: Path = PLANARIA) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _dynamic_import(node: ast.Call) -> str | None:
    """The module an ``importlib.import_module(...)`` or ``__import__(...)`` call names, as
    far as the source spells it (an f-string's literal head); None for any other call."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in _IMPORT_FUNCTIONS or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".") or None
    return None


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
        elif isinstance(node, ast.Call):
            module = _dynamic_import(node)
            if module is not None:
                names.add(module)
    return names


def _crossings(package: str, forbidden: tuple[str, ...], root: Path = PLANARIA) -> dict[str, list[str]]:
    """{module of ``package``: the imports of it that fall in ``forbidden`` packages}."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        name = _module_name(path, root)
        package_of = name if path.name == "__init__.py" else name.rpartition(".")[0]
        bad = sorted(n for n in _imports(path.read_text(), package_of)
                     if any(n == f or n.startswith(f + ".") for f in forbidden))
        if bad:
            out[name] = bad
    return out


def _planaria_parts(root: Path = PLANARIA) -> set[str]:
    """Every subpackage and top-level module of planaria (a new one is covered at once)."""
    return {p.name if p.is_dir() else p.stem for p in root.iterdir()
            if (p.is_dir() and (p / "__init__.py").is_file())
            or (p.suffix == ".py" and p.name != "__init__.py")}


def _all_but(package: str, *allowed: str, root: Path = PLANARIA) -> tuple[str, ...]:
    """The planaria parts ``package`` must not import: all but itself and ``allowed``."""
    for name in (package, *allowed):
        assert name in _planaria_parts(root), f"no planaria.{name}"  # a renamed layer fails loudly
    return tuple(sorted(f"planaria.{p}" for p in _planaria_parts(root) - {package, *allowed}))


def test_the_import_reader_sees_function_level_relative_and_dynamic_imports():
    source = ("def f():\n    from planaria.frontend import admin\n    import planaria.daemon.cli\n"
              "from ..frontend.server import x\nfrom . import loop\n"
              "class C:\n    def g(self):\n        import planaria.elastic.ep\n"
              "importlib.import_module('planaria.engine.core')\n"
              "__import__('planaria.kernels.moe')\n"
              "importlib.import_module(f'planaria.daemon.commands.{name}')\n")
    assert _imports(source, "planaria.daemon") >= {
        "planaria.frontend.admin", "planaria.daemon.cli", "planaria.frontend.server", "planaria.daemon.loop",
        "planaria.elastic.ep", "planaria.engine.core", "planaria.kernels.moe", "planaria.daemon.commands"}


def test_a_crossing_inside_a_function_fails_the_rule(tmp_path):
    root = tmp_path / "planaria"
    for package in ("engine", "daemon", "common"):
        (root / package).mkdir(parents=True)
        (root / package / "__init__.py").write_text("")
    (root / "engine" / "ok.py").write_text("from planaria.common import x\nfrom . import ok\n")
    (root / "engine" / "bad.py").write_text("import os\n\ndef f():\n    from ..daemon import loop\n")
    assert _crossings("engine", _all_but("engine", "common", root=root), root) == {
        "planaria.engine.bad": ["planaria.daemon", "planaria.daemon.loop"]}


def test_daemon_does_not_import_frontend():
    assert _crossings("daemon", ("planaria.frontend",)) == {}


def test_frontend_imports_only_common_and_engine():
    assert _crossings("frontend", _all_but("frontend", "common", "engine")) == {}


def test_elastic_does_not_import_daemon_or_frontend():
    assert _crossings("elastic", ("planaria.daemon", "planaria.frontend")) == {}


def test_engine_imports_only_common_and_kernels():
    assert _crossings("engine", _all_but("engine", "common", "kernels")) == {}


def test_common_imports_no_other_planaria_package():
    assert _crossings("common", _all_but("common")) == {}


def test_kernels_import_no_other_planaria_package():
    assert _crossings("kernels", _all_but("kernels")) == {}
