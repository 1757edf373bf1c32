"""Property-based differential test: random checkpoint compositions, five runs each.

Hypothesis draws a composition (``fuzz_compositions.Comp``): up to three stacked
torch.func transforms, functional_call with swapped parameters, forward-mode
dual inputs, a user dispatch/function mode, disable_saved_tensors_hooks,
no_grad, a default-dtype switch before backward, the checkpoint variant and the
entry point (checkpoint, a name bound before install, functools.partial,
checkpoint_sequential, checkpoint_wrapper).  Each is run as the uncheckpointed
reference, as raw torch (guard uninstalled) and guarded under strict, warn and
fallback, and we require:

* strict raises ``CheckpointCompositionError`` iff raw torch raises or differs
  from the reference (compositions whose reference raises are assumed away);
* fallback does not raise and matches the reference (except the one drift
  the guard documents as unforeseeable at call time, CKG105, where it raises
  the strict error by design);
* warn warns exactly when strict fires, and then behaves like raw torch;
* when strict is silent, the guarded result is bitwise identical to raw torch.

``CKPT_GUARD_FUZZ_EXAMPLES=N`` runs N examples with a random seed (default: 40,
derandomized, for CI).  Add ``-s`` to see the campaign summary (examples,
fired, false negatives, false positives) printed at the end of the module;
``--hypothesis-show-statistics`` shows the same per-example events.

Guard bugs found by the fuzzer are kept as explicit ``@example(...).xfail``
regressions below (strict: a fix shows up as a failure "did not raise"), and
the random draws of the same bug classes are counted, not failed (see
``known_bug``).
"""

from __future__ import annotations

import collections
import os
from typing import List, Optional

import pytest
from hypothesis import HealthCheck, assume, event, example, given, settings

import ckpt_guard
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed
from fuzz_compositions import Comp, all_close, all_equal, compositions, raw_crashes, run


def _holds(rule_id: str) -> bool:
    """Whether a rule's claim holds on the installed torch (version-specific xfails use it)."""
    return rule_by_id(rule_id).holds_on(installed())


EXAMPLES = int(os.environ.get("CKPT_GUARD_FUZZ_EXAMPLES", "40"))

#: Campaign counts, printed at the end of the module (visible with -s).
COUNTS: collections.Counter = collections.Counter()
#: Representative compositions per known-bug class seen in random draws.
SEEN_BUGS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _strict_guard():
    ckpt_guard.install("strict", rules={})
    try:
        yield
    finally:
        ckpt_guard.uninstall()
        if COUNTS:
            print("\nckpt_guard fuzz summary:")
            for key in ("examples", "reference raised (assumed away)", "raw torch crashes (left out)", "checked", "fired",
                        "raw wrong or raises", "false negatives", "false positives",
                        "other violations (known bugs)", "regression examples (xfail)"):
                print(f"  {key}: {COUNTS.get(key, 0)}")
            for key, value in sorted(COUNTS.items()):
                if key.startswith(("rule ", "known bug ")):
                    print(f"  {key}: {value}")
            for name, comp in SEEN_BUGS.items():
                print(f"  first {name}: {comp!r}")


# --------------------------------------------------------------------------
# the property


def violations(comp: Comp, outcomes: dict) -> List[str]:
    """Every way the five runs break the contract; [] when they keep it."""
    ref, raw, strict, warn, fallback = (outcomes[k] for k in ("reference", "raw", "strict", "warn", "fallback"))
    found = []
    raw_bad = raw.error is not None or not all_close(raw.values, ref.values)
    if raw_bad and not strict.fired:
        found.append(f"false negative: raw {raw.describe()} / differs from the reference, strict {strict.describe()}")
    if strict.fired and not raw_bad:
        found.append(f"false positive: raw matches the reference, strict {strict.describe()}")
    if not strict.fired:
        if strict.error is not None or raw.error is not None:
            if type(strict.error) is not type(raw.error):
                found.append(f"strict silent but behaves unlike raw: strict {strict.describe()}, raw {raw.describe()}")
        elif not all_equal(strict.values, raw.values):
            found.append("strict silent but its result is not bitwise identical to raw")
        if strict.warned:
            found.append(f"strict silent but warned {strict.warned}")
    # fallback
    unforeseeable = fallback.fired and fallback.error.rule.id == "CKG105"
    if fallback.error is not None and not unforeseeable:
        found.append(f"fallback {fallback.describe()}")
    elif fallback.error is None and not all_close(fallback.values, ref.values):
        found.append("fallback differs from the reference")
    # warn
    if bool(warn.warned) != strict.fired:
        found.append(f"warn warned {warn.warned} but strict {strict.describe()}")
    if warn.fired:
        found.append(f"warn raised the strict error: {warn.describe()}")
    elif raw.error is not None or warn.error is not None:
        if type(warn.error) is not type(raw.error):
            found.append(f"warn {warn.describe()} unlike raw {raw.describe()}")
    elif not all_equal(warn.values, raw.values):
        found.append("warn returned values not bitwise identical to raw")
    return found


