"""A parameter re-bound between the forward and a recompute (CKG110), the way meta-optimizers do it (issue 27, §1).

``torchopt.MetaSGD`` and ``higher``'s differentiable optimizers replace a module's
parameters with new tensors after the inner loss's backward; the outer backward then
recomputes the inner forward a second time, after the re-bind, and torch's recompute
reads the new weights.  Each composition runs three ways: without checkpointing (the
reference), raw torch checkpointing, and guarded, across the ways a block is handed to
checkpoint (the module, its bound method, a lambda closing over the module: the last was
unseen before).  Expectations come from the table: CKG110's claim on the installed torch.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from conftest import installed_under
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed

RULE = rule_by_id("CKG110")
HOLDS = RULE.holds_on(installed())
#: the module, its bound method, a lambda closing over it, ``partial(forward, module)`` (the way
#: transformers 5's GradientCheckpointingLayer hands its layers to checkpoint), and a lambda calling
#: a helper that closes over it (a closure of a closure), and the method of a plain object that
#: holds the net (a trainer's, a wrapper's): the last two unseen before 2026-12-06
BLOCKS = ("module", "method", "lambda", "partial-forward", "closure of a closure", "a plain object's method")


class _Holder:
    def __init__(self, net):
        self.net = net

    def block(self, h):
        return torch.tanh(self.net.fc1(h))


class Net(nn.Module):
    def __init__(self, how: str, entry: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)
        self.how, self.entry = how, entry

    def block(self, h):
        return torch.tanh(self.fc1(h))

    def forward(self, x):
        helper = lambda h: torch.tanh(self.fc1(h))  # noqa: E731
        function = {
            "module": lambda: nn.Sequential(self.fc1, nn.Tanh()),
            "method": self.block,
            "lambda": lambda h: torch.tanh(self.fc1(h)),
            "partial-forward": lambda: functools.partial(nn.Sequential.forward, nn.Sequential(self.fc1, nn.Tanh())),
            "closure of a closure": lambda h: helper(h),
            "a plain object's method": _Holder(self).block,
        }[self.how]
        if self.how in ("module", "partial-forward"):
            function = function()
        if self.entry == "plain":
            h = function(x)
        elif self.entry == "torch":
            h = checkpoint(function, x, use_reentrant=False)
        else:
            h = ckpt_guard.checkpoint(function, x)
        return self.fc2(h)


def _data():
    torch.manual_seed(1)
    return torch.randn(5, 4), torch.randn(5, 1), torch.randn(5, 4), torch.randn(5, 1)


def reduced_maml(how: str, entry: str) -> list:
    """The issue's reduction: an inner step that re-binds ``fc1.weight``, then the outer loss."""
    torch.manual_seed(0)
    net = Net(how, entry)
    xs, ys, xq, yq = _data()
    w0, b0 = net.fc1.weight, net.fc1.bias
    inner = ((net(xs) - ys) ** 2).mean()
    gw, gb = torch.autograd.grad(inner, (w0, b0), create_graph=True)
    del net.fc1.weight, net.fc1.bias
    net.fc1.weight, net.fc1.bias = w0 - 0.1 * gw, b0 - 0.1 * gb  # re-bound, not updated in place
    ((net(xq) - yq) ** 2).mean().backward()
    return [w0.grad, b0.grad, net.fc2.weight.grad]


def torchopt_maml(how: str, entry: str) -> list:
    torchopt = pytest.importorskip("torchopt", reason="torchopt is a test extra; not installed here")
    torch.manual_seed(0)
    net = Net(how, entry)
    xs, ys, xq, yq = _data()
    state = torchopt.extract_state_dict(net)
    inner = torchopt.MetaSGD(net, lr=0.1)
    for _ in range(2):
        inner.step(((net(xs) - ys) ** 2).mean())
    ((net(xq) - yq) ** 2).mean().backward()
    torchopt.recover_state_dict(net, state)
    return [p.grad.clone() for p in net.parameters()]


