"""Checkpointing that composes with torch.func: a recompute torch.func can transform.

One call's way through this package (``ckpt_guard.checkpoint(block, x)`` under
``grad``):

=============  ===================================================================
``call``       :func:`plan` and :func:`run`: plan the call, refuse what cannot be packed,
               run the first forward, pack its outputs into the Function
``binding``    the walk: what the block reaches (modules' tensors bound per thread,
               closures, partials, containers, arguments), lifted as inputs
``paths``      the path a user would recognise to a tensor the walk reached (messages only)
``shapes``     a module block's walk kept between its calls, checked exhaustively
               and re-read at each call instead of walked again
``proof``      the run-time proof: every tensor needing a gradient the plain run read
               was lifted, or the call is refused
``plan``       :class:`Plan`, the node the Function carries: the first forward, what
               a recompute starts from, the replay of the forward's world
``records``    what a plan keeps: the call (``at_call``), what its first forward found
               (``found``), the world a recompute replays (``world``); one writer each
``replay``     what is put back for each recompute (RNG, dtype, hooks, eager stance)
``saving``     a save policy (selective checkpointing): what the first forward keeps,
               handed back to each recompute instead of run again; names
``residuals``  ``ckpt_guard.saved_residuals``: what each block saved and recomputed
``function``   ``_Recompute``, the ``autograd.Function``: backward, jvp, vmap rules,
               each again a recompute
``later_writes``  an input the caller may write into after the call, kept as a copy on
               write; autograd's error where the block saved it, as without checkpointing
``levels``     applying that Function level by level, one class made once
``refusals``   :class:`Refused` and its :class:`Reason` classes (``docs/limits.md``)
``basics``     tensor helpers; ``counters``: what has run (the matrix reads it)
=============  ===================================================================

Dependencies point down that table's layers: ``call`` → ``function`` →
``plan`` → ``records`` → ``replay``/``saving`` → ``residuals``/``shapes`` → ``paths`` → ``binding``/``proof``/``basics``.
This package is an engine with its doors outside it: it reads the state (``_state``), the
configuration, the rule table and the exceptions, and nothing here imports the decision
(``_decide``, ``_drift``, ``_messages``) or a door (``tests/test_architecture.py`` checks it,
lazy imports included).  Both doors, ``ckpt_guard.checkpoint`` (``_entry``) and fallback's
(``_decide.checkpoint_entry``), go through one ``_decide.run_composable``, which watches the
drift a recompute cannot undo, runs the plan and says what came of it; each door keeps only
its words.  The design, as ``jax.checkpoint``'s ``ad_checkpoint.py``
has it for remat:

torch's checkpoint is built on saved-tensor hooks (non-reentrant) or on an
``autograd.Function`` without ``setup_context`` (reentrant); torch.func refuses
both.  The recompute here is an ``autograd.Function`` with ``setup_context``,
which torch.func transforms like any other operation, and whose every
transformation rule is again such a recompute, as ``jax.checkpoint``'s are.

**The first forward is the plain run.**  :func:`run` calls the block once, as
the caller wrote it, at the caller's torch.func levels, under the run-time
proof (``proof.ReadCheck``).  That run *is* the uncheckpointed code: its
values, its grad mode, its random draws, its Python side effects, once.  Its
output tensors, cut from their graph with ``.detach()`` (which keeps every
level's batching), are then handed to ``_Recompute`` (applied by ``levels.apply``) as operands after
the block's lifted inputs: every transform level unwraps them as it unwraps
any operand (a vmap rule sees where each is batched), and the Function's
``forward`` just returns them.  The plain run's graph goes with its outputs;
the Function saves only the inputs (the memory saving).  So:

* ``forward`` returns the plain run's outputs; the block never runs inside it;
* ``backward`` recomputes the block and takes its vjp.  When something will
  differentiate that result again (grad of grad, a jvp over a grad, an eager
  ``.backward()`` over a torch.func result, a pullback later differentiated),
  the vjp is itself a checkpointed recompute (:class:`_Derivative`): the outer
  transform keeps its inputs (primals and cotangents), never the recomputed
  activations.  Under forward mode alone (``jvp(grad)``, ``hessian``) the
  pullback runs with grad mode on, below the node's own level, so it takes the
  backward formulas the plain code takes (silu's and group_norm's plain
  kernels have no forward-mode formula) without keeping a graph;
* ``jvp`` hands on the tangents the plain run computed, where that jvp level was on top
  or right under the grad levels on top (``jvp(grad)``, ``hessian``, a MeanFlow loss);
  otherwise it recomputes the block under a jvp of its own, in the call's grad mode,
  with the inputs that required grad requiring grad (kernels are chosen by it);
  where the tangents will be differentiated again (a MeanFlow loss's
  ``.backward()``) that too is checkpointed;
* ``vmap`` batches the checkpoint instead of unrolling it (:class:`_Batched`):
  its forward hands on the plain run's batched outputs, its recompute runs the
  block under ``torch.vmap`` with the level's randomness.

Whether the backward or the tangents will be differentiated again is read
when they run, from the functorch levels then alive: one that is neither the
level running this backward nor dead (a pullback called after its ``vjp``
returned) will differentiate it; so will eager autograd, when grad mode is on
below every transform and a tensor involved requires grad there.  Where no
reverse mode can differentiate the call at all (``jvp``, ``jacfwd``,
``linearize``, a forward ``vmap``), the plain run kept nothing to save: it is
the result, and nothing is packed.

**What the block reads.**  Every tensor the block reads that may need a
gradient must be an input, or its gradient would silently be zero.  The walk
in ``binding`` lifts the parameters, buffers and plain tensor attributes of
the modules the block reaches (bound per thread, modules are never copied),
and the tensors that need a gradient held in its closures, defaults,
partials, containers, dataclasses and objects, and the call's arguments
(rebuilt as copies holding the recompute's tensors).  That walk is the fast
path; the proof watches the plain run: a tensor that carries a gradient and
was neither given nor computed makes the call *refused* (:class:`Refused`,
carrying the plain run's output and a :class:`Reason` of a listed class): the
caller returns that output (fallback, warn) or raises (strict), and never runs
the block a second time.  No wrong gradient either way.

**What the block writes.**  An input the block updates in place (BatchNorm's
running statistics, ``h += pos``) is copied just before the write, at the
caller's levels and connected to the input; the Function is handed that copy,
so each recompute starts from what the forward started from (and a later
update of the live tensor, the same module called again, changes nothing it
reads), and a gradient for it reaches the input's value before the update.
Each recompute gives the block a copy of such an input to write into.
An output that is an input, or a view of one (``nn.Identity``, ``nn.Flatten``), is
the caller's as the plain run made it, so the caller's update in place of it
reaches the input; the Function is handed a copy of that input (the caller may
write into it).  A block whose every output is such an alias saves nothing: its
plain run is the result.
The caller may write into an input after the call (``y = ckpt(block, h); h.add_(1)``):
the Function is handed a copy on write of each input a caller can write
(``later_writes``), so a recompute reads what the call saw, and where the block's graph
saved that input autograd's "modified by an inplace operation" is raised, as without
checkpointing.

**What the block sees.**  Each recompute shows the block its inputs'
``requires_grad`` as the call did (``levels.as_the_call_saw``), and runs in the
call's grad mode; with grad mode off at the call (``torch.no_grad()`` inside
``grad(grad)``) no level records the block, and its plain run is the result.

**What the recompute replays.**  The forward's CPU and device RNG states
(dropout draws the same mask), each user ``torch.Generator`` the block drew
from (its state before the first draw, kept by the proof), default dtype,
``torch.device(...)`` context, autocast, a user ``context_fn``'s recompute
context (a selective checkpointing policy: ``saving``), the global module
hooks, the modules' plain numbers, flags and strings (NumPy scalars too) as
the call found them, and what the block's
closures held (frozen copies: a loop rebinding a closed-over variable is not
seen).  Checkpoints nested inside the block run plainly (the outer recompute
already recomputes them).

**What to hold to change it, each in one home.**  ``jax.checkpoint`` needs six
(a primitive carrying the traced function, ``checkpoint()``, one rule per
transform, the policy predicate, ``name_p``, ``saved_residuals``); here, those
marked * exist only because eager PyTorch has no tracer (JAX reads all of it off
a jaxpr, and a jaxpr is pure):

==============================  ============================================================
the doors                       ``_entry.public_checkpoint`` and fallback's
                                ``_decide.checkpoint_entry``, both through
                                ``_decide.run_composable`` (JAX: ``checkpoint()``)
the plan                        ``plan.Plan``: the call, its first forward, what a recompute
                                starts from (JAX: the primitive and its jaxpr), kept in three
                                ``records``: ``at_call``, ``found``, ``world``
the walk *                      ``binding`` (with ``_state.closures``): what the block reaches,
                                lifted as inputs; ``shapes``: a module's walk kept *
the proof *                     ``proof.ReadCheck``: nothing needing a gradient was missed
refusals                        ``refusals``: a :class:`Reason` of a class ``docs/limits.md`` lists
the Function and its rules      ``function._Recompute``: backward, jvp, vmap, each again a
                                recompute (JAX: one rule per transform), over a
                                ``function.Node``: a ``Plan``, its ``_Derivative`` or
                                ``_Batched`` (``node.root``: the plan under it)
levels *                        ``levels.apply``, ``levels.as_the_call_saw``: functorch's levels,
                                and the ``requires_grad`` and grad mode the call saw
the replayed world *            ``replay`` and ``Plan.replay``: RNG, dtype, device, autocast,
                                hooks, the modules' values, globals, containers
in-place writes *               ``found.pre_forward``/``written``: copies of what a write reaches;
                                ``later_writes``: the caller's writes after the call
save policies                   ``saving`` (JAX: the policy predicate and ``name_p``)
the residuals report            ``residuals`` (JAX: ``saved_residuals``)
the drift watch                 ``_decide.watch_composable_recompute``: what no replay undoes
                                (a train/eval switch, an optimizer step), checked at each recompute
counters and the plain scope    ``counters``; nested checkpoints run plainly
                                (``replay._plain_nested_checkpoints``)
==============================  ============================================================
"""

from __future__ import annotations

from . import counters  # noqa: F401 - read as _composable.counters.RECOMPUTES
from .basics import SELECTIVE_CACHING_MODE  # noqa: F401
from .call import plan, run  # noqa: F401
from .refusals import (  # noqa: F401
    NOTHING_TO_SAVE, REFUSAL_CLASSES, ChangedSinceForward, Reason, Refused, describe_reason,
)
from .replay import in_default_dtype  # noqa: F401
