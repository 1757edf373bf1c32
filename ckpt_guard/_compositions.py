"""Compositions that torch gets right: the guard must stay silent on them.

Each is a live probe with the same shape as a rule's probe
(``probe(checkpoint, use_reentrant) -> list of tensors``), run by the test
suite (``tests/test_no_false_alarms.py``) and by ``python -m ckpt_guard``:
under ``strict`` the guarded run must be bitwise identical to raw torch, with
no warning.  Like ``_rules.py``, this module imports torch only inside probes.

The uncheckpointed reference calls each probe with a stand-in ``ckpt`` that
just calls the function (``lambda fn, *a, use_reentrant=None, **k: fn(*a, **k)``).
Probes of APIs that reach torch's checkpoint by themselves
(``checkpoint_sequential``, ``checkpoint_wrapper``,
``apply_activation_checkpointing``, the composable ``checkpoint(module)``) or
that pass checkpoint-only keywords (``context_fn``, ``debug``) test
``ckpt is torch.utils.checkpoint.checkpoint`` (see :func:`_is_torch_checkpoint`;
the guard never replaces that function) and run the same model plainly when it
is not.

``KNOWN_FALSE_ALARMS`` holds compositions torch also gets right but on which the
guard is not (yet) silent; the tests run them as strict xfails.

A composition is safe on the torch releases in its ``torch_range``.  Where it
is not (torch < 2.12 raises under vmap, jvp, jacfwd and functionalize), the
rule named by ``otherwise`` must explain it instead: the matrix and the tests
then run the probe as one more case of that rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from ._rules import NON_REENTRANT, REENTRANT, _grads, _variant_kwargs
from ._versions import ALL, TorchRange, Version

__all__ = ["Composition", "SAFE_COMPOSITIONS", "KNOWN_FALSE_ALARMS"]

BOTH = (REENTRANT, NON_REENTRANT)


@dataclass(frozen=True)
class Composition:
    name: str
    description: str
    variants: tuple[str, ...]
    probe: Callable[[Callable[..., Any], Optional[bool]], Sequence[Any]] = field(repr=False)
    #: the torch releases on which torch gets it right (measured)
    torch_range: TorchRange = ALL
    #: the rule that catches it where torch does not get it right ("" if none is needed)
    otherwise: str = ""

    def holds_on(self, version: Version) -> bool:
        return version in self.torch_range


def _probe_training_step(ckpt, use_reentrant):
    """An ordinary training step: input requires grad, parameters inside."""
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    y.pow(2).sum().backward()
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


def _is_torch_checkpoint(ckpt) -> bool:
    """Whether ``ckpt`` is torch's own ``torch.utils.checkpoint.checkpoint``.

    Probes for APIs that call torch's checkpoint themselves
    (``checkpoint_sequential``, ``checkpoint_wrapper``, the composable
    ``checkpoint(module)``) or that need checkpoint-only keywords
    (``context_fn``) cannot route through an arbitrary ``ckpt``.  They use the
    API when ``ckpt`` is torch's checkpoint (raw and guarded runs: the guard
    never replaces that function) and run the same model plainly otherwise
    (the uncheckpointed reference).
    """
    import torch.utils.checkpoint

    return ckpt is torch.utils.checkpoint.checkpoint


def _mlp(width: int = 8):
    import torch

    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(), torch.nn.Linear(width, width))


def _probe_nested(ckpt, use_reentrant):
    """A checkpointed function that itself checkpoints a sub-block."""
    import torch

    torch.manual_seed(0)
    inner, outer = _mlp(), torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    kw = _variant_kwargs(use_reentrant)

    def block(t):
        return torch.tanh(outer(ckpt(inner, t, **kw))) * 2

    y = ckpt(block, x, **kw)
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *inner.parameters(), *outer.parameters())]


def _probe_checkpoint_sequential(ckpt, use_reentrant):
    """``checkpoint_sequential`` over an nn.Sequential (plain call for the reference)."""
    import torch
    from torch.utils.checkpoint import checkpoint_sequential

    torch.manual_seed(0)
    seq = torch.nn.Sequential(*(m for _ in range(3) for m in (torch.nn.Linear(8, 8), torch.nn.GELU())))
    x = torch.randn(4, 8, requires_grad=True)
    if _is_torch_checkpoint(ckpt):
        y = checkpoint_sequential(seq, 2, x, **_variant_kwargs(use_reentrant))
    else:
        y = seq(x)
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *seq.parameters())]


def _impl(use_reentrant):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl

    return CheckpointImpl.REENTRANT if use_reentrant else CheckpointImpl.NO_REENTRANT


def _probe_checkpoint_wrapper(ckpt, use_reentrant):
    """``checkpoint_wrapper(module, checkpoint_impl=...)`` (plain module for the reference)."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    block, head = _mlp(), torch.nn.Linear(8, 1)
    x = torch.randn(4, 8, requires_grad=True)
    run = checkpoint_wrapper(block, checkpoint_impl=_impl(use_reentrant)) if _is_torch_checkpoint(ckpt) else block
    y = head(run(x))
    y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters(), *head.parameters())]


