"""The guard's own files, by room: which ones the call-site walk steps over, which ones dynamo skips.

A message names the user's line: the walk up the stack from a patch point steps over
the guard's machinery (``OWN``), torch's files and the standard library's helpers.
The probes in ``_rules.py`` and ``_compositions.py`` are not in it: they stand in for
user code.  Dynamo must never trace the code that runs inside a checkpoint call
(``DYNAMO_SKIPPED``), as it never traces torch's own checkpoint internals; ``_hooks.py``
is not in it (it runs inside ``functional_call`` and ``Optimizer.step``, code dynamo
traces, so it is written to be traced).  A new room adds its file here.

Torch-free: ``_patch`` reads it before torch is imported.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _room(folder: str) -> tuple:
    """Every ``.py`` file of a folder of this package, as paths relative to the package."""
    names = sorted(os.listdir(os.path.join(PACKAGE_DIR, folder)))
    return tuple(os.path.join(folder, name) for name in names if name.endswith(".py"))


#: the readers of torch's state
STATE = _room("_state")
#: the decision, at call and at recompute time, and the words it writes
DECISION = ("_entry.py", "_decide.py", "_drift.py", "_actions.py", "_messages.py")

#: the guard's machinery, absolute paths
OWN = frozenset(
    os.path.join(PACKAGE_DIR, name)
    for name in ("__init__.py", "_config.py", "_events.py", "_hooks.py", "_huggingface.py", "_layouts.py", "_patch.py",
                 "_versions.py", *DECISION, *STATE)
)
#: the composable recompute, but for what ``ckpt_guard.checkpoint`` is when dynamo traces it
COMPOSABLE = tuple(name for name in _room("_composable") if not name.endswith("compiled.py"))
#: what dynamo skips, POSIX-style as dynamo compares them (also on Windows): the composable recompute
#: too (a backward run from a compiled frame, its .backward() a graph break, would have dynamo compile
#: the recompute's frames one by one)
DYNAMO_SKIPPED = tuple(
    (pathlib.Path(PACKAGE_DIR) / name).as_posix()
    for name in ("_patch.py", "_layouts.py", "_config.py", "_events.py", *DECISION, *STATE, *COMPOSABLE)
)


def compile_generated(source: str, filename: str, name: str, namespace: dict) -> Any:
    """The function ``name`` defined by generated ``source``, run in ``namespace``, filed under ``filename``.

    Filed under the guard's file so that dynamo skips it and the call-site walk
    counts it as the guard's; placed past that file's last line so that a
    traceback through it never shows an unrelated line of the file (a
    docstring) as its source: it reads ``line N, in generated_<name>`` and
    the function is named as generated.
    """
    with open(filename, encoding="utf-8") as handle:
        past_the_end = sum(1 for _ in handle) + 1
    code = compile("\n" * past_the_end + source.replace(f"def {name}(", f"def generated_{name}(", 1), filename, "exec")
    exec(code, namespace)  # noqa: S102 - the guard's own generated code
    return namespace[f"generated_{name}"]
