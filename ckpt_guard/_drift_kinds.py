"""What each drift rule does, one object per rule: the behaviour its record names.

A drift rule's record (``_rules``) is data: it names its reader in ``_state``
(``read``: called in the forward and again when the recompute starts) and how a
value renders (``render``).  Everything the decision does with the rule beyond
comparing those two values lives on its :class:`DriftKind`, chosen once, here, by
the reader the record names (``_KIND_FOR_READER``):

* ``relevant``: whether a change can change this block's recompute;
* ``describe``: the change in words (the reader's ``describe_change``, else
  "was → now");
* ``anticipated``: its risk is visible at the call (a swap, a user mode, a
  transform), so fallback can avoid it by not checkpointing;
* ``composable_avoids``: the composable recompute does not meet it at all (it reads
  what a swap lifted, and runs under the call's transforms), so fallback runs that
  instead where only this risk shows at the call;
* ``values_only``: which changes are Python values only, which strict and
  fallback replay without a word (the replay is the uncheckpointed program);
* ``set_by_a_context``: whether a user ``context_fn`` could have made the change;
* ``replay``: fallback's repair, a context manager the recompute runs inside;
* ``case_symptom`` / ``case_fallback`` / ``case_remedy``: words that fit one case
  better than the record's.

So nothing outside this file branches on a rule's reader by name; the decision
asks the kind (``_drift``), and so do the words (``_messages``) and the call
(``_decide``).  The positions of the few rules the decision reads directly in a
capture (the transform stack for every message, the bindings, ...) are named
here too, once.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Tuple

import torch as _torch

from . import _composable, _state
from ._composable import binding as _rebind
from ._rules import DRIFT_RULES, Rule

_GONE = _state.GONE
_Module = _torch.nn.Module


class DriftKind:
    """A drift rule whose behaviour is all its record's: compared, described, never replayed."""

    anticipated = False
    composable_avoids = False
    #: ``values_only(was, now)``: the changes fallback and strict replay without a word, or None
    values_only: Optional[Callable[[Any, Any], bool]] = None

    def __init__(
        self, index: int, rule: Rule, relevance: Optional[Callable[[Any, Any, Any], bool]] = None,
        change: Optional[Callable[..., str]] = None, change_takes_function: bool = False,
    ) -> None:
        self.index, self.rule = index, rule
        self.read = getattr(_state, rule.read)
        self.render = getattr(_state, rule.render)
        #: ``relevance(function, was, now)``, or None (every change matters)
        self.relevance = relevance
        #: ``change(was, now[, function])``: the change in words, or None ("render(was) → render(now)")
        self.change, self.change_takes_function = change, change_takes_function

    def relevant(self, function: Any, was: Any, now: Any, modes_managed: bool) -> bool:
        """Whether a changed value can change this function's recompute."""
        return self.relevance is None or self.relevance(function, was, now)

    def describe(self, was: Any, now: Any, function: Any) -> str:
        if self.change is None:
            return f"{self.render(was)} → {self.render(now)}"
        if self.change_takes_function:
            return self.change(was, now, function)
        return self.change(was, now)

    def set_by_a_context(self, was: Any, now: Any) -> bool:
        """Under a user ``context_fn``, whether this change may be its contexts' own doing.

        The forward's state is read at the call, outside the forward context; the
        recompute's inside the recompute context.  A context that sets a Python value
        the block reads (a global scale, a module's flag) for both runs shows here as a
        change torch recomputes right, and one the program made after the call looks the
        same: no replay can tell them apart, so none is made.  A tensor re-bound is no
        context's doing: replayed as ever.
        """
        return self.values_only is not None and self.values_only(was, now)

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        """``(context manager, what fallback did)`` for a drift fallback can undo, or None."""
        return None

    def case_symptom(self, was: Any, now: Any) -> str:
        """What torch really does in this very case, where the rule's general words would not say it."""
        return ""

    def case_fallback(self, was: Any) -> str:
        """What fallback does in this very case, where the rule's general words say more than fits."""
        return ""

    def case_remedy(self, was: Any, now: Any, repaired: bool = False) -> str:
        """A remedy that fits this very case (``repaired``: fallback already made the recompute right)."""
        return ""