def _probe_apply_activation_checkpointing(ckpt, use_reentrant):
    """``apply_activation_checkpointing`` wrapping every Linear of a model (plain model for the reference)."""
    import functools

    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.Tanh())
    params = list(model.parameters())  # wrapping renames them; keep the tensors
    x = torch.randn(4, 8, requires_grad=True)
    if _is_torch_checkpoint(ckpt):
        apply_activation_checkpointing(
            model,
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=_impl(use_reentrant)),
            check_fn=lambda m: isinstance(m, torch.nn.Linear),
        )
    y = model(x)
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *params)]


def _probe_composable_checkpoint(ckpt, use_reentrant):
    """The composable ``torch.distributed._composable.checkpoint(module)`` (plain module for the reference)."""
    import torch
    from torch.distributed._composable import checkpoint as composable_checkpoint

    torch.manual_seed(0)
    model = torch.nn.Sequential(_mlp(), torch.nn.Linear(8, 1))
    x = torch.randn(4, 8, requires_grad=True)
    if _is_torch_checkpoint(ckpt):
        composable_checkpoint(model[0])  # always non-reentrant
    y = model(x)
    y.sum().backward()
    return [y.detach(), *_grads(x, *model.parameters())]


def _pure_block():
    """A pure function over tensors that do not require grad, and its input."""
    import torch

    torch.manual_seed(0)
    w = torch.randn(3, 3)
    x = torch.randn(4, 3)
    return (lambda u: torch.sin(u @ w) * u), x


def _probe_jvp(ckpt, use_reentrant):
    """``torch.func.jvp`` over a checkpointed pure function (forward only)."""
    import torch
    from torch.func import jvp

    block, x = _pure_block()
    tangent = torch.randn(4, 3)
    out, tan = jvp(lambda t: ckpt(block, t, **_variant_kwargs(use_reentrant)), (x,), (tangent,))
    return [out, tan]


def _probe_jacfwd(ckpt, use_reentrant):
    """``torch.func.jacfwd`` over a checkpointed pure function (forward only)."""
    from torch.func import jacfwd

    block, x = _pure_block()
    return [jacfwd(lambda t: ckpt(block, t, **_variant_kwargs(use_reentrant)))(x[0])]


def _probe_vmap_pure(ckpt, use_reentrant):
    """``torch.func.vmap`` over a checkpointed pure function (forward only, nothing requires grad)."""
    from torch.func import vmap

    block, x = _pure_block()
    return [vmap(lambda t: ckpt(block, t, **_variant_kwargs(use_reentrant)))(x)]


def _probe_functionalize(ckpt, use_reentrant):
    """``torch.func.functionalize`` over a checkpointed function that mutates a temporary."""
    from torch.func import functionalize

    block, x = _pure_block()

    def mutating(u):
        t = block(u).clone()
        t.add_(1.0)
        return t

    return [functionalize(lambda t: ckpt(mutating, t, **_variant_kwargs(use_reentrant)))(x)]


def _probe_no_grad(ckpt, use_reentrant):
    """Checkpoint called under ``torch.no_grad()`` (evaluation): nothing to recompute."""
    import torch

    torch.manual_seed(0)
    block = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    return [y, *_grads(x, *block.parameters())]


def _probe_inference_mode(ckpt, use_reentrant):
    """Checkpoint called under ``torch.inference_mode()``: nothing to recompute."""
    import torch

    torch.manual_seed(0)
    block = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with torch.inference_mode():
        y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    return [y.clone()]


def _probe_save_on_cpu(ckpt, use_reentrant):
    """A training step inside ``torch.autograd.graph.save_on_cpu()``."""
    import torch

    torch.manual_seed(0)
    block, head = _mlp(), torch.nn.Linear(8, 1)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = head(ckpt(block, x, **_variant_kwargs(use_reentrant)))
        y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters(), *head.parameters())]


