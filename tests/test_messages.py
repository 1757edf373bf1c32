"""Every fix line, followed literally, leads somewhere better than where the user is.

The programs are the ones users run: functorch's MAML step (vmap over tasks,
inner ``torch.func.grad``, outer ``.backward()``), per-sample gradients, a
MeanFlow loss.  A strict error's fallback line is followed as written (its
``rules={...}`` parsed and installed) and the program then runs and equals the
uncheckpointed one, in one round.  Where fallback already worked, no line
switches the rule to warn or off (that would bring torch's error back).
"""

from __future__ import annotations

import ast
import re
import warnings

import pytest
import torch
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError, CheckpointCompositionWarning
from ckpt_guard._rules import rule_by_id
from ckpt_guard._versions import installed
from conftest import per_sample_grads_refusal


class Net(torch.nn.Module):
    def __init__(self, checkpointing: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(2))
        self.checkpointing = checkpointing

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointing else block(x)
        return x.pow(2).mean()


def maml_step(net: Net) -> list:
    """functorch's MAML example, small: per task an inner grad step, then the query loss; .backward()."""
    params = dict(net.named_parameters())
    support = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    query = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(2))

    def task(x_support, x_query):
        g = grad(lambda p: functional_call(net, p, (x_support,)))(params)
        return functional_call(net, {k: params[k] - 0.1 * g[k] for k in params}, (x_query,))

    net.zero_grad(set_to_none=True)
    vmap(task)(support, query).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def _fallback_line(message: str) -> dict:
    """The ``rules={...}`` of the message's 'use fallback' fix line, parsed."""
    line = next(line for line in message.splitlines() if "use fallback, ckpt_guard.install(..., rules=" in line)
    return ast.literal_eval(re.search(r"rules=(\{[^}]*\})", line).group(1))


@pytest.fixture
def installed_strict():
    ckpt_guard.install("strict", rules={})
    try:
        yield
    finally:
        ckpt_guard.uninstall()


def test_following_the_strict_fix_line_fixes_the_whole_maml_step_in_one_round(installed_strict):
    """Before, MAML needed two rounds: CKG001 (the inner grad), then CKG003 (the query loss under vmap)."""
    reference = maml_step(Net(checkpointing=False))
    with pytest.raises(CheckpointCompositionError) as info:
        maml_step(Net())
    rules = _fallback_line(str(info.value))
    under_vmap = "CKG003" if rule_by_id("CKG003").holds_on(installed()) else "CKG007"  # the table's rule here
    assert {"CKG001", under_vmap} <= set(rules) and set(rules.values()) == {"fallback"}
    # rules this call did not trip are named with the reason they are there
    named = re.search(
        r"\(((?:CKG\d+, )*CKG\d+) and the other torch\.func rules, so that the next transform in this program "
        r"is covered too\)", str(info.value),
    )
    assert named and named.group(1).split(", ")[0] == info.value.rule.id, str(info.value)
    ckpt_guard.install("strict", rules=rules)  # the line, followed literally
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointCompositionWarning)
        got = maml_step(Net())
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r)


def test_where_fallback_worked_no_line_turns_the_rule_off():
    """Under fallback the composable recompute ran: warn or off would bring torch's error back."""
    ckpt_guard.install("fallback")
    try:
        with pytest.warns(CheckpointCompositionWarning) as record:
            maml_step(Net())
    finally:
        ckpt_guard.uninstall()
    for warning in record:
        message = str(warning.message)
        if not issubclass(warning.category, CheckpointCompositionWarning):
            continue
        fixes = message.split("  fix:\n", 1)[1]
        assert "'off'" not in fixes and "'warn'" not in fixes, message
        assert "warnings.filterwarnings('ignore', category=ckpt_guard.CheckpointCompositionWarning" in fixes


def test_the_filterwarnings_line_silences_exactly_this_rule():
    """Followed literally, the line keeps fallback's result and drops its warning."""
    ckpt_guard.install("fallback")
    try:
        with pytest.warns(CheckpointCompositionWarning) as record:
            maml_step(Net())
        line = next(
            line.strip()[2:] for w in record if issubclass(w.category, CheckpointCompositionWarning)
            for line in str(w.message).splitlines() if "warnings.filterwarnings(" in line
        )
        statement = line.split(": ", 1)[1]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            exec(statement, {"warnings": warnings, "ckpt_guard": ckpt_guard})  # noqa: S102 - the message's own line
            got = maml_step(Net())
        rule = re.search(r"\\\[(CKG\d+)\\\]", statement).group(1)
        assert not [w for w in caught if issubclass(w.category, CheckpointCompositionWarning) and f"[{rule}]" in str(w.message)]
    finally:
        ckpt_guard.uninstall()
    for g, r in zip(got, maml_step(Net(checkpointing=False))):
        torch.testing.assert_close(g, r)


