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

import contextlib
import functools
import os
import pathlib
import sys
import threading
from typing import Any

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _room(folder: str) -> tuple:
    """Every ``.py`` file of a folder of this package, as paths relative to the package."""
    names = sorted(os.listdir(os.path.join(PACKAGE_DIR, folder)))
    return tuple(os.path.join(folder, name) for name in names if name.endswith(".py"))


#: the readers of torch's state
STATE = _room("_state")
#: the decision, at call and at recompute time, and the words it writes
DECISION = ("_entry.py", "_decide.py", "_drift.py", "_drift_kinds.py", "_actions.py", "_messages.py", "_transform_entry.py")

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


#: what the walk to the user's line steps over, beside torch's files and the standard library's helpers:
#: the guard's machinery, its composable recompute (a drift check at a recompute is reached from it)
#: and its save policies (their context managers run inside torch's checkpoint)
WALKED_OVER = OWN | frozenset(
    os.path.join(PACKAGE_DIR, name) for name in (*_room("_composable"), "checkpoint_policies.py")
)
#: the standard library's helpers that sit between a user's call and checkpoint (functools.partial,
#: contextlib decorators, threads), by their own paths: a user file named my_functools.py is the user's
_STDLIB_HELPER_FILES = frozenset(
    os.path.abspath(module.__file__) for module in (contextlib, functools, threading) if module.__file__
)

# id(code object) -> (the code object, is it library code?).  Keyed by identity: hashing a code
# object hashes its constants, and dynamo's rewritten code can hold a dict (unhashable).  The entry
# keeps its code object alive, so the id is not reused while cached.  Bounded: generated code (exec,
# torch.fx) makes new code objects forever.
library_codes: dict = {}
CACHE_LIMIT = 1024
_skipped: list = []  # (torch's folder, the helpers' files), read once torch is imported
_FX_GENERATED = "<eval_with_key>"  # the file name torch.fx gives the code it generates


def is_library_code(code: Any) -> bool:
    """Torch's, the guard's or a standard-library helper's code (cached per code object: hot path)."""
    known = library_codes.get(id(code))
    if known is None or known[0] is not code:
        if not _skipped:  # torch's folder is read once torch is imported (this file is torch-free)
            torch_file = sys.modules["torch"].__file__ or ""
            _skipped.append((os.path.dirname(os.path.abspath(torch_file)) + os.sep, _STDLIB_HELPER_FILES))
        torch_dir, helpers = _skipped[0]
        if len(library_codes) >= CACHE_LIMIT:
            library_codes.clear()
        filename = code.co_filename
        known = library_codes[id(code)] = (
            code,
            filename in WALKED_OVER or filename.startswith(torch_dir) or filename in helpers
            or filename.startswith(_FX_GENERATED),  # torch.fx's code (a GraphModule's forward): torch's
        )
    return known[1]


def user_frame(start: Any) -> tuple:
    """``(frame, depth)``: the innermost frame from ``start`` outward that is neither torch's, nor the
    guard's, nor a standard-library helper's, and how many frames out from ``start`` it is.

    The one definition of "the user's line": a message's call site, the line a refusal of the run-time
    proof names, the line ``saved_residuals`` and a save policy's warnings are attributed to.
    """
    frame, depth = start, 0
    while frame is not None and is_library_code(frame.f_code):
        frame = frame.f_back
        depth += 1
    return frame, depth


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
