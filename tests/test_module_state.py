"""A module's own state on torch's recompute path (issue 46, items 4-7): CKG115, CKG116, CKG117.

Each case runs three ways, eager ``.backward()`` (no torch.func: torch's own checkpoint
recomputes): without checkpointing (the reference), raw torch, and guarded, through
torch's checkpoint (both variants) and ``ckpt_guard.checkpoint``, under every policy.
What the guard must do comes from the table for the installed torch:

* a module's plain attribute its forward reads, set before each call of a shared module
  (a timestep as a float, a NumPy scalar, a branch flag), or a counter its own forward
  increments: Python values only, so strict and fallback recompute with the forward's
  values without a word (CKG115's quiet case); a tensor attribute re-bound, or one the
  forward keeps (``self.last = h`` with ``h.retain_grad()``): strict raises CKG115,
  fallback replays;
* a buffer the forward updates (BatchNorm's running statistics, an average the block
  reads after updating it): strict and fallback recompute on copies as the forward found
  them (CKG117), warn warns and does what torch does;
* a forward put on an instance for one call and taken off before the backward (a
  one-shot edit): strict and fallback raise CKG116 (a stateful edit cannot be repeated).
"""

from __future__ import annotations

import types
import warnings

import numpy
import pytest
import torch
from conftest import installed_under
from torch import nn
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed

DTYPE = torch.float64
ENTRIES = ("torch non-reentrant", "torch reentrant", "ckpt_guard.checkpoint")


def _ckpt(entry):
    if entry == "plain":
        return lambda f, x: f(x)
    if entry == "ckpt_guard.checkpoint":
        return ckpt_guard.checkpoint
    reentrant = entry == "torch reentrant"
    return lambda f, x: checkpoint(f, x, use_reentrant=reentrant)


def _skip_unless_holds(rule_id):
    rule = rule_by_id(rule_id)
    if not rule.holds_on(installed()):
        pytest.skip(f"{rule_id}'s claim holds on torch {rule.torch_range}, not on {torch.__version__}")


class Timestep(nn.Module):
    """A shared module whose forward reads ``self.t``, set before each call (a diffusion timestep)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.t = 1.0

    def forward(self, x):
        if isinstance(self.t, bool):  # a branch flag
            return torch.tanh(self.lin(x)) if self.t else torch.sin(self.lin(x))
        return torch.tanh(self.lin(x) * self.t)


VALUES = {
    "float": [1.0, 2.0, 3.0],
    "numpy": [numpy.float64(1.0), numpy.float64(2.0), numpy.float64(3.0)],
    "bool": [True, False, True],
    "tensor": [torch.tensor([1.0, 2.0, 0.5, 1.5], dtype=DTYPE), torch.tensor([2.0, 1.0, 0.5, 1.0], dtype=DTYPE),
               torch.tensor([3.0, 0.5, 1.0, 2.0], dtype=DTYPE)],
}


def _timesteps(entry, values):
    """A shared module called three times, its attribute set before each call; then one backward."""
    torch.manual_seed(0)
    m = Timestep().to(DTYPE)
    h = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    x, ckpt = h, _ckpt(entry)
    for value in values:
        m.t = value
        h = ckpt(m, h)
    h.pow(2).sum().backward()
    return [x.grad, *(p.grad for p in m.parameters())]


def _close(got, reference):
    return all(torch.allclose(g, r) for g, r in zip(got, reference))


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("kind", list(VALUES))
def test_an_attribute_set_before_each_call_of_a_shared_module(kind, entry):
    _skip_unless_holds("CKG115")
    values = VALUES[kind]
    reference = _timesteps("plain", values)
    if entry != "ckpt_guard.checkpoint":
        assert not _close(_timesteps(entry, values), reference)  # torch alone: silently wrong
    tensors = kind == "tensor"
    for policy in ("strict", "fallback"):
        if tensors and policy == "strict":
            with ckpt_guard.policy("strict") if entry == "ckpt_guard.checkpoint" else _installed("strict"):
                with pytest.raises(CheckpointCompositionError, match=r"(?s)\[CKG115\].*t \(Timestep\)"):
                    _timesteps(entry, values)
            continue
        got, said = installed_under(policy, _timesteps, entry, values)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r)
        # Python values: repaired without a word; a tensor re-bound: fallback says what it did
        assert [m.rule.id for m in said] == (["CKG115"] if tensors else []), [str(m) for m in said]
    warned, said = installed_under("warn", _timesteps, entry, values)
    assert "CKG115" in [m.rule.id for m in said]
    if entry != "ckpt_guard.checkpoint":
        for w, r in zip(warned, _timesteps(entry, values)):
            assert torch.equal(w, r)  # warn: what torch does


class _installed:
    def __init__(self, policy):
        self.policy = policy

    def __enter__(self):
        ckpt_guard.install(self.policy, rules={})

    def __exit__(self, *exc):
        ckpt_guard.uninstall()


class Counting(nn.Module):
    """A counter its own forward increments, and computes with."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.lin(x)) / self.calls


