"""CKG113: a block that draws from a torch.Generator of the user's, under torch's checkpoint.

torch preserves the default generators for the recompute, never a user's: the
recompute draws the next numbers, silently.  Each way a block can reach its
generator is run three ways (uncheckpointed, raw torch, guarded); the
generator's final state is compared too (fallback leaves it where the
uncheckpointed run does).  The composable recompute replays user generators
itself (tests/test_composable_cases.py).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import warnings

import pytest
import torch
from conftest import assert_all_close, assert_all_equal
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning

pytestmark = pytest.mark.usefixtures("guard")


def noisy(linear, x, generator):
    return torch.tanh(linear(x) * torch.rand(x.shape, generator=generator))


class Holder:
    def __init__(self, generator):
        self.generator = generator


def _call(ckpt, linear, x, generator, way, use_reentrant):
    variant = {} if ckpt is None else {"use_reentrant": use_reentrant}
    run = ckpt or (lambda f, *a, **k: f(*a, **k))
    if way == "argument":
        return run(noisy, linear, x, generator, **variant)
    if way == "keyword":
        return run(noisy, linear, x, generator=generator, **variant)
    if way == "partial":
        return run(functools.partial(noisy, generator=generator), linear, x, **variant)
    if way == "closure":
        return run(lambda h: noisy(linear, h, generator), x, **variant)
    if way == "in a dict":
        return run(lambda h, options: noisy(linear, h, options["generator"]), x, {"generator": generator}, **variant)
    return run(lambda h, holder: noisy(linear, h, holder.generator), x, Holder(generator), **variant)


def _step(ckpt, way, use_reentrant):
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    generator = torch.Generator().manual_seed(7)
    y = _call(ckpt, linear, x, generator, way, use_reentrant)
    y.sum().backward()
    after = torch.rand(2, generator=generator)  # the program's next draw
    return [y.detach(), x.grad, linear.weight.grad, linear.bias.grad, after]


CASES = [
    pytest.param(way, ur, id=f"{way}-{'reentrant' if ur else 'non-reentrant'}")
    for way in ("argument", "keyword", "partial", "closure", "in a dict", "in an object")
    for ur in (True, False)
    if not (way == "keyword" and ur)  # the reentrant variant takes no keyword arguments
]


@pytest.mark.parametrize("way, use_reentrant", CASES)
def test_a_user_generator_is_caught_and_fallback_replays_it(way, use_reentrant):
    reference = _step(None, way, use_reentrant)
    ckpt_guard.uninstall()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = _step(checkpoint, way, use_reentrant)
    finally:
        ckpt_guard.install("strict")
    assert not torch.equal(raw[2], reference[2])  # torch: another noise in the recompute
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError) as info:
        _step(checkpoint, way, use_reentrant)
    assert info.value.rule.id == "CKG113"
    assert "moved on since the forward" in str(info.value)
    with ckpt_guard.policy("fallback"), pytest.warns(CheckpointCompositionWarning, match=r"\[CKG113\]"):
        repaired = _step(checkpoint, way, use_reentrant)
    assert_all_close(repaired, reference)  # the gradients, and the generator's next draw


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_generator_the_block_does_not_draw_from_is_quiet_and_bitwise(use_reentrant):
    def step():
        torch.manual_seed(0)
        linear = torch.nn.Linear(4, 4)
        x = torch.randn(3, 4, requires_grad=True)
        generator = torch.Generator().manual_seed(7)
        y = checkpoint(lambda h, g: torch.tanh(linear(h)), x, generator, use_reentrant=use_reentrant)
        y.sum().backward()
        return [y.detach(), x.grad, linear.weight.grad]

    ckpt_guard.uninstall()
    try:
        raw = step()
    finally:
        ckpt_guard.install("strict")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        for policy in ("strict", "warn", "fallback"):
            with ckpt_guard.policy(policy):
                assert_all_equal(step(), raw)


def test_the_default_generator_passed_by_name_is_torchs_to_replay():
    """``generator=torch.default_generator`` is preserved by torch itself: no report, exact."""
    linear = torch.nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    with ckpt_guard.policy("strict"), warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointCompositionWarning)
        checkpoint(noisy, linear, x, torch.default_generator, use_reentrant=False).sum().backward()


def test_a_modules_generator_is_seen_on_its_first_call():
    """The first checkpoint call of a fresh process: the module is walked before its generators are read."""
    program = (
        "import torch, ckpt_guard\n"
        "from ckpt_guard._rules import rule_by_id\n"
        "from torch.utils.checkpoint import checkpoint\n"
        "ckpt_guard.install('strict')\n"
        "try:\n"
        "    rule_by_id('CKG113').probe(checkpoint, False)\n"
        "except ckpt_guard.CheckpointCompositionError as error:\n"
        "    print(error.rule.id)\n"
    )
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "CKG113", out.stderr


class Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x):
        return torch.tanh(self.linear(x) * torch.rand(x.shape, generator=self.generator))


def _custom_forward(module):  # transformers' older create_custom_forward(module)
    def custom_forward(*inputs):
        return module(*inputs)

    return custom_forward


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("how", ["the module", "a closure over it", "it as an argument"])
def test_a_modules_generator_is_seen_however_the_module_reaches_the_block(how, use_reentrant):
    """Found by review: a module reached through a closure or passed as an argument was not looked at."""

    def step(checkpointed):
        torch.manual_seed(0)
        module = Noisy()
        x = torch.randn(3, 4, requires_grad=True)
        if not checkpointed:
            y = module(x)
        elif how == "the module":
            y = checkpoint(module, x, use_reentrant=use_reentrant)
        elif how == "a closure over it":
            y = checkpoint(_custom_forward(module), x, use_reentrant=use_reentrant)
        else:
            y = checkpoint(lambda layer, h: layer(h), module, x, use_reentrant=use_reentrant)
        y.pow(2).sum().backward()
        return [x.grad, module.linear.weight.grad, torch.rand(2, generator=module.generator)]

    reference = step(False)
    with ckpt_guard.policy("strict"), pytest.raises(CheckpointCompositionError, match=r"\[CKG113\]"):
        step(True)
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        assert_all_close(step(True), reference)
