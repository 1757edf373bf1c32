"""The live compatibility matrix behind ``python -m ckpt_guard``: measure, never look up.

Every rule's probe (each variant it is about) and every safe composition's
probe is run four ways on the installed torch:

* ``reference``: no checkpointing at all (the probe's ``ckpt`` is a plain call);
* ``raw``: the guard uninstalled, ``torch.utils.checkpoint.checkpoint``;
* ``strict``: the guard installed with ``strict`` (no per-rule overrides);
* ``fallback``: the guard installed with ``fallback``.

What raw torch did is *measured* (it raised, or it returned values that match
the reference or not) and only then compared with what the rule table claims,
so a rule that torch has fixed upstream shows up as a disagreement.

Everything here returns data (:class:`Row`, :func:`header`); printing lives in
``_cli.py``.  Torch is imported when the functions run, not at import time.
The install state that existed before :func:`run_matrix` (installed or not,
and with which configuration) is restored after it, and so is the global RNG.
"""

from __future__ import annotations

import contextlib
import platform
import re
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

from . import _config, _patch, _versions
from ._exceptions import CheckpointCompositionError, CheckpointCompositionWarning
from ._rules import NON_REENTRANT, REENTRANT, Rule, rule_by_id

__all__ = ["Row", "header", "measure_rule", "measure_composition", "run_matrix", "exit_code", "problems"]

#: How many characters of an exception's message a row keeps.
MESSAGE_CHARS = 50

# What a run of a probe came to.
_RETURNED, _RAISED = "returned", "raised"


@dataclass
class Row:
    """One composition and variant (and device), as measured."""

    kind: str  # "rule" or "safe"
    rule_id: str  # the rule's id, "-" for a safe composition
    name: str  # the rule's title, or the safe composition's name
    variant: str  # "reentrant" or "non-reentrant"
    device: str  # "cpu" or "cuda"
    expected: str  # what the table says raw torch does: "raises", "silently wrong", or "ok" (safe)
    raw: str  # measured: "ok", "silently wrong", or "raises: <Type>: <message start>"
    strict: str  # "raised", "repaired", "passed", "raised <OTHER ID>", or "error: <Type>: <message start>"
    strict_equal_raw: Optional[bool]  # safe compositions: strict bitwise equal to raw (None: n/a)
    fallback: str  # "ok", "wrong", "raises (by design)", "raises: <Type>: <message start>", or "n/a"
    fallback_actions: List[str] = field(default_factory=list)  # what the guard recorded under fallback
    #: what fallback ran ("checkpoint", "use_reentrant=False", "composable", "no checkpoint") and
    #: whether the memory saving was kept ("kept", "no", "-"), measured (see fallback_ran)
    fallback_ran: str = ""
    fallback_saving: str = ""
    #: CheckpointCompositionWarning texts (first lines) under strict: a false alarm on a safe composition
    strict_warnings: List[str] = field(default_factory=list)
    #: ... and under fallback, where a drift rule warns whenever its risk is visible at call
    #: time (it then runs the block without checkpointing): by design, even on safe compositions
    fallback_warnings: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)  # one line per disagreement; empty: agrees
    seconds: float = 0.0

    @property
    def agrees(self) -> bool:
        return not self.problems

    @property
    def fallback_ok(self) -> bool:
        return self.fallback in ("ok", "raises (by design)")

    def as_dict(self) -> dict:
        data = asdict(self)
        data["agrees"] = self.agrees
        data["fallback_ok"] = self.fallback_ok
        return data


# --------------------------------------------------------------------------
# running one probe


@dataclass
class _Outcome:
    how: str  # _RETURNED or _RAISED
    values: Any = None
    error: Optional[BaseException] = None
    caught: List[Any] = field(default_factory=list)  # warnings.WarningMessage
    events: list = field(default_factory=list)
    #: recomputes seen during the run: (torch's checkpoint, composable, composable differentiable)
    recomputes: tuple = (0, 0, 0)

    @property
    def raised(self) -> bool:
        return self.how == _RAISED


