"""Meta-learning steps the way real libraries take them, for the conformance matrix.

One inner step on a support batch, then the outer (meta) loss on a query batch and an
eager ``.backward()`` into the model's own parameters; first order (the inner
gradient is a constant) or second order (the inner step is differentiated).  How the
inner step reaches the model's blocks is the cell's *way in* (the matrix's ``access``):

* ``higher innerloop_ctx``: higher's patched module and differentiable optimizer (its
  modules bind their fast weights from a box of their own at each call);
* ``higher monkeypatch``: higher's patched module, fast weights passed per call
  (``fnet(x, params=fast)``);
* ``torchopt MetaSGD``: torchopt's MetaSGD re-binds the module's parameters to the
  new, non-leaf tensors (second order only: it always differentiates its step);
* ``learn2learn-style clone``: learn2learn's ``clone_module`` / ``update_module``
  written out (a shallow copy of every module whose parameters are clones connected to
  the originals, updated by re-binding), so the matrix needs no learn2learn;
* any other way in: ``functional_call`` with the fast weights (the swapped module), or,
  for ``module``, the parameters re-bound on the module itself (``del m.weight;
  m.weight = w - lr * g``), then put back.

Each returns ``[outer loss, which parameters got no gradient, their gradients]``, as
the matrix's other eager transforms do.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, List

import torch

LR = 0.1
LIBRARIES = ("higher innerloop_ctx", "higher monkeypatch", "torchopt MetaSGD", "learn2learn-style clone")


class NotApplicable(Exception):
    """The cell's way in has no such meta step (torchopt's MetaSGD has no first order)."""


def meta_step(pr: Any, second_order: bool, access: str, loss_of: Callable[[Any, torch.Tensor], torch.Tensor],
              backward_grads: Callable[..., List[torch.Tensor]]) -> list:
    x_support, x_query = pr.xs[0], pr.xs[1]
    if access == "higher innerloop_ctx":
        import higher

        leaves = list(pr.net.parameters())
        optimizer = torch.optim.SGD(leaves, lr=LR)
        with higher.innerloop_ctx(
            pr.net, optimizer, copy_initial_weights=False, track_higher_grads=second_order,
        ) as (fnet, diffopt):
            diffopt.step(loss_of(fnet, x_support))
            outer = loss_of(fnet, x_query)
            return [outer, *backward_grads(pr, outer, leaves=leaves)]
    if access == "higher monkeypatch":
        import higher

        fnet = higher.monkeypatch(pr.net, copy_initial_weights=True)
        params = list(pr.net.parameters())
        inner = loss_of(lambda x: fnet(x, params=params), x_support)
        grads = torch.autograd.grad(inner, params, create_graph=second_order)
        fast = [p - LR * g for p, g in zip(params, grads)]
        outer = loss_of(lambda x: fnet(x, params=fast), x_query)
        return [outer, *backward_grads(pr, outer, leaves=params)]
    if access == "torchopt MetaSGD":
        if not second_order:
            raise NotApplicable("torchopt's MetaSGD always differentiates its step (no first order)")
        import torchopt

        state = torchopt.extract_state_dict(pr.net)
        leaves = list(pr.net.parameters())
        try:
            torchopt.MetaSGD(pr.net, lr=LR).step(loss_of(pr.net, x_support))
            outer = loss_of(pr.net, x_query)
            return [outer, *backward_grads(pr, outer, leaves=leaves)]
        finally:
            torchopt.recover_state_dict(pr.net, state)
    if access == "learn2learn-style clone":
        leaves = list(pr.net.parameters())
        clone = clone_module(pr.net)
        inner = loss_of(clone, x_support)
        params = list(clone.parameters())
        grads = torch.autograd.grad(inner, params, create_graph=second_order)
        update_module(clone, {id(p): p - LR * g for p, g in zip(params, grads)})
        outer = loss_of(clone, x_query)
        return [outer, *backward_grads(pr, outer, leaves=leaves)]
    if access == "module":  # the module's own parameters re-bound (as MetaSGD and higher do), then put back
        owners = [(m, name, p) for m in pr.net.modules() for name, p in m._parameters.items() if p is not None]
        inner = loss_of(pr.net, x_support)
        grads = torch.autograd.grad(inner, [p for _, _, p in owners], create_graph=second_order)
        try:
            for (module, name, p), g in zip(owners, grads):
                del module._parameters[name]
                module._parameters[name] = p - LR * g
            outer = loss_of(pr.net, x_query)
            return [outer, *backward_grads(pr, outer, leaves=[p for _, _, p in owners])]
        finally:
            for module, name, p in owners:
                module._parameters[name] = p
    # functional_call with the fast weights (every other way in reaches the swapped module)
    inner = pr.loss(pr.params, pr.buffers, x_support)
    grads = torch.autograd.grad(inner, list(pr.params.values()), create_graph=second_order)
    fast = {k: w - LR * g for (k, w), g in zip(pr.params.items(), grads)}
    outer = pr.loss(fast, pr.buffers, x_query)
    return [outer, *backward_grads(pr, outer)]


def clone_module(module: torch.nn.Module, memo: Any = None) -> torch.nn.Module:
    """learn2learn's ``clone_module``: every module shallow-copied, its parameters cloned (connected)."""
    memo = {} if memo is None else memo
    if id(module) in memo:
        return memo[id(module)]
    clone = copy.copy(module)
    memo[id(module)] = clone
    clone.__dict__ = dict(module.__dict__)
    clone._parameters = {name: (None if p is None else p.clone()) for name, p in module._parameters.items()}
    clone._buffers = dict(module._buffers)
    clone._modules = {name: (None if m is None else clone_module(m, memo)) for name, m in module._modules.items()}
    if hasattr(clone, "flatten_parameters") and hasattr(clone, "_flat_weights_names"):
        clone._flat_weights = [clone._parameters.get(n) for n in clone._flat_weights_names]
    return clone


def update_module(module: torch.nn.Module, new: dict, seen: Any = None) -> None:
    """learn2learn's ``update_module``: each parameter re-bound to its updated tensor."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    for name, p in list(module._parameters.items()):
        if p is not None and id(p) in new:
            module._parameters[name] = new[id(p)]
    if hasattr(module, "_flat_weights_names"):
        module._flat_weights = [module._parameters.get(n) for n in module._flat_weights_names]
    for child in module._modules.values():
        if child is not None:
            update_module(child, new, seen)