class Keeping(nn.Module):
    """A tensor its forward keeps on the module, with ``retain_grad()`` (read after the backward)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last = None

    def forward(self, x):
        h = self.lin(x)
        h.retain_grad()
        self.last = h
        return torch.tanh(h)


class Averaging(nn.Module):
    """A buffer its forward updates, then reads (an exponential average)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("average", torch.ones(4))

    def forward(self, x):
        h = self.lin(x)
        self.average.mul_(0.5).add_(0.5 * h.detach().mean(0))
        return h * self.average


BLOCKS = {
    "batchnorm (train)": lambda: nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
    "counter": Counting,
    "average read after its update": Averaging,
    "a tensor kept with retain_grad": Keeping,
}


def _step(entry, make):
    """One training step; the gradients, the module's state after it, ``.grad`` of what it kept."""
    torch.manual_seed(0)
    block = make().to(DTYPE)
    x = torch.randn(5, 4, dtype=DTYPE, requires_grad=True)
    _ckpt(entry)(block, x).pow(2).sum().backward()
    state = [b.to(DTYPE) for b in block.buffers()]
    state += [torch.tensor(float(m.calls)) for m in block.modules() if isinstance(m, Counting)]
    kept = [m.last.grad if m.last.grad is not None else torch.zeros(1, dtype=DTYPE)
            for m in block.modules() if isinstance(m, Keeping)]
    return [x.grad, *(p.grad for p in block.parameters()), *state, *kept]


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_what_a_block_keeps_of_its_own_is_as_without_checkpointing(name, entry):
    """Strict and fallback: the uncheckpointed program's gradients and state (a tensor kept with
    retain_grad: strict raises CKG115, the recompute would replace it). Warn: torch's, and a word."""
    rule_id = "CKG115" if name in ("counter", "a tensor kept with retain_grad") else "CKG117"
    _skip_unless_holds(rule_id)
    make = BLOCKS[name]
    if entry == "torch reentrant" and name == "a tensor kept with retain_grad":
        pytest.skip("torch's reentrant forward runs under no_grad: retain_grad() raises there, with or without the guard")
    reference = _step("plain", make)
    raw = _step(entry, make) if entry != "ckpt_guard.checkpoint" else None
    if raw is not None:
        assert not _close(raw, reference)  # torch alone: the recompute ran the block's update again
    for policy in ("strict", "fallback"):
        if policy == "strict" and name == "a tensor kept with retain_grad":
            with ckpt_guard.policy("strict") if entry == "ckpt_guard.checkpoint" else _installed("strict"):
                with pytest.raises(CheckpointCompositionError, match=r"(?s)\[CKG115\].*last \(Keeping\)"):
                    _step(entry, make)
            continue
        got, said = installed_under(policy, _step, entry, make)
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r)
        quiet = name != "a tensor kept with retain_grad"
        assert [m.rule.id for m in said] == ([] if quiet else [rule_id]), [str(m) for m in said]
    warned, said = installed_under("warn", _step, entry, make)
    assert rule_id in [m.rule.id for m in said]
    if raw is not None:
        for w, r in zip(warned, raw):
            torch.testing.assert_close(w, r, rtol=0, atol=0)