def _probe_autograd_grad(ckpt, use_reentrant):
    """``torch.autograd.grad`` through the checkpoint, then double backward (create_graph)."""
    import torch

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    y = ckpt(lambda u: torch.tanh(u @ w) * u, x, **_variant_kwargs(use_reentrant))
    gx, gw = torch.autograd.grad(y.pow(2).sum(), (x, w), create_graph=True)
    ggx, ggw = torch.autograd.grad(gx.pow(2).sum() + gw.sin().sum(), (x, w))
    return [y.detach(), gx.detach(), gw.detach(), ggx, ggw]


def _probe_dispatch_mode_around_backward(ckpt, use_reentrant):
    """A user TorchDispatchMode (doubles sin) active in the forward and around .backward()."""
    import torch

    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with _double_sin_dispatch_mode()():
        y = ckpt(lambda t: torch.sin(t) * w, x, **_variant_kwargs(use_reentrant))
        y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_selective(ckpt, use_reentrant):
    """Selective checkpointing: save matmul results, recompute the rest (``context_fn``)."""
    import functools

    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    extra = {}
    if _is_torch_checkpoint(ckpt):  # context_fn is a checkpoint keyword, not the function's
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    y = ckpt(lambda u: torch.sin(torch.relu(u @ w1) @ w2), x, **_variant_kwargs(use_reentrant), **extra)
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, w1, w2)]


def _probe_selective_under_save_on_cpu(ckpt, use_reentrant):
    """Selective checkpointing inside ``save_on_cpu()``: torch 2.15 warns (FutureWarning) that the tensors
    it saves bypass the hooks, and will route them through (pytorch#190581, #191236); the values are the same."""
    import functools

    import torch
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)
    extra = {}
    if _is_torch_checkpoint(ckpt):
        extra["context_fn"] = functools.partial(create_selective_checkpoint_contexts, [torch.ops.aten.mm.default])
    with torch.autograd.graph.save_on_cpu():
        y = ckpt(lambda u: torch.sin(torch.relu(u @ w1) @ w2), x, **_variant_kwargs(use_reentrant), **extra)
        y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, w1, w2)]


def _probe_autocast(ckpt, use_reentrant):
    """``torch.autocast("cpu", bfloat16)`` around the forward, backward outside it."""
    import torch

    torch.manual_seed(0)
    block, head = _mlp(), torch.nn.Linear(8, 1)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = head(ckpt(block, x, **_variant_kwargs(use_reentrant)))
    y.float().sum().backward()
    return [y.detach(), *_grads(x, *block.parameters(), *head.parameters())]


def _probe_device_context(ckpt, use_reentrant):
    """``with torch.device("cpu"):`` around the forward; the block creates a tensor.

    A function mode active in the forward and gone at recompute time, which
    changes nothing there: everything is on the CPU, also on the matrix's CUDA
    rows (a GPU default device is CKG008).
    """
    import torch

    torch.manual_seed(0)
    block = _mlp().to("cpu")
    x = torch.randn(4, 8, device="cpu", requires_grad=True)

    def fn(t):
        return block(t) + torch.ones(8)

    with torch.device("cpu"):
        y = ckpt(fn, x, **_variant_kwargs(use_reentrant))
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_two_steps(ckpt, use_reentrant):
    """Two optimizer steps of a model whose forward checkpoints a block (parameters change in place)."""
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block, self.head = _mlp(), torch.nn.Linear(8, 1)

        def forward(self, x):
            return self.head(ckpt(self.block, x, **_variant_kwargs(use_reentrant)))

    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    results = []
    for _ in range(2):
        x = torch.randn(4, 8, requires_grad=True)
        opt.zero_grad()
        y = net(x)
        y.pow(2).sum().backward()
        results += [y.detach(), *_grads(x, *net.parameters())]
        opt.step()
    return results + [p.detach().clone() for p in net.parameters()]


def _probe_functional_call_backward_inside(ckpt, use_reentrant):
    """functional_call with new parameters where backward runs inside the call (swap still active)."""
    import torch
    from torch.func import functional_call

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

        def forward(self, x):
            h = ckpt(lambda t: torch.tanh(self.inner(t)), x, **_variant_kwargs(use_reentrant))
            return self.outer(h)

    class TrainStep(torch.nn.Module):
        """forward = loss + backward, so the whole step runs under the parameter swap."""

        def __init__(self):
            super().__init__()
            self.net = Net()

        def forward(self, x):
            out = self.net(x)
            out.sum().backward()
            return out.detach()

    torch.manual_seed(0)
    step = TrainStep()
    new = {k: (v.detach() * 1.5 + 0.1).requires_grad_() for k, v in step.named_parameters()}
    x = torch.randn(4, 3, requires_grad=True)
    out = functional_call(step, new, (x,))
    return [out, *_grads(x, *new.values(), *step.parameters())]


