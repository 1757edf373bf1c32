"""The rule table: one record per known-bad composition, each with a live probe.

A rule is data.  Call-time rules carry a predicate over
:class:`ckpt_guard._state.CallState`; recompute-time (drift) rules carry a
reader, called in the forward and again when the recompute starts, and a way
to render its value as "was → now".  Every rule carries a *probe*: the smallest
program that shows the composition, parameterised by the checkpoint function
to use, so the same program yields the uncheckpointed reference, raw torch's
behaviour and the guarded behaviour (see ``tests/test_rules.py`` and
``python -m ckpt_guard``).  A rule's claim about torch is only as good as its
probe on the installed torch.

Each probe is self-contained on purpose (``python -m ckpt_guard explain ID``
prints its source as the minimal reproduction), so probes here repeat small
pieces such as a mode class rather than share helpers.

Adding a rule means adding one record (and its probe) below.  If it reads
state the table has never read, extend ``CallState`` / ``call_is_quiet`` in
``_state/call.py`` too (a recompute-time read: a reader in ``_state/``, named by the record).

This module does not import torch at import time (``import ckpt_guard`` and the
configuration check need the rule ids without torch); predicates, readers and
probes import it when they run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ._versions import ALL, MEASURED, TorchRange, Version

if TYPE_CHECKING:  # pragma: no cover
    from ._state import CallState

__all__ = [
    "Rule", "RULES", "CALL_RULES", "DRIFT_RULES", "RNG_RULE", "DEVICE_RULE", "NESTED_OUTPUT_RULE", "BUFFER_WRITES_RULE",
    "OFFLOAD_RULE",
    "RULE_IDS",
    "rule_by_id", "rules_on",
]

#: A probe runs one composition with the given checkpoint function and
#: ``use_reentrant`` value (``None``: not passed) and returns tensors to compare.
Probe = Callable[[Callable[..., Any], Optional[bool]], Sequence[Any]]

REENTRANT, NON_REENTRANT = "reentrant", "non-reentrant"


@dataclass(frozen=True)
class Rule:
    """One known-bad composition of checkpointing with its surroundings."""

    id: str
    title: str
    stage: str  # "call" (decided when checkpoint is called), "recompute", or "transform" (at a torch.func transform's entry)
    variants: tuple[str, ...]  # which checkpoint variants the rule is about
    trigger: str
    symptom: str  # what torch does without the guard, in words
    symptom_kind: str  # "raises" or "silently wrong" (per variant: see symptom_by_variant)
    remedy: str
    refs: tuple[str, ...]
    #: why the claim holds where it does (the upstream change behind its range)
    torch_note: str
    probe: Probe = field(repr=False)
    fallback: str = ""  # what the fallback policy runs instead
    #: call stage: what fallback runs, when it is not the usual choice (use_reentrant=False,
    #: the composable recompute or no checkpoint): "no-early-stop"
    fallback_runs: str = ""
    #: False for drift that only the recompute can see: fallback cannot avoid it
    #: and raises as strict does, so messages do not suggest it
    fallback_helps: bool = True
    #: call stage: predicate over CallState
    applies: Optional[Callable[["CallState"], bool]] = field(default=None, repr=False)
    #: recompute stage: the ``_state`` function that reads the state, called in
    #: the forward and again when the recompute starts ...
    read: str = ""
    #: ... and the ``_state`` function that renders one value for "was → now"
    render: str = ""
    #: recompute stage: regex of torch's own error per variant, where it raises
    symptom_by_variant: tuple[tuple[str, str], ...] = ()
    raises_match: str = ""  # regex torch's own error matches (call-stage rules)
    #: the torch releases on which the claim holds, measured; elsewhere the
    #: rule is not evaluated, and its probe is not expected to show the symptom
    torch_range: TorchRange = ALL
    #: call stage: rules that explain this composition better where both fire
    #: (e.g. on torch < 2.12 vmap(grad(checkpoint)) fails at the vmap first)
    yields_to: tuple[str, ...] = ()
    #: the wrong values differ from run to run (read from uninitialised memory): "does what
    #: torch does" means wrong as torch is, not bitwise torch's values
    symptom_varies: bool = False
    #: the probe needs a GPU: its symptom needs a default device other than the
    #: CPU; the matrix runs it on CUDA only, ``measured_on`` says where it was
    needs_gpu: bool = False
    measured_on: tuple[str, ...] = MEASURED
    #: strict and fallback make the recompute right without a word (what they run is the
    #: uncheckpointed program, so there is nothing to refuse); warn reports it, off ignores it
    repaired_quietly: bool = False

    def symptom_for(self, variant: str) -> str:
        """"raises" or "silently wrong" for one variant."""
        return dict(self.symptom_by_variant).get(variant, self.symptom_kind)

    @property
    def always_raises(self) -> bool:
        """Torch raises (loudly) in every variant the rule is about: nothing is silently wrong."""
        return all(self.symptom_for(v) == "raises" for v in self.variants)

    @property
    def composable_helps(self) -> bool:
        """``ckpt_guard.checkpoint``'s composable recompute runs this case correctly, keeping the saving."""
        return "composable recompute" in self.fallback

    def holds_on(self, version: Version) -> bool:
        return version in self.torch_range

    @property
    def torch_versions(self) -> str:
        """Where the claim holds, why, and where it was measured (for docs and ``explain``)."""
        return (
            f"holds on {self.torch_range}: {self.torch_note} (checked against torch "
            f"{', '.join(self.measured_on)}, where it holds and where it does not)"
        )


def _variant_kwargs(use_reentrant: Optional[bool]) -> dict:
    return {} if use_reentrant is None else {"use_reentrant": use_reentrant}


def _grads(*tensors: Any) -> list:
    """Gradients of ``tensors``; a missing gradient reads as zeros (it contributes nothing)."""
    import torch

    return [torch.zeros_like(t) if t.grad is None else t.grad for t in tensors]


# ==========================================================================
# Call-time rules
# ==========================================================================


def _probe_grad_transform(ckpt, use_reentrant):
    """torch.func.grad of a loss with a checkpointed block inside."""
    import torch
    from torch.func import grad

    torch.manual_seed(0)
    w, x = torch.randn(3, 3), torch.randn(4, 3)

    def block(t):
        return torch.tanh(t @ w)

    def loss(t):
        return ckpt(block, t, **_variant_kwargs(use_reentrant)).sum()

    return [grad(loss)(x)]


def _probe_vmap_forward(ckpt, use_reentrant):
    """A checkpointed block under vmap, forward only."""
    import torch
    from torch.func import vmap

    torch.manual_seed(0)
    w, x = torch.randn(3, 3), torch.randn(4, 3)
    return [vmap(lambda t: ckpt(lambda u: torch.tanh(u @ w), t, **_variant_kwargs(use_reentrant)))(x)]


def _probe_vmap_backward(ckpt, use_reentrant):
    """vmap over a checkpointed block whose inputs require grad, backward outside the vmap."""
    import torch
    from torch.func import vmap

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    y = vmap(lambda t: ckpt(lambda u: torch.tanh(u @ w), t, **_variant_kwargs(use_reentrant)))(x)
    y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_forward_ad(ckpt, use_reentrant):
    """Forward-mode AD: a dual tensor goes through a checkpointed block."""
    import torch
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    w, x, tangent = torch.randn(3, 3), torch.randn(4, 3), torch.randn(4, 3)
    with fwAD.dual_level():
        out = ckpt(lambda u: torch.tanh(u @ w), fwAD.make_dual(x, tangent), **_variant_kwargs(use_reentrant))
        primal, jvp = fwAD.unpack_dual(out)
    return [primal, jvp]


def _probe_forward_ad_held(ckpt, use_reentrant):
    """Forward-mode AD over the weights: the block holds a dual tensor, its input is plain."""
    import torch
    import torch.autograd.forward_ad as fwAD

    torch.manual_seed(0)
    w, x, tangent = torch.randn(3, 3), torch.randn(4, 3), torch.randn(3, 3)
    with fwAD.dual_level():
        dual_w = fwAD.make_dual(w, tangent)
        out = ckpt(lambda u: torch.tanh(u @ dual_w), x, **_variant_kwargs(use_reentrant))
        primal, jvp = fwAD.unpack_dual(out)
    # no tangent means a zero one: that is what a caller reading it gets
    return [primal, torch.zeros_like(primal) if jvp is None else jvp]


def _probe_hooks_disabled(ckpt, use_reentrant):
    """A training step inside ``disable_saved_tensors_hooks`` (as some libraries do)."""
    import torch

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with torch.autograd.graph.disable_saved_tensors_hooks("saved tensor hooks are disabled here"):
        y = ckpt(lambda u: torch.tanh(u @ w), x, **_variant_kwargs(use_reentrant))
        y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_no_input_grad(ckpt, use_reentrant):
    """The first block of a model is checkpointed; its input (data) does not require grad."""
    import torch

    torch.manual_seed(0)
    block, head = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
    x = torch.randn(4, 3)
    h = ckpt(block, x, **_variant_kwargs(use_reentrant))
    head(torch.relu(h)).sum().backward()
    return [h.detach(), *_grads(block.weight, block.bias, head.weight)]


