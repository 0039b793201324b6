"""Dependencies point inward: the kernel imports no service and no app module; services never import each other
nor the app. Read from the source (every import statement, lazy ones inside functions included)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"generator", "reward", "learner"}
APP = "cli"
# package -> the project packages it must never import
FORBIDDEN = {
    "services": SERVICES | {APP},
    **{service: (SERVICES - {service}) | {APP} for service in SERVICES},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package, line) of every absolute import in a file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.module.split(".")[0], node.lineno))
    return found


def violations(package: str) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{line} imports {target}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for target, line in sorted(imported_packages(path))
        if target in FORBIDDEN[package]
    ]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_dependencies_point_inward(package):
    assert violations(package) == []


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from learner.dapo import x\n    import cli.main\n")
    assert imported_packages(module) == {("learner", 2), ("cli", 3)}


def test_every_installed_package_is_in_a_layer():
    listed = re.search(r"^packages = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert set(re.findall(r'"([^".]+)"', listed)) == set(FORBIDDEN) | {APP}
