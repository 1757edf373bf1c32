"""Reader: optimizer steps (CKG108), counted by ``_hooks`` through ``Optimizer._optimizer_step_code``.

Owns: the process-wide step count, which parameters each step updated, and whether a
step can reach the checkpointed function.  May not touch: the optimizer itself.
"""

from __future__ import annotations

import collections
import functools
import threading
from typing import Any

from . import block_reads as _reads
from .basics import Tensor


# --------------------------------------------------------------------------
# optimizer steps: parameters updated in place between forward and recompute

_optimizer_steps = [0]
#: ``optimizer_steps()``: how many optimizer steps were taken, process-wide; a
#: builtin call, because the capture runs on every checkpoint call.
optimizer_steps = functools.partial(_optimizer_steps.__getitem__, 0)
# The latest steps, oldest first: (step number, ids of the parameters that
# step updated).  Ids are safe to compare: an entry is only consulted for
# parameters alive since before that step.
_step_log: collections.deque = collections.deque(maxlen=64)
_step_lock = threading.Lock()


def _parameters_stepped(optimizer: Any) -> frozenset:
    """Ids of the parameters an optimizer step just updated: those with a gradient.

    Every torch optimizer skips a parameter whose ``grad`` is None and updates
    (in place) every other one, fused or not, even with an all-zero gradient.
    """
    return frozenset(
        id(p)
        for group in optimizer.param_groups
        for p in group.get("params", ())
        if isinstance(p, Tensor) and p.grad is not None
    )


def record_step(optimizer: Any) -> None:
    """An optimizer step just updated its parameters (eager only: see ``_hooks.note_step``).

    Counts the step and logs what it updated: one pass over the optimizer's
    parameters per step (tens of µs for hundreds of tensors), nothing per
    checkpoint call beyond reading the count.  Never raises into the user's
    ``step()``: an optimizer this cannot read (a custom one with odd
    param_groups) is counted, with no parameters logged.
    """
    try:
        updated = _parameters_stepped(optimizer)
    except Exception:  # noqa: BLE001 - this must not break the user's step
        updated = frozenset()
    with _step_lock:
        _optimizer_steps[0] += 1
        _step_log.append((_optimizer_steps[0], updated))


def steps_relevant(function: object, was: int, now: int) -> bool:
    """Whether a step taken since the forward updated a parameter ``function`` uses.

    Never guesses: a module the function may use only in part counts only if
    the steps updated every one of its trainable parameters; parameters it
    cannot see in the direct view count as untouched.  Not the complete view:
    an object of the user's holding the block's module holds others too (a
    GAN trainer's generator and discriminator: the discriminator's step moved
    all of it); the direct view follows only the attributes the block's code
    names (``partial(run, cfg)`` with ``cfg.layers["k"]``; the trainer's ``G``).
    """
    with _step_lock:
        updated = frozenset().union(*(ids for number, ids in _step_log if was < number <= now))
    if not updated:
        return False
    reads = _reads.reads_of(function)
    surely = [*(p for m in reads.whole for p in m.parameters()), *reads.tensors]
    if any(id(p) in updated for p in surely):
        return True
    for module in reads.partial:  # used in part, maybe: count it only when all of it moved
        trainable = [p for p in module.parameters() if p.requires_grad]
        if trainable and all(id(p) in updated for p in trainable):
            return True
    return False




def describe_optimizer_steps(count: int) -> str:
    return f"after optimizer step {count}" if count else "before any optimizer step"