def _reference_checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: Any = None, **kwargs: Any) -> Any:
    """The uncheckpointed reference: same call shape as checkpoint, plain call."""
    kwargs.pop("preserve_rng_state", None)
    kwargs.pop("context_fn", None)
    kwargs.pop("determinism_check", None)
    kwargs.pop("debug", None)
    return function(*args, **kwargs)


@contextlib.contextmanager
def _device(device: str) -> Iterator[None]:
    if device == "cpu":
        yield  # no device context at all: the probe runs exactly as written
        return
    import torch

    with torch.device(device):
        yield


def _run(probe: Callable[..., Any], use_reentrant: bool, mode: str, device: str) -> _Outcome:
    """Run ``probe`` once: mode "reference", "raw", or a policy name ("strict", "fallback")."""
    import torch.utils.checkpoint as tuc

    from . import _events

    _patch.uninstall()
    if mode in ("reference", "raw"):
        ckpt = _reference_checkpoint if mode == "reference" else tuc.checkpoint
    else:
        _patch.install(_config.build_config(mode, {}, read_env=False))
        ckpt = tuc.checkpoint
    # A scope opened by the caller (``with ckpt_guard.policy(...)``) must not
    # override the policy under test: a None scope reads the installed config.
    token = _config.push_scope(None)  # type: ignore[arg-type]
    before = _recompute_counts()
    try:
        with warnings.catch_warnings(record=True) as caught, _events.record() as events, _device(device):
            warnings.simplefilter("always")
            try:
                values = list(probe(ckpt, use_reentrant))
            except Exception as exc:  # noqa: BLE001 - measuring what happens is the point
                return _Outcome(_RAISED, error=exc, caught=list(caught), events=list(events))
            recomputes = tuple(now - then for now, then in zip(_recompute_counts(), before))
            return _Outcome(_RETURNED, values=values, caught=list(caught), events=list(events), recomputes=recomputes)
    finally:
        _config.pop_scope(token)
        _patch.uninstall()


def _recompute_counts() -> tuple:
    """(torch's checkpoint recomputes, composable recomputes, derivatives checkpointed in turn) so far."""
    import sys

    drift, composable = sys.modules.get("ckpt_guard._drift"), sys.modules.get("ckpt_guard._composable")
    return (
        drift.TORCH_RECOMPUTES[0] if drift else 0,
        composable.counters.RECOMPUTES if composable else 0,
        composable.counters.NESTED_RECOMPUTES if composable else 0,
    )


def fallback_ran(outcome: _Outcome) -> tuple:
    """What fallback ran, and whether checkpointing's memory saving was kept, measured.

    ``(ran, saving)``: ran is "checkpoint" (torch's, as asked), "use_reentrant=False", "no early stop",
    "composable" or "no checkpoint"; saving is "kept" (the block was recomputed in the
    backward, so its forward kept no activations; a backward differentiated again is
    checkpointed in turn), "no" (run plainly) or "-" (nothing recomputed).
    """
    actions = {event.action for event in outcome.events}
    torch_recomputes, composable_recomputes, _ = outcome.recomputes
    if "fallback: composable recompute" in actions:
        ran = "composable"
    elif "fallback: no checkpoint" in actions:
        ran = "no checkpoint"
    elif "fallback: use_reentrant=False" in actions:
        ran = "use_reentrant=False"
    elif "fallback: no early stop" in actions:
        ran = "no early stop"
    else:
        ran = "checkpoint"
    if ran == "no checkpoint":
        saving = "no"
    elif composable_recomputes or torch_recomputes:
        saving = "kept"
    else:
        saving = "-"
    return ran, saving


