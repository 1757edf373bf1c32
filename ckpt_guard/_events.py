"""A record of every decision the guard makes, for tests and CI.

``with ckpt_guard.record() as events:`` collects :class:`Event` objects; the
pytest plugin's ``ckpt_guard_events`` fixture is the same list.  Recorders are
process-wide (not per context) on purpose: a recompute runs inside backward,
possibly on an autograd worker thread, and its decisions must still land in the
recording that was open when the test ran.

No torch here.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, List

__all__ = ["Event", "record"]


@dataclass(frozen=True)
class Event:
    """One decision: rule ``rule_id`` fired, ``policy`` applied, ``action`` taken."""

    rule_id: str
    policy: str  # "warn", "fallback" or "strict"
    action: str  # "raised", "warned", "fallback: use_reentrant=False", "fallback: no checkpoint"
    call_site: str  # "file:line in function" of the checkpoint call
    stage: str  # "call" or "recompute"


_recorders: List[List[Event]] = []
_lock = threading.Lock()


def emit(rule_id: str, policy: str, action: str, call_site: str, stage: str) -> None:
    if _recorders:
        event = Event(rule_id, policy, action, call_site, stage)
        with _lock:
            for events in _recorders:
                events.append(event)


@contextlib.contextmanager
def record() -> Iterator[List[Event]]:
    """Collect every guard decision made while the block runs (all threads)."""
    events: List[Event] = []
    with _lock:
        _recorders.append(events)
    try:
        yield events
    finally:
        with _lock:
            _recorders.remove(events)
