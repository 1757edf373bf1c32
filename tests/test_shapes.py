"""The kept walk of a module block (``_composable.shapes``): used while it holds, dropped when the block changes.

Each test runs a model whose blocks go through ``ckpt_guard.checkpoint``
under ``grad`` (of ``functional_call``, as a training step does), for several
steps, against the same model called plainly: gradients equal at every step
(bitwise where nothing else differs: the recompute runs the same ops), and
the block recomputed (the memory saving kept).  Between two steps the test
changes the block the way a user's code does (a parameter added, a submodule
replaced, a forward hook, an attribute turned into a tensor, a number changed,
``eval()``); the step after the change must see the changed block, as a fresh
walk would, and the shape kept for it is re-taken or given up.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import ckpt_guard
from ckpt_guard import _composable
from ckpt_guard._composable import shapes

pytestmark = pytest.mark.usefixtures("guard")
DTYPE = torch.float64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scale = 1.5
        self.extra = []  # a short list of numbers, looked at again at each call

    def forward(self, h):
        out = self.b(torch.tanh(self.a(h))) * self.scale
        for item in self.extra:
            out = out * item
        extra = getattr(self, "gain", None)
        if extra is not None:
            out = out * extra
        return h + out


class Model(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.checkpointed = checkpointed
        self.inject = None  # (block, tensor) -> None: puts a tensor needing a gradient into a block

    def forward(self, h):
        if self.inject is not None:
            self.inject(self.blocks[1], self.gate * 1.0)
        for block in self.blocks:
            h = ckpt_guard.checkpoint(block, h) if self.checkpointed else block(h)
        return h.pow(2).sum()


def _pair():
    torch.manual_seed(0)
    reference = Model(False).to(DTYPE)
    checkpointed = Model(True).to(DTYPE)
    checkpointed.load_state_dict(reference.state_dict())
    return reference, checkpointed


def _step(model, x, transform="grad"):
    params = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}

    def loss(p, x):
        return functional_call(model, p, (x,))

    if transform == "grad":
        return grad(loss)(params, x)
    return vmap(grad(loss), in_dims=(None, 0))(params, x)


def _assert_step_equal(reference, checkpointed, x, transform="grad", exact=True):
    expected = _step(reference, x, transform)
    before = _composable.counters.RECOMPUTES
    got = _step(checkpointed, x, transform)
    assert _composable.counters.RECOMPUTES > before, "the blocks were not recomputed: no memory was saved"
    assert expected.keys() == got.keys()
    for name in expected:
        if exact:
            assert torch.equal(got[name], expected[name]), name
        else:
            torch.testing.assert_close(got[name], expected[name], msg=name)


def _kept(block):
    found = shapes._kept.get(id(block))
    return None if found is None or found[0]() is not block else found[1]


@pytest.mark.parametrize("transform", ["grad", "vmap(grad)"])
def test_a_block_called_again_reads_its_kept_shape_and_matches_the_plain_step(transform):
    reference, checkpointed = _pair()
    x = torch.randn(3, 4, dtype=DTYPE)
    for _ in range(3):
        _assert_step_equal(reference, checkpointed, x, transform)
    for block in checkpointed.blocks:
        assert _kept(block) is not None, "a plain Linear block should be kept between calls"


def test_the_kept_holdings_equal_a_fresh_walk():
    _, checkpointed = _pair()
    block = checkpointed.blocks[0]
    x = torch.randn(3, 4, dtype=DTYPE)
    fresh = _composable.binding.holdings(block, (x,), {})
    shapes.holdings(block, (x,), {})  # taken
    kept = shapes.holdings(block, (x,), {})  # read off the shape
    assert shapes._same(kept, fresh)
    assert kept.plain_attributes


_RETIRED: list = []
CHANGES = {
    # what the user's code does to block 1 between two steps, on both models alike
    "parameter added": lambda b: b.register_parameter("gain", nn.Parameter(torch.full((4,), 0.5, dtype=DTYPE))),
    "buffer added": lambda b: b.register_buffer("gain", torch.full((4,), 0.25, dtype=DTYPE)),
    # the replaced module kept alive (in _RETIRED): a shape holding it must not be read
    "submodule replaced": lambda b: (_RETIRED.append(b.b), setattr(b, "b", nn.Linear(4, 4).to(DTYPE))),
    "submodule with the same name, other class": lambda b: (
        _RETIRED.append(b.a), setattr(b, "a", nn.Sequential(nn.Linear(4, 4)).to(DTYPE))),
    "number changed": lambda b: setattr(b, "scale", -0.75),
    "number became a plain tensor attribute": lambda b: object.__setattr__(
        b, "scale", torch.tensor(2.0, dtype=DTYPE)),
    "list of numbers gained a tensor": lambda b: b.extra.append(torch.full((4,), 3.0, dtype=DTYPE)),
    "list of numbers gained a number": lambda b: b.extra.append(0.5),
    "plain attribute added": lambda b: object.__setattr__(b, "gain", 4.0),
    "forward hook registered": lambda b: b.register_forward_hook(lambda m, i, o: o * 2),
    "forward pre-hook registered": lambda b: b.register_forward_pre_hook(lambda m, i: (i[0] * 0.5,)),
    "eval()": lambda b: b.eval(),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_block_changed_between_steps_is_seen_at_the_next_step(change):
    reference, checkpointed = _pair()
    x = torch.randn(3, 4, dtype=DTYPE)
    _assert_step_equal(reference, checkpointed, x)
    _assert_step_equal(reference, checkpointed, x)  # the second reads the kept shape
    assert _kept(checkpointed.blocks[1]) is not None
    torch.manual_seed(1)
    CHANGES[change](reference.blocks[1])
    torch.manual_seed(1)
    CHANGES[change](checkpointed.blocks[1])
    reference.to(DTYPE), checkpointed.to(DTYPE)
    checkpointed.blocks[1].load_state_dict(reference.blocks[1].state_dict())
    for _ in range(2):  # the step that notices the change, then one after it
        _assert_step_equal(reference, checkpointed, x)


INJECTED = {
    # a tensor that needs the step's gradient, put into block 1 by the model's forward
    "as a plain attribute": lambda b, g: object.__setattr__(b, "gain", g),
    "in place of a number": lambda b, g: object.__setattr__(b, "scale", g),
    "appended to a list of numbers": lambda b, g: b.extra.append(g) if len(b.extra) < 2 else b.extra.__setitem__(1, g),
    "into the list of numbers' place": lambda b, g: b.extra.__setitem__(0, g),
    "in a new list, in place of the list of numbers": lambda b, g: object.__setattr__(b, "extra", [g]),
    "in a forward hook's closure": lambda b, g: (b._forward_hooks.clear(), b.register_forward_hook(
        lambda m, i, o: o * g)),
}


@pytest.mark.parametrize("how", list(INJECTED))
def test_a_tensor_needing_a_gradient_put_into_a_kept_block_is_lifted(how):
    """What a kept shape must not miss: a tensor the recompute has to pass in, or its gradient is lost."""
    reference, checkpointed = _pair()
    for model in (reference, checkpointed):
        model.blocks[1].extra.append(2.0)
    x = torch.randn(3, 4, dtype=DTYPE)
    _assert_step_equal(reference, checkpointed, x)
    _assert_step_equal(reference, checkpointed, x)
    assert _kept(checkpointed.blocks[1]) is not None
    reference.inject = checkpointed.inject = INJECTED[how]
    for _ in range(2):
        _assert_step_equal(reference, checkpointed, x)


def test_a_new_block_at_a_dead_blocks_address_is_not_read_off_its_shape():
    """Shapes are kept by id; a module collected and another allocated at its address must be walked."""
    x = torch.randn(3, 4, dtype=DTYPE)
    for i in range(20):
        reference, checkpointed = _pair()
        if i % 2:  # every other model's blocks read a different number: a stale shape would be wrong
            for r, c in zip(reference.blocks, checkpointed.blocks):
                r.scale = c.scale = 0.25
                object.__setattr__(r, "gain", torch.full((4,), 2.0, dtype=DTYPE))
                object.__setattr__(c, "gain", torch.full((4,), 2.0, dtype=DTYPE))
        _assert_step_equal(reference, checkpointed, x)
        ids = [id(b) for b in checkpointed.blocks]
        del reference, checkpointed
        gc.collect()
        # a collected block's entry goes with it: nothing of a dead model is kept
        assert not any(_kept_entry_alive(i) for i in ids)


def _kept_entry_alive(key):
    found = shapes._kept.get(key)
    return found is not None and found[0]() is None


def test_a_block_with_tensors_in_a_container_is_walked_at_every_call():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.table = {"w": torch.ones(4, dtype=DTYPE)}

        def forward(self, h):
            return self.lin(h) * self.table["w"]

    torch.manual_seed(0)
    block = Holder().to(DTYPE)
    x = torch.randn(3, 4, dtype=DTYPE)
    params = {f"block.{k}": v.detach().clone().requires_grad_() for k, v in block.named_parameters()}

    class Model(nn.Module):
        def __init__(self, checkpointed: bool) -> None:
            super().__init__()
            self.block, self.checkpointed = block, checkpointed

        def forward(self, h):
            return (ckpt_guard.checkpoint(self.block, h) if self.checkpointed else self.block(h)).sum()

    for value in (1.0, 3.0, -2.0):
        block.table["w"] = torch.full((4,), value, dtype=DTYPE)
        expected = grad(lambda p: functional_call(Model(False), p, (x,)))(params)
        got = grad(lambda p: functional_call(Model(True), p, (x,)))(params)
        assert _kept(block) is None and id(block) in shapes._kept  # known: walked at every call
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


def test_forget_drops_every_kept_shape():
    _, checkpointed = _pair()
    _step(checkpointed, torch.randn(3, 4, dtype=DTYPE))
    assert shapes._kept
    shapes.forget()
    assert not shapes._kept