def short_error(exc: BaseException, chars: int = MESSAGE_CHARS) -> str:
    """``Type: first line of the message``, the message cut to about ``chars`` characters."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if len(text) > chars:
        text = text[: chars - 1].rstrip() + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _close(actual: Sequence[Any], expected: Sequence[Any], *, exact: bool = False) -> bool:
    """torch.testing.assert_close over two lists of results (``exact``: bitwise)."""
    import torch

    if len(actual) != len(expected):
        return False
    for a, e in zip(actual, expected):
        if a is None or e is None:
            if a is not e:
                return False
            continue
        try:
            if exact:
                torch.testing.assert_close(a, e, rtol=0, atol=0, equal_nan=True)
            else:
                torch.testing.assert_close(a, e)
        except Exception:  # noqa: BLE001 - AssertionError, or TypeError for mismatched kinds
            return False
    return True


def _guard_warnings(outcome: _Outcome) -> List[str]:
    return [
        str(w.message).splitlines()[0]
        for w in outcome.caught
        if issubclass(w.category, CheckpointCompositionWarning)
    ]


def _use_reentrant(variant: str) -> bool:
    if variant not in (REENTRANT, NON_REENTRANT):
        raise ValueError(f"unknown checkpoint variant {variant!r}; expected {REENTRANT!r} or {NON_REENTRANT!r}")
    return variant == REENTRANT


def _torch_version() -> str:
    import torch

    return torch.__version__


def _classify_raw(raw: _Outcome, reference: _Outcome) -> str:
    if raw.raised:
        return f"raises: {short_error(raw.error)}"  # type: ignore[arg-type]
    return "ok" if _close(raw.values, reference.values) else "silently wrong"


def _kind_of(measured: str) -> str:
    return "raises" if measured.startswith("raises") else measured


def _error_rule_id(exc: Optional[BaseException]) -> Optional[str]:
    if isinstance(exc, CheckpointCompositionError):
        return getattr(getattr(exc, "rule", None), "id", None)
    return None


# --------------------------------------------------------------------------
# one row


def _label(name: str, variant: str, device: str) -> str:
    return f"{name} ({variant}{'' if device == 'cpu' else ', ' + device})"


def _four_runs(probe: Any, use_reentrant: bool, device: str) -> tuple:
    """The reference, raw torch, strict and fallback runs of one probe."""
    return tuple(_run(probe, use_reentrant, how, device) for how in ("reference", "raw", "strict", "fallback"))


def _broken_probe(label: str, reference: Any, raw: Any, problems: List[str]) -> str:
    """The reference itself raised: the probe is broken; say so, return the raw column."""
    problems.append(
        f"BROKEN PROBE: {label}: the uncheckpointed reference raised "
        f"{short_error(reference.error, 200)}"  # type: ignore[arg-type]
    )
    return "raises: " + short_error(raw.error) if raw.raised else "ok?"  # type: ignore[arg-type]


def _fallback_raises_by_design(rule: Rule) -> bool:
    """A drift seen only at recompute, or a transform's entry where this torch cannot set the offload aside."""
    if rule.stage == "transform":
        from ._transform_entry import fallback_can_set_aside

        return not fallback_can_set_aside()
    return rule.stage == "recompute"


