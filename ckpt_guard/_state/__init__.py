"""Reading torch's state: everything a checkpoint call and its recompute depend on.

One module per thing read; a new drift rule adds one reader in one of them (or a new
one) and names it in its rule record (``read=``, ``render=``), and nothing else:

=================  ==========================================================
``basics``         torch's entry points bound once, helpers every reader shares
``transforms``     the functorch interpreter stack (which transforms, which levels)
``modes``          the user's dispatch and function modes (CKG102, CKG103)
``mode_records``   marked modes' records, replay and write-back
``swaps``          ``functional_call``'s parameter swaps (CKG101)
``dtype``          the default dtype (CKG105)
``steps``          optimizer steps (CKG108)
``backward``       a reentrant backward building a graph (CKG114)
``modules``        the block snapshot: tensors, hooks, train/eval, plain attributes,
                   instance forwards (CKG106/110/111/115/116)
``writes``         the buffers a recompute would update again, kept at the call (CKG117)
``contents``       containers and user generators the block is given (CKG112/113)
``call``           the call-time :class:`CallState` the call rules read
``block_reads``    what a function reads, found without running it
``peel``           what a checkpointed callable runs past its partials and wrappers
=================  ==========================================================

This package's ``__init__`` only gathers the names the decision, the words and the
composable recompute use (``_state.block_snapshot``...; a rule's ``read`` and
``render`` are looked up here).  The readers may not import the decision, the
words or the composable recompute: they read, they never decide.

Two kinds of reading happen here.

*Call time* (``call.read_call_state``): the functorch interpreter stack, grad
mode, forward-mode AD, whether saved-tensor hooks are allowed, and whether the
inputs or the parameters inside the checkpointed function require grad.  The
rules in ``_rules.py`` are predicates over the resulting :class:`CallState`.
Reading all of it costs a few microseconds, so the patch points first ask
:func:`call_is_quiet`, a handful of ~50 ns queries that prove no call-time rule
can fire; only a non-quiet call pays for the full reading.

*Recompute time* (``_drift.capture``): a tuple with one value per drift rule,
read in the forward and again when the recompute starts.  A reader may carry
an ``active`` attribute, a builtin query that is falsy when its state is empty,
so the capture can skip the Python call on the usual quiet path.  How a change
is judged and said (its ``relevant``, its ``describe``) is the rule's kind's, in
``_drift_kinds``, which names the functions here that do it.  torch's own
infrastructure modes (fake/functional/proxy tensors under ``torch.compile``,
selective checkpointing's caching modes, ``with torch.device(...)``) are not the
user's and are left out, so they can never cause a report.

Parameter swaps (``torch.func.functional_call``) and optimizer steps leave
no trace in torch's state: the hooks in ``_hooks`` report them here
(:func:`push_swap` / :func:`pop_swap` keep :data:`_active_swaps` current,
:func:`record_step` counts steps and logs which parameters each updated).
Dynamo skips these files; only ``_hooks`` runs inside code it compiles.

A drift reader may also carry a ``relevant(function, was, now)`` attribute:
asked only once its value changed, it says whether the change can reach the
checkpointed function (a swap of other modules, a step of another model's
optimizer cannot).
"""

from __future__ import annotations

from .basics import _GONE as GONE  # noqa: F401 - "absent" in a captured record
from .basics import (  # noqa: F401
    forward_ad,
    get_unwrapped,
    is_module,
    is_functorch_wrapped_tensor,
    peek_interpreter_stack,
    len_dispatch_stack,
    len_function_stack,
    is_grad_enabled,
    requires_grad_anywhere,
    requires_grad_of,
    saved_tensor_hooks_enabled,
    top_saved_tensor_hooks,
    hooks_set_aside,
    hooks_put_back,
    vmap_switches_saved_tensor_hooks_off,
)
from .transforms import (  # noqa: F401
    describe_transforms,
    grad_level_alive,
    interpreter_levels,
    transform_stack,
)
from .modes import (  # noqa: F401
    RECORDING_MODES,
    user_dispatch_modes,
    user_function_modes,
)
from .mode_records import (  # noqa: F401
    QUIET_RECOMPUTE_HOOKS,
    describe_mode_change,
    describe_modes,
    mark_replayable_mode,
    mode_state_kept,
    modes_to_replay,
    modes_updated_in_place,
    only_state_moved,
    put_back_modes,
    replaying_modes,
)
from .swaps import (  # noqa: F401
    SwappedReads,
    begin_swap,
    describe_swap_change,
    describe_swaps,
    pop_swap,
    push_swap,
    swapped_reads,
    swapped_roots,
    swaps_active_here,
    swapped_reads_relevant,
)
from .dtype import (  # noqa: F401
    default_dtype,
    describe_dtype,
)
from .steps import (  # noqa: F401
    describe_optimizer_steps,
    optimizer_steps,
    record_step,
    steps_relevant,
)
from .backward import (  # noqa: F401
    describe_backward_graph,
    describe_graph_building,
    graph_building_relevant,
    reentrant_backward,
    reentrant_backward_builds_graph,
)
from .closures import globals_read, replaying_globals  # noqa: F401
from .peel import member_functions  # noqa: F401
from .modules import (  # noqa: F401
    attributes_values_only,
    bindings_values_only,
    block_bindings,
    block_hooks,
    describe_attribute_change,
    describe_attributes,
    describe_bindings,
    describe_forward_change,
    describe_forwards,
    describe_hook_change,
    describe_rebinding,
    describe_training,
    differs,
    instance_forwards,
    module_attributes,
    module_training,
    reattributed,
    MAY_NEED_REFRESH,
    needs_refresh,
    rebound,
    refresh_after_forward,
    retrained,
    rrelu_seen,
    training_relevant,
)
from .contents import (  # noqa: F401
    REPLAY_LOCK,
    argument_roots,
    holds_container,
    argument_contents,
    changed_at_all,
    changed_contents,
    contents_snapshot,
    describe_contents,
    describe_contents_change,
    describe_generator_change,
    describe_generators,
    generator_states,
    is_user_generator,
    moved_generators,
    replayable,
    values_only,
    replaying_contents,
    replaying_generators,
    restore_contents,
)
from .writes import (  # noqa: F401
    buffers_now,
    describe_written,
    keep,
    kept_buffers,
    written_during,
)
from .call import (  # noqa: F401
    CallState,
    FactoryWatch,
    accelerator_default_device,
    call_is_quiet,
    clear_caches,
    drew_random,
    forward_device_context,
    grad_sample_hooked,
    read_call_state,
    rng_states,
    rrelu_training,
    tensor_versions,
    updated_in_place,
)