def higher_maml(how: str, entry: str) -> list:
    higher = pytest.importorskip("higher", reason="higher is a test extra; not installed here")
    torch.manual_seed(0)
    net = Net(how, entry)
    xs, ys, xq, yq = _data()
    with higher.innerloop_ctx(net, torch.optim.SGD(net.parameters(), lr=0.1), copy_initial_weights=False) as (
        fnet, diffopt,
    ):
        for _ in range(2):
            diffopt.step(((fnet(xs) - ys) ** 2).mean())
        ((fnet(xq) - yq) ** 2).mean().backward()
    return [p.grad.clone() for p in net.parameters()]


def _close(got, reference) -> bool:
    return all(torch.allclose(g, r, rtol=1e-4, atol=1e-6) for g, r in zip(got, reference))


_under = installed_under


@pytest.mark.parametrize("how", BLOCKS)
@pytest.mark.parametrize("run", [reduced_maml, torchopt_maml], ids=["reduced", "torchopt.MetaSGD"])
def test_a_re_bind_before_the_second_recompute_is_caught_for_every_way_a_block_is_given(run, how):
    reference = run(how, "plain")
    raw = run(how, "torch")
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()} (the table: {RULE.torch_versions})")
    assert not _close(raw, reference)  # torch: silently wrong, as the table says
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]"):
        _under("strict", run, how, "torch")
    warned, messages = _under("warn", run, how, "torch")
    assert [m.rule.id for m in messages] and {m.rule.id for m in messages} == {"CKG110"}
    for w, r in zip(warned, raw):
        assert torch.equal(w, r)  # warn: exactly what torch does
    repaired, messages = _under("fallback", run, how, "torch")
    assert {m.rule.id for m in messages} == {"CKG110"}
    for g, r in zip(repaired, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("how", BLOCKS)
@pytest.mark.parametrize("run", [reduced_maml, torchopt_maml], ids=["reduced", "torchopt.MetaSGD"])
def test_ckpt_guard_checkpoint_without_install_applies_the_same_rule(run, how, monkeypatch):
    """Outside torch.func ckpt_guard.checkpoint is torch's checkpoint; with nothing installed its
    recomputes are checked all the same, under the environment's policy."""
    assert not ckpt_guard.is_installed()
    reference = run(how, "plain")
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()}")
    monkeypatch.setenv("CKPT_GUARD_POLICY", "strict")
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]"):
        run(how, "guard")
    monkeypatch.setenv("CKPT_GUARD_POLICY", "fallback")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        got = run(how, "guard")
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("how", BLOCKS)
def test_higher_innerloop_is_caught_and_fallback_runs_it_without_checkpointing(how):
    """higher's functional modules bind their fast weights from a box of their own at each call (a
    ``__setattr__`` of their own): the guard re-reads what the forward bound when it ends, so strict
    catches the outer recompute reading later fast weights; binding the forward's tensors for one
    recompute would not reach that box, so fallback, seeing such modules at the call, runs the
    block without checkpointing (exact), warning once."""
    reference = higher_maml(how, "plain")
    raw = higher_maml(how, "torch")
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()}")
    assert not _close(raw, reference)
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]"):
        _under("strict", higher_maml, how, "torch")
    repaired, messages = _under("fallback", higher_maml, how, "torch")
    assert {m.rule.id for m in messages} == {"CKG110"}
    assert all("ran it without checkpointing" in str(m) for m in messages)
    for g, r in zip(repaired, reference):
        torch.testing.assert_close(g, r)


def higher_monkeypatched(how: str, entry: str) -> list:
    """``higher.monkeypatch(net)`` and ``torch.autograd.grad`` over fast weights given per call: torch
    gets this right (the recompute binds the same fast weights again)."""
    higher = pytest.importorskip("higher", reason="higher is a test extra; not installed here")
    torch.manual_seed(0)
    net = Net(how, entry)
    fnet = higher.monkeypatch(net)
    xs, ys, _, _ = _data()
    params = [p.detach().clone().requires_grad_() for p in net.parameters()]
    loss = ((fnet(xs, params=params) - ys) ** 2).mean()
    return list(torch.autograd.grad(loss, params))