def measure_rule(rule: Rule, variant: str, device: str = "cpu", composition: Any = None) -> Row:
    """Run ``rule``'s probe four ways and say whether the table's claims hold.

    ``composition``: run that composition's probe instead, as a case of
    ``rule`` (a composition torch gets right elsewhere, refused on this torch).
    """
    started = time.perf_counter()
    use_reentrant = _use_reentrant(variant)
    label = _label(rule.id if composition is None else f"{rule.id} ({composition.name})", variant, device)
    expected = rule.symptom_for(variant)
    version = _torch_version()
    problems: List[str] = []

    probe = rule.probe if composition is None else composition.probe
    reference, raw, strict, fallback = _four_runs(probe, use_reentrant, device)

    # --- raw torch, measured, then compared with the table
    if reference.raised:
        raw_text = _broken_probe(label, reference, raw, problems)
    else:
        raw_text = _classify_raw(raw, reference)
        measured = _kind_of(raw_text)
        if isinstance(raw.error, CheckpointCompositionError):
            problems.append(f"BROKEN MATRIX: {label}: the guard was still active in the raw run")
        elif measured != expected:
            said = "returned ok" if measured == "ok" else (
                "returned silently wrong results" if measured == "silently wrong" else f"raised {short_error(raw.error, 80)}"  # type: ignore[arg-type]
            )
            hint = "rule may be fixed upstream" if measured == "ok" else "the table's symptom needs updating"
            problems.append(f"STALE: {label}: table says {expected}, torch {version} {said} — {hint}")
        elif measured == "raises" and rule.raises_match and not re.search(rule.raises_match, str(raw.error)):
            problems.append(
                f"STALE: {label}: table says torch raises an error matching /{rule.raises_match}/, "
                f"torch {version} raised {short_error(raw.error, 80)} — the table's symptom needs updating"  # type: ignore[arg-type]
            )

    # --- strict: CheckpointCompositionError for this very rule (or, where the table says strict
    # repairs it without a word, the reference's values)
    strict_id = _error_rule_id(strict.error)
    if rule.repaired_quietly and not strict.raised:
        strict_text = "repaired" if reference.raised or _close(strict.values, reference.values) else "wrong"
        if strict_text == "wrong":
            problems.append(f"GUARD: {label}: strict returned values that differ from the uncheckpointed reference")
    elif not strict.raised:
        strict_text = "passed"
        problems.append(f"GUARD: {label}: strict let the composition through (no CheckpointCompositionError)")
    elif strict_id == rule.id:
        strict_text = "raised"
    elif strict_id is not None:
        strict_text = f"raised {strict_id}"
        problems.append(f"GUARD: {label}: strict raised {strict_id}, not {rule.id}")
    else:
        strict_text = f"error: {short_error(strict.error)}"  # type: ignore[arg-type]
        problems.append(f"GUARD: {label}: strict ended in {short_error(strict.error, 80)}, not CheckpointCompositionError")  # type: ignore[arg-type]

    # --- fallback: the reference's values, or (drift seen only at recompute) the strict error
    if fallback.raised:
        if _fallback_raises_by_design(rule) and _error_rule_id(fallback.error) == rule.id:
            fallback_text = "raises (by design)"
        else:
            fallback_text = f"raises: {short_error(fallback.error)}"  # type: ignore[arg-type]
            problems.append(f"GUARD: {label}: fallback raised {short_error(fallback.error, 80)}")  # type: ignore[arg-type]
    elif reference.raised:
        fallback_text = "n/a"  # nothing to compare with; the broken probe is reported above
    elif _close(fallback.values, reference.values):
        fallback_text = "ok"
    else:
        fallback_text = "wrong"
        problems.append(f"GUARD: {label}: fallback returned values that differ from the uncheckpointed reference")

    return Row(
        kind="rule",
        rule_id=rule.id,
        name=rule.title if composition is None else f"{composition.name}: {rule.title}",
        variant=variant,
        device=device,
        expected=expected,
        raw=raw_text,
        strict=strict_text,
        strict_equal_raw=None,
        fallback=fallback_text,
        fallback_actions=[f"{e.rule_id}: {e.action}" for e in fallback.events],
        fallback_ran=fallback_ran(fallback)[0],
        fallback_saving=fallback_ran(fallback)[1],
        strict_warnings=_guard_warnings(strict),
        fallback_warnings=_guard_warnings(fallback),
        problems=problems,
        seconds=round(time.perf_counter() - started, 3),
    )


