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


def _tree(name: str) -> ast.Module:
    with open(MODULES[name]) as source:
        return ast.parse(source.read())


def _from_target(name: str, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``name`` reads from, relative levels resolved."""
    if not node.level:
        return node.module or ""
    anchor = (name if _is_package(name) else name.rpartition(".")[0]).split(".")
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join(anchor + ([node.module] if node.module else []))


def _import_time_imports(name: str) -> set:
    """The package's modules ``name`` imports when it is imported (module level, not in functions)."""
    found = set()
    for node in _tree(name).body:  # top level only: a lazy import in a function is no import-time cycle
        if isinstance(node, ast.ImportFrom):
            target = _from_target(name, node)
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



# --------------------------------------------------------------------------
# rooms (issue 49): a subpackage is one room, and so are the rule table's two files; every other
# module of the package is a room of its own.  The front door (``ckpt_guard/__init__``) is no
# room: the rule table's live probes call ``ckpt_guard.checkpoint`` as a user does.

FRONT_DOOR = "ckpt_guard"
RULE_TABLE = {"ckpt_guard._rules", "ckpt_guard._compositions"}


def room_of(module: str) -> str:
    if module in RULE_TABLE:
        return "the rule table"
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and _is_package(module)):
        return ".".join(parts[:2])
    return module


def _imports_anywhere(name: str, tree: ast.Module) -> list:
    """``(imported module, names taken from it or None, alias)`` for every import of the package's
    modules in ``name`` (parsed as ``tree``), lazy ones (inside functions) included."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _from_target(name, node)
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in MODULES:
                    found.append((submodule, None, alias.asname or alias.name))
                elif target in MODULES:
                    found.append((target, alias.name, alias.asname or alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, None, alias.asname or alias.name) for alias in node.names if alias.name in MODULES]
    return found


def _room_graph() -> dict:
    graph: dict = {}
    for name in MODULES:
        for target, _, _ in _imports_anywhere(name, _tree(name)):
            if target != FRONT_DOOR and name != FRONT_DOOR and room_of(target) != room_of(name):
                graph.setdefault(room_of(name), set()).add(room_of(target))
    return graph


def test_no_loop_between_rooms():
    """The house points one way: no room imports, even lazily, a room that imports it back."""
    graph = _room_graph()

    def reaches(start: str, goal: str) -> list:
        seen, stack = {start}, [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == goal:
                    return path + [nxt]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return []

    loops = {" -> ".join([room] + reaches(nxt, room)) for room in graph for nxt in graph[room] if reaches(nxt, room)}
    assert not loops, "loops between rooms:\n" + "\n".join(sorted(loops))


def test_the_composable_recompute_imports_no_decision():
    """``_composable`` is an engine with doors outside it (``_entry``, ``_decide``): it reads the state,
    the configuration, the rule table, the exceptions and the guard's file list (where the user's line
    is), and never the decision, its words or the doors."""
    assert _room_graph()["ckpt_guard._composable"] <= {
        "ckpt_guard._state", "ckpt_guard._config", "ckpt_guard._exceptions", "the rule table", "ckpt_guard._files",
    }


def test_no_private_name_crosses_rooms():
    """A name another room uses is that room's public name: no ``from ..x import _name``, no ``x._name``."""
    crossing = set()
    for name in MODULES:
        tree = _tree(name)
        imports = _imports_anywhere(name, tree)
        for target, taken, _ in imports:
            if taken and taken.startswith("_") and not taken.startswith("__") and room_of(target) != room_of(name):
                crossing.add(f"{name} imports {target}.{taken}")
        modules_by_alias = {alias: target for target, taken, alias in imports if taken is None}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = modules_by_alias.get(node.value.id)
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                if target and private and room_of(target) != room_of(name) and f"{target}.{node.attr}" not in MODULES:
                    crossing.add(f"{name} reads {target}.{node.attr}")
    assert not crossing, "private names crossing rooms:\n" + "\n".join(sorted(crossing))

def _names_a_reader(node: ast.AST) -> bool:
    """A string, or a tuple, list or set of strings: a reader's name."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_reader(element) for element in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def test_a_drift_rule_is_one_object_no_branch_outside_it_names_its_reader():
    """Issue 49, item 4: what the decision does with a drift rule is its kind's (``_drift_kinds``); no
    other module compares a rule's ``read`` with a reader's name, and no reader carries the rule's
    behaviour (``describe_change``, ``relevant``) as a function attribute."""
    from ckpt_guard._drift_kinds import DRIFT_KINDS, _KIND_FOR_READER
    from ckpt_guard._rules import DRIFT_RULES

    branching = []
    for name in MODULES:
        if name == "ckpt_guard._drift_kinds":
            continue
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.Compare) and any(
                isinstance(side, ast.Attribute) and side.attr == "read" for side in [node.left, *node.comparators]
            ) and any(_names_a_reader(side) for side in node.comparators):
                branching.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Attribute) and target.attr in ("describe_change", "relevant")
                for target in node.targets
            ):
                branching.append(f"{name}:{node.lineno} (a reader's behaviour as its attribute)")
    assert not branching, "by-name branches on a drift rule's reader outside _drift_kinds:\n" + "\n".join(branching)
    assert [kind.rule for kind in DRIFT_KINDS] == list(DRIFT_RULES)
    # every reader a record names that does more than compare has its kind: the registry knows no stale name
    assert set(_KIND_FOR_READER) <= {rule.read for rule in DRIFT_RULES}


#: a plan's three records (``_composable/records.py``) and the one file that writes each
RECORD_WRITERS = {
    "at_call": "ckpt_guard._composable.records",  # made whole by its constructor
    "found": "ckpt_guard._composable.plan",
    "world": "ckpt_guard._composable.plan",
}


def _record_written(target: ast.AST) -> str:
    """The record a store writes into (``plan.found.read = ...``, ``plan.found.versions_after[i] = ...``), or ''."""
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute):
        return target.value.attr if target.value.attr in RECORD_WRITERS else ""
    return ""


def test_each_record_of_a_plan_has_one_writer():
    """Issue 49, item 3: what the call is, what its first forward found and the world a recompute replays
    are three records; each field is assigned in one file only (others ask the plan: ``Plan.refuse``,
    ``Plan.hand_in_copy``, ...).  The records file itself writes only ``self``'s fields."""
    strays = []
    for name in MODULES:
        for node in ast.walk(_tree(name)):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for leaf in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
                    record = _record_written(leaf)
                    if record and RECORD_WRITERS[record] != name:
                        strays.append(f"{name}:{node.lineno} writes {record}")
    assert not strays, "a record written outside its one writer:\n" + "\n".join(strays)


def test_every_module_says_what_it_owns():
    for name in MODULES:
        doc = ast.get_docstring(_tree(name))
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


def test_the_guards_file_lists_name_files_that_exist():
    """``_files`` lists the guard's files by path (the call-site walk steps over them, dynamo skips them):
    a file moved between rooms must move there too, or messages name the guard's line and dynamo traces it."""
    from ckpt_guard import _files

    listed = set(_files.OWN) | {os.path.normpath(path) for path in _files.DYNAMO_SKIPPED}
    assert sorted(path for path in listed if not os.path.isfile(path)) == []
    here = {os.path.normpath(path) for path in MODULES.values()}
    assert os.path.normpath(os.path.join(PACKAGE, "_entry.py")) in here & set(_files.OWN)