def test_a_silently_wrong_rule_never_suggests_off(installed_strict):
    """CKG108 (an optimizer step before the recompute): off would give the wrong gradients."""
    from ckpt_guard._rules import rule_by_id

    rule = rule_by_id("CKG108")
    with pytest.raises(CheckpointCompositionError) as info:
        rule.probe(checkpoint, False)
    assert "'off'" not in str(info.value) and "=off" not in str(info.value)


def test_a_meanflow_loss_is_told_what_torch_really_raises(installed_strict):
    """jvp, then .backward(): torch's error is a CheckpointError about the number of saved tensors."""
    net = Net()
    z = torch.randn(5, 4)
    with pytest.raises(CheckpointCompositionError) as info:
        u, dudt = torch.func.jvp(lambda t: net.blocks[1](checkpoint(net.blocks[0], t, use_reentrant=False)), (z,),
                                 (torch.ones_like(z),))
        (u - dudt.detach()).pow(2).sum().backward()
    message = str(info.value)
    assert "ckpt_guard.checkpoint" in message.split("  fix:\n", 1)[1]
    if rule_by_id("CKG007").holds_on(installed()):  # torch < 2.12 raises already in the forward, under jvp
        assert message.startswith("[CKG007]"), message
        return
    assert "[CKG104]" in message
    assert "A different number of tensors was saved" in message and "escaped from inside" not in message


def test_fallbacks_meanflow_warning_names_the_error_torch_really_raises():
    """Under fallback the same loss runs (the composable recompute); its warning says what torch
    would raise here (a review found it quoting the vmap error, which a jvp never gives)."""
    net = Net()
    z = torch.randn(5, 4)
    ckpt_guard.install("fallback")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            u, dudt = torch.func.jvp(lambda t: net.blocks[1](checkpoint(net.blocks[0], t, use_reentrant=False)), (z,),
                                     (torch.ones_like(z),))
            (u - dudt.detach()).pow(2).sum().backward()
    finally:
        ckpt_guard.uninstall()
    messages = [str(w.message) for w in record if issubclass(w.category, CheckpointCompositionWarning)]
    assert messages, "fallback warns about the risk it acted on"
    if rule_by_id("CKG007").holds_on(installed()):  # torch < 2.12: CKG007 explains it, at the call
        assert messages[0].startswith("[CKG007]"), messages
        return
    assert messages[0].startswith("[CKG104] risk:"), messages
    assert "A different number of tensors was saved" in messages[0] and "escaped from inside" not in messages[0]


def test_checkpoint_sequential_segments_are_named_by_the_layers_they_run():
    """checkpoint_sequential's closure holds every layer; the message names the segment's own
    (a fresh-eyes review found it named the last layer of the model, which no segment runs)."""
    from torch.utils.checkpoint import checkpoint_sequential

    class Body(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(6)))

        def forward(self, x):
            return checkpoint_sequential(self.body, 3, x, use_reentrant=False).sum()

    net = Body()
    lines = _checkpointed_lines(lambda: grad(net)(torch.randn(4)))
    assert lines[0] == "checkpointed: checkpoint_sequential segment body.0–body.1 (in Body)", lines


def _checkpointed_lines(program, raises: bool = True) -> list:
    ckpt_guard.install("warn")
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            if raises:
                with pytest.raises(RuntimeError):  # warn: torch's own error follows (CKG001)
                    program()
            else:
                try:
                    program()
                except RuntimeError:
                    pass
    finally:
        ckpt_guard.uninstall()
    return [
        line.strip() for w in record if issubclass(w.category, CheckpointCompositionWarning)
        for line in str(w.message).splitlines() if line.strip().startswith("checkpointed:")
    ]


class _Closures(torch.nn.Module):
    def __init__(self, closure: bool) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        self.closure = closure

    def forward(self, x):
        if self.closure:
            return checkpoint(lambda h: self.block(h) * 2, x, use_reentrant=False).sum()
        return checkpoint(self.block, x, use_reentrant=False).sum()


