"""CKG102/103 under fallback: a user mode marked ``@ckpt_guard.replayable_mode`` is re-entered.

torch's recompute runs under the modes active at the backward, not the
forward's: silently wrong gradients.  Fallback runs a block under an unmarked
mode plainly (whatever state the mode carries, that is right); under a mode
whose class is marked replayable it checkpoints, and recomputes under the
forward's own mode object with its attributes and generator as the forward
found them, then puts its state back.  Every case is run three ways
(uncheckpointed, raw torch, guarded) and compared by value, the mode's final
state included.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import assert_all_close
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard._state import QUIET_RECOMPUTE_HOOKS

pytestmark = pytest.mark.usefixtures("guard")


def replayed(use_reentrant=False):
    """What fallback does with a block under a marked mode on this torch: a non-reentrant recompute
    runs torch's pack hook under the mode, which only torch >= 2.8 lets the guard hide from it."""
    return "fallback: repaired" if use_reentrant or QUIET_RECOMPUTE_HOOKS else "fallback: no checkpoint"


class CountingScale(TorchDispatchMode):
    """Multiplies each sin by how many sins it has seen, plus noise from its own generator:
    state a second run of the block would change, which replay must put back."""

    def __init__(self):
        super().__init__()
        self.seen = 0
        self.generator = torch.Generator().manual_seed(3)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.seen += 1
            out = out * self.seen + 0.1 * torch.randn(out.shape, generator=self.generator)
        return out


ReplayableScale = ckpt_guard.replayable_mode(type("ReplayableScale", (CountingScale,), {}))


@ckpt_guard.replayable_mode
class ReplayableFunctionScale(TorchFunctionMode):
    """The function-mode twin: scales each torch.sin by a per-call counter (Tensor.backward pops it)."""

    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.sin:
            self.seen += 1
            out = out * (self.seen + 1)
        return out


def block(t, w):
    return torch.sin(torch.sin(t) * w)


