"""Which torch releases the guard supports, and which ones a claim holds on.

Every claim in the rule table ("torch raises here", "torch is right here") is
tied to a :class:`TorchRange` of releases, measured on real releases (see
:data:`MEASURED`), so the guard, the tests and ``python -m ckpt_guard`` all read
the expectations for the installed torch from one place.  Releases are compared
by ``(major, minor)``: a local build suffix (``+cpu``, ``+cu132``) or a dev tag
(``2.16.0a0+git...``) does not change which claims apply.

No torch here: ``import ckpt_guard`` and the configuration check stay torch-free.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional, Tuple

Version = Tuple[int, int]

#: The oldest torch the guard supports (and CI runs).
MIN_TORCH: Version = (2, 4)
#: The newest torch release CI runs; newer releases are used as they come, and
#: ``python -m ckpt_guard`` says whether the table still holds there.
NEWEST_TESTED = "2.15.0"
#: Releases the table's ranges were measured on (rules, safe compositions and
#: the interception layouts), oldest first.
MEASURED = ("2.4.1", "2.5.0", "2.8.0", "2.11.0", "2.12.0", "2.13.0", "2.14.1", "2.15.0")


def parse(version: str) -> Optional[Version]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``None`` for a string that is not ``X.Y...``."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return None
    return major, minor


def installed() -> Version:
    """``(major, minor)`` of the imported torch; an unreadable version counts as the newest."""
    torch = sys.modules.get("torch")
    parsed = parse(str(getattr(torch, "__version__", "")))
    return parsed if parsed is not None else (99, 0)


def _text(version: Version) -> str:
    return f"{version[0]}.{version[1]}"


@dataclass(frozen=True)
class TorchRange:
    """The torch releases ``since <= (major, minor) < until``; ``until=None``: no end known."""

    since: Version = MIN_TORCH
    until: Optional[Version] = None

    def __contains__(self, version: object) -> bool:
        return (
            isinstance(version, tuple)
            and self.since <= version
            and (self.until is None or version < self.until)
        )

    def __str__(self) -> str:
        if self.until is None:
            return f">={_text(self.since)}" if self.since > MIN_TORCH else f"all supported (>={_text(MIN_TORCH)})"
        last = (self.until[0], self.until[1] - 1) if self.until[1] > 0 else None
        start = _text(self.since)
        return f"{start}–{_text(last)}" if last is not None and last != self.since else (
            start if last == self.since else f"{start} to before {_text(self.until)}"
        )


#: Every supported release.
ALL = TorchRange()
