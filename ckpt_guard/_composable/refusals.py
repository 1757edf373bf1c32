"""Why the composable recompute did not pack a call: :class:`Refused` and its :class:`Reason`.

Every refusal carries a stable class (``REFUSAL_CLASSES``, listed with why in
``docs/limits.md``) and, where the block already ran, its plain output, so a caller
never runs the block twice.  Owns: the refusal classes and their one-line texts, and the
two errors a recompute raises (the forward could not be repeated; an input changed
since the forward).  May not touch: the decision (it reads these).
"""

from __future__ import annotations

from typing import Any


class Refused(Exception):
    """The composable recompute cannot be correct for this call; ``reason`` says why (for messages).

    ``output``: what the block returned, where it already ran (a refusal the
    run-time proof found during the plain run: the caller returns that, and
    never runs the block a second time); :data:`NOT_RUN` where it did not.
    """

    def __init__(self, reason: str, output: Any = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.output = NOT_RUN if output is None else output

    @property
    def ran(self) -> bool:
        return self.output is not NOT_RUN


#: :attr:`Refused.output` where the block has not run
NOT_RUN = object()

class Reason(str):
    """Why a call cannot be packed into the recompute: the words users read, and a stable class.

    The class (``kind``) names a design decision, listed in ``REFUSAL_CLASSES``
    and, in full, in ``docs/limits.md`` ("Refusal classes"); the conformance
    matrix accepts a refusal only of a listed class.
    """

    kind: str
    #: the change to the user's code that makes the call packable, where there is one: a message's
    #: first fix line
    fix: str

    def __new__(cls, kind: str, text: str, fix: str = "") -> "Reason":
        if kind not in REFUSAL_CLASSES:
            raise ValueError(f"unknown refusal class {kind!r}")
        reason = str.__new__(cls, text)
        reason.kind = kind
        reason.fix = fix
        return reason

    def described(self) -> str:
        """The words, with the class to look up."""
        return f"{self} (refusal class {self.kind}, see docs/limits.md)"


def describe_reason(reason: str) -> str:
    return reason.described() if isinstance(reason, Reason) else reason


#: every refusal class: what it is about, in one line (docs/limits.md says why each is one)
REFUSAL_CLASSES = {
    "user-mode": "a user TorchDispatchMode or TorchFunctionMode is active: the recompute would run without it",
    "compiled": "the block is a torch.compile'd function or module (torch < 2.6 only)",
    "scripted": "the block reaches a TorchScript module (torch.jit.script / trace), which reads its own parameters",
    "functionalize": "functionalize does not transform custom autograd Functions",
    "forward-over-forward": "jvp over jvp: forward mode does not differentiate a custom jvp",
    "dual-level": "a forward-AD dual level of the user's own (not torch.func.jvp's), with reverse mode too",
    "parametrize-cached": "torch.nn.utils.parametrize.cached(): its cache would hold the recompute's tensors",
    "tensor-subclass": "a tensor subclass with its own __torch_function__ (ExpandedWeights)",
    "global-tensor": "a tensor needing a gradient read through a global or a class attribute",
    "unlifted-read": "a tensor needing a gradient read where the walk cannot bind it (found at run time), or held by an uncopyable object",
    "leaf-inside": "the block makes a tensor require grad (requires_grad_()): a leaf inside the checkpoint",
    "write-outside": "the block writes in place into a tensor it was neither given nor made",
    "unseen-update": "an input's memory changed in a way no torch function showed (a C extension)",
    "overlapping-write": "the block updates in place an input that shares memory with another input it is given",
    "long-container": "the block changes a container too long to keep a copy of",
    "aliasing-outputs": "two of the block's outputs share memory (h, h[0]): a write into one would miss the other's gradient",
    "compiled-transform": "inside torch.compile under a torch.func transform: the recompute cannot run in a compiled region",
}


#: :attr:`Plan.unpacked` where no reverse mode could differentiate the call
NOTHING_TO_SAVE = (
    "no reverse mode can differentiate it here (forward mode, a forward vmap, nothing requiring grad): "
    "the plain run kept nothing a checkpoint could save"
)


class ChangedSinceForward(RuntimeError):
    """A tensor the block reads was updated in place between its forward and this recompute.

    The recompute would read the new values (an optimizer step, ``w.mul_(2)``
    between ``vjp`` and its pullback, an in-place write through a view the
    block returned) and return wrong gradients.  Autograd's own check on
    saved tensors does not see it under torch.func: it compares the
    version of the transform's wrapper, which never moves.
    """