def _probe_dropout_rng(ckpt, use_reentrant):
    """A block with dropout; checkpoint restores the RNG state for the recompute (default)."""
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_kwargs_and_tuple_output(ckpt, use_reentrant):
    """Keyword arguments to the function, a non-tensor argument and a tuple output (non-reentrant)."""
    import torch

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)

    def fn(u, scale, *, bias):
        h = u @ w
        return torch.tanh(h) * scale + bias, h.sum(0)

    bias = torch.randn(3, requires_grad=True)
    a, b = ckpt(fn, x, 0.5, bias=bias, **_variant_kwargs(use_reentrant))
    (a.pow(2).sum() + b.sin().sum()).backward()
    return [a.detach(), b.detach(), *_grads(x, w, bias)]


def _probe_namedtuple_output(ckpt, use_reentrant):
    """A block that returns a namedtuple of tensors: a tuple to autograd.Function, so its
    tensors get their gradients (the reentrant variant hands back a plain tuple)."""
    import collections

    import torch

    Pair = collections.namedtuple("Pair", "hidden gate")
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    hidden, gate = ckpt(lambda u: Pair(torch.tanh(u @ w), torch.sigmoid(u).sum(0)), x, **_variant_kwargs(use_reentrant))
    (hidden.pow(2).sum() + gate.sin().sum()).backward()
    return [hidden.detach(), gate.detach(), *_grads(x, w)]


def _double_sin_dispatch_mode():
    """A user TorchDispatchMode class that doubles the result of aten.sin."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class DoubleSin(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.ops.aten.sin.default else out

    return DoubleSin


def _probe_context_fn_reenters_mode(ckpt, use_reentrant):
    """A user dispatch mode around the forward, re-entered in the recompute by ``context_fn``.

    The remedy CKG102 suggests: the same mode object is entered again for the
    recompute, so .backward() may run outside the mode.
    """
    import contextlib

    import torch

    mode = _double_sin_dispatch_mode()()
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    extra = {}
    if _is_torch_checkpoint(ckpt):  # context_fn is a checkpoint keyword, not the function's
        extra["context_fn"] = lambda: (contextlib.nullcontext(), mode)
    with mode:
        y = ckpt(lambda t: torch.sin(t) * w, x, **_variant_kwargs(use_reentrant), **extra)
    y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_context_fn_mode_pair(ckpt, use_reentrant):
    """``context_fn`` enters a fresh user dispatch mode for the forward and for the recompute.

    The reference runs the function under one such mode.
    """
    import torch

    DoubleSin = _double_sin_dispatch_mode()
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    fn = lambda t: torch.sin(t) * w  # noqa: E731
    if _is_torch_checkpoint(ckpt):
        y = ckpt(fn, x, **_variant_kwargs(use_reentrant), context_fn=lambda: (DoubleSin(), DoubleSin()))
    else:
        with DoubleSin():
            y = ckpt(fn, x, **_variant_kwargs(use_reentrant))
    y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_checkpoint_debug(ckpt, use_reentrant):
    """``checkpoint(..., debug=True)``: torch logs the ops of the forward and the recompute."""
    import torch

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    extra = {"debug": True} if _is_torch_checkpoint(ckpt) else {}
    y = ckpt(lambda u: torch.sin(u @ w) * u, x, **_variant_kwargs(use_reentrant), **extra)
    y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_no_early_stop(ckpt, use_reentrant):
    """``set_checkpoint_early_stop(False)``: the recompute runs the whole function."""
    import torch
    from torch.utils.checkpoint import set_checkpoint_early_stop

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with set_checkpoint_early_stop(False):
        y = ckpt(lambda u: torch.sin(u @ w) * u, x, **_variant_kwargs(use_reentrant))
    y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _flop_counter_step(ckpt, use_reentrant, scope):
    """FlopCounterMode around the whole ``"step"``, or around the ``"forward"`` only."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    block, head = _mlp(), torch.nn.Linear(8, 1)
    x = torch.randn(4, 8, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        y = head(ckpt(block, x, **_variant_kwargs(use_reentrant)))
        if scope == "step":
            y.sum().backward()
    if scope == "forward":
        y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters(), *head.parameters())]


def _probe_flop_counter_step(ckpt, use_reentrant):
    """torch's FlopCounterMode around a whole training step (forward and backward)."""
    return _flop_counter_step(ckpt, use_reentrant, "step")


def _probe_flop_counter_forward(ckpt, use_reentrant):
    """torch's FlopCounterMode around the forward only (counting forward FLOPs), backward outside."""
    return _flop_counter_step(ckpt, use_reentrant, "forward")


