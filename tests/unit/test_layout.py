"""Architecture rules that keep the layout honest."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported_modules(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_library_never_imports_grpc():
    offenders = []
    for path in (ROOT / "specmesh").rglob("*.py"):
        if "proto" in path.relative_to(ROOT / "specmesh").parts[:1]:
            continue
        if any(m == "grpc" or m.startswith("grpc.") or m.startswith("grpc_") for m in _imported_modules(path)):
            offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"specmesh/ must not import grpc: {offenders}"


def test_stubs_are_fresh():
    import subprocess
    import sys

    result = subprocess.run([sys.executable, str(ROOT / "protos" / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_console_script_resolves():
    import importlib
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"specmesh", "specmesh-draft", "specmesh-verify", "specmesh-stage"} <= set(scripts)
    for name, target in scripts.items():
        module_name, _, attribute = target.partition(":")
        assert callable(getattr(importlib.import_module(module_name), attribute)), name


def test_test_module_names_are_unique():
    """pytest imports a test file outside any package by its base name (the default "prepend" import
    mode), so two `test_x.py` in different folders stop plain `pytest` at collection ("import file
    mismatch"). Helpers (`*_helpers.py`) are imported by base name too."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name != "conftest.py":  # pytest imports each conftest.py apart
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"test modules that share a base name: {clashes}"


def test_tests_import_their_helpers_by_base_name():
    """tests/ is no package: `from tests.engine.engine_helpers import x` works only when the repository
    root happens to be on sys.path (`python -m pytest`), not under plain `pytest`."""
    offenders = [f"{path.relative_to(ROOT)}: {name}" for path in sorted((ROOT / "tests").rglob("*.py"))
                 for name in _imported_modules(path) if name == "tests" or name.startswith("tests.")]
    assert not offenders, f"import test helpers by base name (`from engine_helpers import ...`): {offenders}"
