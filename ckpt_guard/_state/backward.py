"""Reader: a reentrant backward that builds a graph (CKG114), marked by the patched backward."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator


# --------------------------------------------------------------------------
# the backward a reentrant recompute runs in (CKG114)
#
# torch's reentrant checkpoint takes the block's gradients with a backward of its
# own, which builds no graph whatever the backward running it was asked for.  Under
# ``.backward(create_graph=True)`` the gradients through the block are then constants:
# a gradient penalty or a Hessian-vector product loses the block's terms, silently.
# Grad mode when ``CheckpointFunction.backward`` starts is the engine's create_graph;
# ``_layouts.guard_backward`` notes it here for the recompute to read.

_REENTRANT_BACKWARD = threading.local()
#: reentrant backwards building a graph now, on any thread: the capture's cheap gate (a
#: missing attribute of a threading.local costs ~0.6 µs to ask for; this, ~0.04 µs)
_GRAPH_BUILDING = [0]
_GRAPH_BUILDING_LOCK = threading.Lock()


def reentrant_backward_builds_graph() -> object:
    """True inside a reentrant checkpoint's backward asked to build a graph on this thread, else ``()``."""
    return True if getattr(_REENTRANT_BACKWARD, "builds_graph", False) else ()


reentrant_backward_builds_graph.active = functools.partial(list.__getitem__, _GRAPH_BUILDING, 0)  # type: ignore[attr-defined]
# only a recompute inside such a backward matters: a block whose forward ran inside one (nested in a
# recompute) and is recomputed by the inner, graph-free backward is what torch does without the guard
def graph_building_relevant(function: object, was: object, now: object) -> bool:
    return now is True and was is not True


@contextlib.contextmanager
def reentrant_backward(builds_graph: bool) -> Iterator[None]:
    """While a reentrant checkpoint's backward runs: whether it was asked to build a graph."""
    outer = getattr(_REENTRANT_BACKWARD, "builds_graph", False)
    _REENTRANT_BACKWARD.builds_graph = builds_graph
    if builds_graph:
        with _GRAPH_BUILDING_LOCK:
            _GRAPH_BUILDING[0] += 1
    try:
        yield
    finally:
        _REENTRANT_BACKWARD.builds_graph = outer
        if builds_graph:
            with _GRAPH_BUILDING_LOCK:
                _GRAPH_BUILDING[0] -= 1


def describe_graph_building(was: object, now: object) -> str:
    return (
        "the backward running the recompute was asked to build a graph (create_graph=True); the "
        "reentrant recompute's own backward builds none"
    )


def describe_backward_graph(builds_graph: object) -> str:
    if builds_graph is True:
        return "a backward that builds a graph (create_graph=True)"
    return "a forward outside such a backward"
