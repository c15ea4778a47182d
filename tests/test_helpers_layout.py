"""Tests share helpers through helper modules (conftest.py, draws.py, hf_util.py, plots.py,
stats_util.py, table_worker.py, ...), never by importing another test module: a test file can
then be moved, split or deleted without breaking others, and pytest never collects a test
module twice under two names."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(TESTS)}:{node.lineno} imports {name}"
                          for name in names if name.rpartition(".")[2].startswith("test_")]
    assert not offenders, offenders