def _probe_rrelu(ckpt, use_reentrant):
    """nn.RReLU in training mode inside the block, over a few seeds.

    The noise tensor is saved before RReLU fills it: the gradient is computed
    from whatever memory it got.  A freed NaN-filled tensor of its size, just
    before the forward, makes that memory NaN on every run.
    """
    import torch

    grads = []
    for seed in range(3):
        torch.manual_seed(0)
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.RReLU()).train()
        x = torch.randn(4, 8, requires_grad=True)
        junk = torch.full((4, 8), float("nan"))
        del junk
        torch.manual_seed(seed)
        ckpt(block, x, **_variant_kwargs(use_reentrant)).sum().backward()
        grads += _grads(x, *block.parameters())
    return grads


def _probe_grad_sample_hooks(ckpt, use_reentrant):
    """Opacus' grad-sample hooks, reduced to their mechanism (the real GradSampleModule is tested
    in tests/test_opacus.py): a forward hook named ``capture_activations_hook`` keeps the
    input and counts the forward (skipped without grad, as Opacus' is), a full backward hook makes
    the per-sample gradient and publishes it when the count is back to zero."""
    import torch

    class GradSampler:
        def capture_activations_hook(self, module, inputs, output):
            if not torch.is_grad_enabled():
                return
            module.activations.append(inputs[0].detach())
            module.forward_counter += 1

        def capture_backprops_hook(self, module, grad_inputs, grad_outputs):
            a = module.activations.pop()
            module.current = torch.einsum("ni,nj->nij", grad_outputs[0], a)
            module.forward_counter -= 1
            if module.forward_counter == 0:
                module.grad_sample = module.current

    torch.manual_seed(0)
    sampler, block = GradSampler(), torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    linears = [block[0], block[2]]
    for m in linears:
        m.activations, m.forward_counter = [], 0
        m.register_forward_hook(sampler.capture_activations_hook)
        m.register_full_backward_hook(sampler.capture_backprops_hook)
    x = torch.randn(4, 3, requires_grad=True)
    ckpt(block, x, **_variant_kwargs(use_reentrant)).pow(2).sum().backward()
    # a per-sample gradient never published reads as zeros (Opacus: "parameters without grad_sample")
    return [getattr(m, "grad_sample", torch.zeros(4, 3, 3)) for m in linears] + _grads(x, *block.parameters())


def _under_grad_transform(s: "CallState") -> bool:
    return "grad" in s.transform_names


def _hooks_refused_here(s: "CallState") -> bool:
    """Whether torch refuses a non-reentrant checkpoint under this grad transform, read live, not by
    release: torch's grad transforms switch saved-tensor hooks off for their whole body; a torch patched
    to allow them at first order (as JetBrains' opaque does) runs the checkpoint, unless its vmap
    switches them off for a pullback run under it later (``jacrev``'s, on torch 2.4)."""
    if not s.saved_tensor_hooks_enabled:
        return True
    from ._state import vmap_switches_saved_tensor_hooks_off

    return vmap_switches_saved_tensor_hooks_off()


# the transforms that are not reverse-mode AD (jacfwd shows as vmap + jvp)
_FORWARD_TRANSFORMS = frozenset({"vmap", "jvp", "functionalize"})


_COMPOSABLE_FALLBACK = (
    "runs it as ckpt_guard's composable recompute where that is correct (torch.func transforms "
    "it; the memory saving is kept), else without checkpointing (correct, no memory saving for it)"
)

FIX_MOVE = "move the checkpoint call outside the torch.func transform"
GRAD_TRANSFORMS = "grad, vjp, jacrev or hessian"  # the transforms that run as functorch's grad
_FIX_NR = "pass use_reentrant=False"

