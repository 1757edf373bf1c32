"""Reader: the functorch interpreter stack (which torch.func transforms are active, at which levels).

Owns: ``transform_stack`` (the drift reader for CKG104/CKG105-style transform drift) and
``interpreter_levels`` (read off the C stack), and how a stack is written for the user
(``vmap(level 1) > grad(level 2)``).  May not touch: the decision or the words of a rule.
"""

from __future__ import annotations

from torch._C._functorch import peek_interpreter_stack
from torch._C._functorch import get_interpreter_stack as _get_interpreter_stack
from torch._C._functorch import TransformType as _TransformType


# --------------------------------------------------------------------------
# functorch transforms

_TRANSFORM_NAMES = {"Grad": "grad", "Vmap": "vmap", "Jvp": "jvp", "Functionalize": "functionalize"}
#: a TransformType's value -> its name (``key().name`` costs a microsecond; ``key().value`` a third)
KEY_NAMES = {int(key): name for name, key in _TransformType.__members__.items()}


def transform_stack() -> tuple[tuple[str, int], ...]:
    """The active torch.func transforms, outermost first: ``(("vmap", 1), ("grad", 2))``.

    vjp, jacrev and hessian run as ``grad``; jacfwd as ``jvp`` (+ ``vmap``).
    """
    if peek_interpreter_stack() is None:
        return ()
    return tuple(
        (_TRANSFORM_NAMES.get(name, name.lower()), level) for name, level in interpreter_levels()
    )


def interpreter_levels() -> tuple[tuple[str, int], ...]:
    """``(("Vmap", 1), ("Grad", 2))``: each live torch.func interpreter's key and level, outermost
    first, read off the C stack (a Python interpreter object per level costs microseconds, and the
    composable recompute asks several times per block)."""
    stack = _get_interpreter_stack()
    if not stack:
        return ()
    names = KEY_NAMES
    return tuple([(names[i.key().value], i.level()) for i in stack])


_GRAD = int(_TransformType.Grad)


def grad_level_alive() -> bool:
    """Whether a torch.func reverse-mode level (grad, vjp, jacrev, hessian) is alive now."""
    stack = _get_interpreter_stack()
    if stack:
        for interpreter in stack:
            if interpreter.key().value == _GRAD:
                return True
    return False


transform_stack.active = peek_interpreter_stack  # type: ignore[attr-defined]


def describe_transforms(stack: tuple[tuple[str, int], ...]) -> str:
    if not stack:
        return "none"
    return " > ".join(f"{name}(level {level})" for name, level in stack)
