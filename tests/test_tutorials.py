"""torch.func's official tutorials, their models checkpointed block by block, through both entries.

Per-sample gradients, model ensembling, Jacobians and Hessians (with
Hessian-vector products), the neural tangent kernel (both of its methods) and
functorch's MAML example, each written as the tutorial writes it, with every
block of the model called through ``ckpt``: the plain call (the reference),
``ckpt_guard.checkpoint`` (strict, the default) or torch's
``checkpoint(use_reentrant=False)`` under ``install("fallback")``.  Every result
equals the reference, and where reverse mode differentiates the blocks they
were recomputed (the memory saving is kept).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, stack_module_state, vjp, vmap
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import _composable

DTYPE = torch.float64


def plain(function, *args):
    return function(*args)


def torch_checkpoint(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


ENTRIES = {"ckpt_guard.checkpoint": ("strict", ckpt_guard.checkpoint), "torch checkpoint, fallback": ("fallback", torch_checkpoint)}


def _leaves(value):
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def assert_as_the_tutorial(tutorial, entry, recomputed=True):
    torch.manual_seed(0)
    reference = _leaves(tutorial(plain))
    policy, ckpt = ENTRIES[entry]
    before = _composable.counters.RECOMPUTES
    ckpt_guard.install(policy, rules={})
    try:
        with warnings.catch_warnings():
            # ckpt_guard.checkpoint has nothing to say here; fallback says what it ran instead
            warnings.simplefilter("error" if policy == "strict" else "ignore", ckpt_guard.CheckpointCompositionWarning)
            torch.manual_seed(0)
            got = _leaves(tutorial(ckpt))
    finally:
        ckpt_guard.uninstall()
    assert len(got) == len(reference)
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)
    assert (_composable.counters.RECOMPUTES > before) == recomputed


class SimpleCNN(nn.Module):
    """The per-sample-gradients tutorial's model, each stage a checkpointed block."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 4, 3, 1), nn.Conv2d(4, 4, 3, 1)
        self.fc1, self.fc2 = nn.Linear(4 * 2 * 2, 8), nn.Linear(8, 10)
        self.ckpt = plain

    def _features(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        return torch.flatten(F.max_pool2d(x, 2), 1)

    def forward(self, x):
        x = self.ckpt(self._features, x)
        x = self.ckpt(lambda t: F.relu(self.fc1(t)), x)
        return F.log_softmax(self.fc2(x), dim=1)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_per_sample_gradients(entry):
    def tutorial(ckpt):
        model = SimpleCNN().to(DTYPE)
        model.ckpt = ckpt
        data, targets = torch.randn(6, 1, 8, 8, dtype=DTYPE), torch.randint(10, (6,))
        params = {k: v.detach() for k, v in model.named_parameters()}
        buffers = {k: v.detach() for k, v in model.named_buffers()}

        def compute_loss(params, buffers, sample, target):
            predictions = functional_call(model, (params, buffers), (sample.unsqueeze(0),))
            return F.nll_loss(predictions, target.unsqueeze(0))

        return vmap(grad(compute_loss), in_dims=(None, None, 0, 0))(params, buffers, data, targets)

    assert_as_the_tutorial(tutorial, entry)


class MLP(nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, width), nn.Linear(width, width), nn.Linear(width, 10)
        self.ckpt = plain

    def forward(self, x):
        x = x.flatten(1)
        x = self.ckpt(lambda t: F.relu(self.fc1(t)), x)
        x = self.ckpt(lambda t: F.relu(self.fc2(t)), x)
        return self.fc3(x)


def _ensemble(ckpt):
    models = [MLP().to(DTYPE) for _ in range(3)]
    for m in models:
        m.ckpt = ckpt
    params, buffers = stack_module_state(models)
    base = copy.deepcopy(models[0]).to("meta")
    base.ckpt = ckpt
    return models, params, buffers, base


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_model_ensembling_forward(entry):
    """The tutorial's forward: vmap over the members (no reverse mode: nothing to save, run plainly)."""
    def tutorial(ckpt):
        _, params, buffers, base = _ensemble(ckpt)
        minibatches = torch.randn(3, 4, 1, 4, 4, dtype=DTYPE)
        fmodel = lambda p, b, x: functional_call(base, (p, b), (x,))  # noqa: E731
        same = vmap(fmodel, in_dims=(0, 0, None))(params, buffers, minibatches[0])
        different = vmap(fmodel)(params, buffers, minibatches)
        return same, different

    assert_as_the_tutorial(tutorial, entry, recomputed=False)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_model_ensembling_trained(entry):
    def tutorial(ckpt):
        _, params, buffers, base = _ensemble(ckpt)
        x, y = torch.randn(4, 1, 4, 4, dtype=DTYPE), torch.randint(10, (4,))

        def loss(p, b):
            return F.cross_entropy(functional_call(base, (p, b), (x,)), y)

        return vmap(grad(loss))(params, buffers)

    assert_as_the_tutorial(tutorial, entry)


def _predict_model(ckpt):
    torch.manual_seed(1)
    weight, bias = torch.randn(4, 4, dtype=DTYPE), torch.randn(4, dtype=DTYPE)

    def predict(weight, bias, x):
        h = ckpt(lambda t, w, b: torch.tanh(F.linear(t, w, b)), x, weight, bias)
        return ckpt(lambda t, w, b: F.linear(t, w, b).tanh(), h, weight, bias)

    return weight, bias, predict


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("how", ["jacrev", "jacrev argnums=(0, 1)", "jacfwd", "vmap(jacrev)", "hessian",
                                 "jacfwd(jacrev)", "hvp jvp(grad)", "hvp vjp(grad)"])
def test_jacobians_hessians_and_hvp(how, entry):
    def tutorial(ckpt):
        weight, bias, predict = _predict_model(ckpt)
        x = torch.randn(4, dtype=DTYPE, generator=torch.Generator().manual_seed(2))
        xs = torch.randn(3, 4, dtype=DTYPE, generator=torch.Generator().manual_seed(3))
        if how == "jacrev":
            return jacrev(predict, argnums=2)(weight, bias, x)
        if how == "jacrev argnums=(0, 1)":
            return jacrev(predict, argnums=(0, 1))(weight, bias, x)
        if how == "jacfwd":
            return jacfwd(predict, argnums=2)(weight, bias, x)
        if how == "vmap(jacrev)":
            return vmap(jacrev(predict, argnums=2), in_dims=(None, None, 0))(weight, bias, xs)
        if how == "hessian":
            return hessian(lambda t: predict(weight, bias, t).sum(), argnums=0)(x)
        if how == "jacfwd(jacrev)":
            return jacfwd(jacrev(predict, argnums=2), argnums=2)(weight, bias, x)
        f = lambda t: predict(weight, bias, t).pow(2).sum()  # noqa: E731
        v = torch.ones_like(x)
        if how == "hvp jvp(grad)":
            return jvp(grad(f), (x,), (v,))[1]
        return vjp(grad(f), x)[1](v)

    assert_as_the_tutorial(tutorial, entry, recomputed=how != "jacfwd")


class NTKNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 4, 3), nn.Conv2d(4, 4, 3)
        self.fc = nn.Linear(4 * 2 * 2, 3)
        self.ckpt = plain

    def forward(self, x):
        x = self.ckpt(lambda t: F.relu(self.conv1(t)), x)
        x = self.ckpt(lambda t: F.relu(self.conv2(t)), x)
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("method", ["jacobian contraction", "ntk-vector products"])
def test_neural_tangent_kernel(method, entry):
    def tutorial(ckpt):
        net = NTKNet().to(DTYPE)
        net.ckpt = ckpt
        params = {k: v.detach() for k, v in net.named_parameters()}
        x1, x2 = torch.randn(3, 2, 6, 6, dtype=DTYPE), torch.randn(2, 2, 6, 6, dtype=DTYPE)

        def fnet_single(params, x):
            return functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

        if method == "jacobian contraction":
            jac1 = vmap(jacrev(fnet_single), (None, 0))(params, x1)
            jac2 = vmap(jacrev(fnet_single), (None, 0))(params, x2)
            jac1 = [j.flatten(2) for j in jac1.values()]
            jac2 = [j.flatten(2) for j in jac2.values()]
            return sum(torch.einsum("Naf,Mbf->NMab", j1, j2) for j1, j2 in zip(jac1, jac2))

        def get_ntk(x1, x2):
            def func_x1(params):
                return fnet_single(params, x1)

            def func_x2(params):
                return fnet_single(params, x2)

            output, vjp_fn = vjp(func_x1, params)

            def get_ntk_slice(vec):
                vjps = vjp_fn(vec)
                _, jvps = jvp(func_x2, (params,), vjps)
                return jvps

            basis = torch.eye(output.numel(), dtype=output.dtype).view(output.numel(), -1)
            return vmap(get_ntk_slice)(basis)

        return vmap(vmap(get_ntk, (None, 0)), (0, None))(x1, x2)

    assert_as_the_tutorial(tutorial, entry)