_CALL_RULES = [
    Rule(
        id="CKG001",
        title="non-reentrant checkpoint under a torch.func grad transform",
        stage="call",
        variants=(NON_REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=False) runs with grad enabled under torch.func.grad, vjp, "
            "jacrev or hessian, at any depth (e.g. vmap(grad(f))), where they have switched "
            "saved-tensor hooks off (stock torch always does; a torch patched to allow them at first "
            "order, as JetBrains' opaque does, is read live and not refused there, unless its vmap "
            "switches them off for a later pullback)"
        ),
        symptom=(
            "raises RuntimeError: torch.func.{grad, vjp, jacrev, hessian} don't yet support "
            "saved tensor hooks (an error that never mentions checkpointing)"
        ),
        symptom_kind="raises",
        raises_match=r"don't yet support saved tensor hooks",
        remedy=(
            f"{FIX_MOVE}, or drop checkpointing inside it"
        ),
        fallback=_COMPOSABLE_FALLBACK,
        refs=(
            "https://github.com/pytorch/functorch/issues/993",
            "https://github.com/pytorch/pytorch/pull/85972",
            "https://github.com/pytorch/pytorch/issues/122729",
            "https://github.com/pytorch/pytorch/issues/141845",
        ),
        torch_note="torch.func's grad transforms refuse saved tensor hooks (pytorch#85972)",
        yields_to=("CKG007",),
        probe=_probe_grad_transform,
        applies=lambda s: (
            not s.reentrant and s.grad_enabled and _under_grad_transform(s) and _hooks_refused_here(s)
        ),
    ),
    Rule(
        id="CKG002",
        title="reentrant checkpoint under a torch.func transform",
        stage="call",
        variants=(REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=True, or not passed) runs under any torch.func transform "
            "(grad, vjp, jacrev, hessian, vmap, jvp, jacfwd, functionalize)"
        ),
        symptom=(
            "raises RuntimeError: In order to use an autograd.Function with functorch transforms "
            "... it must override the setup_context staticmethod (CheckpointFunction does not)"
        ),
        symptom_kind="raises",
        raises_match=r"must override the setup_context staticmethod",
        remedy=(
            f"{_FIX_NR} (on torch >= 2.12 it works under vmap, jvp, jacfwd and functionalize, "
            f"see CKG007 for older torch; under {GRAD_TRANSFORMS} neither variant "
            f"works, see CKG001), or {FIX_MOVE}"
        ),
        fallback=(
            "runs it with use_reentrant=False when that is safe here, else as ckpt_guard's "
            "composable recompute where that is correct, else without checkpointing"
        ),
        refs=(
            "https://github.com/pytorch/functorch/issues/993",
            "https://github.com/pytorch/pytorch/pull/89859",
        ),
        torch_note="an autograd.Function needs setup_context under torch.func (pytorch#89859)",
        probe=_probe_vmap_forward,
        applies=lambda s: s.reentrant and bool(s.transforms),
    ),
    Rule(
        id="CKG003",
        title="non-reentrant checkpoint under vmap, output carries autograd history out of the vmap",
        stage="call",
        variants=(NON_REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=False) under vmap (and no grad transform; jacfwd runs "
            "vmap over jvp) with grad enabled while its inputs or the parameters inside (of "
            "modules in training mode) require grad: a later .backward() outside the vmap must "
            "recompute a vmapped function outside the vmap"
        ),
        symptom=(
            "raises at backward: RuntimeError: Either your tensor may have escaped from inside a "
            "function being vmapped and this is a user error ... gen_vmap_plumbing"
        ),
        symptom_kind="raises",
        raises_match=r"escaped from inside a function being vmapped",
        remedy=(
            "compute gradients inside the transform (torch.func.grad / vjp under vmap needs no "
            "checkpointing), or checkpoint outside the vmap (or jacfwd), or run it under "
            "torch.no_grad() if no backward is intended"
        ),
        fallback=_COMPOSABLE_FALLBACK,
        refs=(
            "https://github.com/pytorch/pytorch/issues/165880",
            "https://github.com/pytorch/pytorch/issues/122729",
        ),
        torch_note=(
            "from 2.12 non-reentrant checkpoint runs under vmap (pytorch#174327 dropped "
            "_NoopSaveInputs); before that it raises at the call (CKG007)"
        ),
        torch_range=TorchRange(since=(2, 12)),
        probe=_probe_vmap_backward,
        applies=lambda s: (
            not s.reentrant
            and s.grad_enabled
            and "vmap" in s.transform_names
            and not _under_grad_transform(s)
            and (s.inputs_require_grad or s.params_require_grad)
        ),
    ),
    Rule(
        id="CKG004",
        title="reentrant checkpoint under forward-mode AD",
        stage="call",
        variants=(REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=True, or not passed) inside torch.autograd.forward_ad.dual_level "
            "with a dual tensor among its inputs (dual tensors only inside the block: CKG008)"
        ),
        symptom=(
            "raises NotImplementedError: You must implement the jvp function for custom "
            "autograd.Function to use it with forward mode AD"
        ),
        symptom_kind="raises",
        raises_match=r"You must implement the jvp function",
        remedy=(
            f"{_FIX_NR}: on torch >= 2.12 the non-reentrant variant supports forward-mode AD "
            "(before 2.12 neither variant does, see CKG007: run the block without checkpointing)"
        ),
        fallback="runs it with use_reentrant=False where that supports forward AD, else without checkpointing",
        refs=(
            "https://github.com/pytorch/pytorch/pull/64061",
            "https://github.com/pytorch/pytorch/issues/129293",
        ),
        torch_note=(
            "forward AD through a custom autograd.Function needs its jvp (pytorch#64061); the "
            "fallback runs use_reentrant=False from 2.12, without checkpointing before (CKG007)"
        ),
        probe=_probe_forward_ad,
        applies=lambda s: s.reentrant and s.forward_ad_active and s.dual_args,
    ),
    Rule(
        id="CKG005",
        title="non-reentrant checkpoint while saved-tensor hooks are disabled",
        stage="call",
        variants=(NON_REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=False) with grad enabled inside "
            "torch.autograd.graph.disable_saved_tensors_hooks(...) (outside torch.func grad "
            "transforms, which CKG001 covers)"
        ),
        symptom="raises RuntimeError with the message given to disable_saved_tensors_hooks",
        symptom_kind="raises",
        raises_match=r"saved tensor hooks are disabled here",
        remedy=(
            "checkpoint outside the disable_saved_tensors_hooks block, or run this block without "
            "checkpointing"
        ),
        fallback=_COMPOSABLE_FALLBACK,
        refs=("https://github.com/pytorch/pytorch/pull/85971",),
        torch_note="non-reentrant checkpoint is built on saved tensor hooks (pytorch#85971)",
        yields_to=("CKG007",),
        probe=_probe_hooks_disabled,
        applies=lambda s: (
            not s.reentrant
            and s.grad_enabled
            and not s.saved_tensor_hooks_enabled
            and not _under_grad_transform(s)
        ),
    ),
    Rule(
        id="CKG006",
        title="reentrant checkpoint with no input requiring grad: the block's parameters get no gradient",
        stage="call",
        variants=(REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=True, or not passed) with grad enabled, no tensor input "
            "requiring grad, and parameters inside the function (an nn.Module in training mode, its "
            "bound method, a functools.partial or closure holding one, checkpoint_sequential's "
            "segments) that do"
        ),
        symptom=(
            "returns silently wrong gradients: torch only warns 'None of the inputs have "
            "requires_grad=True', the output does not require grad, and the block's parameters "
            "get no gradient while the rest of the model trains"
        ),
        symptom_kind="silently wrong",
        remedy=f"{_FIX_NR} (it tracks parameters used inside), or make an input require grad",
        fallback="runs it with use_reentrant=False",
        refs=(
            "https://github.com/pytorch/pytorch/issues/7617",
            "https://github.com/pytorch/pytorch/issues/6884",
        ),
        torch_note="the reentrant variant only tracks gradients through its tensor inputs",
        probe=_probe_no_input_grad,
        applies=lambda s: (
            s.reentrant
            and s.grad_enabled
            and not s.inputs_require_grad
            and s.params_require_grad
            and not s.transforms
        ),
    ),
    Rule(
        id="CKG007",
        title="non-reentrant checkpoint under vmap, jvp, jacfwd, functionalize or forward-mode AD (torch < 2.12)",
        stage="call",
        variants=(NON_REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=False) under torch.func.vmap, jvp, jacfwd (vmap over jvp) or "
            "functionalize, at any depth and in any grad mode (vmap(grad(f)) and grad(vmap(f)) "
            "included), or with a dual tensor among its inputs inside "
            "torch.autograd.forward_ad.dual_level, on torch 2.4–2.11"
        ),
        symptom=(
            "raises at the call: non-reentrant checkpoint saves its inputs through an internal "
            "autograd.Function, _NoopSaveInputs, which has no rule for these transforms: "
            "'You tried to vmap over _NoopSaveInputs, but it does not have vmap support', "
            "'You must implement the jvp function for custom autograd.Function to use it with "
            "forward mode AD' or 'NYI: Functionalize rule for custom_function_call'"
        ),
        symptom_kind="raises",
        raises_match=(
            r"You tried to vmap over _NoopSaveInputs|You must implement the jvp function"
            r"|NYI: Functionalize rule for custom_function_call"
        ),
        remedy=(
            f"{FIX_MOVE}, or run this block without checkpointing; torch >= 2.12 (which no "
            "longer uses _NoopSaveInputs) runs non-reentrant checkpoint under vmap, jvp, jacfwd, "
            "functionalize and forward-mode AD (not under grad transforms: CKG001)"
        ),
        fallback=_COMPOSABLE_FALLBACK,
        refs=(
            "https://github.com/pytorch/pytorch/pull/174327",
            "https://github.com/pytorch/pytorch/issues/165880",
        ),
        torch_note=(
            "torch 2.4–2.11 save a non-reentrant checkpoint's inputs with _NoopSaveInputs, "
            "which has no vmap, jvp or functionalize rule; 2.12 replaced it (pytorch#174327)"
        ),
        torch_range=TorchRange(until=(2, 12)),
        probe=_probe_vmap_forward,
        applies=lambda s: not s.reentrant and (bool(s.transform_names & _FORWARD_TRANSFORMS) or s.dual_args),
    ),
    Rule(
        id="CKG008",
        title="reentrant checkpoint under forward-mode AD over tensors the block holds: the tangent is dropped",
        stage="call",
        variants=(REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=True, or not passed) inside torch.autograd.forward_ad.dual_level, "
            "no input is a dual tensor, and a tensor the block reads besides them is: a parameter, "
            "buffer or tensor attribute of its modules (torch's forward-AD-with-modules recipe sets "
            "dual weights with setattr; functional_call with dual parameters) or a tensor it closes over"
        ),
        symptom=(
            "silently drops the block's part of the JVP: the checkpoint's output has no tangent "
            "(unpack_dual(out).tangent is None), because reentrant checkpoint is an "
            "autograd.Function, whose output tangent comes only from its inputs' tangents; a model "
            "around it returns a tangent with the block's contribution missing, and no error"
        ),
        symptom_kind="silently wrong",
        remedy=(
            f"{_FIX_NR}: the non-reentrant variant carries those tangents on every supported torch, "
            "or pass the dual tensors to the block as inputs (then CKG004 applies)"
        ),
        fallback="runs it with use_reentrant=False (correct, keeps the memory saving)",
        refs=(
            "https://github.com/pytorch/pytorch/pull/64061",
            "https://github.com/pytorch/pytorch/issues/129293",
        ),
        torch_note=(
            "an autograd.Function's output tangent comes from its jvp over its inputs' tangents "
            "(pytorch#64061); CheckpointFunction has none and takes only the explicit inputs"
        ),
        probe=_probe_forward_ad_held,
        measured_on=("2.4.1", "2.5.0", "2.8.0", "2.13.0", "2.14.1", "2.15.0"),
        applies=lambda s: s.reentrant and s.forward_ad_active and not s.dual_args and s.dual_held,
    ),
    Rule(
        id="CKG009",
        title="nn.RReLU in training mode under non-reentrant checkpoint: gradients from uninitialised memory",
        stage="call",
        variants=(NON_REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=False) with grad enabled and early stop on (the default) over "
            "a module that contains an nn.RReLU in training mode (the module itself, its bound "
            "method, or a functools.partial of either, as checkpoint_wrapper and transformers "
            "pass it); a functional F.rrelu(training=True) in a closure is not seen"
        ),
        symptom=(
            "returns silently wrong gradients: RReLU's noise tensor is saved before the kernel "
            "fills it, so the backward multiplies by uninitialised memory (garbage, often NaN); "
            "the forward output is exact, and a run can pass by luck"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "wrap the checkpoint call in torch.utils.checkpoint.set_checkpoint_early_stop(False) "
            "(torch 2.13 and 2.15 also take checkpoint(..., early_stop=False); 2.4 does not), or "
            "pass use_reentrant=True, or use LeakyReLU (RReLU's eval-mode behaviour) inside "
            "checkpointed blocks"
        ),
        fallback="runs it with early stop switched off (correct, keeps the memory saving)",
        fallback_runs="no-early-stop",
        refs=("https://github.com/pytorch/pytorch/issues/193671",),
        torch_note=(
            "rrelu_with_noise declares its noise output as a mutated input, which early stop saves "
            "before the kernel writes it (open upstream, no fix)"
        ),
        probe=_probe_rrelu,
        symptom_varies=True,
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
        applies=lambda s: not s.reentrant and s.grad_enabled and s.rrelu_training and not s.transforms,
    ),
    Rule(
        id="CKG011",
        title="Opacus' grad-sample hooks under non-reentrant checkpoint: per-sample gradients lost",
        stage="call",
        variants=(NON_REENTRANT,),
        trigger=(
            "checkpoint(use_reentrant=False) with grad enabled over a module that contains a layer "
            "carrying Opacus' grad-sample forward hook (GradSampleModule's capture_activations_hook, "
            "registered in its hooks and functorch modes) that would take: hooks enabled, the layer "
            "in training mode with a trainable parameter of its own. DP fine-tuning with transformers' "
            "activation (gradient) checkpointing, whose default is non-reentrant. The block as the "
            "module, its bound method, a functools.partial of either or partial(forward, module) "
            "(transformers and checkpoint_wrapper pass it so); a lambda or closure around the model "
            "is not seen"
        ),
        symptom=(
            "runs the hook again in the recompute, so each layer's activations and forward count "
            "are taken twice and its backward hook pops once: the per-sample gradients are never "
            "published (16 of 21 parameters on a 2-layer LLaMA), while .grad is right. Opacus' "
            "optimizer then fails at step() with 'Per sample gradient is not initialized. Not "
            "updated in backward pass?', ghost clipping with a misleading 'Parameter tying is not "
            "supported'; a bare GradSampleModule returns without them"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "pass use_reentrant=True (transformers: model.activation_checkpointing_enable("
            "activation_checkpointing_kwargs={'use_reentrant': True}), or in releases without it "
            "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})): "
            "the reentrant forward runs under no_grad, where Opacus' hook takes nothing, and its "
            "recompute takes each layer once; exact, and it keeps the memory saving"
        ),
        fallback="runs it without checkpointing (correct; pass use_reentrant=True to keep the memory saving)",
        refs=(
            "https://github.com/pytorch/pytorch/issues/143573",
            "https://github.com/meta-pytorch/opacus/blob/main/opacus/grad_sample/grad_sample_module.py",
        ),
        torch_note=(
            "non-reentrant checkpoint re-runs module forward hooks in the recompute, with grad "
            "enabled, on every supported torch (pytorch#143573: a forward hook seen again in the "
            "backward); Opacus counts forwards in them (_forward_counter)"
        ),
        probe=_probe_grad_sample_hooks,
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
        applies=lambda s: not s.reentrant and s.grad_enabled and s.grad_sample_hooks and not s.transforms,
    ),
]


