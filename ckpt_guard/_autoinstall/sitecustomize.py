"""Installs ckpt_guard in every Python process a ``python -m ckpt_guard run`` program starts.

``run`` puts this folder first on ``PYTHONPATH`` and sets ``CKPT_GUARD_RUN=1``
(with ``CKPT_GUARD_POLICY`` / ``CKPT_GUARD_RULES`` for its flags), so a child
interpreter (multiprocessing ``spawn`` and ``forkserver``, ``torch.multiprocessing.spawn``,
a ``subprocess`` running Python) imports this module at start-up, as Python
imports any ``sitecustomize``, and is guarded with the same configuration.

It then runs the ``sitecustomize`` it shadows, if there is one.  It never
stops a child from starting: a failure to install is printed, not raised.
"""

import os
import sys


def _install() -> None:
    if os.environ.get("CKPT_GUARD_RUN") != "1":
        return
    try:
        import ckpt_guard

        ckpt_guard.install()  # policy and rules from the environment, as the launcher set them
    except Exception as exc:  # noqa: BLE001 - a child must start even if the guard cannot
        sys.stderr.write(f"ckpt_guard: could not install the guard in this child process: {exc}\n")


def _run_shadowed_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        import sitecustomize  # noqa: F401 - the next one on the path, if any
    except ImportError:
        if ours is not None:
            sys.modules["sitecustomize"] = ours
    finally:
        sys.path[:] = saved


_install()
_run_shadowed_sitecustomize()
