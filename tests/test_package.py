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


def test_every_subpackage_goes_into_the_wheel():
    """setuptools is given the package list: a room made a folder (``_state/``) must be on it."""
    folders = sorted(
        os.path.relpath(folder, REPO_ROOT).replace(os.sep, ".")
        for folder, _, files in os.walk(PACKAGE) if "__init__.py" in files or folder.endswith("_autoinstall")
    )
    pyproject = open(os.path.join(REPO_ROOT, "pyproject.toml"), encoding="utf-8").read()
    listed = ast.literal_eval(pyproject.split("\npackages = ", 1)[1].split("\n", 1)[0])
    assert sorted(listed) == folders


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


def _readme() -> str:
    with open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_the_readme_keeps_to_its_first_screen_and_its_install_section_stands_alone():
    """A new user followed 'install the torch you want first' into a 5.4 GB CUDA build, and met a
    placeholder URL and 'this machine' (issue 30): the install section says how to get each torch."""
    import re

    text = _readme()
    assert len(text.splitlines()) <= 300
    install = text.split("## Install it into your project", 1)[1].split("\n## ", 1)[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in install  # the CPU torch
    assert re.search(r"--index-url https://download.pytorch.org/whl/cu\d+", install)  # a CUDA torch
    assert "git+https://" in install and "<its repository URL>" not in text
    assert "this machine" not in text


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file():
    import re

    for folder, name in [("", "README.md"), *(("docs", n) for n in os.listdir(os.path.join(REPO_ROOT, "docs")) if n.endswith(".md"))]:
        path = os.path.join(REPO_ROOT, folder, name)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            assert os.path.exists(os.path.join(os.path.dirname(path), target)), f"{folder}/{name}: {target}"