# ==========================================================================
# Recompute-time (drift) rules
# ==========================================================================


def _probe_functional_call(ckpt, use_reentrant):
    """A module with a checkpointed block, called through functional_call with new parameters."""
    import torch
    from torch.func import functional_call

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.outer = torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)

        def forward(self, x):
            h = ckpt(lambda t: torch.tanh(self.inner(t)), x, **_variant_kwargs(use_reentrant))
            return self.outer(h)

    net = Net()
    new = {k: (v.detach() * 1.5 + 0.1).requires_grad_() for k, v in net.named_parameters()}
    x = torch.randn(4, 3, requires_grad=True)
    out = functional_call(net, new, (x,))
    out.sum().backward()
    return [out.detach(), *_grads(x, *new.values(), *net.parameters())]


def _probe_dispatch_mode(ckpt, use_reentrant):
    """A user TorchDispatchMode (doubles sin) active in the forward, backward run outside it.

    Marked replayable (it depends on nothing else), so fallback's row shows the replay; an
    unmarked mode makes fallback run the block plainly (tests/test_mode_replay.py).
    """
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import ckpt_guard

    @ckpt_guard.replayable_mode
    class DoubleSin(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.ops.aten.sin.default else out

    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with DoubleSin():
        y = ckpt(lambda t: torch.sin(t) * w, x, **_variant_kwargs(use_reentrant))
    y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_function_mode(ckpt, use_reentrant):
    """A user TorchFunctionMode (doubles sin) active in the forward and around .backward().

    Marked replayable, as the dispatch mode's probe.
    """
    import torch
    from torch.overrides import TorchFunctionMode

    import ckpt_guard

    @ckpt_guard.replayable_mode
    class DoubleSin(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            return out * 2 if func is torch.sin else out

    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    x = torch.randn(4, 3, requires_grad=True)
    with DoubleSin():
        y = ckpt(lambda t: torch.sin(t) * w, x, **_variant_kwargs(use_reentrant))
        y.sum().backward()
    return [y.detach(), *_grads(x, w)]


def _probe_vmap_closure(ckpt, use_reentrant):
    """vmap forward over a checkpointed block whose parameters hide in a container, backward outside."""
    import collections

    import torch
    from torch.func import vmap

    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    store = collections.deque([w])  # a container the call-time rules do not look into (not a list, tuple or dict)
    x = torch.randn(4, 3)
    y = vmap(lambda t: ckpt(lambda u: torch.tanh(u @ store[0]), t, **_variant_kwargs(use_reentrant)))(x)
    y.sum().backward()
    return [y.detach(), *_grads(w)]


def _probe_default_dtype(ckpt, use_reentrant):
    """The block creates a constant; the default dtype changes between forward and backward."""
    import torch

    def block(t):
        big = torch.tensor(2.0**24)
        return t * ((big + 1) - big)  # 0 in float32, 1 in float64

    x = torch.ones(3, requires_grad=True)
    previous = torch.get_default_dtype()
    try:
        y = ckpt(block, x, **_variant_kwargs(use_reentrant))
        torch.set_default_dtype(torch.float64)
        y.sum().backward()
    finally:
        torch.set_default_dtype(previous)
    return [y.detach(), *_grads(x)]


def _probe_train_eval_flip(ckpt, use_reentrant):
    """A checkpointed block with dropout; model.eval() runs between the forward and .backward()."""
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    x = torch.randn(4, 8, requires_grad=True)
    torch.manual_seed(1)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    block.eval()  # e.g. an evaluation hook between the forward and the backward
    y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_optimizer_step_before_backward(ckpt, use_reentrant):
    """An optimizer step on the checkpointed block between its forward and .backward().

    Without checkpointing autograd refuses this order (a saved parameter was
    modified in place), so the reference takes the same step after the
    backward: the gradients of the loss that was actually computed.
    """
    import torch
    import torch.utils.checkpoint

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    optimizer = torch.optim.SGD(block.parameters(), lr=0.5)
    x = torch.randn(3, 4, requires_grad=True)
    loss = ckpt(block, x, **_variant_kwargs(use_reentrant)).pow(2).sum()

    def step():  # e.g. the other player's update in a GAN, or step() before backward()
        for p in block.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        optimizer.zero_grad()

    checkpointed = ckpt is torch.utils.checkpoint.checkpoint
    if checkpointed:
        step()
    loss.backward()
    grads = [g.clone() for g in _grads(x, *block.parameters())]
    if not checkpointed:
        step()
    return [loss.detach(), *grads]


def _probe_rebound_parameter(ckpt, use_reentrant):
    """A meta-optimizer's step between the inner forward and the outer backward (MetaSGD, higher).

    The inner step's gradient is taken with create_graph; the weight is then
    re-bound to a new, non-leaf tensor (``del lin.weight; lin.weight = w0 -
    lr * g``); the outer backward differentiates through the inner step, and
    so recomputes the inner forward.
    """
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh(), torch.nn.Linear(3, 3))
    lin = block[0]
    x, x2 = torch.randn(4, 3), torch.randn(4, 3)
    w0 = lin.weight
    inner = ckpt(block, x, **_variant_kwargs(use_reentrant)).pow(2).sum()
    (g,) = torch.autograd.grad(inner, w0, create_graph=True)
    del lin.weight
    lin.weight = w0 - 0.1 * g  # the inner step: a new tensor, not an in-place update
    outer = ckpt(block, x2, **_variant_kwargs(use_reentrant)).pow(2).sum()
    outer.backward()
    meta = [w0.grad.clone()]
    del lin.weight
    lin.weight = w0  # the module as it was (the probe runs several times)
    return meta


def _probe_hook_removed(ckpt, use_reentrant):
    """A one-shot forward hook: registered for the forward, removed before .backward()."""
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    x = torch.randn(4, 3, requires_grad=True)
    handle = block[0].register_forward_hook(lambda module, inputs, out: out * 2)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    handle.remove()
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_argument_changed(ckpt, use_reentrant):
    """A KV cache passed to a checkpointed attention block, which appends to it (pytorch#155171)."""
    import torch

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x, cache):
            cache.append(self.k(x))  # the block grows the cache it is given
            keys = torch.cat(cache)
            return (self.q(x) @ keys.T).softmax(-1) @ keys

    torch.manual_seed(0)
    block = Attention()
    x = torch.randn(3, 4, requires_grad=True)
    cache = [torch.randn(3, 4)]
    y = ckpt(block, x, cache, **_variant_kwargs(use_reentrant))
    y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters()), torch.tensor(len(cache))]