def test_a_closure_is_named_as_the_function_that_reads_a_module_not_as_the_module():
    """``checkpoint(lambda h: self.block(h) * 2, x)`` checkpoints a lambda that reads ``block``: the
    message used to name the module alone, as for ``checkpoint(self.block, x)``."""
    assert _checkpointed_lines(lambda: grad(_Closures(closure=False))(torch.randn(4))) == [
        "checkpointed: Sequential at block (in _Closures)",
    ]
    assert _checkpointed_lines(lambda: grad(_Closures(closure=True))(torch.randn(4))) == [
        # its closure holds self; the code names self.block, the submodule it runs
        "checkpointed: function _Closures.forward.<locals>.<lambda>, which reads Sequential at block (in _Closures)",
    ]


def test_a_block_traced_by_torch_compile_is_named_so_not_by_torchs_wrapper():
    compiled = torch.compile(_Closures(closure=True), backend="eager")
    lines = _checkpointed_lines(lambda: grad(compiled)(torch.randn(4)), raises=False)
    if not lines:  # then it must be right
        net, x = _Closures(closure=True), torch.randn(4)
        torch.testing.assert_close(grad(torch.compile(net, backend="eager"))(x), grad(lambda h: (net.block(h) * 2).sum())(x))
        pytest.skip(f"torch {torch.__version__} compiles this checkpoint under grad and runs it correctly: "
                    "the guard sees no call, so there is no message to read")
    assert lines and all(line.startswith("checkpointed: a block traced by torch.compile (graph ") for line in lines), lines


def test_a_reentrant_checkpoint_under_grad_is_not_sent_to_use_reentrant_false():
    """CKG002 under grad: use_reentrant=False is refused there too (CKG001), so the first fix is
    ckpt_guard.checkpoint, and followed literally it gives the uncheckpointed gradient (a review
    followed the old first fix straight into CKG001)."""
    torch.manual_seed(0)
    w, x = torch.randn(3, 3), torch.randn(4, 3)
    block = lambda u: torch.tanh(u @ w)  # noqa: E731
    ckpt_guard.install("strict")
    try:
        with pytest.raises(CheckpointCompositionError) as info:
            grad(lambda t: checkpoint(block, t, use_reentrant=True).sum())(x)
        first_fix = str(info.value).split("  fix:\n", 1)[1].splitlines()[0]
        assert info.value.rule.id == "CKG002"
        assert first_fix.startswith("    - checkpoint these blocks with ckpt_guard.checkpoint"), first_fix
        followed = grad(lambda t: ckpt_guard.checkpoint(block, t).sum())(x)
    finally:
        ckpt_guard.uninstall()
    torch.testing.assert_close(followed, grad(lambda t: block(t).sum())(x))


def _always_raising_rules():
    from ckpt_guard._rules import CALL_RULES

    return [r for r in CALL_RULES if r.always_raises and r.holds_on(installed()) and not r.needs_gpu]


@pytest.mark.parametrize("rule", _always_raising_rules(), ids=lambda r: r.id)
def test_where_torch_raises_the_off_line_says_it_gives_torchs_error(installed_strict, rule):
    """A rule whose composition torch refuses: the line turning it off says what off gives (torch's own
    error), never 'if this composition is in fact right here' (a user read that as a contradiction)."""
    variant = rule.variants[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            rule.probe(checkpoint, variant == "reentrant")
        except CheckpointCompositionError as error:
            message = str(error)
        else:
            pytest.fail(f"{rule.id}'s probe ran under strict without raising")
    assert "in fact right here" not in message
    off_lines = [line for line in message.splitlines() if "off" in line and rule.id in line and "instead" in line]
    assert any("to get torch's own error instead of this one" in line for line in off_lines), message


class _ThreeLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, h):
        for layer in self.layers:
            h = checkpoint(layer, h, use_reentrant=False)  # one call site for all three layers
        return h.sum()


def _per_sample_steps(net: torch.nn.Module, steps: int) -> tuple:
    """Per-sample gradients of ``net`` ``steps`` times: (ckpt_guard's warnings, the events)."""
    params = {k: v.detach() for k, v in net.named_parameters()}
    per_sample = vmap(grad(lambda p, x: functional_call(net, p, (x,))), in_dims=(None, 0))
    with warnings.catch_warnings(record=True) as caught, ckpt_guard.record() as events:
        warnings.simplefilter("always")  # Python's own once-per-location rule out of the way
        for _ in range(steps):
            per_sample(params, torch.randn(5, 4))
    return [w for w in caught if issubclass(w.category, CheckpointCompositionWarning)], events