def _all(found: List[str], *prefixes: str) -> bool:
    return all(v.startswith(prefixes) for v in found)


def known_bug(comp: Comp, found: List[str], outcomes: dict) -> Optional[str]:
    """The known guard bug these violations belong to (see the xfail examples), else None."""
    strict = outcomes["strict"]
    rule = strict.error.rule.id if strict.fired else None
    # FP-FORWARD-ONLY (by design, documented for CKG003): call-time rules whose
    # symptom needs a backward also fire when no backward follows.
    if rule in ("CKG003", "CKG006") and not comp.do_backward and _all(found, "false positive"):
        return "FP-FORWARD-ONLY"
    if not _all(found, "false positive"):
        return None
    # FP-PARENT-CAPTURED (documented limit): the checkpointed closure captures the
    # whole parent module, so CKG006 (reentrant: no input requires grad) and CKG003
    # (vmap: the output carries autograd history) count the parent's trainable
    # parameters even though the block itself is frozen.
    if rule in ("CKG003", "CKG006") and comp.fn_kind == "lambda" and not comp.block_trainable:
        return "FP-PARENT-CAPTURED"
    # FP-SEQ-HARMLESS-DRIFT (conservative): checkpoint_sequential checkpoints only
    # the Linear segment here; a swap, mode change or default-dtype change that the
    # recompute of that segment never turns into a different saved tensor still
    # fires the rule.
    if rule in ("CKG101", "CKG102", "CKG103", "CKG105") and comp.entry == "sequential":
        return "FP-SEQ-HARMLESS-DRIFT"
    # FP-SWAP-UNSEEN (documented limit): functional_call swaps only the head, but the
    # checkpointed function hides which tensors it reads (a closure over the whole
    # Net reads all of it; an object the guard does not look into), so the swapped
    # head counts as read.
    if rule == "CKG101" and comp.fcall == "head" and comp.fn_kind in ("lambda", "object"):
        return "FP-SWAP-UNSEEN"
    # FP-FUNCTIONALIZE-CKG104: a non-reentrant checkpoint under functionalize alone,
    # .backward() outside it: the recompute outside functionalize is harmless when
    # the input does not require grad, but CKG104 fires on the stack difference.
    if rule == "CKG104" and set(comp.transforms) == {"functionalize"}:
        return "FP-FUNCTIONALIZE-CKG104"
    return None