def _probe_user_generator(ckpt, use_reentrant):
    """A block that draws its noise from a torch.Generator of its own (a seeded augmentation, a dropout)."""
    import torch

    class Noisy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.generator = torch.Generator().manual_seed(0)

        def forward(self, x):
            noise = torch.rand(x.shape, generator=self.generator)
            return torch.tanh(self.linear(x) * noise)

    torch.manual_seed(0)
    block = Noisy()
    x = torch.randn(3, 4, requires_grad=True)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters()), block.generator.get_state()]


def _probe_attribute_rebound(ckpt, use_reentrant):
    """A module's own tensor attribute (a scale it keeps, not a parameter) re-bound before .backward()."""
    import torch

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.scale = torch.tensor([1.0, 2.0, 3.0])

        def forward(self, x):
            return torch.tanh(self.lin(x) * self.scale)

    torch.manual_seed(0)
    block = Scaled()
    x = torch.randn(4, 3, requires_grad=True)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    block.scale = torch.tensor([3.0, 2.0, 1.0])  # set for the next call, before this backward
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


def _probe_instance_forward(ckpt, use_reentrant):
    """A one-shot edit (nnsight's edit_in, in miniature): a forward put on the instance for one call,
    taken off before .backward()."""
    import torch

    class Doubled:  # edits the output of the call it was put there for
        def __init__(self, module):
            self.module = module

        def __call__(self, x):
            return type(self.module).forward(self.module, x) * 2

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Tanh())
    x = torch.randn(4, 3, requires_grad=True)
    block[0].forward = Doubled(block[0])
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    del block[0].forward  # the edit is over
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]



_UNFORESEEABLE_FALLBACK = (
    "cannot help: this drift is only visible when the recompute starts, when nothing can "
    "repair it, so fallback raises as strict does"
)

_DRIFT_FALLBACK = (
    "acts whenever this risk is visible at call time: runs the function as ckpt_guard's composable "
    "recompute where that is correct (it reads the tensors the forward read, under any transform), "
    "else without checkpointing; a drift first seen at recompute is raised as under strict "
    "(nothing can repair it then)"
)

_MODE_FALLBACK = (
    "acts whenever a user mode is active at the call: runs the block without checkpointing "
    "(correct whatever state the mode carries; that block's memory saving is lost), unless every "
    "such mode's class is marked with @ckpt_guard.replayable_mode and its state can be recorded: "
    "then it checkpoints, and the recompute runs under the forward's own mode objects alone (other "
    "user modes taken off for it), with their attributes, tensors and generators as the forward "
    "found them, put back after (a non-reentrant call needs torch >= 2.8 for this); a mode first "
    "seen missing at the recompute, or a tensor needing a gradient that a marked mode holds, "
    "updated in place, is raised as under strict"
)


def _probe_create_graph_backward(ckpt, use_reentrant):
    """A gradient penalty: ``.backward(create_graph=True)``, then the input gradient's norm differentiated.

    ``a`` scales the block's input, so the input gradient has a graph even when
    the block's part of it has none: torch does not raise, the terms are missing.
    """
    import torch

    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = ckpt(lambda h: torch.tanh(h @ w).pow(2), x * a, **_variant_kwargs(use_reentrant))
    torch.autograd.backward(y.sum(), create_graph=True)
    penalty = x.grad.pow(2).sum()
    first = [t.grad.detach().clone() for t in (x, a, w)]
    for t in (x, a, w):
        t.grad = None
    penalty.backward()
    return [penalty.detach(), *first, *_grads(x, a, w)]


