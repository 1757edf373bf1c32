"""``ckpt_guard.saved_residuals(f, *args)``: what each checkpointed block keeps, and what its recomputes run.

JAX's ``print_saved_residuals`` answers "what does this checkpoint keep?" by
tracing.  Here the answer is measured: ``saved_residuals`` runs ``f`` once
with a report open on this thread, and the composable recompute's save-policy
machinery (``saving``) writes into it as it works:

* per checkpointed block call: where it was called, under which transforms,
  what the policy saved in the first forward (operation, shapes, dtype, bytes,
  the line of the user's code that ran it), what each name did;
* per recompute of that block (one per order that differentiates it): which
  saved outputs were handed back and which operations ran again, under which
  levels; or why nothing could be handed back there.

A block without a policy is run under one that saves nothing, so its
recomputes are listed too.  Only ``ckpt_guard.checkpoint``'s composable
recompute writes here (under torch.func, under a ``functional_call`` swap, or
with a naming policy); torch's own checkpoint outside transforms does not, and
the report says when no block wrote.  Nothing here runs unless a report is open.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from typing import Any, List, Optional

from .. import _files
from .._state.transforms import describe_transforms, transform_stack


class _Now(threading.local):
    def __init__(self) -> None:
        self.report: Optional["Residuals"] = None


NOW = _Now()

def _user_line() -> str:
    frame, _ = _files.user_frame(sys._getframe(1))  # from this function's caller outward
    if frame is None:
        return "?"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def user_stacklevel() -> int:
    """``warnings.warn``'s stacklevel, called from the function that warns, that names the user's line."""
    frame, depth = _files.user_frame(sys._getframe(1))  # from the function that warns outward
    return depth + 1 if frame is not None else 1


def _op_name(func: Any) -> str:
    return str(func)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


class SavedValue:
    """One output a policy saved: the operation, its shape and dtype, its bytes, the user's line."""

    __slots__ = ("op", "shape", "dtype", "nbytes", "where", "offloaded", "key", "dropped")

    def __init__(
        self, op: str, shape: tuple, dtype: Any, nbytes: int, where: str, offloaded: bool, key: tuple,
    ) -> None:
        self.op, self.shape, self.dtype, self.nbytes, self.where, self.offloaded = op, shape, dtype, nbytes, where, offloaded
        #: (operation, call index): the call it came from
        self.key = key
        #: why it is no longer kept (an in-place write into it since), or None: kept
        self.dropped: Optional[str] = None


class Recompute:
    """One recompute of a block: what was handed back, what ran again (by operation), under which levels."""

    def __init__(self, levels: str, note: str = "") -> None:
        self.levels = levels
        self.handed_back: "collections.Counter[str]" = collections.Counter()
        self.ran: "collections.Counter[str]" = collections.Counter()
        #: operations that ran again and compute nothing new (views, metadata queries, in-place ones)
        self.other = 0
        #: why nothing (more) was handed back, where that happened
        self.note = note

    def not_lined_up(self, func: Any) -> None:
        self.note = (
            f"from {_op_name(func)} on, the recompute's operations did not match the forward's "
            "(another path, or other arguments): everything after it ran again"
        )