def measure_composition(composition: Any, variant: str, device: str = "cpu") -> Row:
    """Run a safe composition's probe four ways: the guard must stay out of the way."""
    started = time.perf_counter()
    use_reentrant = _use_reentrant(variant)
    label = _label(composition.name, variant, device)
    version = _torch_version()
    problems: List[str] = []

    reference, raw, strict, fallback = _four_runs(composition.probe, use_reentrant, device)

    if reference.raised:
        raw_text = _broken_probe(label, reference, raw, problems)
    else:
        raw_text = _classify_raw(raw, reference)
        if raw_text != "ok":
            problems.append(f"UNSAFE: {label}: listed as safe, but torch {version} {raw_text}")

    strict_equal: Optional[bool] = None
    strict_id = _error_rule_id(strict.error)
    if not strict.raised:
        strict_text = "passed"
        strict_equal = (not raw.raised) and _close(strict.values, raw.values, exact=True)
        if not strict_equal:
            problems.append(f"FALSE ALARM: {label}: strict returned values that are not bitwise equal to raw torch")
    elif strict_id is not None:
        strict_text = f"raised {strict_id}"
        problems.append(f"FALSE ALARM: {label}: strict raised {strict_id} on a safe composition")
    else:
        strict_text = f"error: {short_error(strict.error)}"  # type: ignore[arg-type]
        if not raw.raised:
            problems.append(f"FALSE ALARM: {label}: strict ended in {short_error(strict.error, 80)}")  # type: ignore[arg-type]

    if fallback.raised:
        fallback_text = f"raises: {short_error(fallback.error)}"  # type: ignore[arg-type]
        problems.append(f"FALSE ALARM: {label}: fallback raised {short_error(fallback.error, 80)}")  # type: ignore[arg-type]
    elif reference.raised:
        fallback_text = "n/a"  # nothing to compare with; the broken probe is reported above
    elif _close(fallback.values, reference.values):
        fallback_text = "ok"
    else:
        fallback_text = "wrong"
        problems.append(f"FALSE ALARM: {label}: fallback returned values that differ from the reference")

    strict_warnings = _guard_warnings(strict)
    for text in strict_warnings:
        problems.append(f"FALSE ALARM: {label}: CheckpointCompositionWarning under strict: {text}")

    return Row(
        kind="safe",
        rule_id="-",
        name=composition.name,
        variant=variant,
        device=device,
        expected="ok",
        raw=raw_text,
        strict=strict_text,
        strict_equal_raw=strict_equal,
        fallback=fallback_text,
        fallback_actions=[f"{e.rule_id}: {e.action}" for e in fallback.events],
        fallback_ran=fallback_ran(fallback)[0],
        fallback_saving=fallback_ran(fallback)[1],
        strict_warnings=strict_warnings,
        fallback_warnings=_guard_warnings(fallback),
        problems=problems,
        seconds=round(time.perf_counter() - started, 3),
    )


# --------------------------------------------------------------------------
# the whole matrix

#: (kind, subject, variant, device); kind "rule" (subject a Rule), "safe" (a Composition)
#: or "covered" (subject (Rule, Composition): a composition this torch refuses, as a case of the rule)
Task = Tuple[str, Any, str, str]


def devices() -> List[str]:
    """``cpu``, plus ``cuda`` when a GPU is usable."""
    import torch

    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def plan(
    rules: Optional[Iterable[Rule]] = None,
    compositions: Optional[Iterable[Any]] = None,
    on: Optional[Sequence[str]] = None,
) -> List[Task]:
    """Every (rule or composition, variant, device) the matrix runs, in order."""
    if rules is None:
        from ._rules import RULES as rules  # noqa: N811
    if compositions is None:
        from ._compositions import SAFE_COMPOSITIONS as compositions  # noqa: N811
    version = _versions.installed()
    rules = [r for r in rules if r.holds_on(version)]
    compositions = list(compositions)
    tasks: List[Task] = []
    for device in on if on is not None else devices():
        tasks += [("rule", r, v, device) for r in rules for v in r.variants if device != "cpu" or not r.needs_gpu]
        for c in compositions:
            if c.holds_on(version):
                tasks += [("safe", c, v, device) for v in c.variants]
            elif c.otherwise and rule_by_id(c.otherwise).holds_on(version):
                tasks += [("covered", (rule_by_id(c.otherwise), c), v, device) for v in c.variants]
    return tasks