def test_fallback_warns_once_per_rule_and_call_site_and_records_every_call():
    """Fallback handled each call (the composable recompute): one warning for the call site, not one per
    layer per step (six for a 3-layer model in two steps); the events still record every call, and the
    next install() starts afresh."""
    rule_id = per_sample_grads_refusal()
    ckpt_guard.install("fallback")
    try:
        warned, events = _per_sample_steps(_ThreeLayers(), 2)
        assert [w.message.rule.id for w in warned] == [rule_id], [str(w.message) for w in warned]
        assert "shown once for this call site" in str(warned[0].message)
        assert "other blocks and later steps included" in str(warned[0].message)  # it names the first block only
        assert len([e for e in events if e.rule_id == rule_id]) == 6
        ckpt_guard.install("fallback")  # a new install: said again, once
        warned_again, _ = _per_sample_steps(_ThreeLayers(), 1)
        assert [w.message.rule.id for w in warned_again] == [rule_id]
    finally:
        ckpt_guard.uninstall()


def _fix_lines(message: str) -> list:
    return [line.strip()[2:] for line in message.split("  fix:\n", 1)[1].splitlines() if line.startswith("    - ")]


def test_strict_under_a_transform_leads_with_what_keeps_checkpointing_working(installed_strict):
    """CKG001 under vmap(grad): the first fix is ckpt_guard.checkpoint (works, keeps the memory saving),
    then fallback; moving or dropping the checkpoint comes after. Followed, the first line gives the
    uncheckpointed per-sample gradients."""
    net = Net()
    params = {k: v.detach() for k, v in net.named_parameters()}
    x = torch.randn(5, 4)
    per_sample = vmap(grad(lambda p, xi: functional_call(net, p, (xi[None],))), in_dims=(None, 0))
    with pytest.raises(CheckpointCompositionError) as info:
        per_sample(params, x)
    fixes = _fix_lines(str(info.value))
    assert fixes[0].startswith("checkpoint these blocks with ckpt_guard.checkpoint"), fixes
    assert fixes[1].startswith("use fallback"), fixes
    assert any(line.startswith("or move the checkpoint call outside") for line in fixes[2:]), fixes
    followed = Net()
    followed.forward = lambda h: _ckpt_guard_forward(followed, h)
    plain = Net(checkpointing=False)
    expected = vmap(grad(lambda p, xi: functional_call(plain, p, (xi[None],))), in_dims=(None, 0))(params, x)
    got = vmap(grad(lambda p, xi: functional_call(followed, p, (xi[None],))), in_dims=(None, 0))(params, x)
    for k in expected:
        torch.testing.assert_close(got[k], expected[k])


def _ckpt_guard_forward(net: Net, x):
    for block in net.blocks:
        x = ckpt_guard.checkpoint(block, x)
    return x.pow(2).mean()


def test_where_fallbacks_composable_recompute_ran_there_is_nothing_to_fix():
    """Fallback said it ran the composable recompute and kept the saving: its fix list said 'move the
    checkpoint call outside the transform' next (a user read that as something still to do)."""
    ckpt_guard.install("fallback")
    try:
        warned, _ = _per_sample_steps(_ThreeLayers(), 1)
    finally:
        ckpt_guard.uninstall()
    fixes = _fix_lines(str(warned[0].message))
    assert fixes[0].startswith("none needed"), fixes
    assert not any("move the checkpoint call" in line for line in fixes), fixes
    assert "warnings.filterwarnings('ignore'" in fixes[-1]


def test_every_place_a_block_takes_a_tensor_from_is_named_in_messages():
    """Issue 49: the message paths (``paths.describe_path``) skipped ``__kwdefaults__``, so a tensor
    lifted from a keyword-only default was "a tensor the guard cannot name"; each place the walk lifts
    a tensor from is named."""
    import functools

    import torch

    from ckpt_guard._composable.paths import describe_path

    w = torch.ones(2)
    closed = torch.ones(2)

    def positional(h, scale=w):
        return h * scale

    def keyword_only(h, *, scale=w):
        return h * scale

    def closure(h):
        return h * closed

    def bound(h, scale):
        return h * scale

    cases = {
        "default 0": (positional, w),
        "default scale=": (keyword_only, w),
        "→ closed": (closure, closed),
        "(bound argument 0)": (functools.partial(bound, w), w),
    }
    for words, (block, tensor) in cases.items():
        path = describe_path(block, (torch.zeros(2),), {}, tensor)
        assert path is not None and words in path, (words, path)