def _probe_functional_call_swap_outside_block(ckpt, use_reentrant):
    """functional_call swapping only the head's weight (not used by the checkpointed block), backward after."""
    import torch
    from torch.func import functional_call

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

        def forward(self, x):
            h = ckpt(lambda t: torch.tanh(self.inner(t)), x, **_variant_kwargs(use_reentrant))
            return self.outer(h)

    torch.manual_seed(0)
    net = Net()
    new = {"outer.weight": (net.outer.weight.detach() * 1.5).requires_grad_()}
    x = torch.randn(4, 3, requires_grad=True)
    out = functional_call(net, new, (x,))
    out.sum().backward()
    return [out.detach(), *_grads(x, *new.values(), *net.parameters())]


def _probe_functional_call_swap_other_module(ckpt, use_reentrant):
    """functional_call swapping only the head; the checkpointed function is the block itself."""
    import torch
    from torch.func import functional_call

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

        def forward(self, x):
            return self.outer(torch.tanh(ckpt(self.inner, x, **_variant_kwargs(use_reentrant))))

    torch.manual_seed(0)
    net = Net()
    new = {"outer.weight": (net.outer.weight.detach() * 1.5).requires_grad_()}
    x = torch.randn(4, 3, requires_grad=True)
    out = functional_call(net, new, (x,))
    out.sum().backward()
    return [out.detach(), *_grads(x, *new.values(), *net.parameters())]


def _probe_vmap_module_forward(ckpt, use_reentrant):
    """vmap over a checkpointed nn.Module (parameters require grad), forward only, grad mode on."""
    import torch
    from torch.func import vmap

    torch.manual_seed(0)
    block = _mlp(3)
    x = torch.randn(4, 3)
    return [vmap(lambda t: ckpt(block, t, **_variant_kwargs(use_reentrant)))(x).detach()]


def _probe_vmap_no_grad(ckpt, use_reentrant):
    """vmap over a checkpointed nn.Module (parameters require grad) under torch.no_grad()."""
    import torch
    from torch.func import vmap

    torch.manual_seed(0)
    block = _mlp(3)
    x = torch.randn(4, 3)
    with torch.no_grad():
        return [vmap(lambda t: ckpt(block, t, **_variant_kwargs(use_reentrant)))(x)]


def _probe_frozen_block(ckpt, use_reentrant):
    """A frozen checkpointed block (no parameter requires grad) on data input; the head trains."""
    import torch

    torch.manual_seed(0)
    block, head = _mlp(), torch.nn.Linear(8, 1)
    block.requires_grad_(False)
    x = torch.randn(4, 8)
    y = head(ckpt(block, x, **_variant_kwargs(use_reentrant)))
    y.sum().backward()
    return [y.detach(), *_grads(*head.parameters())]


def _probe_data_input_nonreentrant(ckpt, use_reentrant):
    """Non-reentrant checkpoint of a block whose input does not require grad (its parameters do)."""
    import torch

    torch.manual_seed(0)
    block, head = _mlp(), torch.nn.Linear(8, 1)
    x = torch.randn(4, 8)
    y = head(ckpt(block, x, **_variant_kwargs(use_reentrant)))
    y.sum().backward()
    return [y.detach(), *_grads(*block.parameters(), *head.parameters())]


def _probe_default_dtype_whole_step(ckpt, use_reentrant):
    """The default dtype is float64 for the whole step (forward and backward); the block creates a tensor."""
    import torch

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        block = _mlp()
        x = torch.randn(4, 8, requires_grad=True)
        y = ckpt(lambda t: block(t) * torch.tensor(0.5), x, **_variant_kwargs(use_reentrant))
        y.pow(2).sum().backward()
    finally:
        torch.set_default_dtype(previous)
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_gan_other_player_steps(ckpt, use_reentrant):
    """GAN-style: the discriminator's optimizer steps between the checkpointed generator's
    forward and its backward; the generator's own parameters are untouched (CKG108 stays quiet)."""
    import torch

    torch.manual_seed(0)
    generator, discriminator = _mlp(), torch.nn.Linear(8, 1)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.1)
    z = torch.randn(4, 8, requires_grad=True)  # reentrant needs an input that requires grad (CKG006)
    fake = ckpt(generator, z, **_variant_kwargs(use_reentrant))
    d_loss = discriminator(fake.detach()).pow(2).mean()
    d_loss.backward()
    d_optimizer.step()  # updates only the discriminator
    d_optimizer.zero_grad()
    g_loss = fake.sin().sum()  # (a real GAN scores fake with D; this keeps D out of g's graph)
    g_loss.backward()
    return [fake.detach(), *_grads(*generator.parameters(), *discriminator.parameters())]