class UserModes(DriftKind):
    """CKG102/103: a user dispatch or function mode in the forward, not (or not so) at the recompute."""

    anticipated = True

    def __init__(self, index: int, rule: Rule, dispatch: bool) -> None:
        super().__init__(index, rule, change=_state.describe_mode_change)
        self.dispatch = dispatch

    def relevant(self, function: Any, was: Any, now: Any, modes_managed: bool) -> bool:
        # a user context_fn may enter modes of its own for the recompute: then only a mode of the
        # forward's missing from the recompute matters (a context_fn that re-enters it is fine)
        return not modes_managed or any(mode not in now for mode in was)

    @staticmethod
    def all_recorded(modes: Any) -> bool:
        """Every user mode is marked replayable and its state was recorded at the call."""
        return all(record is not None for record in getattr(modes, "records", (None,)))

    @staticmethod
    def some_recorded(was: Any) -> bool:
        """The forward's user modes include a marked one whose state was recorded."""
        return any(record is not None for record in getattr(was, "records", ()))

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        replayable = not modes_managed and (reentrant or _state.QUIET_RECOMPUTE_HOOKS)
        replay = _state.modes_to_replay(was, now, self.dispatch) if replayable else None
        if replay is None or not _state.mode_state_kept(replay):
            return None  # torch's mode above a user mode, a gradient-carrying tensor it holds updated
        popped, pushed, restated = replay
        names = ", ".join(type(mode).__name__ for mode, _ in (*restated, *pushed))
        off = (
            f"; {', '.join(type(mode).__name__ for mode in popped)} (not the forward's) taken off for it"
            if popped else ""
        )
        return _state.replaying_modes(replay, self.dispatch, inside_hooks=not reentrant), (
            f"recomputing under the forward's own mode objects ({names}, marked with "
            f"ckpt_guard.replayable_mode) with their attributes as the forward found them{off}; their "
            "state is put back after (policy fallback)"
        )

    def case_symptom(self, was: Any, now: Any) -> str:
        if _state.only_state_moved(was, now):
            return (
                "returns silently wrong gradients: the recompute runs under the forward's mode object, but "
                "with the state it has now (the forward moved it on), so it computes other values"
            )
        return ""

    def case_fallback(self, was: Any) -> str:
        if self.some_recorded(was):
            return (
                "checkpoints the block and recomputes it under the forward's own mode objects, with their "
                "attributes, tensors and generators as the forward found them, put back after"
            )
        return ""

    def case_remedy(self, was: Any, now: Any, repaired: bool = False) -> str:
        if not self.some_recorded(was):
            return ""
        if repaired:
            return (
                "nothing to change for correctness: the mode is marked @ckpt_guard.replayable_mode and "
                "this recompute ran under the forward's mode object with the state it had then; to save "
                "the replay's cost, keep the mode out of the checkpointed region"
            )
        return (
            "the mode is marked @ckpt_guard.replayable_mode: policy fallback for this rule (next line) "
            "makes this call right and keeps its memory saving (a non-reentrant call on torch < 2.8 "
            "runs without checkpointing); or keep the mode out of the checkpointed region"
        )


class DefaultDtype(DriftKind):
    """CKG105: the default dtype changed before the recompute."""

    def set_by_a_context(self, was: Any, now: Any) -> bool:
        return True  # a context_fn may set the dtype for both runs: no replay could tell

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        return _composable.in_default_dtype(was), f"recomputing in the forward's default dtype, {was} (policy fallback)"


class ModuleTraining(DriftKind):
    """CKG106: a module switched between train and eval before the recompute."""

    def __init__(self, index: int, rule: Rule) -> None:
        super().__init__(index, rule, relevance=_state.training_relevant)

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        if was is None:
            return None
        modes = _state.retrained(was, function)
        if not modes:
            return None  # its modules changed since the forward: no mode to put back
        return _rebind.bound([(m, "__dict__", "training", flag) for m, flag in modes]), (
            "recomputing with each module in the train/eval mode it had in the forward, bound for this "
            "recompute on its thread (policy fallback)"
        )