_DRIFT_RULES = [
    Rule(
        id="CKG101",
        title="functional_call swap: the recompute would read other tensors than the forward",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "the forward ran inside torch.func.functional_call (torch's _reparametrize_module), "
            "whose swap put other tensors in the checkpointed block's modules, and the recompute "
            "would read different ones: the swap was undone (or another one is active) by then. "
            "A block that reads no swapped tensor (parameter-free, or "
            "functional_call(net, dict(net.named_parameters()))) is not at risk"
        ),
        symptom=(
            "returns silently wrong gradients: the recompute reads the module's own parameters, "
            "so the swapped-in parameters and the inputs get wrong gradients (reentrant: the "
            "module's own parameters get gradients instead)"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "call .backward() (or torch.autograd.grad) while the functional_call is still active, "
            "e.g. inside a module whose forward computes the loss and its gradients (not enough "
            "when one backward differentiates through several functional_calls, as second-order "
            "MAML does: then checkpoint those blocks with ckpt_guard.checkpoint, whose recompute "
            "binds the tensors the forward read, which fallback does too), or disable "
            "checkpointing for stateless calls"
        ),
        fallback=_DRIFT_FALLBACK,
        refs=(
            "https://github.com/pytorch/pytorch/pull/61447",
            "https://github.com/pytorch/functorch/issues/993",
        ),
        torch_note="the recompute reads whatever the module holds when it runs",
        probe=_probe_functional_call,
        read="swapped_reads",
        render="describe_swaps",
    ),
    Rule(
        id="CKG102",
        title="user dispatch mode of the forward missing (or not as it was) at recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "a user TorchDispatchMode was active when checkpoint ran the forward, and the recompute "
            "runs without it or under a different dispatch-mode stack (torch's own modes are ignored); "
            "for a mode marked @ckpt_guard.replayable_mode, also under another object of its class "
            "or with its state changed since the forward (a .backward() run inside it)"
        ),
        symptom=(
            "returns silently wrong gradients: the recompute runs without the mode, so the tensors "
            "it saves for backward differ from the forward's"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "keep the mode out of the checkpointed region; or, if what the mode computes depends on "
            "nothing but its own attributes, mark its class with @ckpt_guard.replayable_mode and use "
            "policy fallback (it recomputes under the forward's mode object and state); only for a mode "
            "with no state of its own (no generator, counter or flag its __enter__ sets): run "
            ".backward() inside the same dispatch mode, or re-enter it in the recompute with "
            "context_fn (use_reentrant=False)"
        ),
        fallback=_MODE_FALLBACK,
        refs=("https://github.com/pytorch/pytorch/pull/148919",),
        torch_note="the recompute runs under the modes active when it runs",
        probe=_probe_dispatch_mode,
        read="user_dispatch_modes",
        render="describe_modes",
    ),
    Rule(
        id="CKG103",
        title="user function mode of the forward missing (or not as it was) at recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "a user TorchFunctionMode was active when checkpoint ran the forward, and the recompute "
            "runs without it; Tensor.backward itself runs with function modes popped, so this "
            "happens even when .backward() is called inside the mode (torch.device contexts, which "
            "torch restores itself, are ignored)"
        ),
        symptom="returns silently wrong gradients: the recompute runs without the mode",
        symptom_kind="silently wrong",
        remedy=(
            "keep the function mode out of the checkpointed region; or, if what the mode computes "
            "depends on nothing but its own attributes, mark its class with "
            "@ckpt_guard.replayable_mode and use policy fallback; only for a mode with no state of "
            "its own: re-enter it in the recompute with context_fn (use_reentrant=False)"
        ),
        fallback=_MODE_FALLBACK,
        refs=(
            "https://github.com/pytorch/pytorch/issues/147995",
            "https://github.com/pytorch/pytorch/pull/148023",
        ),
        torch_note="Tensor.backward pops function modes, and the recompute runs inside it",
        probe=_probe_function_mode,
        read="user_function_modes",
        render="describe_modes",
    ),
    Rule(
        id="CKG104",
        title="torch.func transform stack differs at recompute",
        stage="recompute",
        # The reentrant variant never gets this far: CKG002 refuses it under any transform.
        variants=(NON_REENTRANT,),
        trigger=(
            "the functorch interpreter stack when the recompute starts differs from the forward's, "
            "e.g. the forward ran under vmap and .backward() runs outside it"
        ),
        symptom=(
            "raises a confusing RuntimeError ('Either your tensor may have escaped from inside a "
            "function being vmapped ...') or worse, recomputes under the wrong transforms"
        ),
        symptom_kind="raises",
        raises_match=r"escaped from inside a function being vmapped",
        remedy=(
            "take gradients inside the transform (torch.func.grad / vjp) instead of calling "
            ".backward() outside it, or checkpoint outside the transform"
        ),
        fallback=_DRIFT_FALLBACK,
        refs=("https://github.com/pytorch/pytorch/issues/165880",),
        torch_note=(
            "a forward under a transform is only reachable from 2.12 (before, CKG001, CKG002 "
            "and CKG007 cover every transform at the call)"
        ),
        torch_range=TorchRange(since=(2, 12)),
        probe=_probe_vmap_closure,
        read="transform_stack",
        render="describe_transforms",
    ),
    Rule(
        id="CKG105",
        title="default dtype changed between the forward and the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger="torch.get_default_dtype() at recompute differs from the forward's",
        symptom=(
            "reentrant: returns silently different gradients (tensors the block creates change "
            "dtype); non-reentrant: raises CheckpointError (recomputed metadata mismatch)"
        ),
        symptom_kind="silently wrong",
        symptom_by_variant=((NON_REENTRANT, "raises"),),
        raises_match=r"[Rr]ecomputed values for the following tensors have different metadata",
        remedy="restore the default dtype before .backward(), or set it once at program start",
        fallback="recomputes in the forward's default dtype: correct, keeps the memory saving",
        # No upstream thread on this one; the closest: which global state the
        # recompute does restore (autocast), and which it does not.
        refs=("https://github.com/pytorch/pytorch/pull/71169",),
        torch_note="the recompute reads the default dtype when it runs",
        probe=_probe_default_dtype,
        read="default_dtype",
        render="describe_dtype",
    ),
    Rule(
        id="CKG106",
        title="checkpointed module switched between train and eval mode before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "the checkpointed function is an nn.Module (or its bound method, as with "
            "checkpoint_wrapper and the composable API) whose .training flag at recompute "
            "differs from the forward's, e.g. model.eval() between forward and .backward()"
        ),
        symptom=(
            "reentrant: returns silently wrong gradients (the recompute runs dropout / batch "
            "norm in the other mode); non-reentrant: raises CheckpointError (a different "
            "number of tensors was saved)"
        ),
        symptom_kind="silently wrong",
        symptom_by_variant=((NON_REENTRANT, "raises"),),
        raises_match=r"different number of tensors was saved",
        remedy="run .backward() before switching modes (model.eval() / model.train())",
        fallback=(
            "recomputes with each module in the train/eval mode it had in the forward (bound for "
            "the recompute only, on its thread): correct, keeps the memory saving"
        ),
        # No upstream thread on this one; the closest: which state the recompute restores.
        refs=("https://github.com/pytorch/pytorch/pull/71169",),
        torch_note="the recompute reads module.training when it runs",
        probe=_probe_train_eval_flip,
        read="module_training",
        render="describe_training",
    ),
    Rule(
        id="CKG108",
        title="optimizer updated the checkpointed block's parameters before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "a torch.optim optimizer stepped on parameters the checkpointed function uses after "
            "its forward and before its recompute: optimizer.step() before loss.backward(), a "
            "GAN's other player stepping between this forward and its backward, a second "
            "backward (retain_graph=True) after a step"
        ),
        symptom=(
            "returns silently wrong gradients: the recompute runs with the updated parameters. "
            "Without checkpointing autograd refuses (a variable needed for gradient computation "
            "has been modified by an inplace operation); checkpointing bypasses that check"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "finish loss.backward() before optimizer.step(); in alternating updates (GANs), "
            "run each backward before the other optimizer steps on parameters it uses, or "
            "do not checkpoint blocks whose parameters are updated in between"
        ),
        fallback=_UNFORESEEABLE_FALLBACK,
        fallback_helps=False,
        # No upstream thread on this one; the closest: checkpointing and autograd's
        # in-place (version counter) checks, discussed when checkpoint was added.
        refs=("https://github.com/pytorch/pytorch/pull/4594",),
        torch_note="the recompute reads the parameters' values when it runs",
        probe=_probe_optimizer_step_before_backward,
        read="optimizer_steps",
        render="describe_optimizer_steps",
    ),
    Rule(
        id="CKG110",
        title="a tensor or value the checkpointed block reads was re-bound before the recompute (not updated in place)",
        stage="recompute",
        # the probe takes the inner gradient with autograd.grad, which the reentrant variant refuses
        variants=(NON_REENTRANT,),
        trigger=(
            "between the forward and the recompute, a parameter or buffer of the checkpointed "
            "module (the module, its bound method, or a partial of either) was replaced by another "
            "tensor: a meta-optimizer writing new, non-leaf weights (torchopt's MetaSGD, higher's "
            "differentiable optimizers, del m.weight; m.weight = w0 - lr * g), or a variable a "
            "checkpointed function closes over, a global it (or a helper it calls) loads, or an "
            "attribute of the plain object whose method it is, was re-bound (a loop: "
            "m = masks[i]; a script's W = W - lr * g; self.calls += 1)"
        ),
        symptom=(
            "returns silently wrong gradients: the recompute reads the new tensor, so the outer "
            "(meta-)gradient differentiates another function than the forward computed"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "re-bind after the backward that recomputes this block, or do not checkpoint blocks "
            "whose weights a meta-optimizer replaces between the forward and the backward; a "
            "closure or a global: bind the value as a default argument or with functools.partial"
        ),
        fallback=(
            "recomputes with the tensors and values the forward read (a module's bound for the "
            "recompute only, on its thread; a closure variable, a global or a plain object's attribute "
            "set for the recompute under a lock, so another thread reading it meanwhile reads the "
            "forward's value too): correct, keeps the memory saving. Where only Python values changed "
            "(a counter its forward advances, a step, a scale or a flag re-bound), strict does the same "
            "without a word"
        ),
        refs=(
            "https://github.com/metaopt/torchopt",
            "https://github.com/facebookresearch/higher",
        ),
        torch_note="the recompute reads the module's attributes and the function's closure and globals when it runs",
        probe=_probe_rebound_parameter,
        read="block_bindings",
        render="describe_bindings",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
    Rule(
        id="CKG111",
        title="a forward hook of the checkpointed block was added or removed before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "between the forward and the recompute, a forward hook or pre-hook of a module the "
            "checkpointed block runs was registered or removed: a one-shot edit made with a hook, a "
            "handle removed right after the forward, a probe registered for one step"
        ),
        symptom=(
            "returns silently wrong gradients: the forward ran with the hooks it had, the "
            "recompute runs with the hooks there are then; the output is right, its gradients are not"
        ),
        symptom_kind="silently wrong",
        remedy="remove (or add) hooks after the backward, or keep the hooked module out of checkpointed blocks",
        fallback=(
            "recomputes with the hooks the forward ran (bound for the recompute only, on its "
            "thread): correct, keeps the memory saving"
        ),
        refs=("https://github.com/pytorch/pytorch/issues/143573",),
        torch_note="the recompute calls the module, whose hooks run as they are when it runs",
        probe=_probe_hook_removed,
        read="block_hooks",
        render="describe_bindings",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
    Rule(
        id="CKG112",
        title="a list, dict or object the checkpointed block was given changed before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "between the forward and the recompute, the contents of a container the checkpointed "
            "block was given (an argument, a keyword argument, what a functools.partial of it binds, "
            "its closure variable) changed: a KV cache the block appends to in its own forward, a "
            "list it collects into, a dict or object (a Cache class) whose entries were replaced, a "
            "tensor in it updated in place. Where only Python values changed (a counter, a step "
            "number, a position, a log of strings, a memo of numbers), strict and fallback recompute "
            "with the values the forward read and put the new ones back after, without a word: "
            "that is the uncheckpointed program whether or not the block computes with them; warn "
            "reports a value replaced"
        ),
        symptom=(
            "reentrant: returns silently wrong gradients (the recompute reads the changed contents, "
            "and changes them again: a cache grows twice); non-reentrant: raises CheckpointError "
            "(recomputed metadata mismatch) where a shape changed, else silently wrong"
        ),
        symptom_kind="silently wrong",
        symptom_by_variant=((NON_REENTRANT, "raises"),),
        raises_match=r"[Rr]ecomputed values for the following tensors have different metadata",
        remedy=(
            "do not hand a checkpointed block a container it changes (transformers turns use_cache "
            "off under gradient checkpointing for this reason): return the new cache entries as "
            "outputs and update the cache outside the block, or run that block without checkpointing"
        ),
        fallback=(
            "recomputes with the containers as the forward found them, and puts back what they hold "
            "after the recompute (the change happens once, as without checkpointing): correct, keeps "
            "the memory saving (a reentrant forward that put a tensor in them runs again with "
            "use_reentrant=False, so that tensor keeps its gradient); a tensor in them updated in "
            "place cannot be put back: raises as strict"
        ),
        refs=("https://github.com/pytorch/pytorch/issues/155171",),
        torch_note="the recompute runs the block on the same container objects, as they are when it runs",
        probe=_probe_argument_changed,
        read="argument_contents",
        render="describe_contents",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
    Rule(
        id="CKG113",
        title="a torch.Generator of the user's that the checkpointed block draws from moved on before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "the checkpointed block draws random numbers from a torch.Generator of the user's "
            "(torch.rand(..., generator=g), a dropout or augmentation with its own generator) held "
            "as an attribute of one of its modules or given to it (an argument, a keyword, a "
            "functools.partial, a closure variable, inside a list, dict or object it is given)"
        ),
        symptom=(
            "returns silently wrong gradients: torch's checkpoint restores the default generators "
            "for the recompute, never a user's, so the recompute draws the next numbers (another "
            "noise, another mask) and advances the generator a second time"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "draw from the default generator (seeded with torch.manual_seed) inside checkpointed "
            "blocks, which torch restores for the recompute; or draw the noise outside the block "
            "and pass it in as an input"
        ),
        fallback=(
            "recomputes with each user generator in the state the forward found it in, and puts its "
            "state back after (the program's next draw is the one it would have made): correct, "
            "keeps the memory saving"
        ),
        # preserve_rng_state was added for the default generators (#14253); its devices are the
        # inputs' (#121212): no release saves a generator of the user's
        refs=(
            "https://github.com/pytorch/pytorch/pull/14253",
            "https://github.com/pytorch/pytorch/issues/121212",
        ),
        torch_note=(
            "preserve_rng_state saves and restores only the default CPU and device generators"
        ),
        probe=_probe_user_generator,
        read="generator_states",
        render="describe_generators",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
    Rule(
        id="CKG114",
        title="a reentrant checkpoint's backward was asked to build a graph (.backward(create_graph=True))",
        stage="recompute",
        variants=(REENTRANT,),
        trigger=(
            "loss.backward(create_graph=True) (or torch.autograd.backward with create_graph=True) "
            "runs through a reentrant checkpoint, to differentiate the gradients again: a gradient "
            "penalty on an input's .grad, a Hessian-vector product or Hessian trace from the "
            "parameters' .grad (AdaHessian, Sophia-style optimizers), a mixed second derivative"
        ),
        symptom=(
            "returns silently wrong second-order gradients: the reentrant recompute takes the "
            "block's gradients with a backward of its own that builds no graph, so differentiating "
            "them again sees constants (the block's parameters get no second-order gradient; "
            "tensors before the block get only the terms that do not pass through it). torch "
            "raises only for torch.autograd.grad, and where nothing but the block would give the "
            "gradients a graph (element 0 of tensors does not require grad); elsewhere it returns "
            "them without a word"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "pass use_reentrant=False (its recompute runs inside the backward asked for, so the "
            "gradients keep their graph), or do not checkpoint the blocks whose gradients are "
            "differentiated again"
        ),
        fallback=_UNFORESEEABLE_FALLBACK,
        fallback_helps=False,
        refs=("https://github.com/pytorch/pytorch/issues/33999",),
        torch_note=(
            "CheckpointFunction.backward runs torch.autograd.backward on the recomputed outputs "
            "without create_graph"
        ),
        probe=_probe_create_graph_backward,
        read="reentrant_backward_builds_graph",
        render="describe_backward_graph",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
    Rule(
        id="CKG115",
        title="a plain attribute of a checkpointed module, which its forward reads, changed before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "between the forward and the recompute, an attribute of a module the checkpointed block "
            "runs, named in its class's code and holding a number, flag, string or tensor (not a "
            "parameter or buffer), changed: a timestep, scale or flag set before each call of a shared "
            "module (m.t = t), a counter its own forward increments (self.calls += 1), a tensor it "
            "keeps (self.last = h, then h.retain_grad()), a tensor re-bound for the next call"
        ),
        symptom=(
            "returns silently wrong gradients: the recompute reads the value the attribute holds "
            "then, not the one the forward read (a counter its forward increments is incremented "
            "again; a tensor the forward kept is replaced by the recompute's, whose .grad stays None)"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "change the attribute after the backward that recomputes this block, or pass the value "
            "to the block as an argument"
        ),
        fallback=(
            "recomputes with each attribute as the forward found it (bound for the recompute only, "
            "on its thread; what the recompute writes there is dropped): correct, keeps the memory "
            "saving. Where only Python values changed, strict does the same without a word"
        ),
        # No upstream thread on this one; the closest: which state the recompute restores (the RNG only).
        refs=("https://github.com/pytorch/pytorch/pull/71169",),
        torch_note="the recompute calls the module, whose forward reads its attributes as they are when it runs",
        probe=_probe_attribute_rebound,
        read="module_attributes",
        render="describe_attributes",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
    Rule(
        id="CKG116",
        title="a forward put on a checkpointed module's instance was changed or taken off before the recompute",
        stage="recompute",
        variants=(REENTRANT, NON_REENTRANT),
        trigger=(
            "between the forward and the recompute, the forward set on a module instance "
            "(module.forward = f, as nnsight's edit_in does for one call) was taken off, replaced or "
            "added: a one-shot edit of a module's output, an instrumentation wrapper removed"
        ),
        symptom=(
            "returns silently wrong gradients: the forward ran the edited forward, the recompute "
            "runs the one there is then (the class's), so the gradients are those of another function"
        ),
        symptom_kind="silently wrong",
        remedy=(
            "take the edit off after the backward that recomputes the block, or keep the edited "
            "module out of checkpointed blocks for that step"
        ),
        # an edit may be stateful (one that edits only its first call): putting it back for the
        # recompute would recompute unedited, so nothing can make this recompute right
        fallback=_UNFORESEEABLE_FALLBACK,
        fallback_helps=False,
        refs=("https://github.com/ndif-team/nnsight",),
        torch_note="the recompute calls the module, which runs the forward its instance holds then",
        probe=_probe_instance_forward,
        read="instance_forwards",
        render="describe_forwards",
        measured_on=("2.4.1", "2.13.0", "2.15.0"),
    ),
]


def _probe_rng_not_preserved(ckpt, use_reentrant):
    """A checkpointed block with dropout, called with preserve_rng_state=False."""
    import torch
    import torch.utils.checkpoint

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
    x = torch.randn(4, 8, requires_grad=True)
    # preserve_rng_state is a checkpoint option; the uncheckpointed reference has none
    extra = {"preserve_rng_state": False} if ckpt is torch.utils.checkpoint.checkpoint else {}
    torch.manual_seed(1)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant), **extra)
    y.sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