@pytest.mark.parametrize("entry", ["ckpt_guard.checkpoint (warn)", "torch's checkpoint (fallback)"])
def test_a_drift_at_a_composable_recompute_names_the_users_line_and_the_forwards_transforms(entry):
    """Issue 49's one definition of the user's line: a drift found before a composable recompute (an
    optimizer step between a vjp and its pullback) was attributed to the guard's own
    ``_composable/plan.py`` ("recompute reached from: .../plan.py:469 in for_recompute"), the walk not
    stepping over the recompute's files, and said "torch.func transforms: none" for a forward that ran
    under one.  Now: the user's pullback line, and the forward's transform."""
    import inspect
    import warnings

    import torch

    import ckpt_guard
    from ckpt_guard._composable import ChangedSinceForward

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    if entry.startswith("ckpt_guard"):
        policy, ckpt = "warn", ckpt_guard.checkpoint
    else:
        policy = "fallback"
        ckpt = lambda f, *a: torch.utils.checkpoint.checkpoint(f, *a, use_reentrant=False)  # noqa: E731
    optimizer = torch.optim.SGD(lin.parameters(), lr=0.1)
    ckpt_guard.install(policy, rules={})
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, pull = torch.func.vjp(lambda x: ckpt(lin, x).sum(), x)
            for p in lin.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()  # between the forward and its pullback
            raised = None
            try:
                pull_line = inspect.currentframe().f_lineno + 1
                pull(torch.ones_like(out))
            except ckpt_guard.CheckpointCompositionError as error:  # fallback: no replay undoes a step
                raised = str(error)
            except ChangedSinceForward:  # warn: the recompute stops, its parameters were updated in place
                pass
    finally:
        ckpt_guard.uninstall()
    said = [w for w in caught if "[CKG108]" in str(w.message)]  # fallback also says CKG001's at the call
    if policy == "warn":
        assert len(said) == 1 and raised is None, [str(w.message) for w in caught]
        text = str(said[0].message)
        assert (said[0].filename, said[0].lineno) == (__file__, pull_line), text
    else:
        assert said == [] and raised is not None and "[CKG108]" in raised, raised
        text = raised
    assert f"recompute reached from: {__file__}:{pull_line}" in text, text
    assert "torch.func transforms: grad(level" in text, text


@pytest.mark.parametrize("policy", ["strict", "warn", "fallback"])
def test_ckpt_guard_checkpoints_refusal_names_the_users_line(policy):
    """The words name the user's call of ``ckpt_guard.checkpoint``, never the guard's own entry: the walk
    to the user's line steps over ``_entry.py`` wherever it lives (issue 49 moved it out of
    ``_composable``; ``_files`` must list it)."""
    import inspect
    import warnings

    import torch
    from torch.overrides import TorchFunctionMode

    import ckpt_guard

    class Watching(TorchFunctionMode):  # a user mode: the composable recompute refuses it (user-mode)
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    lin = torch.nn.Linear(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)
    with ckpt_guard.policy(policy, rules={}), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with Watching():
                line = inspect.currentframe().f_lineno + 1
                torch.func.grad(lambda x: ckpt_guard.checkpoint(lin, x).sum())(x)
            text = "\n".join(str(w.message) for w in caught if "checkpoint called at" in str(w.message))
        except ckpt_guard.CheckpointCompositionError as error:
            text = str(error)
        except RuntimeError as error:  # warn: what torch does next, after the warning
            text = "\n".join(str(w.message) for w in caught if "checkpoint called at" in str(w.message))
            assert policy == "warn", error
    assert f"checkpoint called at: {__file__}:{line} in <lambda>" in text, text
    assert "_entry.py" not in text, text


def test_saved_residuals_names_the_users_line_for_an_fx_block():
    """torch.fx's generated code (file name ``<eval_with_key>...``) is torch's, not the user's line: the one
    walk steps over it, as ``saved_residuals``' own walk did before it was merged into ``_files``."""
    import inspect

    import torch
    import torch.fx
    from torch.func import grad

    import ckpt_guard
    from ckpt_guard import checkpoint_policies as policies

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.eye(3, dtype=torch.float64))

        def forward(self, h):
            return (torch.sin(h) @ self.w).cos().sum()

    if not hasattr(torch.utils.checkpoint, "create_selective_checkpoint_contexts"):
        pytest.skip(f"torch {torch.__version__}: save policies (what saved_residuals lists by line) need torch >= 2.5")
    traced = torch.fx.symbolic_trace(Block())
    x = torch.rand(3, 3, dtype=torch.float64)
    saving = policies.context_fn(policies.dots_saveable)
    line = inspect.currentframe().f_lineno + 1
    report = ckpt_guard.saved_residuals(grad(lambda t: ckpt_guard.checkpoint(traced, t, context_fn=saving)), x)
    where = [value.where for block in report.blocks for value in block.values]
    assert where and all(w == f"test_messages.py:{line}" for w in where), where