def check(comp: Comp) -> None:
    if comp.expect_bug:  # regression examples stay out of the campaign counts
        COUNTS["regression examples (xfail)"] += 1
        found = violations(comp, {how: run(comp, how) for how in ("reference", "raw", "strict", "warn", "fallback")})
        if found:
            raise AssertionError(f"{comp.expect_bug}: {comp!r}\n  " + "\n  ".join(found))
        return
    COUNTS["examples"] += 1
    if raw_crashes(comp):  # raw torch segfaults: measured in a subprocess elsewhere
        COUNTS["raw torch crashes (left out)"] += 1
        event("raw torch crashes (left out)")
        assume(False)
    outcomes = {"reference": run(comp, "reference")}
    if outcomes["reference"].error is not None:
        COUNTS["reference raised (assumed away)"] += 1
        event(f"reference raises {type(outcomes['reference'].error).__name__}")
        assume(False)
    for how in ("raw", "strict", "warn", "fallback"):
        outcomes[how] = run(comp, how)
    COUNTS["checked"] += 1
    raw, strict, ref = outcomes["raw"], outcomes["strict"], outcomes["reference"]
    raw_bad = raw.error is not None or not all_close(raw.values, ref.values)
    COUNTS["raw wrong or raises"] += raw_bad
    if strict.fired:
        COUNTS["fired"] += 1
        COUNTS[f"rule {strict.error.rule.id}"] += 1
        event(f"strict fired {strict.error.rule.id}")
    else:
        event("strict silent")
    found = violations(comp, outcomes)
    COUNTS["false negatives"] += any(v.startswith("false negative") for v in found)
    COUNTS["false positives"] += any(v.startswith("false positive") for v in found)
    if not found:
        return
    bug = known_bug(comp, found, outcomes)
    if comp.expect_bug:  # an explicit regression example: fail (it is an xfail) naming the class
        raise AssertionError(f"{comp.expect_bug} (classified {bug}): {comp!r}\n  " + "\n  ".join(found))
    if bug is not None:
        COUNTS["other violations (known bugs)"] += 1
        COUNTS[f"known bug {bug}"] += 1
        SEEN_BUGS.setdefault(bug, comp)
        event(f"known bug {bug}")
        return
    if os.environ.get("CKPT_GUARD_FUZZ_COLLECT"):  # exploration: record, do not fail
        COUNTS["unknown violations"] += 1
        print(f"\nVIOLATION {comp!r}\n  " + "\n  ".join(found)
              + "\n  " + "\n  ".join(f"{k}: {o.describe()}" for k, o in outcomes.items()))
        return
    raise AssertionError(f"{comp!r}\n  " + "\n  ".join(found))


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("CKPT_GUARD_FUZZ_EXAMPLES") is None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture],
    database=None,
)
@given(comp=compositions())
# One natural example per rule:
@example(comp=Comp(transforms=("grad",), use_reentrant=False, x_requires_grad=False, do_backward=False))  # CKG001
@example(comp=Comp(transforms=("vmap",), use_reentrant=True))  # CKG002
@example(comp=Comp(transforms=("vmap",), use_reentrant=None, entry="sequential"))  # CKG002, defaulted
@example(comp=Comp(transforms=("vmap",), use_reentrant=False))  # CKG003
@example(comp=Comp(dual=True, use_reentrant=True, do_backward=False))  # CKG004
@example(comp=Comp(hooks_disabled=True, use_reentrant=False))  # CKG005
@example(comp=Comp(use_reentrant=True, x_requires_grad=False))  # CKG006
@example(comp=Comp(use_reentrant=True, x_requires_grad=False, entry="bound", fn_kind="lambda"))  # CKG006
@example(comp=Comp(fcall="all", use_reentrant=False))  # CKG101
@example(comp=Comp(fcall="all", use_reentrant=True, entry="partial"))  # CKG101
@example(comp=Comp(mode="dispatch", use_reentrant=False))  # CKG102
@example(comp=Comp(mode="function", backward_in_mode=True, use_reentrant=True))  # CKG103
@example(comp=Comp(transforms=("vmap",), fn_kind="object", x_requires_grad=False, use_reentrant=False))  # CKG104
@example(comp=Comp(dtype_switch=True, use_reentrant=True))  # CKG105 (reentrant: silently wrong)
@example(comp=Comp(dtype_switch=True, use_reentrant=False, entry="wrapper"))  # CKG105 (non-reentrant: raises)
# Quiet compositions torch gets right:
@example(comp=Comp(use_reentrant=False, entry="wrapper"))
@example(comp=Comp(transforms=("vmap", "grad"), use_reentrant=False, no_grad=True, do_backward=False, x_requires_grad=False))
@example(comp=Comp(mode="dispatch", backward_in_mode=True, use_reentrant=False))
@example(comp=Comp(fcall="head", use_reentrant=False, entry="bound"))
# Regressions: guard bugs the fuzzer found, fixed since.
# The call-state reading asked unpack_dual (no batching rule) about vmapped inputs.
@example(comp=Comp(transforms=("vmap",), use_reentrant=False, dual=True, x_requires_grad=False, do_backward=False))
@example(comp=Comp(transforms=("jvp", "vmap"), use_reentrant=True, do_backward=False))
# CKG006 did not see the parameters behind checkpoint_sequential's closure over a
# list (and CKG101 could not tell that a swap of the head misses those segments).
@example(comp=Comp(entry="sequential", use_reentrant=True, x_requires_grad=False))
@example(comp=Comp(fcall="head", entry="sequential", use_reentrant=False))
# Under strict and fallback torch's non-reentrant recompute got a dual input detached (no tangent):
# "a different number of tensors was saved" where raw torch is right (found by CI's campaign).
@example(comp=Comp(dual=True, use_reentrant=False))
@example(comp=Comp(dual=True, use_reentrant=True))  # CKG004's fallback is the non-reentrant call
@example(comp=Comp(dual=True, use_reentrant=None, entry="wrapper", dtype_switch=True))
# Conservative cases (strict xfails, documented): a change to the guard shows up here.
@example(comp=Comp(use_reentrant=True, fn_kind="lambda", x_requires_grad=False, block_trainable=False, expect_bug="FP-PARENT-CAPTURED")).xfail(
    reason="FP-PARENT-CAPTURED (documented limit): the closure captures the whole Net; its head is "
    "trainable although the checkpointed block is frozen", raises=AssertionError)
