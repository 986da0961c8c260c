"""The package's layering is a checked contract (import-linter, configured in pyproject.toml), and its
modules stay small, with no private helper imported across subpackages."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "bigmodel"
LINT = Path(sys.executable).with_name("lint-imports")
MAX_LINES = 400


def _lint(root: Path) -> subprocess.CompletedProcess:
    if not LINT.exists():
        pytest.skip("import-linter is not installed (it is in the test extra)")
    env = {**os.environ, "PYTHONPATH": str(root / "src")}
    return subprocess.run([str(LINT)], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layering_contract_holds() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_lower_layer_importing_a_higher_one_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(PACKAGE, tmp_path / "src" / "bigmodel", ignore=shutil.ignore_patterns("__pycache__"))
    sizes = tmp_path / "src" / "bigmodel" / "core" / "sizes.py"
    sizes.write_text(sizes.read_text() + "\nfrom ..dispatch import dispatch as _violation  # noqa\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "Layers: a subpackage imports only the subpackages below it BROKEN" in result.stdout
    assert "bigmodel.core.sizes -> bigmodel.dispatch.dispatch" in result.stdout


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(path: Path) -> list[tuple[int, str, str]]:
    """(line, target module, name) for every ``from X import name`` inside bigmodel."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        if target.startswith("bigmodel."):
            found.extend((node.lineno, target, alias.name) for alias in node.names)
    return found


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def test_no_private_name_is_imported_across_subpackages() -> None:
    crossings = []
    for path in PACKAGE.rglob("*.py"):
        mine = _subpackage(_module_name(path) + (".__init__" if path.name == "__init__.py" else ""))
        for line, target, name in _imported_names(path):
            if name.startswith("_") and _subpackage(target) != mine:
                crossings.append(f"{path.relative_to(ROOT)}:{line} imports {name} from {target}")
    assert crossings == [], "promote these helpers to a public name of their module:\n" + "\n".join(crossings)


def test_no_module_is_over_the_size_guideline() -> None:
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules by concept (at most {MAX_LINES} lines each): {long}"
