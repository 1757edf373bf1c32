"""What the composable recompute has done so far, for the matrix and the benchmarks.

Read, never reset, by ``tests/conformance.py`` and ``ckpt_guard._matrix`` (a recompute
means the forward did not keep the block's activations); ``PROOF`` is the one switch,
for ``benchmarks/proof.py`` alone.
"""

from __future__ import annotations

import collections

#: Recomputes of blocks run so far, and derivatives checkpointed in turn (a backward or
#: tangents that something differentiated again).  The matrix reads them: a recompute
#: means the block's activations were not kept by the forward.
RECOMPUTES = 0
NESTED_RECOMPUTES = 0
#: Recomputes a block's jvp rule ran (the tangents of its outputs computed again): none where
#: the plain run's own tangents were handed on (``Plan.keep_tangents``: ``jvp(grad)``,
#: ``hessian``, a MeanFlow loss; a derivative run at the caller's levels,
#: ``_Derivative.run_for_tangents``); the tests read it
TANGENT_RECOMPUTES = 0
#: Calls packed into the recompute (their plain run's activations dropped) so far
PACKED = 0

#: Save policies (``saving``): operation outputs a policy kept in a first forward, outputs handed
#: back to a recompute instead of running the operation, and operations a recompute under a
#: policy ran again (by operation): the tests read them ("a saved operation is not run again")
SAVED_BY_POLICY = 0
HANDED_BACK = 0
RECOMPUTED_UNDER_POLICY: "collections.Counter[object]" = collections.Counter()

#: The run-time proof runs on every first forward.  ``benchmarks/proof.py`` switches it off
#: to measure what it costs; nothing else may (without it a wrong gradient goes unnoticed).
PROOF = True