def _probe_gan_parent_method(ckpt, use_reentrant):
    """GAN-style with one parent module holding both players, checkpointed as
    ``gan.generate``, ``partial(GAN.generate, gan)`` and ``partial(gan.generate)``; each
    time the discriminator steps before the generator's backward.  These may use any
    part of the parent; the generator's parameters are untouched (CKG108 stays quiet)."""
    import functools

    import torch

    class GAN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.generator, self.discriminator = _mlp(), torch.nn.Linear(8, 1)

        def generate(self, z):
            return self.generator(z)

    torch.manual_seed(0)
    gan = GAN()
    d_optimizer = torch.optim.SGD(gan.discriminator.parameters(), lr=0.1)
    results = []
    for function in (gan.generate, functools.partial(GAN.generate, gan), functools.partial(gan.generate)):
        gan.generator.zero_grad()
        z = torch.randn(4, 8, requires_grad=True)
        fake = ckpt(function, z, **_variant_kwargs(use_reentrant))
        gan.discriminator(fake.detach()).pow(2).mean().backward()
        d_optimizer.step()
        fake.sin().sum().backward()
        results += [fake.detach(), *_grads(*gan.generator.parameters())]
    return results


def _probe_optimizer_step_skips_block(ckpt, use_reentrant):
    """An optimizer holding the block's parameters steps before .backward(), but they have
    no gradient yet, so SGD leaves them as they are (CKG108 compares versions: quiet)."""
    import torch

    torch.manual_seed(0)
    block = _mlp()
    other = torch.zeros(8, requires_grad=True)  # say, an embedding trained on another loss
    optimizer = torch.optim.SGD([*block.parameters(), other], lr=0.1)
    x = torch.randn(4, 8, requires_grad=True)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    other.grad = torch.ones_like(other)  # only `other` has a gradient
    optimizer.step()
    y.pow(2).sum().backward()
    return [y.detach(), other.detach().clone(), *_grads(x, *block.parameters())]


# torch < 2.12 refuses non-reentrant checkpoint under vmap, jvp and functionalize (CKG007)
_SINCE_2_12 = TorchRange(since=(2, 12))