# Not a state comparison like the drift rules: the forward itself is watched.
RNG_RULE = Rule(
    id="CKG107",
    title="preserve_rng_state=False, but the checkpointed forward drew random numbers",
    stage="recompute",
    variants=(REENTRANT, NON_REENTRANT),
    trigger=(
        "checkpoint(..., preserve_rng_state=False) whose forward advanced the CPU or a CUDA "
        "random number generator (dropout, torch.rand, ...): the recompute draws different numbers"
    ),
    symptom=(
        "returns silently wrong gradients: the recompute uses a different dropout mask (or other "
        "random values) than the forward did"
    ),
    symptom_kind="silently wrong",
    remedy=(
        "drop preserve_rng_state=False (the default True restores the RNG state for the "
        "recompute), or keep random operations out of the checkpointed function"
    ),
    fallback="runs the checkpoint with preserve_rng_state=True (correct, keeps the memory saving)",
    refs=("https://github.com/pytorch/pytorch/pull/71169",),
    torch_note=(
        "the recompute draws from the RNG state it finds (CPU and CUDA generators watched; "
        "other accelerators' are not)"
    ),
    probe=_probe_rng_not_preserved,
)

def _probe_nested_output(ckpt, use_reentrant):
    """A checkpointed block that returns its tensors in a dict (a dataclass, a list: the same).

    The loss has another term, so the backward runs (alone, the block's output
    would not require grad and torch would raise).
    """
    import torch

    torch.manual_seed(0)
    block = torch.nn.Linear(3, 3)
    x = torch.randn(4, 3, requires_grad=True)
    out = ckpt(lambda t: {"hidden": torch.tanh(block(t))}, x, **_variant_kwargs(use_reentrant))
    (out["hidden"].pow(2).sum() + x.sum()).backward()  # a loss with other terms: backward runs
    return [out["hidden"].detach(), *_grads(x, *block.parameters())]


# Not a state comparison either: the reentrant forward's output is looked at.
NESTED_OUTPUT_RULE = Rule(
    id="CKG010",
    title="reentrant checkpoint returning tensors inside a container: they carry no gradient",
    stage="call",
    variants=(REENTRANT,),
    trigger=(
        "checkpoint(use_reentrant=True, or not passed) with grad enabled whose function returns "
        "its tensors inside a dict, list, dataclass or nested tuple (a model output object), "
        "not as a tensor or a flat tuple of tensors"
    ),
    symptom=(
        "returns silently wrong gradients: the reentrant checkpoint is an autograd.Function, which "
        "tracks only tensors it returns directly; tensors inside a container come back detached, "
        "so nothing before the block (inputs, its parameters) gets a gradient through them"
    ),
    symptom_kind="silently wrong",
    remedy=f"{_FIX_NR} (it tracks outputs of any structure), or return a tensor or a tuple of tensors",
    fallback="runs it with its outputs flattened for the autograd.Function and rebuilt after (correct, keeps the memory saving)",
    refs=("https://github.com/pytorch/pytorch/issues/124725",),
    torch_note="closed upstream as expected behaviour of autograd.Function outputs",
    probe=_probe_nested_output,
    measured_on=("2.4.1", "2.13.0", "2.15.0"),
)


def _probe_default_device(ckpt, use_reentrant):
    """A block that makes a tensor without naming a device, under a GPU default device.

    The matrix runs this on CUDA inside ``with torch.device("cuda")`` (forward
    and backward): ``torch.full`` lands on the GPU in the forward.
    """
    import torch

    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(t):
        return block(t) * torch.full((8,), 2.0)

    y = ckpt(fn, x, **_variant_kwargs(use_reentrant))
    y.pow(2).sum().backward()
    return [y.detach(), *_grads(x, *block.parameters())]