@pytest.mark.parametrize("how", ["module", "partial-forward"])
def test_higher_monkeypatch_is_no_false_alarm(how):
    """Issue 27, section 2: ``net.forward`` checkpointing a submodule under ``higher.monkeypatch`` raised
    CKG110 under strict and fallback: the guard's record, taken at the call, held what the module's
    previous call bound; the forward binds the fast weights itself. The record is now re-read when the
    forward ends: strict is silent and bitwise torch's; fallback runs it without checkpointing (it cannot
    tell that no later re-bind will come, and could not undo one: higher binds from its own box), exact."""
    reference = higher_monkeypatched(how, "plain")
    raw = higher_monkeypatched(how, "torch")
    assert _close(raw, reference)  # torch is right here
    guarded, messages = _under("strict", higher_monkeypatched, how, "torch")
    assert messages == []
    for g, r in zip(guarded, raw):
        assert torch.equal(g, r)
    repaired, messages = _under("fallback", higher_monkeypatched, how, "torch")
    assert {m.rule.id for m in messages} == {"CKG110"}
    assert all("ran it without checkpointing" in str(m) for m in messages)
    for g, r in zip(repaired, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("how", ["method", "lambda"])
def test_higher_monkeypatch_through_the_whole_net_is_a_known_strict_refusal(how):
    """The documented limit (docs/limits.md, CKG110): a block that holds the whole net (its bound
    method, a closure over ``self``) records ``fc2`` too, which the block never calls and the outer
    forward binds after it; the guard does not record which modules a forward called, so strict
    refuses this correct program. Fallback is exact (no checkpoint), and warn is torch's, bitwise."""
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()}")
    reference = higher_monkeypatched(how, "plain")
    raw = higher_monkeypatched(how, "torch")
    assert _close(raw, reference)
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]"):
        _under("strict", higher_monkeypatched, how, "torch")
    warned, _ = _under("warn", higher_monkeypatched, how, "torch")
    for w, r in zip(warned, raw):
        assert torch.equal(w, r)
    repaired, _ = _under("fallback", higher_monkeypatched, how, "torch")
    for g, r in zip(repaired, reference):
        torch.testing.assert_close(g, r)


@pytest.mark.parametrize("how", BLOCKS)
def test_a_functional_call_swap_is_reported_once_as_ckg101_not_also_as_ckg110(how):
    """The tensors a swap puts in are re-bound too when it ends; one cause, one warning."""
    torch.manual_seed(0)
    net = Net(how, "torch")
    params = {k: v.detach().clone().requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(5, 4)
    ckpt_guard.install("warn", rules={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            functional_call(net, params, (x,)).sum().backward()  # the backward runs after the swap ended
    finally:
        ckpt_guard.uninstall()
    ids = [w.message.rule.id for w in caught if issubclass(w.category, CheckpointCompositionWarning)]
    assert "CKG110" not in ids and ids.count("CKG101") <= 1, ids


@pytest.mark.parametrize(
    ("how", "expected"),
    [("module", ["0.weight, 0.bias"]), ("method", ["fc1.weight, fc1.bias", "fc2.weight, fc2.bias"]),
     ("lambda", ["self.fc1.weight, self.fc1.bias", "self.fc2.weight, self.fc2.bias"]),
     ("partial-forward", ["0.weight, 0.bias"])],
)
@pytest.mark.parametrize("run", [higher_maml, torchopt_maml], ids=["higher.innerloop_ctx", "torchopt.MetaSGD"])
def test_the_change_line_names_tensors_by_their_path_from_the_block(run, how, expected):
    """Issue 27, section 2: CKG110 named ``InnerFunctionalLinear.weight`` twice (higher's patched
    classes all read so); it names each tensor by where the block reaches it, grouped per module."""
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()}")
    with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]") as info:
        _under("strict", run, how, "torch")
    change = next(line for line in str(info.value).splitlines() if "changed since the forward:" in line)
    groups = [part.split(" (")[0].strip() for part in change.split(": ", 1)[1].split("; ")]
    assert groups == expected, change
    assert "re-bound (other tensors, not updated in place)" in change


def test_a_partial_of_a_helper_with_a_closure_keeps_its_closure_watched():
    """Review of d8b2762: ``partial(helper, lin)`` was read as ``lin``'s method, so a Parameter the helper
    closes over, re-bound before the backward, went unseen. A helper with a closure is a function (its cells
    watched); ``partial(forward, module)`` of the module's own class, or of a helper without a closure, is
    the module."""
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()}")
    lin = nn.Linear(3, 3)
    scale = nn.Parameter(torch.ones(3))

    def helper(module, x):
        return module(x) * scale

    ckpt_guard.install("strict", rules={})
    try:
        out = checkpoint(functools.partial(helper, lin), torch.randn(2, 3, requires_grad=True), use_reentrant=False)
        scale = nn.Parameter(torch.full((3,), 2.0))  # noqa: F841 - re-bound: the cell the helper reads
        with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]") as info:
            out.sum().backward()
    finally:
        ckpt_guard.uninstall()
    assert "the closure variable 'scale' re-bound" in str(info.value)