def test_a_block_run_twice_per_step_keeps_each_calls_state():
    """The same BatchNorm block called twice before one backward: each recompute starts from what
    its own forward found (the second call's running statistics include the first's update)."""
    _skip_unless_holds("CKG117")

    def run(entry):
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).to(DTYPE)
        x = torch.randn(5, 4, dtype=DTYPE, requires_grad=True)
        ckpt = _ckpt(entry)
        y = ckpt(block, ckpt(block, x))
        y.pow(2).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters()), *(b.to(DTYPE) for b in block.buffers())]

    reference = run("plain")
    for entry in ENTRIES:
        got, said = installed_under("strict", run, entry)
        assert said == []
        for g, r in zip(got, reference):
            torch.testing.assert_close(g, r)


class Doubled:
    """A one-shot edit in miniature (nnsight's edit_in): the call it is put there for is doubled."""

    def __init__(self, module):
        self.module = module

    def __call__(self, x):
        return type(self.module).forward(self.module, x) * 2


def _edited(entry):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(DTYPE)
    x = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
    block[0].forward = Doubled(block[0])
    y = _ckpt(entry)(block, x)
    del block[0].forward  # the edit is over before the backward
    y.pow(2).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_one_shot_edit_taken_off_before_the_backward_is_refused(entry):
    _skip_unless_holds("CKG116")
    reference = _edited("plain")
    if entry != "ckpt_guard.checkpoint":
        assert not _close(_edited(entry), reference)
    for policy in ("strict", "fallback"):
        scope = ckpt_guard.policy(policy) if entry == "ckpt_guard.checkpoint" else _installed(policy)
        with scope, pytest.raises(CheckpointCompositionError, match=r"(?s)\[CKG116\].*0 \(Linear\): Doubled on the instance → its class's forward"):
            _edited(entry)


def test_an_instance_forward_that_stays_is_no_alarm():
    """A wrapper put on the instance for good (as accelerate's hooks do): nothing changes, nothing said,
    bitwise torch's."""
    def run():
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).to(DTYPE)
        block[0].forward = Doubled(block[0])
        x = torch.randn(3, 4, dtype=DTYPE, requires_grad=True)
        checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())]

    raw = run()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckpt_guard.CheckpointCompositionWarning)
        guarded, said = installed_under("strict", run)
    assert said == []
    for g, r in zip(guarded, raw):
        assert torch.equal(g, r)


# --------------------------------------------------------------------------
# the same state reached through a closure (``checkpoint(lambda h: m(h), x)``): found 2026-12-06
# silently wrong under every policy (the closure's modules were not looked at on torch's path)


class _CountingLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.calls = 0
        self.log: list = []

    def forward(self, h):
        self.calls += 1
        self.log.append(self.calls)
        return torch.tanh(self.lin(h)) * (1.0 + 0.1 * self.calls + 0.01 * len(self.log))