class ModuleAttributes(DriftKind):
    """CKG115: a module's own plain attribute its forward reads changed before the recompute."""

    values_only = staticmethod(_state.attributes_values_only)

    def __init__(self, index: int, rule: Rule) -> None:
        super().__init__(index, rule, change=_state.describe_attribute_change, change_takes_function=True)

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        changes = _state.reattributed(was, function)
        if not changes or any(value is _GONE for _, _, value in changes):
            return None  # an attribute the forward did not have: nothing to put back
        return _rebind.bound([(module, "__dict__", name, value) for module, name, value in changes]), (
            "recomputing with each attribute as the forward found it, bound for this recompute on its "
            "thread (what the recompute writes there is dropped) (policy fallback)"
        )


class ArgumentContents(DriftKind):
    """CKG112: a list, dict or object the block was given changed before the recompute."""

    values_only = staticmethod(lambda was, now: _state.values_only(was))

    def __init__(self, index: int, rule: Rule) -> None:
        super().__init__(
            index, rule, relevance=lambda function, was, now: bool(_state.changed_contents(was)),
            change=_state.describe_contents_change,
        )

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        changed = _state.changed_at_all(was)  # every value put back, a position counter too
        if not _state.replayable(changed):
            return None  # updated in place, or only its length kept: what the forward read is gone
        return _state.replaying_contents(changed), (
            "recomputing with the containers the block was given as the forward found them, their "
            "contents put back after the recompute (policy fallback)"
        )

    def case_symptom(self, was: Any, now: Any) -> str:
        if _state.values_only(was):
            return (
                "recomputes with the Python value as the forward left it (a counter, a step, a position), "
                "and the block changes it a second time: silently wrong gradients where the "
                "block computes with that value, none where it only counts"
            )
        return ""

    def case_remedy(self, was: Any, now: Any, repaired: bool = False) -> str:
        if _state.values_only(was):
            return (
                "nothing to change where the value only counts; policy strict or fallback recomputes with "
                "the value the forward read and puts the new one back after, without a word (exact "
                "either way); warn only reports it"
            )
        return ""


class GeneratorStates(DriftKind):
    """CKG113: a user ``torch.Generator`` the block draws from moved before the recompute."""

    def __init__(self, index: int, rule: Rule) -> None:
        super().__init__(
            index, rule, relevance=lambda function, was, now: bool(_state.moved_generators(was)),
            change=_state.describe_generator_change,
        )

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        moved = [(generator, state) for _, generator, state in _state.moved_generators(was)]
        return _state.replaying_generators(moved), (
            "recomputing with each user generator in the state the forward found it in, its state put "
            "back after the recompute (policy fallback)"
        )


class BlockBindings(DriftKind):
    """CKG110 (tensors and values the block reads by name re-bound) and CKG111 (``hooks``: its hooks)."""

    def __init__(self, index: int, rule: Rule, hooks: bool) -> None:
        describe = _state.describe_hook_change if hooks else _state.describe_rebinding
        super().__init__(index, rule, change=describe, change_takes_function=True)
        self.hooks = hooks
        if not hooks:
            self.values_only = _state.bindings_values_only

    def replay(
        self, was: Any, now: Any, function: Any, modes_managed: bool = False, reentrant: bool = False,
    ) -> Optional[Tuple[Any, str]]:
        changes = _state.rebound(was, function, hooks=self.hooks)
        if not changes or any(store == "new" for _, store, _, _ in changes):
            return None  # something the forward did not have: nothing to put back
        derived = _derived_bindings(changes)
        if derived is None:
            return None  # a module keeps its own view of the tensor: binding the name would not reach it
        return _forward_bindings(changes + derived), (
            "recomputing with what the forward read, bound for this recompute on its thread (policy fallback)"
        )