def test_the_forward_re_read_survives_the_device_watch(monkeypatch):
    """Review of e2fd73d: under a GPU default device a reentrant call's handle is wrapped in CKG109's
    device watch, which lost the re-read set on the handle before it: higher.monkeypatch then gave a
    CKG110 false alarm. The watch is faked on the CPU here (a default-device context on the stack, the
    accelerator check answering yes)."""
    higher = pytest.importorskip("higher", reason="higher is a test extra; not installed here")
    from ckpt_guard import _state

    class Net2(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 1)

        def forward(self, x):
            return self.fc2(checkpoint(self.fc1, x, use_reentrant=True))

    monkeypatch.setattr(_state, "accelerator_default_device", lambda: torch.device("cpu"))
    torch.manual_seed(0)
    net = Net2()
    fnet = higher.monkeypatch(net)
    x = torch.randn(5, 4, requires_grad=True)
    params = [p.detach().clone().requires_grad_() for p in net.parameters()]
    ckpt_guard.install("strict", rules={})
    try:
        with torch.device("cpu"):  # a DeviceContext on the function-mode stack, as a GPU default would be
            fnet(x, params=params).pow(2).mean().backward()
    finally:
        ckpt_guard.uninstall()
    assert all(p.grad is not None for p in params)


# --------------------------------------------------------------------------
# a global the block loads, re-bound before the recompute (a script's ``W = W - lr * g``, or the block's
# own ``global calls; calls += 1``): unseen before 2026-12-06, torch's recompute read the new value

GLOBAL_W = None
GLOBAL_CALLS = 0
GLOBAL_SCALE = 1.0


def _global_weight_block(h):
    return torch.tanh(h @ GLOBAL_W)


def _global_counter_block(h):
    global GLOBAL_CALLS
    GLOBAL_CALLS += 1
    return torch.tanh(h) * GLOBAL_CALLS


def _global_scale_block(h):  # a scale the program re-binds after the call (a Python value, as a counter)
    return torch.tanh(h @ GLOBAL_W * GLOBAL_SCALE)


def _calls_the_weight_block(h):  # a global helper of the user's, which loads the global
    return _global_weight_block(h)


def _calls_the_counter_block(h):
    return _global_counter_block(h)


def _calls_the_scale_block(h):
    return _global_scale_block(h)


class _GlobalsUser:
    """A plain object (no module) whose method, or whose ``__call__``, loads the global."""

    def __init__(self, block):
        self.block_code = block

    def __call__(self, h):
        return self.block_code(h)

    def run(self, h):
        return self.block_code(h)