class _Parent(nn.Module):
    """A model whose block is checkpointed as ``lambda u: self.block(u)`` (the closure holds the parent)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(_CountingLinear(), nn.BatchNorm1d(3))


CLOSURES = {
    "lambda u: norm(counting(u))": lambda counting, norm, parent: (lambda u: norm(counting(u))),
    "lambda u: counting(u)": lambda counting, norm, parent: (lambda u: counting(u)),
    "lambda u: self.block(u)": lambda counting, norm, parent: (lambda u: parent.block(u)),
    # a closure of a closure: the block calls a helper that holds the modules (unseen before 2026-12-06)
    "lambda u: inner(u), inner = lambda u: norm(counting(u))":
        lambda counting, norm, parent: _calling(lambda u: norm(counting(u))),
    "three closures deep, to self.block": lambda counting, norm, parent: _calling(_calling(lambda u: parent.block(u))),
    # the modules behind a list, a dict, a plain object, a bound method (unseen before 2026-12-06)
    "lambda u: layers[1](layers[0](u)), a list": lambda counting, norm, parent: _through_list([counting, norm]),
    "lambda u: parts['norm'](parts['counting'](u)), a dict":
        lambda counting, norm, parent: _through_dict({"counting": counting, "norm": norm}),
    "holder.run, a plain object's method": lambda counting, norm, parent: _Holder(parent.block).run,
    "lambda u: holder.block(u), a plain object": lambda counting, norm, parent: _through_object(_Holder(parent.block)),
    "lambda u: forward(u), forward = self.block.forward": lambda counting, norm, parent: _calling(parent.block.forward),
    "a callable object holding the block": lambda counting, norm, parent: _CallableHolder(parent.block),
    "def block(u): return GLOBAL_BLOCK(u), a global": lambda counting, norm, parent: _through_a_global(parent.block),
    "lambda u, block=self.block: block(u), a default": lambda counting, norm, parent: (lambda u, b=parent.block: b(u)),
    # beside a module whose snapshot cannot be read: CKG117 kept nothing (the flags and the modules it
    # looked for disagreed), so torch's recompute moved BatchNorm's statistics again (c7c5382)
    "lambda u: norm(counting(unreadable(u)))":
        lambda counting, norm, parent: (lambda odd: lambda u: norm(counting(odd(u))))(_Unreadable()),
}

GLOBAL_BLOCK = None  # what _read_the_global loads; each copy _through_a_global makes reads its own


def _read_the_global(u):
    return GLOBAL_BLOCK(u)


def _through_a_global(block):
    """A script's ``def block(u): return model.layer(u)``: the module is a global the function loads
    (each block its own namespace, as each script has its own: one shared global re-bound by the next
    block's call would make every recompute run the last block)."""
    return types.FunctionType(_read_the_global.__code__, {"GLOBAL_BLOCK": block}, "_read_the_global")


def _calling(inner):
    """``lambda u: inner(u)``: a block that reaches its modules only through the function it calls."""
    return lambda u: inner(u)


def _through_list(layers):
    return lambda u: layers[1](layers[0](u))


def _through_dict(parts):
    return lambda u: parts["norm"](parts["counting"](u))


def _through_object(holder):
    return lambda u: holder.block(u)


class _Unreadable(nn.Module):
    """A module whose train/eval flag cannot be read (a property that raises): no snapshot of it is taken."""

    @property
    def training(self):
        raise RuntimeError("not readable")

    @training.setter
    def training(self, value):
        pass

    def forward(self, u):
        return u * 1.0


class _Holder:
    """A plain object (no module) that keeps a block: a trainer, a wrapper of a library's own."""

    def __init__(self, block):
        self.block = block

    def run(self, u):
        return self.block(u)


class _CallableHolder(_Holder):
    def __call__(self, u):
        return self.block(u)


def _closure_program(closure, ckpt, reentrant_input=False):
    torch.manual_seed(0)
    parent = _Parent().double()
    counting, norm = parent.block[0], parent.block[1]
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=reentrant_input)
    block = CLOSURES[closure](counting, norm, parent)
    ckpt(block, x).pow(2).sum().backward()
    grads = [torch.zeros(3, 3) if p.grad is None else p.grad for p in parent.parameters()]
    return [torch.tensor(float(counting.calls)), torch.tensor(float(len(counting.log))), norm.running_mean,
            norm.num_batches_tracked, *grads]