class MAMLNet(nn.Module):
    """functorch's MAML example (omniglot), shrunk: conv, batchnorm without running stats, relu, maxpool."""

    def __init__(self, n_way=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(1 if i == 0 else 4, 4, 3, padding=1),
                          nn.BatchNorm2d(4, momentum=1, affine=True, track_running_stats=False),
                          nn.ReLU(inplace=True), nn.MaxPool2d(2, 2))
            for i in range(2)
        )
        self.fc = nn.Linear(4 * 2 * 2, n_way)
        self.ckpt = plain

    def forward(self, x):
        for block in self.blocks:
            x = self.ckpt(block, x)
        return self.fc(x.flatten(1))


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_maml(entry):
    def tutorial(ckpt):
        net = MAMLNet().to(DTYPE)
        net.ckpt = ckpt
        params = dict(net.named_parameters())
        x_spt, y_spt = torch.randn(2, 6, 1, 8, 8, dtype=DTYPE), torch.randint(3, (2, 6))
        x_qry, y_qry = torch.randn(2, 6, 1, 8, 8, dtype=DTYPE), torch.randint(3, (2, 6))

        def loss_for_task(x1, y1, x2, y2):
            def compute_loss(new_params, x, y):
                return F.cross_entropy(functional_call(net, new_params, (x,)), y)

            new_params = params
            for _ in range(2):
                grads = grad(compute_loss)(new_params, x1, y1)
                new_params = {k: new_params[k] - 0.1 * grads[k] for k in new_params}
            return F.cross_entropy(functional_call(net, new_params, (x2,)), y2)

        losses = vmap(loss_for_task)(x_spt, y_spt, x_qry, y_qry)
        losses.sum().backward()
        return [losses.detach(), *(p.grad for p in net.parameters())]

    assert_as_the_tutorial(tutorial, entry)


def test_mse_loss_under_jvp_of_grad_is_torchs_own_limit_and_the_written_out_loss_works():
    """docs/limits.md: F.mse_loss under jvp(grad) raises without any checkpoint; the written-out loss
    runs, and ckpt_guard.checkpoint gives the uncheckpointed Hessian-vector product for it."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).to(DTYPE)
    params = {k: v.detach() for k, v in net.named_parameters()}
    x, y = torch.randn(6, 4, dtype=DTYPE), torch.randn(6, 1, dtype=DTYPE)
    tangent = {k: torch.randn_like(v) for k, v in params.items()}

    def hvp(loss_of, ckpt):
        def loss(p):
            return loss_of(ckpt(lambda t: functional_call(net, p, (t,)), x), y)
        return jvp(grad(loss), (params,), (tangent,))[1]

    with pytest.raises(RuntimeError, match="ZeroTensors are immutable"):
        hvp(F.mse_loss, plain)  # torch's, with no checkpoint anywhere
    written_out = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    reference = hvp(written_out, plain)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ckpt_guard.CheckpointCompositionWarning)
        got = hvp(written_out, ckpt_guard.checkpoint)
    assert reference.keys() == got.keys()
    for name in reference:
        torch.testing.assert_close(got[name], reference[name])