class TransformStack(DriftKind):
    """CKG104: the torch.func transform stack differs at the recompute (a ``jvp``, then ``.backward()``)."""

    anticipated = composable_avoids = True

    def case_symptom(self, was: Any, now: Any) -> str:
        if any(name == "jvp" for name, _ in was) and not any(name == "jvp" for name, _ in now):
            return (
                "raises CheckpointError: A different number of tensors was saved during the original forward "
                "and recomputation (the recompute runs without the jvp's forward-mode level, so it saves "
                "other tensors than the forward did)"
            )
        return ""

    def case_remedy(self, was: Any, now: Any, repaired: bool = False) -> str:
        if any(name == "jvp" for name, _ in was):
            return (
                "checkpoint these blocks with ckpt_guard.checkpoint (or run under policy fallback): its "
                "recompute carries the jvp's tangents, and .backward() after torch.func.jvp (a MeanFlow or "
                "consistency-model loss) then keeps the memory saving"
            )
        return ""


class SwappedReads(DriftKind):
    """CKG101: the forward ran inside a ``functional_call`` swap, the recompute after it."""

    anticipated = composable_avoids = True

    def __init__(self, index: int, rule: Rule) -> None:
        super().__init__(index, rule, relevance=_state.swapped_reads_relevant, change=_state.describe_swap_change)

    def case_remedy(self, was: Any, now: Any, repaired: bool = False) -> str:
        if isinstance(now, _state.SwappedReads) or _state.swaps_active_here():
            # .backward() already runs under a functional_call, just not the forward's
            # (second-order MAML: one backward recomputes the inner and the outer step).
            return (
                "the recompute runs under another functional_call than the forward's: when one backward "
                "recomputes blocks that ran under different functional_calls (second-order MAML: the "
                "inner and the outer step), no single one can stay active for all of them. Run these "
                "blocks without checkpointing (policy fallback does), or checkpoint outside the "
                "stateless calls"
            )
        return ""


#: the kind of each reader a record may name; a reader not here is a plain :class:`DriftKind`
_KIND_FOR_READER: dict = {
    "user_dispatch_modes": lambda i, rule: UserModes(i, rule, dispatch=True),
    "user_function_modes": lambda i, rule: UserModes(i, rule, dispatch=False),
    "default_dtype": DefaultDtype,
    "module_training": ModuleTraining,
    "module_attributes": ModuleAttributes,
    "argument_contents": ArgumentContents,
    "generator_states": GeneratorStates,
    "block_bindings": lambda i, rule: BlockBindings(i, rule, hooks=False),
    "block_hooks": lambda i, rule: BlockBindings(i, rule, hooks=True),
    "transform_stack": TransformStack,
    "swapped_reads": SwappedReads,
    "optimizer_steps": lambda i, rule: DriftKind(i, rule, relevance=_state.steps_relevant),
    "instance_forwards": lambda i, rule: DriftKind(
        i, rule, change=_state.describe_forward_change, change_takes_function=True,
    ),
    "reentrant_backward_builds_graph": lambda i, rule: DriftKind(
        i, rule, relevance=_state.graph_building_relevant, change=_state.describe_graph_building,
    ),
}

#: one kind per drift rule, in ``DRIFT_RULES`` order (a capture's order)
DRIFT_KINDS: Tuple[DriftKind, ...] = tuple(
    _KIND_FOR_READER.get(rule.read, DriftKind)(i, rule) for i, rule in enumerate(DRIFT_RULES)
)


def _position(reader: str) -> int:
    return next(kind.index for kind in DRIFT_KINDS if kind.rule.read == reader)


# where the decision reads a capture directly, by the reader the record names (here only)
TRANSFORMS_INDEX = _position("transform_stack")  # every message names the forward's transforms
SWAPS_INDEX = _position("swapped_reads")
BINDINGS_INDEX = _position("block_bindings")
HOOKS_INDEX = _position("block_hooks")
CONTENTS_INDEX = _position("argument_contents")
GENERATORS_INDEX = _position("generator_states")
TRAINING_INDEX = _position("module_training")
STEPS_INDEX = _position("optimizer_steps")
#: the user modes' positions (CKG102/103)
MODE_INDICES = frozenset(kind.index for kind in DRIFT_KINDS if isinstance(kind, UserModes))
#: the positions of the drift whose risk is visible at call time
ANTICIPATED_INDICES = tuple(kind.index for kind in DRIFT_KINDS if kind.anticipated)
#: the positions whose Python-values-only changes are replayed without a word, in the order their
#: replays are entered (outermost first): what the block is given, its modules' attributes, its bindings
QUIET_INDICES = tuple(sorted(
    (kind.index for kind in DRIFT_KINDS if kind.values_only is not None),
    key=lambda i: (ArgumentContents, ModuleAttributes, BlockBindings).index(type(DRIFT_KINDS[i])),
))
#: the transform-stack rule, for the fix line that names every torch.func rule
TRANSFORMS_RULE = DRIFT_KINDS[TRANSFORMS_INDEX].rule