class Block:
    """One checkpointed block call: where, under which transforms, what its policy saved, its recomputes."""

    def __init__(self, index: int, label: str, site: str, levels: str) -> None:
        self.index, self.label, self.site, self.levels = index, label, site, levels
        self.values: List[SavedValue] = []
        #: name -> (shape, why it is not saved, or None: saved)
        self.names: "dict[str, tuple]" = {}
        self.recomputes: List[Recompute] = []
        self.policy = ""

    # -- written by ``saving``

    def saved(self, func: Any, index: int, outputs: list, offload: bool) -> None:
        where = _user_line()
        for t in outputs:
            self.values.append(SavedValue(
                _op_name(func), tuple(t.shape), t.dtype, t.numel() * t.element_size(), where,
                offload and t.device.type != "cpu", (func, index),
            ))

    def dropped(self, func: Any, index: int, why: str) -> None:
        for value in self.values:
            if value.key == (func, index) and value.dropped is None:
                value.dropped = why

    def name(self, name: str, shape: tuple, why: Optional[str], key: Optional[tuple]) -> None:
        self.names[name] = (shape, why, key)

    def recompute(self, note: str = "") -> "_RecomputeWriter":
        entry = Recompute(describe_transforms(transform_stack()), note)
        self.recomputes.append(entry)
        return _RecomputeWriter(entry)

    # -- read

    @property
    def kept(self) -> List[SavedValue]:
        """The values still kept (not dropped by an in-place write since)."""
        return [v for v in self.values if v.dropped is None]

    @property
    def saved_bytes(self) -> int:
        return sum(v.nbytes for v in self.kept)

    def lines(self) -> List[str]:
        levels = self.levels if self.levels != "none" else "no torch.func transform"
        out = [f"block {self.index}: {self.label}, called at {self.site} under {levels}"
               + (f" ({self.policy})" if self.policy else "")]
        if self.values:
            out.append(f"  saved in the forward: {len(self.kept)} value(s), {_bytes(self.saved_bytes)}")
            for v in self.values:
                shape = "(" + ", ".join(map(str, v.shape)) + ("," if len(v.shape) == 1 else "") + ")"
                kept = " (offloaded to the CPU)" if v.offloaded else ""
                if v.dropped is not None:
                    kept += f" -- NOT kept: {v.dropped}; recomputed"
                out.append(f"    {v.op:<28} {shape:<16} {str(v.dtype).replace('torch.', ''):<9} "
                           f"{_bytes(v.nbytes):>10}  {v.where}{kept}")
        else:
            out.append("  saved in the forward: nothing (every operation is recomputed)")
        dropped = {v.key: v.dropped for v in self.values if v.dropped is not None}
        for name, (shape, why, key) in sorted(self.names.items()):
            if why is None and key in dropped:
                why = dropped[key]
            out.append(f"  name {name!r} {shape} (as the block sees it): "
                       + ("saved" if why is None else f"not saved: {why}"))
        if not self.recomputes:
            out.append("  recomputed: not yet (no backward of it ran inside the function)")
        for i, r in enumerate(self.recomputes, 1):
            handed = ", ".join(f"{op} x{n}" for op, n in sorted(r.handed_back.items())) or "nothing"
            ran = ", ".join(f"{op} x{n}" for op, n in sorted(r.ran.items())) or "nothing"
            out.append(f"  recompute {i}, inside {r.levels} (the innermost level is the recompute's own):")
            out.append(f"    handed back: {handed}")
            other = f" (and {r.other} view, metadata or in-place op(s))" if r.other else ""
            out.append(f"    ran again:   {ran}{other}")
            if r.note:
                out.append(f"    note: {r.note}")
        return out


class _RecomputeWriter:
    """What ``saving``'s hand-back mode calls, one per recompute."""

    __slots__ = ("entry",)

    def __init__(self, entry: Recompute) -> None:
        self.entry = entry

    def handed_back(self, func: Any) -> None:
        self.entry.handed_back[_op_name(func)] += 1

    def ran(self, func: Any, computes: bool) -> None:
        if computes:
            self.entry.ran[_op_name(func)] += 1
        else:  # views, metadata queries, in-place: listed as a count
            self.entry.other += 1

    def not_lined_up(self, func: Any) -> None:
        self.entry.not_lined_up(func)


class Residuals:
    """The report ``ckpt_guard.saved_residuals`` prints: one :class:`Block` per checkpointed block call."""

    def __init__(self) -> None:
        self.blocks: List[Block] = []
        #: what the function returned
        self.result: Any = None

    @property
    def saved_bytes(self) -> int:
        """Bytes the policies keep (values dropped by an in-place write since not counted)."""
        return sum(b.saved_bytes for b in self.blocks)

    def __str__(self) -> str:
        if not self.blocks:
            return (
                "saved_residuals: no block went through ckpt_guard.checkpoint's composable recompute: "
                "outside torch.func transforms torch's own checkpoint runs each block (with its own "
                "selective checkpointing, if given a policy), which this report cannot see"
            )
        values = sum(len(b.kept) for b in self.blocks)
        lines = [
            f"saved_residuals: {len(self.blocks)} checkpointed block call(s); their policies saved "
            f"{values} value(s), {_bytes(self.saved_bytes)} (besides each block's inputs, which every checkpoint keeps)"
        ]
        for block in self.blocks:
            lines.extend(block.lines())
        return "\n".join(lines)

    def __repr__(self) -> str:  # printed already: a REPL echoing the returned report gets one line
        return f"<saved_residuals: {len(self.blocks)} block call(s), {_bytes(self.saved_bytes)} saved by policies>"


def block_entry(label: str = "", policy: str = "") -> Optional[Block]:
    """A new entry for a block call, if a report is open on this thread (else None: nothing is collected)."""
    report = NOW.report
    if report is None:
        return None
    block = Block(len(report.blocks) + 1, label, _user_line(), describe_transforms(transform_stack()))
    block.policy = policy
    report.blocks.append(block)
    return block


def is_open() -> bool:
    return NOW.report is not None


def saved_residuals(function: Any, *args: Any, **kwargs: Any) -> Residuals:
    """Run ``function(*args, **kwargs)`` once and print what each checkpointed block saved and recomputed."""
    report = Residuals()
    previous, NOW.report = NOW.report, report
    try:
        report.result = function(*args, **kwargs)
    finally:
        NOW.report = previous
    print(report)
    return report
