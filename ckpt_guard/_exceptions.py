"""The two things ckpt_guard raises or warns with.

This module must not import torch: users filter the warning (``-W``,
``PYTHONWARNINGS``) and catch the error before torch is necessarily loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ._rules import Rule

__all__ = ["CheckpointCompositionError", "CheckpointCompositionWarning"]


class CheckpointCompositionError(RuntimeError):
    """A checkpoint call composes with its surroundings in a way torch gets wrong.

    Subclasses ``RuntimeError`` so existing ``except RuntimeError`` code keeps
    working. ``.rule`` is the rule record that fired (``.rule.id``,
    ``.rule.title``, ...).
    """

    __module__ = "ckpt_guard"  # tracebacks name the public class

    def __init__(self, message: str, rule: Rule) -> None:
        super().__init__(message)
        self.rule = rule

    def __reduce__(self):  # picklable (multiprocessing, distributed error reports)
        return (_rebuild, (type(self), self.args[0], self.rule.id))


class CheckpointCompositionWarning(UserWarning):
    """Emitted by the ``warn`` and ``fallback`` policies; ``.rule`` as above."""

    __module__ = "ckpt_guard"

    def __init__(self, message: str, rule: Rule) -> None:
        super().__init__(message)
        self.rule = rule

    def __reduce__(self):
        return (_rebuild, (type(self), self.args[0], self.rule.id))


def _rebuild(cls: type, message: str, rule_id: str) -> BaseException:
    """Unpickle: the rule by its id (rule records hold functions, some of them lambdas)."""
    from ._rules import rule_by_id

    return cls(message, rule_by_id(rule_id))
