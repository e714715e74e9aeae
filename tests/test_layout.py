"""The house's import rules, as lint: one import name (`ballast`), and a training side that never imports
Airflow or the orchestrator (what a training pod runs has neither). `test_ruff_holds_the_import_rules` runs
ruff with the rules pyproject.toml and training/ruff.toml declare (the parse-time budget's banned imports
too); the unit test below is the same boundary read from the code's syntax, so that it holds without ruff."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

SOURCES = ("plugins", "training", "data_checks", "dags", "tests")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def _top(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.unit
def test_the_training_side_imports_neither_airflow_nor_the_orchestrator():
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in sorted((ROOT / "training").rglob("*.py"))
           for line, name in _imports(p)
           if _top(name, "airflow") or (_top(name, "ballast") and not _top(name, "ballast.training"))]
    assert not bad, "training/ runs in training processes (no Airflow, no orchestrator): " + "; ".join(bad)


@pytest.mark.unit
def test_one_import_name():
    """`training` and `data_checks` are `ballast.training` and `ballast.data_checks`: a user's own folder named
    `training` can neither shadow ours nor be shadowed."""
    bad = [f"{p.relative_to(ROOT)}:{line}: {name}" for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))
           for line, name in _imports(p) if _top(name, "training", "data_checks")]
    assert not bad, "import these as ballast.training / ballast.data_checks: " + "; ".join(bad)


@pytest.mark.integration
def test_ruff_holds_the_import_rules():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.fail("ruff is not installed in the test environment (the test extra pins it): make test installs it")
    proc = subprocess.run([ruff, "check", "--no-cache", "--select", "TID251,TID253", "plugins", "dags", "training",
                           "data_checks"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