#: how the block reaches the global: its own code, a helper in its closure (a function without cells
#: of its own), a global helper, a callable object, a plain object's method (the last four unseen
#: before 2026-12-06's second session: torch's recompute read the new value)
GLOBAL_SHAPES = {
    "the block's own code": lambda block: block,
    "a helper in its closure": lambda block: (lambda inner: lambda h: inner(h))(
        (lambda h: torch.tanh(h @ GLOBAL_W)) if block is _global_weight_block else block
    ),
    "a global helper it calls": lambda block: {
        _global_weight_block: _calls_the_weight_block, _global_counter_block: _calls_the_counter_block,
        _global_scale_block: _calls_the_scale_block,
    }[block],
    "a callable object": lambda block: _GlobalsUser(block),
    "a plain object's method": lambda block: _GlobalsUser(block).run,
}


#: what the program does to a global the block reads, by the block, and the global it names
GLOBAL_CHANGES = {
    "a weight re-bound after the call": (_global_weight_block, "GLOBAL_W"),
    "a counter the block's forward advances": (_global_counter_block, "GLOBAL_CALLS"),
    "a scale re-bound after the call": (_global_scale_block, "GLOBAL_SCALE"),
}


def _global_program(which: str, ckpt, shape: str = "the block's own code") -> list:
    global GLOBAL_W, GLOBAL_CALLS, GLOBAL_SCALE
    torch.manual_seed(0)
    GLOBAL_W = w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    GLOBAL_CALLS, GLOBAL_SCALE = 0, 1.0
    y = ckpt(GLOBAL_SHAPES[shape](GLOBAL_CHANGES[which][0]), x)
    if which == "a weight re-bound after the call":
        GLOBAL_W = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    elif which == "a scale re-bound after the call":
        GLOBAL_SCALE = 2.0
    y.pow(2).sum().backward()
    return [w.grad, x.grad, torch.tensor(float(GLOBAL_CALLS))]


GLOBAL_ENTRIES = {
    "torch checkpoint (non-reentrant)": lambda f, *a: checkpoint(f, *a, use_reentrant=False),
    "torch checkpoint (reentrant)": lambda f, *a: checkpoint(f, *a, use_reentrant=True),
    "ckpt_guard.checkpoint": lambda f, *a: ckpt_guard.checkpoint(f, *a),
}


@pytest.mark.parametrize("shape", list(GLOBAL_SHAPES))
@pytest.mark.parametrize("entry", list(GLOBAL_ENTRIES))
@pytest.mark.parametrize("which", list(GLOBAL_CHANGES))
def test_a_global_re_bound_before_the_recompute_is_caught(which, entry, shape):
    named = f"the global {GLOBAL_CHANGES[which][1]!r} of module"
    _caught_then_repaired(_global_program, which, entry, shape, named)


def _caught_then_repaired(program, which: str, entry: str, shape: str, named: str) -> None:
    """CKG110 on ``program(which, ckpt, shape)``: torch alone is silently wrong (w gets no gradient, or
    the count is off) and warn does exactly what torch does, saying so.  A tensor re-bound: strict
    raises naming what was re-bound, and fallback gives the uncheckpointed program's numbers.  A counter
    the forward advances (only Python values changed): strict and fallback both give the uncheckpointed
    program's numbers without a word, as for CKG115's counter on a module (before 2026-12-07 strict
    raised there, where its own replay is exact)."""
    if not HOLDS:
        pytest.skip(f"CKG110's claim does not hold on torch {installed()}")
    ckpt = GLOBAL_ENTRIES[entry]
    zeros = lambda got: [torch.zeros(()) if g is None else g for g in got]  # noqa: E731 - reentrant: no w.grad
    reference = zeros(program(which, lambda f, *a: f(*a), shape))
    ckpt_guard.uninstall()
    if entry != "ckpt_guard.checkpoint":  # torch alone: silently wrong
        raw = zeros(program(which, ckpt, shape))
        assert any(r.shape != g.shape or not torch.allclose(r, g) for r, g in zip(raw, reference))
    values_only = "weight" not in which  # a counter, a scale: Python values
    if values_only:  # strict repairs it quietly
        repaired, said = _under("strict", program, which, ckpt, shape)
        assert said == []
        for g, r in zip(zeros(repaired), reference):
            torch.testing.assert_close(g, r)
    else:
        with pytest.raises(CheckpointCompositionError, match=r"\[CKG110\]") as info:
            _under("strict", program, which, ckpt, shape)
        assert named in str(info.value)
    if entry != "ckpt_guard.checkpoint":
        warned, messages = _under("warn", program, which, ckpt, shape)
        assert {m.rule.id for m in messages} == {"CKG110"}
        assert named in str(messages[0])
        for w, r in zip(zeros(warned), raw):
            assert torch.equal(w, r)  # warn: exactly what torch does
    repaired, said = _under("fallback", program, which, ckpt, shape)
    if values_only:
        assert said == []
    for g, r in zip(zeros(repaired), reference):
        torch.testing.assert_close(g, r)


