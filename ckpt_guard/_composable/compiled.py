"""``ckpt_guard.checkpoint`` traced by dynamo: what runs inside a compiled region.

``torch.compile(grad(f))`` compiles ``f``'s frames while functorch's grad runs around
them (a live grad level at trace time and at run time): torch's checkpoint there fails
("don't yet support saved tensor hooks"), and the composable recompute, whose walk,
proof and per-level Function are Python that dynamo does not trace, cannot run inside
the compiled graph.  So a block checkpointed there runs plainly, traced with the rest:
the result is the uncheckpointed program's, its activations are kept (no memory saving
for it), and the user is told once per compilation, at trace time (dynamo's
``comptime``: no graph break, ``fullgraph=True`` holds).  Outside transforms dynamo
turns torch's checkpoint into its own higher-order op, recomputed by AOTAutograd's
partitioner, and ``ckpt_guard.checkpoint`` hands it that.

Everything here is read by dynamo while tracing: only what it can trace (a functorch
interpreter query it constant-folds, module globals), and the message built by a
``comptime`` callback, which runs as plain Python.  Owns: that decision and its words.
May not touch: the composable recompute.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from .. import _config

#: torch's own checkpoint keywords: never the block's
_TORCH_OPTIONS = frozenset({"determinism_check", "debug", "early_stop", "respect_saved_tensors_hooks", "use_reentrant"})


def under_a_transform() -> bool:
    """At trace time: a torch.func transform (grad, vmap, jvp, ...) or a forward-AD level runs around
    the frame being compiled (read by dynamo as a constant of the trace: dynamo's guard on the functorch
    stack recompiles where it differs)."""
    return _transform_live()


def _live() -> bool:
    return torch._C._functorch.peek_interpreter_stack() is not None or torch.autograd.forward_ad._current_level >= 0


def _constant_at_trace_time(function: Any) -> Any:
    """``function`` run as plain Python while dynamo traces, its result a constant of the trace.

    torch 2.13's dynamo wraps the interpreter stack it reads in an object it then never compares with
    None (measured: always "not None"); 2.4's cannot trace the query at all (a graph break), yet the
    stack is live while it traces (measured), and there torch's checkpoint inside a compiled transform
    gave wrong numbers (``jacrev``, ``vjp(grad)``, aot_eager: the matrix's 2.4.1 section).  Either way
    the query runs as plain Python at trace time."""
    try:
        import torch._dynamo
    except Exception:  # noqa: BLE001 - no dynamo: nothing is traced
        return function
    return torch._dynamo.assume_constant_result(function)


_transform_live = _constant_at_trace_time(_live)


def traced_checkpoint(function: Any, args: tuple, kwargs: dict, context_fn: Any, preserve_rng_state: bool) -> Any:
    """``ckpt_guard.checkpoint`` as dynamo traces it (see the module docstring)."""
    if under_a_transform():
        say_plain()
        return function(*args, **{k: v for k, v in kwargs.items() if k not in _TORCH_OPTIONS})
    options = {} if context_fn is None else {"context_fn": context_fn}
    respect = kwargs.pop("respect_saved_tensors_hooks", None)
    if _RESPECTS_HOOKS:  # as saved_tensors_hooks_option: True where torch has it, unless said
        options["respect_saved_tensors_hooks"] = True if respect is None else respect
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **options, **kwargs
    )


def _respects_hooks() -> bool:
    import inspect

    import torch.utils.checkpoint

    return "respect_saved_tensors_hooks" in inspect.signature(torch.utils.checkpoint.checkpoint).parameters


_RESPECTS_HOOKS = _respects_hooks()


PLAIN_UNDER_COMPILE = (
    "ckpt_guard.checkpoint inside torch.compile, under a torch.func transform that runs around the "
    "compiled code: the composable recompute cannot run inside a compiled region, and torch's checkpoint "
    "fails there, so the block ran without checkpointing (traced with the rest of the graph). The result "
    "is the uncheckpointed program's; this block's activations are kept for the backward (no memory "
    "saving for it). To keep the saving: checkpoint outside the transform, or leave the transform "
    "uncompiled (docs/compile.md) (refusal class compiled-transform, see docs/limits.md)"
)


def say_plain() -> None:
    """Say, once per compilation (at trace time: no graph break), that the block ran plainly."""
    from torch._dynamo.comptime import comptime

    comptime(_warn_plain)


def _warn_plain(ctx: Any = None) -> None:
    from .._exceptions import CheckpointCompositionWarning
    from .._rules import rule_by_id

    if _config.for_ckpt_guard_checkpoint(_config.scoped_config()).policy_for("CKG001") == "off":
        return
    message = CheckpointCompositionWarning(PLAIN_UNDER_COMPILE, rule_by_id("CKG001"))
    where = _traced_line(ctx)
    if where is None:
        warnings.warn(message, stacklevel=2)
    else:  # the user's line dynamo is tracing (the call of ckpt_guard.checkpoint)
        warnings.warn_explicit(message, CheckpointCompositionWarning, *where)


def _traced_line(ctx: Any) -> Any:
    """``(filename, line)`` of the frame dynamo is tracing, where its tracer says (else None)."""
    import os

    tracer = getattr(ctx, "_ComptimeContext__tx", None)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while tracer is not None:
        code = getattr(tracer, "f_code", None)
        line = getattr(tracer, "lineno", None)
        if code is None or not isinstance(line, int):
            return None
        if not os.path.abspath(code.co_filename).startswith(package + os.sep):
            return code.co_filename, line  # the first frame that is not the guard's own
        tracer = getattr(tracer, "parent", None)
    return None
