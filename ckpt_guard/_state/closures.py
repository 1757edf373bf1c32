"""Reader's helper: the closure cells a function block reads through, its own and its helpers'.

A block given as ``lambda h: inner(h)`` reads what ``inner`` holds as much as
what it holds itself; each reader of a closure (the block snapshot, CKG110's
re-bound values, the containers CKG112 keeps) walks these cells, one walk.
"""

from __future__ import annotations

import types


#: how many functions a closure's cells lead to are followed for what they hold: ``lambda h:
#: inner(h)`` where ``inner`` is itself a closure over a module or a tensor (a closure of a closure)
CLOSURE_FUNCTIONS_LIMIT = 16


def closure_cells(function: types.FunctionType) -> list:
    """``[(cell, name)]``: the function's closure cells, then those of each function they hold, in turn
    (named ``"'w' (of main.<locals>.inner, which the block calls)"`` past the block's own).

    A block ``lambda h: inner(h)`` reads what ``inner``'s cells hold as much as
    its own: a module behind it is advanced again by torch's recompute, a
    tensor re-bound there is read anew.  Followed breadth-first, each function
    once, up to :data:`CLOSURE_FUNCTIONS_LIMIT` functions (a closure holding
    a long chain of helpers is watched in its first ones).  A function
    reached through a module, a container or a global is not followed.
    """
    found: list = []
    queue, seen = [function], {id(function)}
    while queue and len(seen) <= CLOSURE_FUNCTIONS_LIMIT:
        current = queue.pop(0)
        owner = "" if current is function else f" (of {current.__qualname__}, which the block calls)"
        for cell, name in zip(current.__closure__ or (), current.__code__.co_freevars):
            found.append((cell, repr(name) + owner))
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: reading it fails for the caller, as for the function
                continue
            if type(value) is types.FunctionType and value.__closure__ and id(value) not in seen:
                seen.add(id(value))
                queue.append(value)
    return found