#: the ids of the rules :attr:`DriftKind.composable_avoids` (fallback runs the composable recompute for them)
COMPOSABLE_AVOIDS = frozenset(kind.rule.id for kind in DRIFT_KINDS if kind.composable_avoids)
_KIND_BY_ID = {kind.rule.id: kind for kind in DRIFT_KINDS}


def kind_of(rule: Rule) -> DriftKind:
    """The kind of a drift rule's record (a drift rule's only: ``KeyError`` for another)."""
    return _KIND_BY_ID[rule.id]


def _derived_bindings(changes: list) -> Optional[list]:
    """What else to bind so the recompute reads the forward's tensors; None where that is unknown.

    A module whose class has its own ``__setattr__`` may keep its own view
    of a tensor set on it: an RNN keeps ``_flat_weights`` (its forward reads
    that list, not the attributes), which is re-bound too.  Any other such
    class: no replay (fallback then raises, as strict), never a recompute
    that silently reads the new tensor.
    """
    flat_weights: dict = {}  # id(rnn) -> (rnn, its _flat_weights with the forward's tensors put back)
    for owner, store, name, value in changes:
        if store not in ("_parameters", "_buffers") or type(owner).__setattr__ is _Module.__setattr__:
            continue
        names = owner.__dict__.get("_flat_weights_names")
        flat = owner.__dict__.get("_flat_weights")
        if not (isinstance(owner, _torch.nn.RNNBase) and names is not None and flat is not None and name in names):
            return None
        _, replaced = flat_weights.setdefault(id(owner), (owner, list(flat)))
        replaced[list(names).index(name)] = value
    # its _flat_weight_refs too: the recompute's forward re-points them at the tensors it binds, and
    # left in the module they would make its next forward think its weights unchanged (and keep
    # reading the flat weights of the meta-optimizer's step, whose graph is gone)
    import weakref

    bindings = []
    for rnn, replaced in flat_weights.values():
        bindings.append((rnn, "__dict__", "_flat_weights", replaced))
        refs = rnn.__dict__.get("_flat_weight_refs")
        if refs is not None:
            bindings.append((rnn, "__dict__", "_flat_weight_refs", [None if w is None else weakref.ref(w) for w in replaced]))
    return bindings


#: a closure cell is the function's, not the thread's: one replay at a time points cells
_CELL_LOCK = _state.REPLAY_LOCK


@contextlib.contextmanager
def _forward_bindings(changes: list) -> Any:
    """The forward's tensors and hooks where the block reads them (modules: per thread; cells: locked)."""
    from collections import OrderedDict

    bindings = [
        (owner, "__dict__", name, OrderedDict(value) if store in ("_forward_hooks", "_forward_pre_hooks") else value)
        for owner, store, name, value in changes if store != "cell"
    ]
    # ... and in its parameter or buffer dict where the name is still there: what reads the dict (a
    # checkpoint nested in this recompute asking whether its parameters were swapped) sees them too
    bindings += [
        (owner, store, name, value) for owner, store, name, value in changes
        if store in ("_parameters", "_buffers") and name in owner.__dict__.get(store, ())
    ]
    cells = [(cell, value) for cell, store, _, value in changes if store == "cell"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(_rebind.bound(bindings))
        if cells:
            stack.enter_context(_CELL_LOCK)
            for cell, value in cells:
                held = cell.cell_contents
                cell.cell_contents = value
                stack.callback(setattr, cell, "cell_contents", held)
        yield
