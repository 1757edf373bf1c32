"""ckpt_guard: activation checkpointing that refuses to silently compute wrong gradients.

Quick start::

    import ckpt_guard
    ckpt_guard.install()            # policy from CKPT_GUARD_POLICY, default "strict"

Policies: ``strict`` raises :class:`CheckpointCompositionError`, ``warn`` emits
:class:`CheckpointCompositionWarning` and does what torch would, ``fallback``
warns and runs the safest correct alternative, ``off`` does nothing.

Importing this package does not import torch.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List, Mapping, Optional, Union

from . import _config, _patch
from ._events import Event, record
from ._exceptions import CheckpointCompositionError, CheckpointCompositionWarning
from ._rules import RULES, Rule

__all__ = [
    "CheckpointCompositionError",
    "CheckpointCompositionWarning",
    "Event",
    "Rule",
    "install",
    "is_installed",
    "policy",
    "record",
    "rules",
    "uninstall",
]

__version__ = "0.1.0"

RulesArg = Optional[Union[Mapping[str, str], str]]


def install(policy: Optional[str] = None, *, rules: RulesArg = None) -> None:
    """Guard every checkpoint call in this process.

    ``policy``: ``"off"``, ``"warn"``, ``"fallback"`` or ``"strict"``; ``None``
    reads ``CKPT_GUARD_POLICY`` (default ``"strict"``).  ``rules``: per-rule
    overrides ``{"CKG003": "warn"}`` (or ``"CKG003=warn,..."``); ``None`` reads
    ``CKPT_GUARD_RULES``.  Calling it again replaces the configuration.  Works
    before ``import torch``: patching then happens once torch is imported.
    Raises ``ValueError`` for a bad configuration.
    """
    _patch.install(_config.build_config(policy, rules, read_env=True))


def uninstall() -> None:
    """Put back everything ``install()`` replaced.  Safe to call twice."""
    _patch.uninstall()


def is_installed() -> bool:
    return _patch.is_installed()


@contextlib.contextmanager
def policy(policy: str, *, rules: RulesArg = None) -> Iterator[None]:
    """Use ``policy`` (and ``rules`` overrides) for checkpoint calls made in this block.

    The scope replaces the installed configuration entirely (installed
    per-rule overrides do not leak in) and is private to the current thread /
    asyncio task.  It has an effect only while the guard is installed.
    """
    token = _config.push_scope(_config.build_config(policy, rules, read_env=False))
    try:
        yield
    finally:
        _config.pop_scope(token)


def rules() -> tuple[Rule, ...]:
    """The rule table, in the order rules are evaluated."""
    return RULES


def current_config() -> str:
    """The configuration in force here, e.g. ``"strict (rules: CKG003=warn)"``."""
    return _config.current().describe()