# the same globals through ckpt_guard.checkpoint's composable recompute, under torch.func: it binds the
# call's values for each recompute (before 2026-12-06 it read the new ones: silently wrong under vjp)

def _composable_global_program(which: str, transform: str, ckpt, shape: str = "the block's own code") -> list:
    global GLOBAL_W, GLOBAL_CALLS
    torch.manual_seed(0)
    w0 = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    block = GLOBAL_SHAPES[shape](
        _global_weight_block if which == "a weight re-bound after the call" else _global_counter_block
    )

    def loss(x):
        global GLOBAL_W
        y = ckpt(block, x)
        GLOBAL_W = w0 * 2  # re-bound after the call, before the backward (a counter block: not read)
        return y.pow(2).sum()

    GLOBAL_W, GLOBAL_CALLS = w0, 0
    if transform == "vjp, pullback after a re-bind":
        GLOBAL_W = w0
        out, pull = torch.func.vjp(lambda x: ckpt(block, x).pow(2).sum(), x)
        GLOBAL_W = w0 * 2
        got = pull(torch.ones_like(out))[0]
    elif transform == "grad":
        got = torch.func.grad(loss)(x)
    else:  # vmap(grad)
        got = torch.func.vmap(torch.func.grad(loss))(x.unsqueeze(1).expand(4, 2, 3).clone())
    return [got, torch.tensor(float(GLOBAL_CALLS))]


