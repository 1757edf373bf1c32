"""The house's shape (issue 28): rooms by job, none over 900 lines, no import cycle, each says what it owns.

And the words users read did not move when the rooms did: ``explain`` for every rule is
byte-identical to the text recorded in ``tests/golden/explain/`` before the split (a
change of a rule's words is a deliberate change of those files, reviewed as such).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

from ckpt_guard._rules import RULE_IDS

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "ckpt_guard")
GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden", "explain")
#: the two rule tables are records, one per rule: they may grow past the limit
TABLES = {"_rules.py", "_compositions.py"}
LIMIT = 900


def _modules() -> dict:
    """``{dotted module name: path}`` for every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                relative = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[relative.removesuffix(".__init__")] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].endswith("__init__.py")


def _import_time_imports(name: str) -> set:
    """The package's modules ``name`` imports when it is imported (module level, not in functions)."""
    tree = ast.parse(open(MODULES[name]).read())
    base = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in tree.body:  # top level only: a lazy import in a function is no import-time cycle
        if isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = {f"{target}.{alias.name}" for alias in node.names} & MODULES.keys()
            found |= submodules  # from . import _config: that module
            if target in MODULES and len(submodules) < len(node.names):
                found.add(target)  # a name the module (or package __init__) defines
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in MODULES}
    return {m for m in found if m != name}


def test_no_code_module_is_over_900_lines():
    long = {
        name: sum(1 for _ in open(path))
        for name, path in MODULES.items() if os.path.basename(path) not in TABLES
    }
    assert {name: n for name, n in long.items() if n > LIMIT} == {}


def test_no_import_cycle():
    graph = {name: _import_time_imports(name) for name in MODULES}
    state: dict = {}

    def visit(node: str, path: list) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])


def test_the_readers_never_import_the_decision_the_words_or_the_composable_recompute():
    """_state/ reads torch's state; it may not decide (the docstring of _state says so)."""
    forbidden = ("ckpt_guard._decide", "ckpt_guard._drift", "ckpt_guard._messages", "ckpt_guard._composable")
    for name in MODULES:
        if name.startswith("ckpt_guard._state"):
            assert not [m for m in _import_time_imports(name) if m.startswith(forbidden)], name


def test_every_module_says_what_it_owns():
    for name, path in MODULES.items():
        doc = ast.get_docstring(ast.parse(open(path).read()))
        assert doc and len(doc) > 40, f"{name} has no docstring saying what it owns"


@pytest.mark.parametrize("rule_id", RULE_IDS)
def test_explain_is_byte_identical_to_the_recorded_text(rule_id):
    result = subprocess.run(
        [sys.executable, "-m", "ckpt_guard", "explain", rule_id],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("CKPT_GUARD_")},
    )
    assert result.returncode == 0, result.stderr
    with open(os.path.join(GOLDEN, f"{rule_id}.txt"), encoding="utf-8") as recorded:
        assert result.stdout == recorded.read()


def test_every_rule_has_a_recorded_explain_text():
    assert sorted(name[:-4] for name in os.listdir(GOLDEN)) == sorted(RULE_IDS)


def test_generated_code_is_attributed_past_its_files_end_never_to_a_docstring_line():
    """Issue 27: a traceback through the generated block snapshot showed a line of the file's docstring.
    The generated functions (the drift capture, the block snapshot) are filed under the guard's own file
    (dynamo skips it), past its last line, and named generated_*."""
    import traceback

    import torch

    from ckpt_guard import _drift, _files
    from ckpt_guard._state import modules

    def lines_of(path):
        with open(path, encoding="utf-8") as handle:
            return sum(1 for _ in handle)

    block = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())
    assert modules.block_snapshot(block)  # a snapshot compiled for this shape
    generated = [_drift.capture, *modules._snapshots.values()]
    assert len(generated) >= 2
    for function in generated:
        code = function.__code__
        assert code.co_name.startswith("generated_"), code.co_name
        assert code.co_firstlineno > lines_of(code.co_filename), (code.co_filename, code.co_firstlineno)

    failing = _files.compile_generated("def boom(x):\n    return 1 // x\n", _files.__file__, "boom", {})
    try:
        failing(0)
    except ZeroDivisionError as error:
        frame = traceback.extract_tb(error.__traceback__)[-1]
    assert frame.filename == _files.__file__ and frame.name == "generated_boom"
    assert frame.lineno > lines_of(_files.__file__) and not frame.line  # no unrelated source line shown
