"""The conformance matrix: every module kind × every transform × every way in, against the plain code.

A *cell* is one program: a two-block model of one module kind (``KINDS``),
differentiated one way torch.func users do (``TRANSFORMS``), its blocks
reaching their tensors one way (``ACCESS``) and checkpointed through one entry
(``ENTRIES``).  :func:`run_cell` runs it without checkpointing (the reference)
and checkpointed, and says what happened (:class:`Outcome`):

* ``checkpointed``: the results equal the reference and the blocks were packed
  into the recompute (the forward kept no activations: the memory saving) and
  recomputed where a backward ran;
* ``plain``: the results equal the reference and the blocks ran without
  checkpointing, for a reason of a listed refusal class (``refusal``); or,
  where no reverse mode differentiates anything (``jvp``, ``jacfwd``, a
  forward ``vmap``), because there is nothing to save;
* ``refused``: ``CheckpointCompositionError`` (strict only) of a listed class;
* ``n/a``: the plain code itself raises (the cell exists to show that the
  guard then raises too, never returns a number), or the cell does not apply
  (a transform over parameters where the block has none to be given);
* ``WRONG`` / ``CRASH``: a number that differs, an error where the plain code
  runs: a failure.

"Results" are every tensor the program returns, the gradients an eager
``.backward()`` leaves and which leaves it leaves None (the program runs twice, as two training steps: a
block's second call reads what the first kept of it), and what the program leaves behind: the next number
of the global RNG, every buffer of the model (BatchNorm's running
statistics), and a module's call counter.

The matrix is generated, as JAX's remat tests cross every transform with
``jax.checkpoint``: :func:`cells` is the full cross of kinds × transforms for
the main entries, and a pairwise cover (every pair of values of any two axes
at least once) of all four axes.  ``python tests/conformance.py --write
docs/conformance.md`` runs it on the installed torch and writes its table.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import gc
import itertools
import json
import re
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, linearize, vjp, vmap
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torch.utils.checkpoint import checkpoint_sequential

import ckpt_guard
import meta_learning
import process_state
from ckpt_guard import CheckpointCompositionError, _composable

D, T, BATCH = 4, 3, 2  # features, tokens per sample, samples (or tasks, or ensemble members)
DEPTH = 4  # the nested entry's depth (a closure over the next, four deep: issue 46)
DTYPE = torch.float64

# --------------------------------------------------------------------------
# module kinds: blocks mapping a (T, D) sample to a (T, D) sample

#: how many times each block's Python ran (a global the recompute cannot bind back: it counts reruns)
RUNS: Dict[int, int] = {}


class Kind:
    """A block factory, and what the kind needs from the cell.

    ``caller``: what the code around the checkpoint does with the block's outputs (the kind
    whose outputs alias each other writes into one of them), else the output is used as is.
    """

    def __init__(
        self, make: Callable[[], nn.Module], *, random: bool = False, note: str = "",
        caller: Optional[Callable[[Any], torch.Tensor]] = None,
    ) -> None:
        self.make, self.random, self.note, self.caller = make, random, note, caller


class Block(nn.Module):
    """The kind's layers, with a run counter the matrix reads."""

    def __init__(self, body: nn.Module, forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.body = body
        self._forward = forward

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        RUNS[id(self)] = RUNS.get(id(self), 0) + 1
        return self._forward(self.body, h)


def _mlp(b, h):
    return b[1](torch.tanh(b[0](h)))


def _conv(b, h):
    return F.relu(b(h.reshape(1, T, 2, 2))).reshape(T, D)


def _residual_inplace(b, h):
    # torchvision's BasicBlock: a residual added in place to a tensor the block made
    out = F.relu(b[0](h), inplace=True)
    out = b[1](out)
    out += h
    return F.relu(out, inplace=True)


def _groupnorm(b, h):
    return F.silu(b[1](b[0](h)))


def _norm_then_linear(b, h):
    return F.gelu(b[1](b[0](h)))


def _bn(b, h):
    return b[1](b[0](h))


def _bn_maml(b, h):
    # functorch's MAML example: Linear, BatchNorm(momentum=1, track_running_stats=False), ReLU(inplace=True)
    return F.relu(b[1](b[0](h)), inplace=True)


def _embedding(b, h):
    return h + b.emb(b.idx) + b.lin(h)


def _mha(b, h):
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    out, _ = b(h[None], h[None], h[None], attn_mask=mask, need_weights=False)
    return out[0]


def _encoder(b, h):
    return b(h[None])[0]


def _encoder_masked(b, h):
    padding = torch.tensor([[False, False, True]])
    return b(h[None], src_key_padding_mask=padding)[0]


def _rnn(b, h):
    return b(h[None])[0][0]


def _gated(b, h):
    # LLaMA's MLP: down(silu(gate(h)) * up(h))
    return b[2](F.silu(b[0](h)) * b[1](h))


def _seq(b, h):
    return b(h)


def _dropout(b, h):
    return b[1](torch.tanh(b[0](h)))


class _Counting(nn.Module):
    """A module that counts its calls in a plain attribute and computes with the count."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.calls = 0

    def forward(self, h):
        self.calls += 1
        return torch.tanh(self.lin(h)) / self.calls


def _counting(b, h):
    return b(h)


def _maml_conv(b, h):
    # functorch's MAML example: Conv2d, BatchNorm2d(momentum=1, track_running_stats=False), ReLU(inplace), MaxPool2d
    out = b[2](F.relu(b[1](b[0](h.reshape(1, T, 2, 2))), inplace=True))
    return out.reshape(T, 1).expand(T, D) * h


def _relu_in_place_first(b, h):
    # the block's own input updated in place (nn.ReLU(inplace=True) first in the block)
    return b(F.relu(h, inplace=True))


class _Logging(nn.Module):
    """A module that appends to a plain list it holds, and reads its length."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.log: List[int] = []

    def forward(self, h):
        self.log.append(len(self.log))
        return torch.tanh(self.lin(h)) * (1.0 + 0.1 * len(self.log))


class _Timestep(nn.Module):
    """A shared module whose timestep the model sets before each call, as a NumPy scalar."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.t = 0.0

    def forward(self, h):
        return torch.tanh(self.lin(h) * float(self.t))


def _grad_mode_branch(b, h):
    # nn.TransformerEncoder's fast path in miniature: another computation where grad mode is off
    return torch.tanh(b(h)) if torch.is_grad_enabled() else torch.sin(b(h))


def _requires_grad_branch(b, h):
    # nn.MultiheadAttention's fast-path test in miniature: another computation where the input
    # does not require grad (under a jvp level alone a tensor reads requires_grad=False)
    return torch.tanh(b(h)) if h.requires_grad else torch.sin(b(h))


def _overlapping_outputs(b, h):
    # a block returning a tensor and a view of it (a CLS-token pooling: hidden, hidden[0])
    out = torch.tanh(b(h)) * 1.0
    return out, out[..., :2]


def _writes_one_alias(outputs):
    # the caller updates the view in place: without checkpointing the write reaches the other output
    out, view = outputs
    view.mul_(2.0)
    return out


def _view_of_input(b, h):
    # nn.Flatten / nn.Unflatten / an einops rearrange in a checkpointed segment: a view of the input
    return b(h).view(D, T).view(T, D)


def _embedding_body(max_norm=None):
    body = nn.Module()
    body.emb = nn.Embedding(5, D, max_norm=max_norm)
    body.lin = nn.Linear(D, D)
    body.register_buffer("idx", torch.tensor([0, 3, 1]))
    return body


def _bn_eval_body():
    body = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)).eval()
    body[1].running_mean.uniform_(-0.5, 0.5)
    body[1].running_var.uniform_(0.5, 1.5)
    return body


def _encoder_layer(train: bool):
    layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0, batch_first=True)
    return layer.train(train)


KINDS: Dict[str, Kind] = {
    "mlp": Kind(lambda: Block(nn.Sequential(nn.Linear(D, 2 * D), nn.Linear(2 * D, D)), _mlp)),
    "conv2d": Kind(lambda: Block(nn.Conv2d(T, T, 3, padding=1), _conv)),
    "residual in place": Kind(lambda: Block(nn.Sequential(nn.Linear(D, D), nn.Linear(D, D)), _residual_inplace)),
    "groupnorm": Kind(lambda: Block(nn.Sequential(nn.Linear(D, D), nn.GroupNorm(2, D)), _groupnorm)),
    "layernorm": Kind(lambda: Block(nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D)), _norm_then_linear)),
    "rmsnorm": Kind(lambda: Block(nn.Sequential(nn.RMSNorm(D), nn.Linear(D, D)), _norm_then_linear)),
    "batchnorm eval": Kind(lambda: Block(_bn_eval_body(), _bn)),
    "batchnorm train, no running stats": Kind(lambda: Block(nn.Sequential(
        nn.Linear(D, D), nn.BatchNorm1d(D, momentum=1.0, track_running_stats=False)), _bn_maml)),
    "batchnorm train, running stats": Kind(lambda: Block(nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)), _bn)),
    "embedding": Kind(lambda: Block(_embedding_body(), _embedding)),
    "embedding max_norm": Kind(lambda: Block(_embedding_body(max_norm=1.0), _embedding)),
    "multihead attention": Kind(lambda: Block(nn.MultiheadAttention(D, 2, batch_first=True), _mha)),
    "multihead attention, eval": Kind(lambda: Block(nn.MultiheadAttention(D, 2, batch_first=True).eval(), _mha)),
    "transformer layer, train": Kind(lambda: Block(_encoder_layer(True), _encoder)),
    "transformer layer, eval, padding mask": Kind(lambda: Block(_encoder_layer(False), _encoder_masked)),
    "lstm": Kind(lambda: Block(nn.LSTM(D, D, batch_first=True), _rnn)),
    "gru": Kind(lambda: Block(nn.GRU(D, D, batch_first=True), _rnn)),
    "silu gated mlp": Kind(lambda: Block(nn.ModuleList([nn.Linear(D, 2 * D), nn.Linear(D, 2 * D),
                                                        nn.Linear(2 * D, D)]), _gated)),
    "gelu mlp": Kind(lambda: Block(nn.Sequential(nn.Linear(D, 2 * D), nn.GELU("tanh"), nn.Linear(2 * D, D)), _seq)),
    "dropout": Kind(lambda: Block(nn.Sequential(nn.Linear(D, D), nn.Dropout(0.3)), _dropout), random=True),
    "call counter": Kind(lambda: Block(_Counting(), _counting)),
    "conv, batchnorm, relu in place, maxpool (MAML's)": Kind(lambda: Block(nn.Sequential(
        nn.Conv2d(T, T, 1), nn.BatchNorm2d(T, momentum=1.0, track_running_stats=False), nn.MaxPool2d(2)), _maml_conv)),
    "relu in place first": Kind(lambda: Block(nn.Linear(D, D), _relu_in_place_first)),
    "appends to a list it holds": Kind(lambda: Block(_Logging(), _counting)),
    "numpy timestep set before each call": Kind(lambda: Block(_Timestep(), _counting)),
    "branches on grad mode": Kind(lambda: Block(nn.Linear(D, D), _grad_mode_branch)),
    "branches on requires_grad": Kind(lambda: Block(nn.Linear(D, D), _requires_grad_branch)),
    "returns a view of its input": Kind(lambda: Block(nn.Identity(), _view_of_input)),
    "returns overlapping outputs, caller writes one": Kind(
        lambda: Block(nn.Linear(D, D), _overlapping_outputs), caller=_writes_one_alias,
    ),
}


# --------------------------------------------------------------------------
# ways in: how the checkpointed call reaches the block's tensors, and what checkpoints it


def _apply(module, h):
    return module(h)


def _call_with_parameters(block, names, h, *tensors):
    return functional_call(block, dict(zip(names, tensors)), (h,))


def _checkpointed(ckpt: Callable[..., Any], block: nn.Module, access: str, h: torch.Tensor) -> torch.Tensor:
    if access in ("module", "functional_call", UNDER_NO_GRAD, *meta_learning.LIBRARIES):
        return ckpt(block, h)
    if access == "closure":
        return ckpt(lambda t: block(t), h)
    if access == "module as argument":
        return ckpt(_apply, block, h)
    if access == "argument":  # the block's parameters (the swapped ones, under functional_call) as arguments
        names = [name for name, _ in block.named_parameters()]
        tensors = [tensor for _, tensor in block.named_parameters()]
        return ckpt(functools.partial(_call_with_parameters, block, names), h, *tensors)
    raise ValueError(access)


#: the first block called under ``torch.no_grad()``, its output added to its input (a constant to
#: every level of every transform: ``GradInterpreter.lower`` passes the mode down), the second as usual
UNDER_NO_GRAD = "first block under no_grad"
ACCESS = ("functional_call", "module", "closure", "module as argument", "argument", UNDER_NO_GRAD,
          *meta_learning.LIBRARIES)


def _nr(function, *args):
    return torch_checkpoint(function, *args, use_reentrant=False)


def _r(function, *args):
    return torch_checkpoint(function, *args, use_reentrant=True)


def _plain(function, *args):
    return function(*args)


# save policies (selective checkpointing): torch's own API since 2.5, its compile-only form before
_aten = torch.ops.aten
#: the matrix's matmuls: what a "save matmuls" policy keeps (JAX's dots_saveable)
MATMULS = frozenset({_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default})


def _save_policy_context(keep: Callable[[Any], bool]) -> Any:
    """A ``context_fn`` for torch's selective checkpointing that saves the ops ``keep`` says."""
    import torch.utils.checkpoint as tuc

    if hasattr(tuc, "create_selective_checkpoint_contexts"):
        def policy(ctx, op, *args, **kwargs):
            return tuc.CheckpointPolicy.MUST_SAVE if keep(op) else tuc.CheckpointPolicy.PREFER_RECOMPUTE

        return functools.partial(tuc.create_selective_checkpoint_contexts, policy)
    return functools.partial(tuc._pt2_selective_checkpoint_context_fn_gen, lambda mode, op, *a, **k: keep(op))


def _names_context(*names: str) -> Any:
    """A ``context_fn`` applying ``checkpoint_policies.save_only_these_names(*names)`` (torch 2.4: its private form)."""
    import torch.utils.checkpoint as tuc

    from ckpt_guard.checkpoint_policies import save_only_these_names

    policy = save_only_these_names(*names)
    if hasattr(tuc, "create_selective_checkpoint_contexts"):
        return functools.partial(tuc.create_selective_checkpoint_contexts, policy)
    return functools.partial(tuc._pt2_selective_checkpoint_context_fn_gen, policy)


def _naming_outputs(function: Any) -> Any:
    """``function`` with each tensor it returns named "out" (``ckpt_guard.checkpoint_name``)."""
    def named(*args):
        return torch.utils._pytree.tree_map(
            lambda t: ckpt_guard.checkpoint_name(t, "out") if isinstance(t, torch.Tensor) else t, function(*args)
        )

    return named


SAVE_MATMULS = _save_policy_context(lambda op: op in MATMULS)
SAVE_EVERYTHING = _save_policy_context(lambda op: True)


def _save_matmuls(function, *args):
    return ckpt_guard.checkpoint(function, *args, context_fn=SAVE_MATMULS)


#: a naming policy (JAX's save_only_these_names): the entry names every block's output "out"
SAVE_NAMED = _names_context("out")


def _save_named(function, *args):
    return ckpt_guard.checkpoint(_naming_outputs(function), *args, context_fn=SAVE_NAMED)


def _nr_save_everything(function, *args):
    return torch_checkpoint(function, *args, use_reentrant=False, context_fn=SAVE_EVERYTHING)


#: entry -> (policy, the checkpoint function the blocks are called through)
ENTRIES: Dict[str, Tuple[str, Any]] = {
    "ckpt_guard.checkpoint, strict": ("strict", ckpt_guard.checkpoint),
    "ckpt_guard.checkpoint, fallback": ("fallback", ckpt_guard.checkpoint),
    "torch checkpoint (non-reentrant), fallback": ("fallback", _nr),
    "torch checkpoint (reentrant), fallback": ("fallback", _r),
    "torch checkpoint_sequential, fallback": ("fallback", "sequential"),
    "nested ckpt_guard.checkpoint, fallback": ("fallback", "nested"),
    "recursive ckpt_guard.checkpoint, strict": ("strict", "recursive"),
    "ckpt_guard.checkpoint nested 4 deep, fallback": ("fallback", "deep"),
    "ckpt_guard.checkpoint, save matmuls, strict": ("strict", _save_matmuls),
    "ckpt_guard.checkpoint, save named, strict": ("strict", _save_named),
    "torch checkpoint (non-reentrant), save everything, fallback": ("fallback", _nr_save_everything),
}
#: the entries with a save policy (a conformance axis of their own: issue 31)
POLICY_ENTRIES = (
    "ckpt_guard.checkpoint, save matmuls, strict", "ckpt_guard.checkpoint, save named, strict",
    "torch checkpoint (non-reentrant), save everything, fallback",
)



class Net(nn.Module):
    def __init__(self, kind: str, access: str, entry: str, inside: Optional[str] = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([KINDS[kind].make() for _ in range(2)])
        self.caller = KINDS[kind].caller
        self.access, self.inside = access, inside
        self.ckpt: Any = _plain  # set per run
        self.entry = entry

    def _block_fn(self, block: nn.Module) -> nn.Module:
        return block if self.inside is None else _Inside(block, self.inside)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + 0.0  # a tensor of the model's own (a block may update its input in place, as after a stem)
        ckpt = self.ckpt
        if ENTRIES[self.entry][1] == "deep":  # checkpointed or not, the same four blocks in turn
            return self._nested(h, DEPTH)
        if ckpt == "sequential":
            return checkpoint_sequential(nn.Sequential(*map(self._block_fn, self.blocks)), 2, h, use_reentrant=False)
        if ckpt == "nested":
            def pair(t):
                for i, block in enumerate(self.blocks):
                    self._set_timestep(block, i)
                    t = self._through(ckpt_guard.checkpoint, i, block, t)
                return t
            return ckpt_guard.checkpoint(pair, h)
        if ckpt == "recursive":
            return ckpt_guard.checkpoint(self._recursive, h, len(self.blocks))
        if ckpt == "deep":
            return self._nested(h, DEPTH)
        for i, block in enumerate(self.blocks):
            self._set_timestep(block, i)
            h = self._through(ckpt, i, block, h)
        return h

    def _through(self, ckpt: Any, i: int, block: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """Block ``i`` on ``h``, checkpointed by ``ckpt`` the cell's way in (and what the caller does
        with the outputs)."""
        if self.access == UNDER_NO_GRAD and i == 0:
            with torch.no_grad():
                constant = self._use(_checkpointed(ckpt, self._block_fn(block), self.access, h))
            return h + constant
        return self._use(_checkpointed(ckpt, self._block_fn(block), self.access, h))

    def _use(self, outputs: Any) -> torch.Tensor:
        return outputs if self.caller is None else self.caller(outputs)

    def _nested(self, h: torch.Tensor, depth: int) -> torch.Tensor:
        """``DEPTH`` checkpoints nested in one another, the blocks taken in turn: each a closure over
        the next (``nest``, which calls itself: a block that reaches itself through its closure) and
        over the blocks' parameters, read once before the first call (the tensors a transform
        differentiates, reached through ``nest``'s closure at every depth)."""
        checkpointed = self.ckpt == "deep"
        weights_of = [dict(block.named_parameters()) for block in self.blocks]  # read once, here

        def nest(t, d):
            if d == 0:
                return t
            i = (DEPTH - d) % len(self.blocks)
            block, weights = self._block_fn(self.blocks[i]), weights_of[i]

            def level(u):
                return nest(self._use(functional_call(block, weights, (u,)) if weights else block(u)), d - 1)

            return ckpt_guard.checkpoint(level, t) if checkpointed else level(t)

        return nest(h, depth)

    @staticmethod
    def _set_timestep(block: nn.Module, i: int) -> None:
        for module in block.modules():
            if isinstance(module, _Timestep):
                import numpy

                module.t = numpy.float64(0.5 + i)

    def _recursive(self, h, n):
        """A block that checkpoints the rest of the model inside itself (``ck(block, h, n - 1)``)."""
        block = self.blocks[len(self.blocks) - n]
        self._set_timestep(block, len(self.blocks) - n)
        h = self._through(_plain, len(self.blocks) - n, block, h)
        if n > 1:
            h = ckpt_guard.checkpoint(self._recursive, h, n - 1)
        return h


class _Inside(nn.Module):
    """The block with a torch.func transform inside it (forces as -dE/dh; a vmap over copies)."""

    def __init__(self, block: nn.Module, how: str) -> None:
        super().__init__()
        self.block, self.how = block, how

    def forward(self, h):
        if self.how == "grad":
            return h - 0.1 * grad(lambda u: self.block(u).pow(2).sum())(h)
        return vmap(self.block)(torch.stack([h, 0.5 * h])).sum(0)


# --------------------------------------------------------------------------
# transforms: what a cell computes, given the model as functions of (params, x)

W_OUT = torch.linspace(-1.0, 1.0, T * D, dtype=DTYPE).reshape(T, D)


@dataclasses.dataclass
class Program:
    """The model as the transforms see it, and the data.

    As in torch.func's tutorials, the parameters and the buffers are both
    arguments of the function transformed (``functional_call(net, (p, b), x)``);
    only the parameters and the input are ever differentiated.
    """

    net: Net
    params: Dict[str, torch.Tensor]  # the transforms' parameters (empty: the module keeps its own)
    buffers: Dict[str, torch.Tensor]
    x: torch.Tensor  # one sample (T, D)
    xs: torch.Tensor  # a batch (BATCH, T, D)
    v: torch.Tensor  # a direction in x's space

    def features(self, p, b, x):
        if not p:
            return self.net(x)
        return functional_call(self.net, (p, b), (x,))

    def loss(self, p, b, x):
        return (torch.tanh(self.features(p, b, x)) * W_OUT).sum()

    def vector(self, p, b, x):
        return self.features(p, b, x).mean(0)


def _sq(tree) -> torch.Tensor:
    return sum(t.pow(2).sum() for t in torch.utils._pytree.tree_leaves(tree))


def _t_grad(pr):
    return grad(pr.loss, argnums=(0, 2))(pr.params, pr.buffers, pr.x)


def _t_vmap_grad(randomness):
    def run(pr):
        per_sample = grad(pr.loss, argnums=(0, 2))
        return vmap(per_sample, in_dims=(None, None, 0), randomness=randomness)(pr.params, pr.buffers, pr.xs)
    return run


def _t_jacrev(pr):
    return jacrev(pr.vector, argnums=2)(pr.params, pr.buffers, pr.x)


def _t_jacfwd(pr):
    return jacfwd(pr.vector, argnums=2, randomness="different")(pr.params, pr.buffers, pr.x)


def _t_hessian(pr):
    return hessian(pr.loss, argnums=2)(pr.params, pr.buffers, pr.x)


def _t_jvp(pr):
    return jvp(lambda x: pr.vector(pr.params, pr.buffers, x), (pr.x,), (pr.v,))


def _t_jvp_grad(pr):
    return jvp(lambda x: grad(pr.loss, argnums=2)(pr.params, pr.buffers, x), (pr.x,), (pr.v,))


def _t_vjp_grad(pr):
    _, pullback = vjp(lambda x: grad(pr.loss, argnums=2)(pr.params, pr.buffers, x), pr.x)
    return pullback(pr.v)


def _t_grad_grad(pr):
    def norm_of_gradient(p, b, x):
        return _sq(grad(pr.loss, argnums=(0, 2))(p, b, x))
    return grad(norm_of_gradient, argnums=(0, 2))(pr.params, pr.buffers, pr.x)


def _t_linearize(pr):
    _, jvp_fn = linearize(lambda x: pr.vector(pr.params, pr.buffers, x), pr.x)
    return jvp_fn(pr.v)


def _eager_leaves(pr) -> List[torch.Tensor]:
    """What an eager ``.backward()`` differentiates: the parameters, or the module's own."""
    return list(pr.params.values()) if pr.params else [p for p in pr.net.parameters()]


def _backward_grads(pr, total, extra: Tuple[torch.Tensor, ...] = (), leaves: Optional[list] = None) -> List[torch.Tensor]:
    leaves = [*(_eager_leaves(pr) if leaves is None else leaves), *extra]
    total.backward()
    # which leaves autograd left without a gradient (None: an optimizer skips them), then the gradients
    untouched = torch.tensor([t.grad is None for t in leaves])
    return [untouched, *(torch.zeros_like(t) if t.grad is None else t.grad for t in leaves)]


def _t_jvp_backward(pr):
    # a MeanFlow loss: the value and its tangent, then an eager backward
    out, tangent = jvp(lambda x: pr.vector(pr.params, pr.buffers, x), (pr.x,), (pr.v,))
    return [out, tangent, *_backward_grads(pr, out.sum() + tangent.pow(2).sum())]


def _t_jvp_grad_backward(pr):
    # a Hessian-vector product, then an eager backward into the parameters and the input (a
    # curvature penalty): the derivative of forward over reverse differentiated by eager autograd
    x = pr.x.detach().requires_grad_()
    g, hvp = jvp(lambda u: grad(pr.loss, argnums=2)(pr.params, pr.buffers, u), (x,), (pr.v,))
    grads = _backward_grads(pr, hvp.pow(2).sum() + (g * hvp).sum(), extra=[x])
    return [g, hvp, *grads]


def _t_dual_backward(pr):
    # eager forward-mode AD (torch.autograd.forward_ad, no torch.func): a dual input, then an eager
    # backward through the value and its tangent, inside the dual level
    with torch.autograd.forward_ad.dual_level():
        out = pr.vector(pr.params, pr.buffers, torch.autograd.forward_ad.make_dual(pr.x, pr.v))
        out, tangent = torch.autograd.forward_ad.unpack_dual(out)
        tangent = torch.zeros_like(out) if tangent is None else tangent
        return [out, tangent, *_backward_grads(pr, out.sum() + tangent.pow(2).sum())]


def _t_vmap_backward(pr):
    out = vmap(pr.loss, in_dims=(None, None, 0), randomness="different")(pr.params, pr.buffers, pr.xs)
    return [out, *_backward_grads(pr, out.sum())]


def _t_maml(pr):
    # functorch's MAML example: vmap over tasks, an inner grad step, the outer loss's eager backward
    def task_loss(x_support, x_query):
        g = grad(pr.loss)(pr.params, pr.buffers, x_support)
        fast = {k: w - 0.1 * g[k] for k, w in pr.params.items()}
        return pr.loss(fast, pr.buffers, x_query)

    losses = vmap(task_loss, randomness="different")(pr.xs, pr.xs.flip(0))
    return [losses, *_backward_grads(pr, losses.sum())]


def _t_ensemble(pr):
    # the model-ensembling tutorial: stacked copies of the parameters, vmapped over members
    members = [{k: w.detach() * (1.0 + 0.1 * i) for k, w in pr.params.items()} for i in range(BATCH)]
    stacked = {k: torch.stack([m[k] for m in members]) for k in pr.params}
    return vmap(grad(pr.loss), in_dims=(0, None, None), randomness="different")(stacked, pr.buffers, pr.x)


def _t_inside(pr):  # the outer transform over a block with a transform inside (see Net.inside)
    return _t_grad(pr)


def _t_eager_backward(pr):
    # a plain training step: no torch.func at all (torch's own checkpoint recomputes, guarded)
    total = pr.loss(pr.params, pr.buffers, pr.x)
    return [total, *_backward_grads(pr, total)]


def _loss_of(model, x):
    return (torch.tanh(model(x)) * W_OUT).sum()


def _t_meta(second_order: bool):
    def run(pr):
        return meta_learning.meta_step(pr, second_order, pr.net.access, _loss_of, _backward_grads)
    return run


#: eager forward-mode AD, no torch.func (found by the fuzzer: a dual input reached torch's recompute detached)
DUAL_THEN_BACKWARD = "forward AD (dual tensors), then .backward()"
TRANSFORMS: Dict[str, Callable[[Program], Any]] = {
    "grad": _t_grad,
    "vmap(grad), randomness same": _t_vmap_grad("same"),
    "vmap(grad), randomness different": _t_vmap_grad("different"),
    "jacrev": _t_jacrev,
    "jacfwd": _t_jacfwd,
    "hessian": _t_hessian,
    "jvp": _t_jvp,
    "jvp(grad)": _t_jvp_grad,
    "vjp(grad)": _t_vjp_grad,
    "grad(grad)": _t_grad_grad,
    "linearize": _t_linearize,
    "jvp, then .backward()": _t_jvp_backward,
    "jvp(grad), then .backward()": _t_jvp_grad_backward,
    "vmap, then .backward()": _t_vmap_backward,
    DUAL_THEN_BACKWARD: _t_dual_backward,
    "MAML": _t_maml,
    "ensemble (stack_module_state)": _t_ensemble,
    "grad inside the block": _t_inside,
    "vmap inside the block": _t_inside,
    "eager .backward()": _t_eager_backward,
    "meta step, first order": _t_meta(False),
    "meta step, second order": _t_meta(True),
}
#: eager meta-learning steps: the only transforms a meta-learning library's way in takes
META_TRANSFORMS = ("meta step, first order", "meta step, second order")

#: transforms that differentiate no reverse mode: nothing for a checkpoint to save
FORWARD_ONLY = frozenset({"jvp", "jacfwd", "linearize"})
#: transforms that need the parameters as the transform's inputs
OVER_PARAMETERS = frozenset({"MAML", "ensemble (stack_module_state)"})

# --------------------------------------------------------------------------
# running a cell


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str
    transform: str
    access: str
    entry: str
    #: how the program runs: eagerly (""), or under ``torch.compile`` with this backend (``COMPILED``)
    compiled: str = ""

    def label(self) -> str:
        where = f" | compiled, {self.compiled}" if self.compiled else ""
        return f"{self.kind} | {self.transform} | {self.access} | {self.entry}{where}"


@dataclasses.dataclass
class Outcome:
    verdict: str  # checkpointed | plain | refused | n/a | WRONG | CRASH
    detail: str = ""
    refusal: str = ""  # the refusal class, where it ran plainly or was refused

    @property
    def failed(self) -> bool:
        return self.verdict in ("WRONG", "CRASH")


_TEMPLATES: Dict[Tuple[str, str, str, Optional[str]], Net] = {}


def _fresh_net(cell: Cell) -> Net:
    inside = {"grad inside the block": "grad", "vmap inside the block": "vmap"}.get(cell.transform)
    key = (cell.kind, cell.access, cell.entry, inside)
    if key not in _TEMPLATES:
        torch.manual_seed(0)
        _TEMPLATES[key] = Net(cell.kind, cell.access, cell.entry, inside).to(DTYPE)
    net = copy.deepcopy(_TEMPLATES[key])
    return net


def _program(cell: Cell, ckpt: Any) -> Program:
    net = _fresh_net(cell)
    net.ckpt = ckpt
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(BATCH, T, D, dtype=DTYPE, generator=generator)
    v = torch.randn(T, D, dtype=DTYPE, generator=generator)
    if cell.access == "module" or cell.access in meta_learning.LIBRARIES:  # the module keeps its own
        params, buffers = {}, {}
    else:
        params = {k: w.detach().clone().requires_grad_() for k, w in net.named_parameters()}
        buffers = {k: b.detach().clone() for k, b in net.named_buffers()}
    return Program(net, params, buffers, xs[0].clone(), xs, v)


def _leaves(value) -> List[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _execute(cell: Cell, ckpt: Any, compiled: str = "") -> Tuple[List[torch.Tensor], int]:
    """The cell's results (see the module docstring) and how many times its blocks' Python ran;
    ``compiled``: the whole program (the transform included) under ``torch.compile`` with that backend."""
    RUNS.clear()
    program = _program(cell, ckpt)
    run = TRANSFORMS[cell.transform]
    if compiled:
        _fresh_compiler()
        run = torch.compile(run, backend=compiled)
    torch.manual_seed(2)
    results = []
    for _ in range(2):  # two steps: the second reads what the first kept of each block (_composable.shapes)
        results += [r.detach().clone() for r in _leaves(run(program))]
    after = [torch.rand(1, dtype=DTYPE)]  # the global RNG as the program leaves it
    after += [b.detach().clone() for b in program.net.buffers()]
    after += [b.detach().clone() for b in program.buffers.values()]
    counters = [m.calls for m in program.net.modules() if isinstance(m, _Counting)]
    counters += [len(m.log) for m in program.net.modules() if isinstance(m, _Logging)]
    after += [torch.tensor(float(c)) for c in counters]
    return results + after, sum(RUNS.values())


def _fresh_compiler() -> None:
    """dynamo's caches, and fake tensors' (a compile that failed under a forward-mode transform left
    entries there that made the next cell's compile fail: measured on torch 2.13)."""
    torch._dynamo.reset()
    from torch._subclasses.fake_tensor import FakeTensorMode

    clear = getattr(FakeTensorMode, "cache_clear", None)
    if clear is not None:
        clear()


def _compare(got: List[torch.Tensor], reference: List[torch.Tensor]) -> str:
    if len(got) != len(reference):
        return f"{len(got)} results against {len(reference)}"
    for i, (g, r) in enumerate(zip(got, reference)):
        try:
            torch.testing.assert_close(g, r, equal_nan=True)
        except AssertionError as exc:
            first = str(exc).strip().splitlines()
            return f"result {i}: {' '.join(first[:3])}"
    return ""


def refusal_reason(text: str) -> str:
    for marker in ("could not use its composable recompute here: ", "could not be used, because "):
        if marker in text:
            return text.split(marker, 1)[1].split("\n", 1)[0]
    return text.split("\n", 1)[0]


def refusal_class(text: str) -> str:
    """The refusal class a message names (``_composable.REFUSAL_CLASSES``), or what else it is."""
    match = re.search(r"\(refusal class ([a-z-]+),", text)
    if match:
        return match.group(1)
    if _composable.NOTHING_TO_SAVE in text:
        return "forward-only"
    rule = re.match(r"\[(CKG\d+)\]", text.strip())
    if rule:  # a rule of the guard's table decided what ran (its fallback, or strict's explanation)
        return f"rule {rule.group(1)}"
    return "unclassified"


def run_cell(cell: Cell) -> Outcome:
    # torch's own selective checkpointing under linearize (make_fx) writes torch.fx.traceback's
    # process-wide current_meta and leaves it ({'ac_graph_id': None, 'recompute': ...}, measured on
    # torch 2.13 without ckpt_guard); a later torch.compile of a checkpoint with aot_eager then
    # fails comparing None with an int. Each cell leaves that dict as it found it.
    import torch.fx.traceback as fx_traceback

    if cell.compiled and _COMPILED_CELLS_APART and not IN_A_FRESH_PROCESS[0]:
        # measured on torch 2.15: after the compiled cells ran in this process, a later reentrant checkpoint
        # under torch.device("meta") returned an output without a grad_fn and a composable recompute there
        # read a tensor without storage (tests/test_default_device.py failed after them, passes alone;
        # the cause is not found): there each compiled cell runs in a process of its own
        return _in_a_fresh_process(cell)
    meta = dict(fx_traceback.current_meta)
    if cell.compiled:
        gc.collect()  # what earlier cells left to the collector lands before this one (see below)
    before, keys = process_state.global_state(), process_state.dispatch_keys()
    try:
        outcome = _run_cell(cell)
    finally:
        fx_traceback.current_meta.clear()
        fx_traceback.current_meta.update(meta)
    if cell.compiled:
        # a failed compile leaves its frames in reference cycles, and one of them may hold a C++ guard
        # that puts back, when the collector frees it, the dispatch keys of the moment it was made: collected
        # here, that lands on this cell by name rather than on whichever test runs at the next collection
        gc.collect()
    changed = process_state.put_back_if_changed(before, keys)
    if changed:
        # a cell that leaves process-wide state behind fails by name, and the next cells start clean
        # (at 0d7e5da and e92e4e4, 1,477 and 1,651 later tests ran under a torch.func layer's dispatch keys)
        if outcome.verdict == "n/a" and set(changed) <= set(process_state.DISPATCH_KEY_STATE):
            # torch's own: the uncheckpointed program's compile fails too, and that failure is what
            # leaks (Tensor.__repr__'s guard, see tests/process_state.py; measured on torch 2.13 in six
            # such cells, none where the compile succeeds); the next cells start clean all the same
            return outcome
        return Outcome("CRASH", f"the cell left process-wide state changed (before, after): {changed}")
    if cell.compiled and outcome.failed and COMPILER_FAILED_HERE[0]:
        return _in_a_fresh_process(cell)
    return outcome


#: set in a child process that runs one cell (see _in_a_fresh_process)
IN_A_FRESH_PROCESS = [False]
#: where compiled cells run apart (see run_cell)
_COMPILED_CELLS_APART = tuple(int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) >= (2, 15)


#: set once torch.compile failed on a cell's uncheckpointed program in this process: measured on torch
#: 2.13, a compile that fails inside a forward-mode transform leaves state behind (no TLS, interpreter or
#: dual level left over that could be reset) that makes a later cell's compile fail on fake tensors;
#: a compiled cell failing after that is run again in a fresh process, whose outcome counts
COMPILER_FAILED_HERE = [False]


def _in_a_fresh_process(cell: Cell) -> Outcome:
    import os
    import subprocess

    code = (
        "import json, sys; sys.path.insert(0, {here!r}); import conformance as m\n"
        "m.IN_A_FRESH_PROCESS[0] = True\n"
        "o = m.run_cell(m.Cell(*{fields!r})); print(json.dumps([o.verdict, o.detail, o.refusal]))"
    ).format(here=os.path.dirname(os.path.abspath(__file__)), fields=dataclasses.astuple(cell))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    try:
        verdict, detail, refusal = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Outcome("CRASH", f"a fresh process ran it and printed no outcome: {done.stderr[-300:]}")
    return Outcome(verdict, detail, refusal)


def _run_cell(cell: Cell) -> Outcome:
    if cell.access == "module" and cell.transform in OVER_PARAMETERS:
        return Outcome("n/a", "the transform takes the parameters; the module keeps its own here")
    if cell.access in meta_learning.LIBRARIES and cell.transform not in META_TRANSFORMS:
        return Outcome("n/a", "a meta-learning library drives an eager step of its own")
    if (cell.access, cell.transform) == ("torchopt MetaSGD", "meta step, first order"):
        return Outcome("n/a", "torchopt's MetaSGD always differentiates its step (no first order)")
    if cell.entry == "torch checkpoint_sequential, fallback" and cell.access != "module":
        return Outcome("n/a", "checkpoint_sequential takes modules")
    if cell.entry == "torch checkpoint_sequential, fallback" and KINDS[cell.kind].caller is not None:
        return Outcome("n/a", "checkpoint_sequential chains the blocks' outputs: no caller between them")
    policy, ckpt = ENTRIES[cell.entry]
    was_installed = ckpt_guard.is_installed()
    try:  # the reference: the same program, neither compiled nor checkpointed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reference, reference_runs = _execute(cell, _plain)
    except Exception as exc:  # noqa: BLE001 - the plain code raises: the guarded run must not return numbers
        reference, reference_error = None, exc
    before = _composable.counters.RECOMPUTES, _composable.counters.PACKED
    crash: Optional[BaseException] = None
    refusal = ""
    ckpt_guard.install(policy, rules={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got, runs = _execute(cell, ckpt, cell.compiled)
            except CheckpointCompositionError as exc:
                if reference is None:
                    return Outcome("n/a", f"the plain code raises {type(reference_error).__name__}")
                if policy != "strict":
                    return Outcome("CRASH", f"{policy} raised {exc.rule.id}: {_short(exc)}")
                return Outcome("refused", f"{exc.rule.id}: {refusal_reason(str(exc))[:300]}", refusal_class(str(exc)))
            except Exception as exc:  # noqa: BLE001
                if reference is None:
                    return Outcome("n/a", f"the plain code raises {type(reference_error).__name__}")
                crash = exc
    finally:
        ckpt_guard.uninstall()
        if crash is not None:  # torch's own refusal, measured with the guard uninstalled
            refusal = _torchs_own_refusal(cell, ckpt, crash)
        if was_installed:
            ckpt_guard.install("strict", rules={})
    if crash is not None:
        if refusal:
            return Outcome("n/a", refusal)
        return Outcome("CRASH", f"{type(crash).__name__}: {_short(crash)}")
    if reference is None:
        return Outcome("WRONG", f"the plain code raises {type(reference_error).__name__}: "
                                f"{_short(reference_error)}, the checkpointed one returned numbers")
    wrong = _compare(got, reference)
    if wrong and cell.compiled and _compiler_changes_the_numbers(cell, reference, got):
        return Outcome("n/a", "torch.compile gives other numbers for the uncheckpointed program too (torch's own); "
                              "the checkpointed one gives the compiled program's")
    if wrong:
        return Outcome("WRONG", wrong)
    # the forward kept no activations: packed into the recompute (which ran, if a backward did),
    # or torch's own checkpoint recomputed
    recomputed = runs > reference_runs or (_composable.counters.RECOMPUTES, _composable.counters.PACKED) != before
    if recomputed:
        return Outcome("checkpointed")
    words = " ".join(str(w.message) for w in caught if issubclass(w.category, ckpt_guard.CheckpointCompositionWarning))
    if not words:  # ckpt_guard.checkpoint keeps the plain run, quietly, where nothing could be saved
        return Outcome("plain", "no reverse mode: nothing to save", "forward-only")
    return Outcome("plain", refusal_reason(words)[:300], refusal_class(words))


#: torch's own loud refusals of a checkpoint variant, by design, each naming its fix: a cell whose
#: guarded run ends in one is n/a where torch alone, unguarded, raises too (measured, never assumed)
TORCH_REFUSALS = {
    "incompatible with .grad()": "torch's reentrant checkpoint refuses torch.autograd.grad (its documented "
                                 "limit; its error names use_reentrant=False)",
    "selective activation checkpoint has been mutated": "torch's selective checkpointing refuses a block that "
                                                         "writes in place into a tensor its policy saved (its own check)",
}


def _torchs_own_refusal(cell: Cell, ckpt: Any, exc: BaseException) -> str:
    """The reason, where ``exc`` is one of :data:`TORCH_REFUSALS` and torch alone raises it too, or where
    the compiled program fails to compile without checkpointing too (measured, the guard uninstalled)."""
    text = str(exc)
    found = next((why for marker, why in TORCH_REFUSALS.items() if marker in text), "")
    if cell.compiled and not found:  # torch.compile itself refusing the program (a .backward() in fullgraph)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _execute(cell, _plain, cell.compiled)
        except Exception as plain:  # noqa: BLE001
            COMPILER_FAILED_HERE[0] = True
            return f"torch.compile refuses the uncheckpointed program too: {type(plain).__name__}"
        if ckpt is _nr and _same_crash_without_the_guard(cell, exc):
            # dynamo traces torch's public checkpoint as its own higher-order op, which the guard never
            # replaces, and fails there under some transforms (forward mode; backend "eager" faking a
            # functorch-wrapped tensor) before any code of the guard runs; ckpt_guard.checkpoint's cells are right
            return f"dynamo fails tracing torch's checkpoint under this transform (torch's own crash, at trace " \
                   f"time, the same without the guard: {type(exc).__name__})"
        return ""
    if not found or ckpt_guard.is_installed():
        return ""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _execute(cell, ckpt, cell.compiled)
    except Exception:  # noqa: BLE001 - torch alone refuses this program too (loudly, never a number)
        return found
    return ""


def _compiler_changes_the_numbers(cell: Cell, reference: List[torch.Tensor], got: List[torch.Tensor]) -> bool:
    """Whether the same program compiled, uncheckpointed and unguarded, differs from the eager reference
    (measured on torch 2.4.1: ``torch.compile(jacrev(...))`` of a BatchNorm in eval, aot_eager) and the
    checkpointed run gives what it gives (the guard changed nothing of the compiled program's numbers)."""
    was_installed = ckpt_guard.is_installed()
    ckpt_guard.uninstall()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled, _ = _execute(cell, _plain, cell.compiled)
    except Exception:  # noqa: BLE001 - a compile that fails here is not this question's answer
        return False
    finally:
        if was_installed:
            ckpt_guard.install("strict", rules={})
    return bool(_compare(compiled, reference)) and not _compare(got, compiled)


def _same_crash_without_the_guard(cell: Cell, exc: BaseException) -> bool:
    """Whether torch's checkpoint, the guard uninstalled, fails this compiled cell with the same error."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _execute(cell, _nr, cell.compiled)
    except Exception as alone:  # noqa: BLE001
        return type(alone) is type(exc) and _short(alone)[:80] == _short(exc)[:80]
    return False


def _short(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:240]


# --------------------------------------------------------------------------
# which cells: the full cross where it matters most, pairwise for the rest

MAIN_ENTRIES = ("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback",
                "torch checkpoint (non-reentrant), fallback", *POLICY_ENTRIES)


def _pairwise(axes: List[Tuple[str, ...]]) -> List[Tuple[str, ...]]:
    """A small set of rows covering every pair of values of any two axes (greedy, deterministic)."""
    uncovered = {
        (i, a, j, b)
        for i, j in itertools.combinations(range(len(axes)), 2)
        for a in axes[i] for b in axes[j]
    }
    rows = []
    while uncovered:
        best, best_count = None, -1
        # seed with the first uncovered pair, then choose the remaining values greedily
        i0, a0, j0, b0 = min(uncovered)
        row: List[Optional[str]] = [None] * len(axes)
        row[i0], row[j0] = a0, b0
        for k in range(len(axes)):
            if row[k] is not None:
                continue
            choice, choice_count = None, -1
            for value in axes[k]:
                count = sum(
                    1 for m in range(len(axes)) if row[m] is not None
                    for key in [((m, row[m], k, value) if m < k else (k, value, m, row[m]))] if key in uncovered
                )
                if count > choice_count:
                    choice, choice_count = value, count
            row[k] = choice
        covered = {
            (i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(axes)), 2)
        } & uncovered
        uncovered -= covered
        rows.append(tuple(row))
        del best, best_count
    return rows


def cells() -> List[Cell]:
    found: Dict[Cell, None] = {}
    for kind in KINDS:
        for transform in TRANSFORMS:
            for entry in MAIN_ENTRIES:
                found[Cell(kind, transform, "functional_call", entry)] = None
    for kind in KINDS:  # every transform over a block called under no_grad (the grad levels' modes)
        for transform in TRANSFORMS:
            found[Cell(kind, transform, UNDER_NO_GRAD, "ckpt_guard.checkpoint, strict")] = None
    for kind, transform, access, entry in _pairwise([tuple(KINDS), tuple(TRANSFORMS), ACCESS, tuple(ENTRIES)]):
        found[Cell(kind, transform, access, entry)] = None
    for kind in KINDS:  # an eager step through every way in, both doors (found: a module passed as an
        for access in ("closure", "module as argument", "argument", UNDER_NO_GRAD):  # argument was unseen)
            for entry in LIBRARY_ENTRIES:
                found[Cell(kind, "eager .backward()", access, entry)] = None
    for kind in KINDS:  # eager forward AD on the module's own parameters (under functional_call's swap
        for entry in LIBRARY_ENTRIES:  # an eager backward is CKG101's), through both doors
            found[Cell(kind, DUAL_THEN_BACKWARD, "module", entry)] = None
    for kind in KINDS:  # every kind through each meta-learning library, both orders, both doors
        for access in meta_learning.LIBRARIES:
            for transform in META_TRANSFORMS:
                for entry in LIBRARY_ENTRIES:
                    found[Cell(kind, transform, access, entry)] = None
    # the compile axis: a pairwise cover of kinds x transforms x entries x backends ("eager" and
    # "aot_eager" trace and partition as inductor does, in seconds), and a few inductor cells
    for kind, transform, entry, backend in _pairwise(
        [COMPILED_KINDS, COMPILED_TRANSFORMS, COMPILED_ENTRIES, ("eager", "aot_eager")]
    ):
        found[Cell(kind, transform, "functional_call", entry, backend)] = None
    for kind, transform, entry, backend in INDUCTOR_CELLS:
        found[Cell(kind, transform, "functional_call" if transform != "eager .backward()" else "module", entry,
                   backend)] = None
    return list(found)


#: the compile axis (issue 47): what torch.func users compile, through both doors
COMPILED_KINDS = ("mlp", "layernorm", "gelu mlp", "dropout", "batchnorm eval", "residual in place",
                  "multihead attention", "embedding", "call counter")
COMPILED_TRANSFORMS = ("grad", "vmap(grad), randomness different", "jacrev", "hessian", "jvp(grad)", "vjp(grad)",
                       "eager .backward()", "jvp, then .backward()")
COMPILED_ENTRIES = ("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback",
                    "torch checkpoint (non-reentrant), fallback")
#: inductor takes ~90 s per compile on CI's 2 cores: two cells, one per door
INDUCTOR_CELLS = (("mlp", "grad", "ckpt_guard.checkpoint, fallback", "inductor"),
                  ("mlp", "eager .backward()", "torch checkpoint (non-reentrant), fallback", "inductor"))


#: the entries the meta-learning libraries are crossed with: ckpt_guard.checkpoint and torch's
LIBRARY_ENTRIES = ("ckpt_guard.checkpoint, strict", "ckpt_guard.checkpoint, fallback",
                   "torch checkpoint (non-reentrant), fallback")


# --------------------------------------------------------------------------
# the table in docs/conformance.md

SYMBOLS = {"checkpointed": "✓", "plain": "·", "refused": "R", "n/a": "–"}


def _symbol(outcome: Outcome) -> str:
    if outcome.verdict == "plain" and outcome.refusal == "forward-only":
        return "="
    return SYMBOLS.get(outcome.verdict, "✗")


def documented_refusal_classes(text: str) -> List[str]:
    """The classes docs/limits.md lists under "Refusal classes" (lines ``- `name`: ...``)."""
    section = text.split("## Refusal classes", 1)[1] if "## Refusal classes" in text else ""
    return re.findall(r"^- `([a-z-]+)`:", section, flags=re.M)


def version_section(outcomes: Dict[Cell, Outcome]) -> str:
    """docs/conformance.md's section for the installed torch: counts, two grids, every cell not checkpointed."""
    counts: Dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
    lines = [f"## torch {torch.__version__.split('+')[0]}", ""]
    lines.append(", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items())) + f" ({len(outcomes)} cells)")
    lines.append("")
    for entry in ("ckpt_guard.checkpoint, fallback", "torch checkpoint (non-reentrant), fallback"):
        lines += [f"### {entry}, the block reached through functional_call", ""]
        lines.append("| kind | " + " | ".join(TRANSFORMS) + " |")
        lines.append("|---|" + "---|" * len(TRANSFORMS))
        for kind in KINDS:
            row = [_symbol(outcomes[Cell(kind, t, "functional_call", entry)]) for t in TRANSFORMS]
            lines.append(f"| {kind} | " + " | ".join(row) + " |")
        lines.append("")
    lines += ["### Every cell not checkpointed (refusal class, or why not)", "", "```"]
    for cell, outcome in outcomes.items():
        if outcome.verdict != "checkpointed":
            lines.append(f"{cell.label()}: {outcome.verdict} [{outcome.refusal or outcome.detail}]")
    lines += ["```", ""]
    return "\n".join(lines)


HEADER = """# The conformance matrix

Generated by `python tests/conformance.py --write docs/conformance.md` on each torch CI
runs (one section per release; the suite fails if the installed release's section is
stale). Every cell runs a two-block model of one module kind, differentiated one way
torch.func users do, its blocks reaching their tensors one way and checkpointed through
one entry (`tests/conformance.py` says each in full), twice (two training steps: the
second reads what the first left behind), against the same program without
checkpointing: results, the gradients an eager backward leaves, the global RNG's next
number, every buffer, a module's call counter.

- ✓ checkpointed: equal to the plain code, and the blocks were recomputed (the
  forward kept no activations);
- = plain, nothing to save: no reverse mode differentiates the call (forward mode, a
  forward vmap), so the plain run is the result;
- · plain: equal to the plain code, the block ran once without checkpointing, for a
  refusal of a class listed in [limits.md](limits.md#refusal-classes) (or a rule of the
  guard's table decided so);
- R refused: strict raised `CheckpointCompositionError` naming the class;
- – n/a: the plain code itself raises (the guarded run raises too), or the cell does not
  apply (a transform over parameters where the module keeps its own).

The grids show the full cross of module kinds and transforms for two entries; the list
under them names every cell of all entries and ways in (full cross for the main entries,
a pairwise cover of the rest) that was not checkpointed.

"""


def write_table(path: str, outcomes: Dict[Cell, Outcome]) -> None:
    import os

    sections: Dict[str, str] = {}
    if os.path.exists(path):
        with open(path) as existing:
            text = existing.read()
        for part in re.split(r"^(?=## torch )", text, flags=re.M)[1:]:
            sections[part.split("\n", 1)[0]] = part.rstrip() + "\n"
    section = version_section(outcomes)
    sections[section.split("\n", 1)[0]] = section

    def key(title: str) -> Tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", title))

    with open(path, "w") as out:
        out.write(HEADER + "\n".join(sections[t] for t in sorted(sections, key=key)))


def main(argv: List[str]) -> int:
    import time

    selected = cells()
    if "--kind" in argv:
        want = argv[argv.index("--kind") + 1]
        selected = [c for c in selected if c.kind == want]
    if "--transform" in argv:
        want = argv[argv.index("--transform") + 1]
        selected = [c for c in selected if c.transform == want]
    if "--access" in argv:
        want = argv[argv.index("--access") + 1]
        selected = [c for c in selected if c.access == want]
    counts: Dict[str, int] = {}
    failures = []
    outcomes: Dict[Cell, Outcome] = {}
    started = time.perf_counter()
    for cell in selected:
        t0 = time.perf_counter()
        outcome = outcomes[cell] = run_cell(cell)
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
        if outcome.failed or "-v" in argv:
            print(f"{outcome.verdict:12} {time.perf_counter() - t0:6.2f}s {cell.label()}: {outcome.refusal} {outcome.detail}")
        if outcome.failed:
            failures.append(cell)
    print(json.dumps(counts), f"{len(selected)} cells in {time.perf_counter() - started:.0f} s")
    if "--write" in argv and not failures:
        write_table(argv[argv.index("--write") + 1], outcomes)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