# Not a state comparison either: the reentrant forward is watched for tensors made without device=.
DEVICE_RULE = Rule(
    id="CKG109",
    title="reentrant checkpoint under a GPU default device: the recompute makes its tensors on the CPU",
    stage="recompute",
    variants=(REENTRANT,),
    trigger=(
        "checkpoint(use_reentrant=True, or not passed) inside torch.set_default_device(...) or "
        "`with torch.device(...)` for a device other than the CPU, whose forward made a tensor "
        "without device= (torch.ones, torch.full, torch.arange, ...)"
    ),
    symptom=(
        "the backward raises 'Expected all tensors to be on the same device, but found at "
        "least two devices, cuda:0 and cpu!': the reentrant recompute runs without the "
        "forward's device context, so those tensors land on the CPU"
    ),
    symptom_kind="raises",
    raises_match=r"Expected all tensors to be on the same device",
    remedy=(
        f"{_FIX_NR} (it re-enters the forward's device context since torch 2.11), or pass "
        "device= to the tensor constructors in the block"
    ),
    fallback="re-enters the forward's device context around the recompute (correct, keeps the memory saving)",
    refs=(
        "https://github.com/pytorch/pytorch/issues/124788",
        "https://github.com/pytorch/pytorch/pull/172802",
        "https://github.com/pytorch/pytorch/pull/193922",
    ),
    torch_note=(
        "the reentrant recompute runs without the forward's function modes, DeviceContext "
        "included; the fix was declined for use_reentrant=True (pytorch#193922), "
        "use_reentrant=False got it in 2.11 (pytorch#172802)"
    ),
    probe=_probe_default_device,
    needs_gpu=True,
    measured_on=("2.11.0+cu130 on an H200 (a CPU-only machine cannot show the symptom)",),
)

def _probe_buffers_updated_again(ckpt, use_reentrant):
    """A checkpointed block with a BatchNorm in training mode: one step, its running statistics read after."""
    import torch

    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3))
    x = torch.randn(4, 3, requires_grad=True)
    y = ckpt(block, x, **_variant_kwargs(use_reentrant))
    y.pow(2).sum().backward()
    norm = block[1]
    return [y.detach(), *_grads(x, *block.parameters()), norm.running_mean, norm.running_var,
            norm.num_batches_tracked.double()]


# Not a state comparison: what the recompute itself writes is watched.
BUFFER_WRITES_RULE = Rule(
    id="CKG117",
    title="the recompute updates the checkpointed block's buffers a second time (BatchNorm's running statistics)",
    stage="recompute",
    variants=(REENTRANT, NON_REENTRANT),
    trigger=(
        "a checkpointed block whose forward updates its modules' buffers in place (BatchNorm and "
        "InstanceNorm in training mode with running statistics, a counter or an average the user's "
        "module keeps in a buffer), then a backward that recomputes it"
    ),
    symptom=(
        "silently wrong state: the recompute runs the update again, so num_batches_tracked counts "
        "two batches per step and the running statistics move twice (evaluation then uses other "
        "statistics than the uncheckpointed model's); a block that reads such a buffer after "
        "updating it computes its gradients from the twice-updated value"
    ),
    symptom_kind="silently wrong",
    remedy=(
        "nothing to change under strict or fallback: each recompute runs on copies of the buffers "
        "as the forward found them, and the module's own are left as the forward left them"
    ),
    fallback=(
        "recomputes with each buffer as the forward found it (a copy-on-write copy kept at the "
        "call, bound for the recompute on its thread): correct, keeps the memory saving; strict "
        "does the same, without a word"
    ),
    refs=(
        "https://github.com/pytorch/pytorch/issues/96136",
        "https://github.com/pytorch/pytorch/issues/62471",
    ),
    torch_note="the recompute runs the block's forward again, in the mode it had, buffers included",
    probe=_probe_buffers_updated_again,
    measured_on=("2.4.1", "2.13.0", "2.15.0"),
    repaired_quietly=True,
)

def _probe_offload_around_transform(ckpt, use_reentrant):
    """Per-sample gradients by ``vmap(grad)``, the block checkpointed, activations offloaded by
    ``save_on_cpu`` around the transform (what a user adds for memory).

    Offload changes no value, and torch refuses it here with or without checkpointing, so the
    uncheckpointed reference (a plain call named ``no_checkpoint``, as the reproduction script's)
    runs without the offload too: the gradients the program means.
    """
    import contextlib

    import torch
    from torch.func import grad, vmap

    torch.manual_seed(0)
    w, xs = torch.randn(3, 3), torch.randn(4, 3)

    def loss(w, x):
        return ckpt(lambda u: torch.tanh(u @ w), x, **_variant_kwargs(use_reentrant)).pow(2).sum()

    reference = getattr(ckpt, "__name__", "") in ("no_checkpoint", "_reference_checkpoint")
    with contextlib.nullcontext() if reference else torch.autograd.graph.save_on_cpu(pin_memory=False):
        return [vmap(grad(loss), in_dims=(None, 0))(w, xs)]


# Not a checkpoint call: decided where a torch.func transform is entered (``_transform_entry``).
OFFLOAD_RULE = Rule(
    id="CKG012",
    title="saved-tensor hooks (an offload's, or a checkpoint's own) around a torch.func transform: torch refuses "
          "them at the transform's entry",
    stage="transform",
    variants=(REENTRANT, NON_REENTRANT),
    trigger=(
        "a torch.func transform entered inside torch.autograd.graph.save_on_cpu(...) or any "
        "saved_tensors_hooks(...) (a library's offload), or inside a block of torch's non-reentrant "
        "checkpoint (its own hooks): grad, vjp, jacrev, hessian and vmap(grad) on every torch; vmap, jvp "
        "and jacfwd too on torch 2.4. Checkpointed blocks inside the transform or not: torch refuses it "
        "before the first one runs"
    ),
    symptom=(
        "raises 'torch.func... don't yet support saved tensor hooks. Please open an issue with your "
        "use case' at the transform's entry, naming neither the offload nor what works instead"
    ),
    symptom_kind="raises",
    raises_match=r"don't yet support saved tensor hooks",
    remedy=(
        "offload under the transform through a save policy of ckpt_guard.checkpoint: "
        "ckpt_guard.checkpoint(block, x, context_fn=ckpt_guard.checkpoint_policies.context_fn("
        "ckpt_guard.checkpoint_policies.offload_dots)) keeps each checkpointed block's matrix products "
        "as CPU copies (torch >= 2.5; elsewhere ckpt_guard.checkpoint alone keeps the memory saving), "
        "and take save_on_cpu off the transform (it may stay around an eager .backward() step)"
    ),
    fallback=(
        "sets the offload hooks aside while the transform runs (torch >= 2.8, which can read them): "
        "correct, nothing inside the transform is offloaded, its checkpointed blocks keep their saving"
    ),
    refs=(
        "https://github.com/pytorch/pytorch/issues/122729",
        "https://github.com/pytorch/pytorch/issues/141845",
        "https://github.com/pytorch/pytorch/pull/187316",
        "https://github.com/pytorch/pytorch/pull/131191",
        "https://github.com/pytorch/functorch/issues/1027",
    ),
    torch_note=(
        "functorch's grad transforms switch saved-tensor hooks off for their body and refuse a "
        "non-empty hooks stack at entry (since 2022); torch 2.5 lifted it for vmap and jvp "
        "(pytorch#131191); scoping it to higher orders is proposed, not merged (pytorch#187316)"
    ),
    probe=_probe_offload_around_transform,
    measured_on=("2.4.1", "2.13.0", "2.15.0"),
)

#: Every rule, in id order (how the CLI and the docs list them), for every supported torch.
RULES: tuple[Rule, ...] = tuple(sorted(
    _CALL_RULES + _DRIFT_RULES + [RNG_RULE, DEVICE_RULE, NESTED_OUTPUT_RULE, BUFFER_WRITES_RULE, OFFLOAD_RULE], key=lambda rule: rule.id
))
CALL_RULES: tuple[Rule, ...] = tuple(_CALL_RULES)
#: Recompute rules decided by comparing state captured in the forward and at recompute.
DRIFT_RULES: tuple[Rule, ...] = tuple(_DRIFT_RULES)
RULE_IDS: tuple[str, ...] = tuple(r.id for r in RULES)


def rules_on(version: Version, rules: Sequence[Rule] = RULES) -> tuple[Rule, ...]:
    """The rules whose claim holds on this torch ``(major, minor)``, in the given order."""
    return tuple(rule for rule in rules if rule.holds_on(version))


def rule_by_id(rule_id: str) -> Rule:
    for rule in RULES:
        if rule.id == rule_id.upper():
            return rule
    raise KeyError(rule_id)
