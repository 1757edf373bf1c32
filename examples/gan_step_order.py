"""A GAN step in the wrong order: the discriminator steps before the generator's backward.

The classic pitfall: one discriminator forward on the fakes feeds both losses,
and ``d_optimizer.step()`` runs before ``g_loss.backward()``.  Without
checkpointing, autograd refuses ("modified by an inplace operation").  With a
checkpointed discriminator, torch recomputes it with the *updated* weights and
the generator silently gets wrong gradients.  Three runs:

1. raw torch, discriminator not checkpointed: autograd's error;
2. raw torch, discriminator checkpointed: no error, wrong generator gradients
   (compared with the same step in the right order);
3. ckpt_guard, policy strict: CKG108 names the problem before the recompute.

Run: ``python examples/gan_step_order.py`` (exit status 0 when all three happen).
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.utils.checkpoint import checkpoint

import ckpt_guard


class Discriminator(torch.nn.Module):
    def __init__(self, checkpointing: bool) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logit = checkpoint(self.body, x, use_reentrant=False) if self.checkpointing else self.body(x)
        return torch.sigmoid(logit)


def gan_step(checkpointing: bool, wrong_order: bool) -> list[torch.Tensor]:
    """One step of both players; returns the generator's gradients."""
    torch.manual_seed(0)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh())
    discriminator = Discriminator(checkpointing)
    d_optimizer = torch.optim.SGD(discriminator.parameters(), lr=0.5)
    real, z = torch.randn(16, 8), torch.randn(16, 4)

    fake = generator(z)
    d_real, d_fake = discriminator(real), discriminator(fake)
    d_loss = -(torch.log(d_real).mean() + torch.log(1 - d_fake).mean())
    g_loss = -torch.log(d_fake).mean()

    d_optimizer.zero_grad()
    d_loss.backward(retain_graph=True)
    if wrong_order:
        d_optimizer.step()  # updates the discriminator in place ...
        g_loss.backward()  # ... before the generator's backward goes through it
    else:
        generator.zero_grad()
        g_loss.backward()
        d_optimizer.step()
    return [p.grad.clone() for p in generator.parameters()]


def main() -> int:
    ok = True
    right = gan_step(checkpointing=False, wrong_order=False)

    print("1) raw torch, no checkpointing, wrong order:")
    try:
        gan_step(checkpointing=False, wrong_order=True)
        print("   no error (unexpected on this torch)")
        ok = False
    except RuntimeError as exc:
        print(f"   {type(exc).__name__}: {str(exc).splitlines()[0][:110]}...")

    print("\n2) raw torch, checkpointed discriminator, wrong order:")
    wrong = gan_step(checkpointing=True, wrong_order=True)
    differs = not all(torch.allclose(w, r) for w, r in zip(wrong, right))
    print(f"   no error; generator gradients {'differ from' if differs else 'match'} the right order's "
          f"(max |diff| {max((w - r).abs().max().item() for w, r in zip(wrong, right)):.3g})")
    ok &= differs

    print("\n3) ckpt_guard, policy strict, same code:")
    ckpt_guard.install("strict")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gan_step(checkpointing=True, wrong_order=True)
        print("   no error (unexpected)")
        ok = False
    except ckpt_guard.CheckpointCompositionError as exc:
        print("   " + str(exc).replace("\n", "\n   "))
        ok &= exc.rule.id == "CKG108"
    finally:
        ckpt_guard.uninstall()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