CLOSURE_ENTRIES = {
    "ckpt_guard.checkpoint": lambda f, *a: ckpt_guard.checkpoint(f, *a),
    "torch checkpoint (non-reentrant)": lambda f, *a: checkpoint(f, *a, use_reentrant=False),
    "torch checkpoint (reentrant)": lambda f, *a: checkpoint(f, *a, use_reentrant=True),
}


@pytest.mark.parametrize("policy", ["strict", "fallback", "warn"])
@pytest.mark.parametrize("entry", list(CLOSURE_ENTRIES))
@pytest.mark.parametrize("closure", list(CLOSURES))
def test_state_a_closures_module_advances_is_advanced_once(closure, entry, policy):
    """A counter the module's forward increments (CKG115), a log it appends to (CKG112) and BatchNorm's
    statistics (CKG117), the module reached through the closure's cells: strict and fallback recompute
    on what the forward found (as for the module given itself); warn says so and does what torch does."""
    reentrant = entry.endswith("(reentrant)")
    ckpt = CLOSURE_ENTRIES[entry]
    reference = _closure_program(closure, lambda f, *a: f(*a), reentrant)
    raw = _closure_program(closure, CLOSURE_ENTRIES["torch checkpoint (reentrant)" if reentrant else
                                                    "torch checkpoint (non-reentrant)"], reentrant)  # torch alone
    assert any(not torch.equal(r, w) for r, w in zip(raw, reference)), "torch's recompute no longer advances it twice"
    got, caught = installed_under(policy, _closure_program, closure, ckpt, reentrant)
    said = {w for w in ("CKG112", "CKG115", "CKG117") if any(w in str(c) for c in caught)}
    if policy == "warn":
        assert said, "warn said nothing of the state torch's recompute advances again"
        for g, r in zip(got, raw):
            torch.testing.assert_close(g, r)
        return
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


# the matrix's kinds, each given as a closure over its module (the module keeps its own parameters:
# no functional_call, whose CKG101 would speak first), under the transforms torch's path recomputes in
import itertools  # noqa: E402

import conformance as cf  # noqa: E402

CLOSURE_TRANSFORMS = ("eager .backward()", "vmap, then .backward()", "jvp, then .backward()", "grad")
CLOSURE_CELL_ENTRIES = ("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback",
                        "torch checkpoint (non-reentrant), fallback", "torch checkpoint (reentrant), fallback")


#: how the block reaches its module: ``lambda t: block(t)``, through a helper that closes over it
#: (a closure of a closure), a list in its closure, a plain object's method, a bound method it calls
REACHES = {
    "closure": lambda block: _calling(block),
    "closure of a closure": lambda block: _calling(_calling(block)),
    "a list in the closure": lambda block: (lambda layers: lambda t: layers[0](t))([block]),
    "a plain object's method": lambda block: _Holder(block).run,
    "a bound method in the closure": lambda block: _calling(block.forward),
    "a global": lambda block: _through_a_global(block),
}


def _closure_cells():
    turns = itertools.cycle(CLOSURE_CELL_ENTRIES)  # 4 entries against 4 transforms: each reach meets each pair
    return [(cf.Cell(kind, transform, "module", next(turns)), reach)
            for reach in REACHES for kind in cf.KINDS for transform in CLOSURE_TRANSFORMS]


@pytest.mark.parametrize("cell, reach", _closure_cells(), ids=lambda c: c.label().replace(
    "| module |", "| closure, own parameters |") if isinstance(c, cf.Cell) else c)
def test_every_kind_given_as_a_closure_over_its_module(cell, reach, monkeypatch):
    checkpointed = cf._checkpointed

    def through_a_closure(ckpt, block, access, h):
        if access == "module" and ckpt is not cf._plain:
            return ckpt(REACHES[reach](block), h)
        return checkpointed(ckpt, block, access, h)

    monkeypatch.setattr(cf, "_checkpointed", through_a_closure)
    outcome = cf._run_cell(cell)
    assert not outcome.failed, f"{cell.label()} (reached through {reach}): {outcome.verdict}: {outcome.detail}"