@example(comp=Comp(transforms=("vmap",), use_reentrant=False, fn_kind="lambda", x_requires_grad=False, block_trainable=False, expect_bug="FP-PARENT-CAPTURED")).xfail(
    condition=_holds("CKG003"),  # before 2.12 torch itself refuses vmap here (CKG007): no false alarm
    reason="FP-PARENT-CAPTURED for CKG003 (found by a 1024-example campaign): vmap over a closure "
    "that captures the whole Net; only its head is trainable, and the head is not checkpointed",
    raises=AssertionError)
# CKG006 and CKG101 see a module in a dict the closure holds (they did not before); CKG101
# also sees one in an object's attribute.
@example(comp=Comp(use_reentrant=True, fn_kind="dict", x_requires_grad=False))
@example(comp=Comp(fcall="head", fn_kind="dict", use_reentrant=False))
@example(comp=Comp(fcall="head", fn_kind="namespace", use_reentrant=False))
# CKG006 sees a module behind an object's attribute or slot that the block's code names (it did
# not before: FN-PARAMS-UNSEEN, a reentrant call that trained nothing, silently)
@example(comp=Comp(use_reentrant=True, fn_kind="namespace", x_requires_grad=False))
@example(comp=Comp(use_reentrant=True, fn_kind="object", x_requires_grad=False))
@example(comp=Comp(transforms=("functionalize",), use_reentrant=False, x_requires_grad=False, expect_bug="FP-FUNCTIONALIZE-CKG104")).xfail(
    condition=_holds("CKG104"),  # before 2.12 torch refuses functionalize here (CKG007)
    reason="FP-FUNCTIONALIZE-CKG104: CKG104 fires although torch's result matches the reference",
    raises=AssertionError)
@example(comp=Comp(fcall="head", fn_kind="lambda", use_reentrant=False, expect_bug="FP-SWAP-UNSEEN")).xfail(
    reason="FP-SWAP-UNSEEN (documented limit): swap of the head only, closure captures the whole Net",
    raises=AssertionError)
@example(comp=Comp(entry="sequential", use_reentrant=True, dtype_switch=True, expect_bug="FP-SEQ-HARMLESS-DRIFT")).xfail(
    reason="FP-SEQ-HARMLESS-DRIFT for CKG105 (found by a 732-example campaign): the constant is "
    "created in the uncheckpointed last segment", raises=AssertionError)
@example(comp=Comp(mode="function", entry="sequential", use_reentrant=True, expect_bug="FP-SEQ-HARMLESS-DRIFT")).xfail(
    reason="FP-SEQ-HARMLESS-DRIFT: the mode only changes the uncheckpointed segment", raises=AssertionError)
@example(comp=Comp(transforms=("vmap",), use_reentrant=False, x_requires_grad=False, do_backward=False, expect_bug="FP-FORWARD-ONLY")).xfail(
    condition=_holds("CKG003"),  # before 2.12 torch refuses vmap here (CKG007)
    reason="FP-FORWARD-ONLY (documented for CKG003): no backward follows", raises=AssertionError)
@example(comp=Comp(use_reentrant=True, x_requires_grad=False, do_backward=False, expect_bug="FP-FORWARD-ONLY")).xfail(
    reason="FP-FORWARD-ONLY for CKG006: no backward follows", raises=AssertionError)
def test_guard_agrees_with_torch(comp):
    check(comp)