def not_here(rules: Optional[Iterable[Rule]] = None, compositions: Optional[Iterable[Any]] = None) -> List[str]:
    """What the matrix leaves out on this torch, and why: one line per rule or composition."""
    if rules is None:
        from ._rules import RULES as rules  # noqa: N811
    if compositions is None:
        from ._compositions import SAFE_COMPOSITIONS as compositions  # noqa: N811
    version = _versions.installed()
    lines = [f"{r.id}: its claim holds on torch {r.torch_range}" for r in rules if not r.holds_on(version)]
    if "cuda" not in devices():
        lines += [f"{r.id}: needs a GPU (a default device other than the CPU)" for r in rules if r.needs_gpu]
    lines += [
        f"{c.name}: torch gets it right on {c.torch_range}"
        + (f" (here it is a case of {c.otherwise})" if c.otherwise else " (not available here)")
        for c in compositions
        if not c.holds_on(version)
    ]
    return lines


def task_label(task: Task) -> str:
    kind, subject, variant, device = task
    if kind == "covered":
        name = f"{subject[0].id} ({subject[1].name})"
    else:
        name = subject.id if kind == "rule" else subject.name
    return f"{name} {variant}" + ("" if device == "cpu" else f" {device}")


@contextlib.contextmanager
def _preserved_state(on: Sequence[str]) -> Iterator[None]:
    """Put back the guard's install state, the RNG and the default dtype afterwards."""
    import torch

    was_installed = _patch.is_installed()
    installed_config = _config.installed()  # the process-wide configuration, not a scope
    dtype = torch.get_default_dtype()
    cuda_devices = list(range(torch.cuda.device_count())) if "cuda" in on else []
    try:
        with torch.random.fork_rng(devices=cuda_devices):
            yield
    finally:
        torch.set_default_dtype(dtype)
        _patch.uninstall()
        if was_installed:
            _patch.install(installed_config)


def run_matrix(
    rules: Optional[Iterable[Rule]] = None,
    compositions: Optional[Iterable[Any]] = None,
    on: Optional[Sequence[str]] = None,
    progress: Optional[Callable[[int, int, str], None]] = None,
) -> List[Row]:
    """Measure every rule (each variant) and safe composition on each device.

    ``rules`` / ``compositions`` default to the whole table and
    ``SAFE_COMPOSITIONS``; ``on`` defaults to :func:`devices`.
    ``progress(i, n, label)`` is called before each row is measured.
    """
    on = list(on) if on is not None else devices()
    tasks = plan(rules, compositions, on)
    rows: List[Row] = []
    with _preserved_state(on):
        for i, task in enumerate(tasks, 1):
            if progress is not None:
                progress(i, len(tasks), task_label(task))
            kind, subject, variant, device = task
            if kind == "covered":
                rows.append(measure_rule(subject[0], variant, device, composition=subject[1]))
            elif kind == "rule":
                rows.append(measure_rule(subject, variant, device))
            else:
                rows.append(measure_composition(subject, variant, device))
    return rows


def problems(rows: Iterable[Row]) -> List[str]:
    """Every disagreement, one line each, in row order."""
    return [line for row in rows for line in row.problems]


def exit_code(rows: Iterable[Row]) -> int:
    """0 when every row agrees with the table, else 1."""
    return 0 if all(row.agrees for row in rows) else 1


def header(on: Optional[Sequence[str]] = None) -> dict:
    """Versions and devices the matrix was measured with."""
    import torch

    from . import __version__

    on = list(on) if on is not None else devices()
    return {
        "ckpt_guard": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda_used": "cuda" in on,
        "cuda_device": torch.cuda.get_device_name(0) if "cuda" in on else None,
        "devices": on,
        "interception": interception(),
        "not_on_this_torch": not_here(),
    }


def interception() -> str:
    """Whether checkpoint calls reach the guard on this torch (installs it for a moment).

    The install state before the call is put back.
    """
    was_installed = _patch.is_installed()
    installed_config = _config.installed()
    _patch.uninstall()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the line below says it all
            try:
                _patch.install(_config.build_config("warn", {}, read_env=False))
            except RuntimeError as exc:  # a torch too old for the guard
                return f"NOT WORKING: {exc}"
            return _patch.interception()
    finally:
        _patch.uninstall()
        if was_installed:
            _patch.install(installed_config)