def _probe_eval_switch_without_mode_dependent_layers(ckpt, use_reentrant):
    """A block without dropout or batch norm switched to eval between its forward and backward."""
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8))
    x = torch.randn(4, 8, requires_grad=True)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    block.eval()  # e.g. an evaluation hook between the forward and the backward
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_default_dtype_switch_no_factory(ckpt, use_reentrant):
    """The default dtype changes before backward, but the block creates no tensor from it."""
    import torch

    torch.manual_seed(0)
    block = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    previous = torch.get_default_dtype()
    try:
        y = ckpt(block, x, **_variant_kwargs(use_reentrant))
        torch.set_default_dtype(torch.float64)
        y.pow(2).sum().backward()
    finally:
        torch.set_default_dtype(previous)
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_observer_function_mode(ckpt, use_reentrant):
    """A user TorchFunctionMode that only counts calls, around the forward; backward outside it."""
    import torch
    from torch.overrides import TorchFunctionMode

    class CountCalls(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            CountCalls.calls += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    block = _mlp()
    x = torch.randn(4, 8, requires_grad=True)
    with CountCalls():
        y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


SAFE_COMPOSITIONS: tuple[Composition, ...] = (
    Composition(
        name="training-step",
        description="an ordinary training step through a checkpointed block",
        variants=BOTH,
        probe=_probe_training_step,
    ),
    Composition(
        name="nested",
        description="a checkpointed function that itself checkpoints a sub-block",
        variants=BOTH,
        probe=_probe_nested,
    ),
    Composition(
        name="checkpoint-sequential",
        description="torch.utils.checkpoint.checkpoint_sequential over an nn.Sequential",
        variants=BOTH,
        probe=_probe_checkpoint_sequential,
    ),
    Composition(
        name="checkpoint-wrapper",
        description="checkpoint_wrapper(module, checkpoint_impl=REENTRANT / NO_REENTRANT)",
        variants=BOTH,
        probe=_probe_checkpoint_wrapper,
    ),
    Composition(
        name="apply-activation-checkpointing",
        description="apply_activation_checkpointing wrapping every Linear of a model",
        variants=BOTH,
        probe=_probe_apply_activation_checkpointing,
    ),
    Composition(
        name="composable-checkpoint",
        description="the composable torch.distributed._composable.checkpoint(module)",
        variants=(NON_REENTRANT,),
        probe=_probe_composable_checkpoint,
    ),
    Composition(
        name="jvp",
        description="torch.func.jvp over a checkpointed pure function, nothing requires grad",
        variants=(NON_REENTRANT,),
        probe=_probe_jvp,
        torch_range=_SINCE_2_12,
        otherwise="CKG007",
    ),
    Composition(
        name="jacfwd",
        description="torch.func.jacfwd over a checkpointed pure function, nothing requires grad",
        variants=(NON_REENTRANT,),
        probe=_probe_jacfwd,
        torch_range=_SINCE_2_12,
        otherwise="CKG007",
    ),
    Composition(
        name="vmap-forward",
        description="torch.func.vmap over a checkpointed pure function, nothing requires grad",
        variants=(NON_REENTRANT,),
        probe=_probe_vmap_pure,
        torch_range=_SINCE_2_12,
        otherwise="CKG007",
    ),
    Composition(
        name="functionalize",
        description="torch.func.functionalize over a checkpointed function that mutates a temporary",
        variants=(NON_REENTRANT,),
        probe=_probe_functionalize,
        torch_range=_SINCE_2_12,
        otherwise="CKG007",
    ),
    Composition(
        name="no-grad",
        description="checkpoint called under torch.no_grad()",
        variants=BOTH,
        probe=_probe_no_grad,
    ),
    Composition(
        name="inference-mode",
        description="checkpoint called under torch.inference_mode()",
        variants=BOTH,
        probe=_probe_inference_mode,
    ),
    Composition(
        name="save-on-cpu",
        description="a training step inside torch.autograd.graph.save_on_cpu()",
        variants=BOTH,
        probe=_probe_save_on_cpu,
    ),
    Composition(
        name="autograd-grad",
        description="torch.autograd.grad through the checkpoint, including double backward",
        variants=(NON_REENTRANT,),
        probe=_probe_autograd_grad,
    ),
    Composition(
        name="dispatch-mode-around-backward",
        description="a user TorchDispatchMode active in the forward and around .backward()",
        variants=BOTH,
        probe=_probe_dispatch_mode_around_backward,
    ),
    Composition(
        name="selective-checkpoint",
        description="selective checkpointing: context_fn=create_selective_checkpoint_contexts([aten.mm])",
        variants=(NON_REENTRANT,),
        probe=_probe_selective,
        torch_range=TorchRange(since=(2, 5)),  # create_selective_checkpoint_contexts is new in 2.5
    ),
    Composition(
        name="selective-checkpoint-under-save-on-cpu",
        description=(
            "selective checkpointing inside save_on_cpu(): torch's FutureWarning about "
            "respect_saved_tensors_hooks (2.15) passes through, nothing added"
        ),
        variants=(NON_REENTRANT,),
        probe=_probe_selective_under_save_on_cpu,
        torch_range=TorchRange(since=(2, 5)),
    ),
    Composition(
        name="autocast",
        description='torch.autocast("cpu", dtype=torch.bfloat16) around the forward, backward outside',
        variants=BOTH,
        probe=_probe_autocast,
    ),
    Composition(
        name="device-context",
        description='with torch.device("cpu"): around the forward; the block creates a tensor',
        variants=(NON_REENTRANT, REENTRANT),
        probe=_probe_device_context,
    ),
    Composition(
        name="two-optimizer-steps",
        description="two optimizer steps of a model that checkpoints a block in its forward",
        variants=BOTH,
        probe=_probe_two_steps,
    ),
    Composition(
        name="gan-other-player-steps",
        description="another model's optimizer steps between the checkpointed forward and its backward",
        variants=BOTH,
        probe=_probe_gan_other_player_steps,
    ),
    Composition(
        name="gan-parent-method",
        description="checkpoint(gan.generate, z), also through partials, on a parent holding both players; the other player steps",
        variants=BOTH,
        probe=_probe_gan_parent_method,
    ),
    Composition(
        name="optimizer-step-skips-block",
        description="an optimizer over the block steps before backward, but the block has no gradients yet",
        variants=BOTH,
        probe=_probe_optimizer_step_skips_block,
    ),
    Composition(
        name="functional-call-backward-inside",
        description="torch.func.functional_call whose module runs .backward() inside the call",
        variants=BOTH,
        probe=_probe_functional_call_backward_inside,
    ),
    Composition(
        name="dropout-rng",
        description="a block with dropout; preserve_rng_state (default) replays the RNG in the recompute",
        variants=BOTH,
        probe=_probe_dropout_rng,
    ),
    Composition(
        name="kwargs-tuple-output",
        description="keyword and non-tensor arguments to the function, a tuple output",
        variants=(NON_REENTRANT,),
        probe=_probe_kwargs_and_tuple_output,
    ),
    Composition(
        name="namedtuple-output",
        description="a block that returns a namedtuple of tensors (not CKG010: a tuple to autograd.Function)",
        variants=BOTH,
        probe=_probe_namedtuple_output,
    ),
    Composition(
        name="context-fn-reenters-mode",
        description="a user dispatch mode around the forward, re-entered for the recompute via context_fn",
        variants=(NON_REENTRANT,),
        probe=_probe_context_fn_reenters_mode,
    ),
    Composition(
        name="no-early-stop",
        description="set_checkpoint_early_stop(False) around the forward",
        variants=(NON_REENTRANT,),
        probe=_probe_no_early_stop,
    ),
    Composition(
        name="flop-counter-around-step",
        description="torch.utils.flop_counter.FlopCounterMode around forward and backward",
        variants=BOTH,
        probe=_probe_flop_counter_step,
    ),
    Composition(
        name="vmap-no-grad",
        description="vmap over a checkpointed module with trainable parameters, under torch.no_grad()",
        variants=(NON_REENTRANT,),
        probe=_probe_vmap_no_grad,
        torch_range=_SINCE_2_12,
        otherwise="CKG007",
    ),
    Composition(
        name="frozen-block",
        description="a frozen checkpointed block on data input, the head after it trains",
        variants=BOTH,
        probe=_probe_frozen_block,
    ),
    Composition(
        name="data-input-non-reentrant",
        description="non-reentrant checkpoint of a trainable block whose input does not require grad",
        variants=(NON_REENTRANT,),
        probe=_probe_data_input_nonreentrant,
    ),
    Composition(
        name="default-dtype-whole-step",
        description="default dtype float64 for the whole step; the block creates a tensor",
        variants=BOTH,
        probe=_probe_default_dtype_whole_step,
    ),
    Composition(
        name="context-fn-mode-pair",
        description="context_fn enters a fresh user dispatch mode for the forward and for the recompute",
        variants=(NON_REENTRANT,),
        probe=_probe_context_fn_mode_pair,
    ),
    Composition(
        name="checkpoint-debug",
        description="checkpoint(..., debug=True): torch's LoggingTensorMode around forward and recompute",
        variants=(NON_REENTRANT,),
        probe=_probe_checkpoint_debug,
    ),
    Composition(
        name="flop-counter-forward-only",
        description="FlopCounterMode around the forward only, backward outside it",
        variants=BOTH,
        probe=_probe_flop_counter_forward,
    ),
    Composition(
        name="eval-switch-without-mode-dependent-layers",
        description="a Linear/GELU/LayerNorm block switched to eval between forward and backward (CKG106 stays quiet)",
        variants=BOTH,
        probe=_probe_eval_switch_without_mode_dependent_layers,
    ),
    Composition(
        name="functional-call-swap-other-module",
        description="functional_call swapping only the head; the checkpointed block (a submodule) is untouched; backward after",
        variants=BOTH,
        probe=_probe_functional_call_swap_other_module,
    ),
)


#: Compositions torch gets right on which the guard (this version) is NOT
#: silent: known false alarms, kept apart so SAFE_COMPOSITIONS keeps its
#: contract.  ``tests/test_no_false_alarms.py`` runs them as strict xfails, so a
#: fix shows up as XPASS: then move the entry into SAFE_COMPOSITIONS.
KNOWN_FALSE_ALARMS: tuple[Composition, ...] = (
    Composition(
        name="functional-call-swap-outside-block",
        description="functional_call swapping only parameters the checkpointed block does not use, backward after",
        variants=BOTH,
        probe=_probe_functional_call_swap_outside_block,
    ),
    Composition(
        name="default-dtype-switch-no-factory",
        description="default dtype changed before backward; the block creates no tensor from it",
        variants=BOTH,
        probe=_probe_default_dtype_switch_no_factory,
    ),
    Composition(
        name="observer-function-mode",
        description="a user TorchFunctionMode that only counts calls, around the forward only",
        variants=BOTH,
        probe=_probe_observer_function_mode,
    ),
    Composition(
        name="vmap-module-forward-only",
        description="vmap over a checkpointed module with trainable parameters, grad mode on, no backward",
        variants=(NON_REENTRANT,),
        probe=_probe_vmap_module_forward,
        torch_range=_SINCE_2_12,
        otherwise="CKG007",
    ),
)