def _step(mode_class, how, use_reentrant=False, backward_inside=False, **options):
    """One training step under a fresh mode; returns values to compare (the mode's final state too)."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    mode = mode_class()
    with mode:
        if how == "plain":
            y = block(x, w)
        else:
            y = checkpoint(block, x, w, use_reentrant=use_reentrant, **options)
        if backward_inside:
            y.sum().backward()
    if not backward_inside:
        y.sum().backward()
    state = [torch.tensor(float(mode.seen))] if hasattr(mode, "seen") else []
    if hasattr(mode, "generator"):
        state.append(torch.rand(2, generator=mode.generator))  # the program's next draw
    return [y.detach(), x.grad, w.grad, *state]


def _raw(*args, **kwargs):
    ckpt_guard.uninstall()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _step(*args, **kwargs)
    finally:
        ckpt_guard.install("strict")


def _fallback(*args, **kwargs):
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        result = _step(*args, **kwargs)
    return result, [(event.rule_id, event.action) for event in events]


CASES = [
    pytest.param(mode, inside, ur, id=f"{mode.__name__}-{'inside' if inside else 'outside'}-{'R' if ur else 'NR'}")
    for mode, inside in ((ReplayableScale, False), (ReplayableScale, True), (ReplayableFunctionScale, True))
    for ur in (True, False)
]


@pytest.mark.parametrize("mode_class, backward_inside, use_reentrant", CASES)
def test_a_replayable_mode_is_re_entered_and_the_memory_saving_kept(mode_class, backward_inside, use_reentrant):
    reference = _step(mode_class, "plain", backward_inside=backward_inside)
    raw = _raw(mode_class, "checkpoint", use_reentrant, backward_inside)
    assert not torch.equal(raw[2], reference[2])  # torch: the recompute runs under other state
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError) as info:
        _step(mode_class, "checkpoint", use_reentrant, backward_inside)
    assert info.value.rule.id == ("CKG102" if issubclass(mode_class, TorchDispatchMode) else "CKG103")
    repaired, events = _fallback(mode_class, "checkpoint", use_reentrant, backward_inside)
    assert_all_close(repaired, reference)  # the gradients, the counter, the generator's next draw
    assert [action for _, action in events] == [replayed(use_reentrant)]  # checkpointed and recomputed


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_an_unmarked_mode_still_runs_the_block_plainly(use_reentrant):
    reference = _step(CountingScale, "plain")
    repaired, events = _fallback(CountingScale, "checkpoint", use_reentrant)
    assert_all_close(repaired, reference)
    assert events == [("CKG102", "fallback: no checkpoint")]


def test_a_subclass_of_a_marked_mode_is_not_marked():
    """It may read what its parent does not: the user marks it."""
    Sub = type("Sub", (ReplayableScale,), {})
    reference = _step(Sub, "plain")
    repaired, events = _fallback(Sub, "checkpoint")
    assert_all_close(repaired, reference)
    assert events == [("CKG102", "fallback: no checkpoint")]


def test_a_user_context_fn_keeps_the_plain_run():
    """A context_fn manages the recompute's modes itself: fallback does not add the forward's."""
    import contextlib

    context_fn = lambda: (contextlib.nullcontext(), contextlib.nullcontext())  # noqa: E731
    reference = _step(ReplayableScale, "plain")
    repaired, events = _fallback(ReplayableScale, "checkpoint", context_fn=context_fn)
    assert_all_close(repaired, reference)
    assert events == [("CKG102", "fallback: no checkpoint")]


class Unmarked(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 3 if func is torch.ops.aten.sin.default else out


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("around_backward", ["another object of its class", "an unrelated unmarked mode"])
def test_other_modes_around_the_backward_are_taken_off_for_the_recompute(around_backward, use_reentrant):
    """Found by the reviews: a mode around the backward only is not the forward's; in the recompute it
    would see operations it never saw without checkpointing.  Fallback takes it off for the recompute."""

    def step(how):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with ReplayableScale():
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=use_reentrant)
        other = ReplayableScale() if around_backward.startswith("another") else Unmarked()
        other.seen = 5  # configured (or moved on) otherwise than the forward's
        with other:
            y.sum().backward()
        return [x.grad, w.grad]

    reference = step("plain")
    raw = _raw_step(lambda: step("checkpoint"))
    assert not torch.equal(raw[1], reference[1])
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match=r"\[CKG102\]"):
        step("checkpoint")
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = step("checkpoint")
    assert_all_close(repaired, reference)
    assert [event.action for event in events] == [replayed(use_reentrant)]
    assert (torch._C._len_torch_dispatch_stack(), torch._C._len_torch_function_stack()) == (0, 0)


@ckpt_guard.replayable_mode
class ScaleInATensor(TorchDispatchMode):
    """Keeps its scale in a tensor it updates in place (an FP8 amax history's way), inside
    __torch_dispatch__, where no version counter moves; and another in a tuple."""

    def __init__(self):
        super().__init__()
        self.scale = torch.ones(())
        self.history = (torch.zeros(2),)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.scale.add_(1)
            self.history[0].add_(0.5)
            out = out * self.scale + self.history[0].sum()
        return out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_tensor_a_marked_mode_updates_in_place_is_replayed_from_a_copy(use_reentrant):
    def step(how):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        mode = ScaleInATensor()
        with mode:
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=use_reentrant)
        y.sum().backward()
        return [y.detach(), x.grad, w.grad, mode.scale, mode.history[0]]

    reference = step("plain")
    raw = _raw_step(lambda: step("checkpoint"))
    assert not torch.equal(raw[2], reference[2])
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = step("checkpoint")
    assert_all_close(repaired, reference)  # the user's tensors hold what the forward left, not more
    assert [event.action for event in events] == [replayed(use_reentrant)]


@ckpt_guard.replayable_mode
class LearnedScale(TorchFunctionMode):
    """Multiplies each torch.sin by a tensor that needs a gradient: the recompute must use that
    very tensor, so an in-place update of it cannot be replayed."""

    def __init__(self, scale):
        super().__init__()
        self.scale = scale

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * self.scale if func is torch.sin else out


def test_a_mode_tensor_that_needs_a_gradient_flows_and_an_update_of_it_is_raised():
    def step(how, update=False):
        torch.manual_seed(0)
        scale = torch.tensor(1.5, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with LearnedScale(scale):  # reentrant: replayed on every torch (see replayed())
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=True)
            if update:
                with torch.no_grad():
                    scale.add_(1)
            y.sum().backward()
        return [x.grad, w.grad, scale.grad]

    reference = step("plain")
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        assert_all_close(step("checkpoint"), reference)  # the scale's gradient included
        with pytest.raises(CheckpointCompositionError, match=r"\[CKG103\]"):
            step("checkpoint", update=True)


def test_a_marked_mode_without_drift_is_bitwise_torch():
    """A marked mode around the whole step whose state does not change: no rule fires, torch's result."""

    @ckpt_guard.replayable_mode
    class Quiet(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def step():
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with Quiet():
            checkpoint(block, x, w, use_reentrant=False).sum().backward()
        return [x.grad, w.grad]

    raw = _raw_step(step)
    for policy in ("strict", "warn", "fallback"):
        with ckpt_guard.policy(policy), warnings.catch_warnings():
            # fallback runs it plainly, and says so, where it could not replay the mode (torch < 2.8)
            quiet = policy != "fallback" or QUIET_RECOMPUTE_HOOKS
            warnings.simplefilter("error" if quiet else "ignore", CheckpointCompositionWarning)
            result = step()
        for a, b in zip(result, raw):
            assert torch.equal(a, b)


def _raw_step(step):
    ckpt_guard.uninstall()
    try:
        return step()
    finally:
        ckpt_guard.install("strict")


def test_the_users_exception_in_a_replayed_mode_passes_through_and_the_state_is_put_back():
    @ckpt_guard.replayable_mode
    class FailsSecondTime(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.armed = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.sin.default and self.armed:
                raise KeyError("the user's own")
            return func(*args, **(kwargs or {}))

    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    mode = FailsSecondTime()
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        with mode:
            y = checkpoint(block, x, w, use_reentrant=False)
        mode.armed = True  # changed after the forward: the replay puts False back for the recompute
        y.sum().backward()
    assert mode.armed is True  # and the current state back after it
    assert torch._C._len_torch_dispatch_stack() == 0


@pytest.mark.parametrize("bad", [42, TorchDispatchMode(), int])
def test_replayable_mode_names_a_bad_value(bad):
    with pytest.raises(TypeError, match=r"replayable_mode\(.*\): expected a TorchDispatchMode or TorchFunctionMode"):
        ckpt_guard.replayable_mode(bad)


class _Deep:
    def __init__(self, depth):
        self.inner = _Deep(depth - 1) if depth else None
        self.counter = 0


@pytest.mark.parametrize(
    "held",
    [
        pytest.param(lambda: __import__("collections").deque([1.0]), id="a deque"),
        pytest.param(lambda: torch.nn.Linear(2, 2), id="a module"),
        pytest.param(lambda: __import__("threading").Lock(), id="a lock"),
        pytest.param(lambda: _Deep(6), id="an object six deep"),
        pytest.param(lambda: list(range(1000)), id="a long list"),
        pytest.param(lambda: torch.zeros(1 << 19), id="a large tensor"),
    ],
)
def test_a_marked_mode_holding_state_the_replay_cannot_keep_runs_the_block_plainly(held):
    """Its whole state could not be put back for the recompute: not checkpointed, as an unmarked one."""

    @ckpt_guard.replayable_mode
    class Holding(CountingScale):
        def __init__(self):
            super().__init__()
            self.held = held()

    reference = _step(Holding, "plain")
    repaired, events = _fallback(Holding, "checkpoint")
    assert_all_close(repaired, reference)
    assert events == [("CKG102", "fallback: no checkpoint")]


@pytest.mark.parametrize(
    "held",
    [
        pytest.param(lambda: torch.sin, id="a function"),
        pytest.param(lambda: torch.ops.aten.sin.default, id="an operator"),
        pytest.param(lambda: {"log": [1, 2], "scale": (torch.ones(2), 2.0)}, id="a dict of a list and a tuple"),
        pytest.param(lambda: _Deep(2), id="an object three deep"),
    ],
)
def test_a_marked_mode_holding_state_the_replay_keeps_is_checkpointed(held):
    @ckpt_guard.replayable_mode
    class Holding(CountingScale):
        def __init__(self):
            super().__init__()
            self.held = held()

    reference = _step(Holding, "plain")
    repaired, events = _fallback(Holding, "checkpoint")
    assert_all_close(repaired, reference)
    assert events == [("CKG102", replayed())]


class _Stats:
    def __init__(self):
        self.count = 0


@ckpt_guard.replayable_mode
class NestedCounter(TorchDispatchMode):
    """Its scale is a counter inside an object inside a dict it holds: replayed from the call's values."""

    def __init__(self):
        super().__init__()
        self.seen = 0
        self.config = {"stats": _Stats(), "seen": []}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            stats = self.config["stats"]
            stats.count += 1
            self.config["seen"].append(stats.count)
            out = out * stats.count
        return out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_nested_state_of_a_marked_mode_is_replayed_and_put_back(use_reentrant):
    def step(how):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        mode = NestedCounter()
        with mode:  # the backward inside it: torch recomputes under the counter the forward moved on
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=use_reentrant)
            y.sum().backward()
        return [x.grad, w.grad, torch.tensor(mode.config["seen"], dtype=torch.float)]

    reference = step("plain")
    raw = _raw_step(lambda: step("checkpoint"))
    assert not torch.equal(raw[1], reference[1])
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = step("checkpoint")
    assert_all_close(repaired, reference)  # the log holds the forward's two entries, not four
    assert [event.action for event in events] == [replayed(use_reentrant)]


# --------------------------------------------------------------------------
# what the second review found: each broke the first version of the replay


@ckpt_guard.replayable_mode
class OpLog(TorchDispatchMode):
    """Logs every operation it sees and scales sin by the log's length: it must see exactly the
    forward's operations in the recompute (not the guard's copies, nor torch's recompute hooks)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.ones(())  # a tensor the guard copies
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        return out * len(self.ops) if func is torch.ops.aten.sin.default else out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_mode_logging_every_operation_sees_neither_the_guards_copies_nor_torchs_hooks(use_reentrant):
    def step(how):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        mode = OpLog()
        with mode:
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=use_reentrant)
            forward_ops = list(mode.ops)
        y.sum().backward()
        return [y.detach(), x.grad, w.grad], forward_ops, mode.ops

    reference, reference_ops, _ = step("plain")
    _, raw_forward_ops, _ = _raw_step(lambda: step("checkpoint"))  # torch 2.4's own forward shows ops too
    for policy in ("strict", "warn", "fallback"):
        with ckpt_guard.policy(policy), ckpt_guard.record() as events, warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointCompositionWarning)
            try:
                result, forward_ops, final_ops = step("checkpoint")
            except CheckpointCompositionError:
                assert policy == "strict"
                continue
        ran_plainly = [event.action for event in events] == ["fallback: no checkpoint"]
        assert forward_ops == (reference_ops if ran_plainly else raw_forward_ops)  # the guard's reads run unseen
        if policy == "fallback":
            assert_all_close(result, reference)
            assert final_ops == forward_ops  # the recompute's operations are put back, not added


@ckpt_guard.replayable_mode
class AllowList(TorchDispatchMode):
    """Allows only the operations of the block (an audit mode), and holds a tensor."""

    allowed = frozenset({"aten.sin.default", "aten.mul.Tensor"})

    def __init__(self):
        super().__init__()
        self.scale = torch.ones(())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.allowed:
            raise RuntimeError(f"{func} is not allowed")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["strict", "warn", "fallback"])
def test_an_audit_mode_sees_no_operation_of_the_guard(policy):
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with ckpt_guard.policy(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        with AllowList():
            y = checkpoint(block, x, w, use_reentrant=True)
    assert y.shape == (4, 3)


@ckpt_guard.replayable_mode
class FakeQuant(TorchDispatchMode):
    """Rounds every float result to a 1/16 grid and adds a constant tensor it never changes."""

    def __init__(self):
        super().__init__()
        self.bias = torch.tensor(0.1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            out = (out * 16).round() / 16
        return out + self.bias if func is torch.ops.aten.sin.default else out


def _held(value):
    @ckpt_guard.replayable_mode
    class Holds(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.value = value()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return Holds


@pytest.mark.parametrize(
    "mode_class",
    [
        pytest.param(FakeQuant, id="a fake-quant mode"),
        pytest.param(_held(lambda: torch.tensor([float("nan"), 1.0])), id="a tensor holding NaN"),
        pytest.param(_held(lambda: torch.empty(3, device="meta")), id="a meta tensor"),
        pytest.param(_held(lambda: torch.eye(3).to_sparse()), id="a sparse tensor"),
    ],
)
def test_a_marked_mode_whose_state_does_not_move_is_bitwise_torch(mode_class):
    """The backward inside the same mode object, nothing changed: strict and warn stay silent (no
    false alarm, no crash) with torch's result; fallback gives it too (a meta or sparse tensor is not
    copied, so that mode's block runs plainly, with a warning saying so)."""

    def step():
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with mode_class():
            y = checkpoint(block, x, w, use_reentrant=False)
            y.sum().backward()
        return [y.detach(), x.grad, w.grad]

    raw = _raw_step(step)
    for policy in ("strict", "warn", "fallback"):
        with ckpt_guard.policy(policy), ckpt_guard.record() as events, warnings.catch_warnings():
            warnings.simplefilter("error" if policy != "fallback" else "ignore", CheckpointCompositionWarning)
            result = step()
        if [event.action for event in events] == ["fallback: no checkpoint"]:
            expected = _raw_step(lambda: _plain(step))  # the plain run's (torch 2.4's checkpoint
        else:  # shows the fake-quant mode ops of its own, so raw torch differs from it there)
            expected = raw
        for a, b in zip(result, expected):
            assert torch.equal(a, b)


def _plain(step):
    """``step`` with checkpoint calling the block plainly."""
    global checkpoint
    saved, checkpoint = checkpoint, lambda function, *args, **kwargs: function(*args)
    try:
        return step()
    finally:
        checkpoint = saved


class _SlotCounter(TorchDispatchMode):
    __slots__ = ("seen",)

    def __init__(self):
        super().__init__()
        self.seen = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.seen += 1
            out = out * (self.seen + 1)
        return out


class _ClassList(TorchDispatchMode):
    history: list = []  # shared by its objects: self.history is the class's list

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.history.append(1)
            out = out * (len(self.history) + 1)
        return out


class _MutableDefault(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.scale_of = lambda out, seen=[]: (seen.append(1), out * (len(seen) + 1))[1]  # noqa: B006

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return self.scale_of(out) if func is torch.ops.aten.sin.default else out


class _ViewOfHistory(TorchDispatchMode):
    """Holds a buffer and a view of it, updates the buffer in place: copies would not follow."""

    def __init__(self):
        super().__init__()
        self.history = torch.zeros(2)
        self.latest = self.history[:1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.history.add_(1)
            out = out * (self.latest + 1)
        return out


class _GradScale(TorchDispatchMode):
    """A dispatch mode holding a tensor that needs a gradient, updated inside __torch_dispatch__ (no
    version counter moves there)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.tensor(2.0, requires_grad=True)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.scale.data.add_(1)
            out = out * self.scale.detach()
        return out


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize(
    "mode_class",
    [
        pytest.param(_SlotCounter, id="state in __slots__"),
        pytest.param(_ClassList, id="a list held by the class"),
        pytest.param(_MutableDefault, id="a function with a mutable default"),
        pytest.param(_ViewOfHistory, id="a tensor and a view of it"),
        pytest.param(_GradScale, id="a dispatch mode holding a tensor that needs a gradient"),
    ],
)
def test_a_marked_mode_with_state_the_record_cannot_keep_runs_the_block_plainly(mode_class, use_reentrant):
    marked = ckpt_guard.replayable_mode(type(mode_class.__name__, (mode_class,), {}))
    if mode_class is _ClassList:
        marked.history = []

    def step(how):
        if mode_class is _ClassList:
            marked.history.clear()
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with marked():
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=use_reentrant)
        y.sum().backward()
        return [y.detach(), x.grad, w.grad]

    reference = step("plain")
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        result = step("checkpoint")
    assert_all_close(result, reference)
    assert [event.action for event in events] == ["fallback: no checkpoint"]


# --------------------------------------------------------------------------
# what the third review found


@ckpt_guard.replayable_mode
class Accumulator(TorchDispatchMode):
    """Adds 1 to a tensor of its own on each sin, inside __torch_dispatch__ (no version counter moves)."""

    def __init__(self):
        super().__init__()
        self.acc = torch.ones(3)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.acc.add_(1.0)
        return out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_tensor_the_mode_holds_and_the_block_reads_is_replayed_for_both(use_reentrant):
    """The block is given the mode's own tensor: a copy swapped into the mode alone left the block
    reading the moved one.  The replay writes the forward's value into the tensor itself."""

    def block_reading(t, w, acc):
        return torch.sin(t * acc) * w

    def step(how):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        mode = Accumulator()
        with mode:
            if how == "plain":
                y = block_reading(x, w, mode.acc)
            else:
                y = checkpoint(block_reading, x, w, mode.acc, use_reentrant=use_reentrant)
            torch.sin(x)  # the mode's state moves on after the block
        y.sum().backward()
        return [y.detach(), x.grad, w.grad, mode.acc.clone()]

    reference = step("plain")
    raw = _raw_step(lambda: step("checkpoint"))
    assert not torch.equal(raw[1], reference[1])
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = step("checkpoint")
    assert_all_close(repaired, reference)  # the mode's tensor ends where the plain run leaves it
    assert [event.action for event in events] == [replayed(use_reentrant)]


@pytest.mark.parametrize("backward_inside", [False, True])
def test_a_reentrant_forward_run_again_for_a_kv_cache_starts_from_the_modes_state_at_the_call(backward_inside):
    """CKG112's fallback runs a reentrant forward that filled a cache again, non-reentrant: the
    marked mode's counter must be put back before, as the cache is."""

    def block_caching(t, w, cache):
        out = torch.sin(torch.sin(t) * w)
        cache.append(out * 2)
        return out

    def step(how):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        mode, cache = ReplayableScale(), []
        with mode:
            if how == "plain":
                y = block_caching(x, w, cache)
            else:
                y = checkpoint(block_caching, x, w, cache, use_reentrant=True)
            if backward_inside:
                (y.sum() + cache[0].sum()).backward()
        if not backward_inside:
            (y.sum() + cache[0].sum()).backward()
        return [y.detach(), cache[0].detach(), x.grad, w.grad, torch.tensor(float(mode.seen)), torch.tensor(len(cache))]

    reference = step("plain")
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = step("checkpoint")
    assert_all_close(repaired, reference)


@ckpt_guard.replayable_mode
class GrowingHistory(TorchDispatchMode):
    """Appends to a list on each sin and scales by its length: state that only grows."""

    def __init__(self):
        super().__init__()
        self.history = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.history.append(1)
            out = out * len(self.history)
        return out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_state_that_only_grows_counts_as_moved_when_the_backward_runs_inside_the_mode(use_reentrant):
    """CKG112 does not count a log appended to; a marked mode's own log may be what it computes from."""
    reference = _step(GrowingHistoryCounted, "plain", backward_inside=True)
    raw = _raw(GrowingHistoryCounted, "checkpoint", use_reentrant, True)
    assert not torch.equal(raw[2], reference[2])
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match="history: 0 items → 2 items"):
        _step(GrowingHistoryCounted, "checkpoint", use_reentrant, True)
    repaired, events = _fallback(GrowingHistoryCounted, "checkpoint", use_reentrant, True)
    assert_all_close(repaired, reference)
    assert [action for _, action in events] == [replayed(use_reentrant)]


@ckpt_guard.replayable_mode
class GrowingHistoryCounted(GrowingHistory):
    @property
    def seen(self):  # what _step reports as the mode's final state
        return len(self.history)


# --------------------------------------------------------------------------
# what the fourth review found


@ckpt_guard.replayable_mode
class LearnedShift(TorchFunctionMode):
    """Adds a tensor that needs a gradient to each sin and bumps it under no_grad."""

    def __init__(self, shift):
        super().__init__()
        self.shift = shift

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.sin:
            with torch.no_grad():
                self.shift.add_(1)
            out = out + self.shift
        return out


def test_a_reentrant_forward_that_moved_a_modes_gradient_tensor_is_not_run_again():
    """CKG112's rerun would start from the moved tensor (no copy can stand in for it): raised."""
    shift = torch.zeros(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, requires_grad=True)

    def block_caching(t, w, cache):
        out = torch.sin(t) * w
        cache.append(out * 2)
        return out

    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        with LearnedShift(shift), pytest.raises(CheckpointCompositionError, match="one a marked mode holds"):
            checkpoint(block_caching, x, w, [], use_reentrant=True)


@ckpt_guard.replayable_mode
class Shapes(TorchDispatchMode):
    """Keeps the last shape it saw, a new (equal) tuple each time: not a change of state."""

    def __init__(self):
        super().__init__()
        self.last = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.last = tuple(out.shape)
        return out


def test_an_equal_tuple_rebound_is_no_change():
    def step():
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with Shapes() as mode:
            mode.last = (4, 3)  # what it holds at the call, and again at the recompute, made anew
            y = checkpoint(block, x, w, use_reentrant=False)
            (y * 1).sum().backward()
            assert mode.last == (4, 3)
        return [y.detach(), x.grad, w.grad]

    raw = _raw_step(step)
    with ckpt_guard.policy("strict"), warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        for a, b in zip(step(), raw):
            assert torch.equal(a, b)


@ckpt_guard.replayable_mode
class Growing(TorchDispatchMode):
    """Grows a tensor of its own in place (resize_): its old value cannot be written back into it."""

    def __init__(self):
        super().__init__()
        self.history = torch.zeros(3)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.history.resize_(self.history.numel() + 1)
        return out


def test_a_held_tensor_resized_in_place_is_raised_not_crashed():
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        mode = Growing()
        with mode:
            y = checkpoint(block, x, w, use_reentrant=True)
        with pytest.raises(CheckpointCompositionError, match=r"\[CKG102\]"):
            y.sum().backward()
    assert mode.history.numel() == 5  # left as the forward made it


# --------------------------------------------------------------------------
# what the fifth review found


def _closing_over_a_list():
    seen = []

    class ClosesOver(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.sin.default:
                seen.append(1)
                out = out * (len(seen) + 1)
            return out

    return ClosesOver


class _DefaultOnDispatch(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None, _seen=[]):  # noqa: B006
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            _seen.append(1)
            out = out * (len(_seen) + 1)
        return out


class _StaticHelper(TorchDispatchMode):
    @staticmethod
    def scale(out, _seen=[]):  # noqa: B006
        _seen.append(1)
        return out * (len(_seen) + 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return self.scale(out) if func is torch.ops.aten.sin.default else out


class _Tracker:
    history: list = []

    def scale(self, out):
        self.history.append(1)
        return out * (len(self.history) + 1)


class _MixinAfterTheBase(TorchDispatchMode, _Tracker):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return self.scale(out) if func is torch.ops.aten.sin.default else out


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_closing_over_a_list, id="its method closes over a list"),
        pytest.param(lambda: _DefaultOnDispatch, id="a mutable default on __torch_dispatch__"),
        pytest.param(lambda: _StaticHelper, id="a static method with a mutable default"),
        pytest.param(lambda: _MixinAfterTheBase, id="a mixin after the base holding a list"),
    ],
)
def test_state_outside_the_instance_keeps_the_plain_run(make, use_reentrant):
    """State the promise excludes, that the guard can see: marked or not, the block runs plainly."""
    marked = ckpt_guard.replayable_mode(type("Marked", (make(),), {}))

    def step(how):
        return _step(marked, how, use_reentrant, backward_inside=True)

    first, second = step("plain"), step("plain")
    assert not torch.equal(first[0], second[0])  # its state lives outside the object: it moved on
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        step("checkpoint")
    assert [event.action for event in events] == ["fallback: no checkpoint"]  # the plain run, as unmarked


@ckpt_guard.replayable_mode
class ScheduledScale(TorchFunctionMode):
    """Multiplies sin by a scale tensor it holds (autograd saves it); the user steps it between the
    forward and the backward."""

    def __init__(self):
        super().__init__()
        self.scale = torch.tensor(2.0)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * self.scale if func is torch.sin else out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_held_tensor_updated_where_autograd_sees_it_is_raised_as_torch_raises(use_reentrant):
    """Without checkpointing torch raises (a saved tensor modified in place); a quiet write-back would
    have hidden that and used the new scale."""
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    mode = ScheduledScale()
    with mode:
        y = block(x, w)
    with torch.no_grad():
        mode.scale.fill_(3.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    mode = ScheduledScale()
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        with mode:
            y = checkpoint(block, x, w, use_reentrant=use_reentrant)
        with torch.no_grad():
            mode.scale.fill_(3.0)
        if use_reentrant or QUIET_RECOMPUTE_HOOKS:
            with pytest.raises(CheckpointCompositionError, match=r"\[CKG103\]"):
                y.sum().backward()
        else:  # torch 2.4-2.7, non-reentrant: run plainly, so torch's own error
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward()


# --------------------------------------------------------------------------
# what the sixth review found


def _nonlocal_counter():
    n = 0

    class CountsInACell(TorchDispatchMode):
        def scale(self, out):
            nonlocal n
            n += 1
            return out * (n + 1)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return self.scale(out) if func is torch.ops.aten.sin.default else out

    return CountsInACell


class _FunctionAttribute(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            helper.calls += 1
            out = out * (helper.calls + 1)
        return out

    @staticmethod
    def helper():
        pass


helper = _FunctionAttribute.helper
helper.calls = 0


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("make", [
    pytest.param(_nonlocal_counter, id="a number in a closure cell, rebound by nonlocal"),
    pytest.param(lambda: _FunctionAttribute, id="a counter on a function's attributes"),
])
def test_a_number_kept_in_a_cell_or_on_a_function_keeps_the_plain_run(make, use_reentrant):
    marked = ckpt_guard.replayable_mode(type("Marked", (make(),), {}))

    def step(how):
        return _step(marked, how, use_reentrant, backward_inside=True)

    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        step("checkpoint")
    assert [event.action for event in events] == ["fallback: no checkpoint"]


import dataclasses  # noqa: E402
import enum  # noqa: E402
import functools  # noqa: E402
import typing  # noqa: E402


class _Kind(enum.Enum):
    SCALE = 1


@dataclasses.dataclass
class _DataclassScale(TorchDispatchMode):
    seen: int = 0
    kind: _Kind = _Kind.SCALE

    def __post_init__(self):
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.seen += 1
            out = out * (self.seen + 1)
        return out


T = typing.TypeVar("T")


class _GenericScale(TorchDispatchMode, typing.Generic[T]):
    ops = frozenset({torch.ops.aten.sin.default})
    kind = _Kind.SCALE

    def __init__(self):
        super().__init__()
        self.seen = 0

    @functools.cached_property
    def factor(self):
        return 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ops:
            self.seen += 1
            out = out * (self.seen + self.factor)
        return out


def _reading_a_namespace():
    aten = torch.ops.aten

    class ReadsNamespace(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is aten.sin.default:
                self.seen += 1
                out = out * (self.seen + 1)
            return out

    return ReadsNamespace


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("make", [
    pytest.param(lambda: _DataclassScale, id="a dataclass"),
    pytest.param(lambda: _GenericScale, id="typing.Generic, an enum, a frozenset of ops, a cached_property"),
    pytest.param(_reading_a_namespace, id="a closure over torch.ops.aten"),
])
def test_ordinary_mode_classes_are_replayed(make, use_reentrant):
    """Found by the sixth review: these were refused by a class inspection that looked at Python's
    own bookkeeping (a dataclass's fields, Generic's class methods, torch's op namespace)."""
    marked = ckpt_guard.replayable_mode(type("Marked", (make(),), {}))
    reference = _step(marked, "plain", backward_inside=True)
    raw = _raw(marked, "checkpoint", use_reentrant, True)
    assert not torch.equal(raw[2], reference[2])
    repaired, events = _fallback(marked, "checkpoint", use_reentrant, True)
    assert_all_close(repaired, reference)
    assert [action for _, action in events] == [replayed(use_reentrant)]


class _ClassCounter(TorchDispatchMode):
    calls = 0  # a number the class holds, rebound by its objects: state outside the instance

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            type(self).calls += 1
            out = out * (type(self).calls + 1)
        return out


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_number_its_class_holds_is_recorded_and_replayed(use_reentrant):
    marked = ckpt_guard.replayable_mode(type("MarkedClassCounter", (_ClassCounter,), {}))

    def step(how):
        marked.calls = 0
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        with marked():
            y = block(x, w) if how == "plain" else checkpoint(block, x, w, use_reentrant=use_reentrant)
            y.sum().backward()
        return [y.detach(), x.grad, w.grad, torch.tensor(float(marked.calls))]

    reference = step("plain")
    raw = _raw_step(lambda: step("checkpoint"))
    assert not torch.equal(raw[2], reference[2])
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match="MarkedClassCounter.calls changed"):
        step("checkpoint")
    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = step("checkpoint")
    assert_all_close(repaired, reference)  # the class's counter too
    assert [event.action for event in events] == [replayed(use_reentrant)]


# --------------------------------------------------------------------------
# what the seventh review found


class _NestedState(TorchDispatchMode):
    class State:
        calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.sin.default:
            self.State.calls += 1
            out = out * (self.State.calls + 1)
        return out


def _counting(function):
    def wrapper(*args, **kwargs):
        wrapper.calls = getattr(wrapper, "calls", 0) + 1  # created on the first call
        return function(*args, **kwargs) * (wrapper.calls + 1)

    return wrapper


class _LazyWrapperCounter(TorchDispatchMode):
    @staticmethod
    @_counting
    def scale(out):
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return self.scale(out) if func is torch.ops.aten.sin.default else out


def _no_grad_nonlocal():
    n = 0

    class NoGradNonlocal(TorchDispatchMode):
        @torch.no_grad()
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            nonlocal n
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.sin.default:
                n += 1
                out = out * (n + 1)
            return out

    return NoGradNonlocal


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("make, expected", [
    pytest.param(lambda: _NestedState, "replayed", id="a nested class's counter (recorded)"),
    pytest.param(lambda: _LazyWrapperCounter, "replayed", id="a decorator's counter made on first use (recorded)"),
    pytest.param(_no_grad_nonlocal, "plain", id="a nonlocal under torch.no_grad() on __torch_dispatch__ (refused)"),
])
def test_state_in_referenced_classes_and_wrappers_is_recorded_or_refused(make, expected, use_reentrant):
    base = make()

    def fresh():
        for klass in base.__mro__:
            if "State" in vars(klass):
                klass.State.calls = 0
        scale = vars(base).get("scale")
        if scale is not None and hasattr(scale.__func__, "calls"):
            del scale.__func__.calls
        return ckpt_guard.replayable_mode(type("Marked", (base,), {}))

    with ckpt_guard.policy("fallback"), ckpt_guard.record() as events, warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        repaired = _step(fresh(), "checkpoint", use_reentrant, backward_inside=True)
    if expected == "plain":
        assert [event.action for event in events] == ["fallback: no checkpoint"]
        return
    reference = _step(fresh(), "plain", backward_inside=True)
    assert_all_close(repaired, reference)
    assert [event.action for event in events] == [replayed(use_reentrant)]


@ckpt_guard.replayable_mode
class FunctionLog(TorchFunctionMode):
    """Logs every function it sees, holding a tensor and a generator: the guard's record reads
    their versions and states, which it must do unseen."""

    def __init__(self):
        super().__init__()
        self.scale = torch.ones(())
        self.generator = torch.Generator().manual_seed(1)
        self.log = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.log.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_function_mode_sees_no_read_of_the_record():
    """The non-reentrant call (the reentrant one reads its inputs' requires_grad under the mode, as
    it did before records existed); fallback where it replays (torch >= 2.8), else it runs plainly."""

    def forward_log():
        w = torch.randn(3, requires_grad=True)
        x = torch.randn(4, 3, requires_grad=True)
        mode = FunctionLog()
        with mode:
            checkpoint(block, x, w, use_reentrant=False)
        return mode.log

    raw = _raw_step(forward_log)
    for policy in ("strict", "warn", "fallback") if QUIET_RECOMPUTE_HOOKS else ("strict", "warn"):
        with ckpt_guard.policy(policy), warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointCompositionWarning)
            assert forward_log() == raw


def test_the_words_for_a_marked_mode_say_what_is_left_to_do():
    """Strict: one line offers fallback, in this case's words (a review found two saying the same,
    one of 700 characters); the change line says which attribute moved though the mode is gone.
    Fallback, repaired: nothing to change (a review found it told the user to do what they had done)."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    mode = ReplayableScale()
    with mode:
        y = checkpoint(block, x, w, use_reentrant=True)
    mode.seen += 5
    with pytest.raises(CheckpointCompositionError) as info:
        y.sum().backward()
    message = str(info.value)
    fixes = [line for line in message.splitlines() if line.startswith("    - ")]
    assert sum("fallback" in line for line in fixes) == 2  # the remedy points to the next line, which sets it
    assert sum("rules={'CKG102': 'fallback'}" in line for line in fixes) == 1
    assert all(len(line) < 400 for line in fixes), fixes
    assert "ReplayableScale.seen changed" in message

    with ckpt_guard.policy("fallback"), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with mode:
            y = checkpoint(block, x, w, use_reentrant=True)
        y.sum().backward()
    text = "\n".join(str(r.message) for r in record if issubclass(r.category, CheckpointCompositionWarning))
    assert "    - nothing to change for correctness" in text, text
    assert "rules={'CKG102': 'fallback'}" not in text, text
