"""The package as users get it: its README example runs, its modules import no cycle, it is typed,
its `dir()` is its API."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO_ROOT, "ckpt_guard")


def test_the_readme_torch_func_example_runs_as_written(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO_ROOT, "tests", "readme_example.py"), os.path.join(REPO_ROOT, "README.md")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "'head.weight': (8, 1, 16)" in proc.stdout, proc.stdout


def _imports() -> dict:
    """module -> the package modules it imports (at any depth of its code)."""
    graph = {}
    for name in os.listdir(PACKAGE):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(PACKAGE, name), encoding="utf-8").read())
            found = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level == 1:
                    found.update([node.module] if node.module else [a.name for a in node.names])
            graph[name[:-3]] = found
    return graph


def test_no_two_modules_import_each_other():
    graph = _imports()
    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if a in graph.get(b, ())})
    assert cycles == []


def test_the_package_is_typed():
    assert os.path.exists(os.path.join(PACKAGE, "py.typed"))
    pyproject = open(os.path.join(REPO_ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert '"py.typed"' in pyproject


def test_dir_lists_the_public_names_and_each_resolves():
    """Tab completion shows the API, not the module's own imports (``Optional``, ``contextlib``)."""
    import ckpt_guard

    assert dir(ckpt_guard) == sorted([*ckpt_guard.__all__, "__version__"])
    for name in dir(ckpt_guard):
        assert getattr(ckpt_guard, name) is not None, name