@pytest.mark.parametrize("shape", list(GLOBAL_SHAPES))
@pytest.mark.parametrize("transform", ["vjp, pullback after a re-bind", "grad", "vmap(grad)"])
@pytest.mark.parametrize("which", ["a weight re-bound after the call", "a counter the block's forward advances"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_the_composable_recompute_reads_globals_as_the_call_found_them(policy, which, transform, shape):
    reference = _composable_global_program(which, transform, lambda f, *a: f(*a), shape)
    got, _ = _under(policy, _composable_global_program, which, transform, ckpt_guard.checkpoint, shape)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


# a plain object's own attribute its code reads (``self.calls += 1``, ``self.weight``), re-bound between the
# call and the recompute: a trainer or a wrapper of a library's own that is not a module (unseen before
# 2026-12-06's second session: torch's recompute read the new value, the composable one too)

class _Stepper:
    def __init__(self, weight):
        self.weight, self.calls, self.log = weight, 0, []

    def __call__(self, h):
        self.calls += 1
        self.log.append(self.calls)  # a log its forward keeps (CKG112's: appended once)
        return torch.tanh(h @ self.weight) * self.calls

    def run(self, h):
        return self(h)


ATTRIBUTE_SHAPES = {"a callable object": lambda stepper: stepper, "a plain object's method": lambda stepper: stepper.run}


def _attribute_program(which: str, ckpt, shape: str) -> list:
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    stepper = _Stepper(w)
    y = ckpt(ATTRIBUTE_SHAPES[shape](stepper), x)
    if which == "a weight re-bound after the call":
        stepper.weight = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    y.pow(2).sum().backward()
    return [w.grad, x.grad, torch.tensor(float(stepper.calls)), torch.tensor(float(len(stepper.log)))]


@pytest.mark.parametrize("shape", list(ATTRIBUTE_SHAPES))
@pytest.mark.parametrize("entry", list(GLOBAL_ENTRIES))
@pytest.mark.parametrize("which", ["a weight re-bound after the call", "a counter the block's forward advances"])
def test_a_plain_objects_attribute_re_bound_before_the_recompute_is_caught(which, entry, shape):
    name = "weight" if "weight" in which else "calls"
    _caught_then_repaired(
        _attribute_program, which, entry, shape, f"the attribute {name!r} of the _Stepper object the block runs re-bound"
    )


def _composable_attribute_program(which: str, transform: str, ckpt, shape: str) -> list:
    torch.manual_seed(0)
    w0 = torch.randn(3, 3, dtype=torch.float64)
    x = torch.randn(4, 3, dtype=torch.float64)
    stepper = _Stepper(w0)
    block = ATTRIBUTE_SHAPES[shape](stepper)

    def loss(x):
        y = ckpt(block, x)
        if which == "a weight re-bound after the call":
            stepper.weight = w0 * 2
        return y.pow(2).sum()

    if transform == "vjp, pullback after a re-bind":
        out, pull = torch.func.vjp(loss, x)
        got = pull(torch.ones_like(out))[0]
    elif transform == "grad":
        got = torch.func.grad(loss)(x)
    else:  # vmap(grad)
        got = torch.func.vmap(torch.func.grad(loss))(x.unsqueeze(1).expand(4, 2, 3).clone())
    return [got, torch.tensor(float(stepper.calls)), torch.tensor(float(len(stepper.log)))]


@pytest.mark.parametrize("shape", list(ATTRIBUTE_SHAPES))
@pytest.mark.parametrize("transform", ["vjp, pullback after a re-bind", "grad", "vmap(grad)"])
@pytest.mark.parametrize("which", ["a weight re-bound after the call", "a counter the block's forward advances"])
@pytest.mark.parametrize("policy", ["strict", "fallback"])
def test_the_composable_recompute_reads_a_plain_objects_attributes_as_the_call_found_them(
    policy, which, transform, shape
):
    reference = _composable_attribute_program(which, transform, lambda f, *a: f(*a), shape)
    got, _ = _under(policy, _composable_attribute_program, which, transform, ckpt_guard.checkpoint, shape)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


class _Trainer:
    """A trainer whose block is one of its methods; another of its attributes is re-bound between the
    forward and the backward (a logged loss), which the block's code never reads."""

    def __init__(self, weight):
        self.weight, self.last_loss, self.step = weight, None, 0

    def __call__(self, h):  # the training step: what it names is not the block's read
        self.step += 1
        return self.block(h)

    def block(self, h):
        return self._activation(h @ self.weight)

    def _activation(self, h):
        return torch.tanh(h)

    def log(self, loss):
        self.last_loss = float(loss.detach())


@pytest.mark.parametrize("entry", list(GLOBAL_ENTRIES))
def test_an_attribute_the_blocks_code_never_reads_is_no_alarm(entry):
    """Only the attributes the block's method (and the methods it names) reads are watched: strict stays
    quiet, and the numbers are torch's own, bitwise."""
    def program(ckpt):
        torch.manual_seed(0)
        trainer = _Trainer(torch.randn(3, 3, dtype=torch.float64, requires_grad=True))
        x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
        loss = ckpt(trainer.block, x).pow(2).sum()
        trainer.log(loss)
        trainer.step += 1
        loss.backward()
        return [trainer.weight.grad if trainer.weight.grad is not None else torch.zeros(()), x.grad]

    raw = program(GLOBAL_ENTRIES[entry]) if entry != "ckpt_guard.checkpoint" else program(lambda f, *a: f(*a))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, _ = _under("strict", program, GLOBAL_ENTRIES[entry])
    for g, r in zip(got, raw):
        assert torch.equal(g, r)
