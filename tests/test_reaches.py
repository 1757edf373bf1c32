"""The composable recompute never returns a wrong number, however the block reaches its tensors.

Every reach (``reaches.REACHES``) crossed with every transform, through
``ckpt_guard.checkpoint`` (strict and fallback) and through torch's own
checkpoint under fallback, compared with the uncheckpointed reference: equal,
or refused with ``CheckpointCompositionError`` (strict only).  Fallback never
refuses: it runs what it cannot recompute without checkpointing.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from reaches import LIFTED, REACHES, RESET_AFTER_THE_CALL, TRANSFORMS, plain, run
from torch.utils.checkpoint import checkpoint

import ckpt_guard
from ckpt_guard import CheckpointCompositionError

pytestmark = pytest.mark.usefixtures("guard")


def _reference(reach, transform):
    if transform == "eager .backward()" and reach in RESET_AFTER_THE_CALL:
        pytest.skip("the reach resets what the block reads when the call returns; an eager backward comes after")
    try:
        return run(reach, transform, plain)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"the uncheckpointed program itself raises: {exc!r}")


def _torch_checkpoint(function, *args):
    return checkpoint(function, *args, use_reentrant=False)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("reach", list(REACHES))
def test_public_checkpoint_is_right_or_refuses(reach, transform):
    reference = _reference(reach, transform)
    try:
        got = run(reach, transform, ckpt_guard.checkpoint)
    except CheckpointCompositionError as refused:
        if transform == "eager .backward()":  # torch's own checkpoint: a drift rule explains it
            assert refused.rule.stage == "recompute", refused
        else:
            assert reach not in LIFTED or transform == "then-backward", "a liftable reach was refused"
        return
    torch.testing.assert_close(got, reference)


@pytest.mark.parametrize("transform", list(TRANSFORMS))
@pytest.mark.parametrize("reach", list(REACHES))
@pytest.mark.parametrize("entry", ["public", "torch"])
def test_fallback_is_right(reach, transform, entry):
    reference = _reference(reach, transform)
    ckpt = ckpt_guard.checkpoint if entry == "public" else _torch_checkpoint
    with ckpt_guard.policy("fallback"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(reach, transform, ckpt)
    torch.testing.assert_close(got, reference)
