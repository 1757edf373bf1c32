"""What a decision can ask a patch point to do, and the rules that hold on the installed torch.

Shared by the decision at call time (``_decide``), at recompute time (``_drift``) and the
words (``_messages``), so it sits below all three.  Owns: the action names and the
per-torch selections of the rule tables.  May not touch: anything else.
"""

from __future__ import annotations

from . import _versions
from ._rules import CALL_RULES, DRIFT_RULES
from ._rules import NON_REENTRANT, rules_on

#: The installed torch, and the call-time rules whose claim holds on it (in table order).
TORCH = _versions.installed()
CALL_RULES_HERE = rules_on(TORCH, CALL_RULES)
# per drift rule (DRIFT_RULES order): does its claim hold on this torch?
DRIFT_HOLDS = tuple(rule.holds_on(TORCH) for rule in DRIFT_RULES)
# per drift rule: is it about the non-reentrant variant too? (CKG114 is not: a non-reentrant
# recompute started inside a reentrant backward is no business of it)
DRIFT_NON_REENTRANT = tuple(NON_REENTRANT in rule.variants for rule in DRIFT_RULES)

# What a call-time decision asks the patch point to do.
PROCEED = "proceed"  # run torch's checkpoint as asked
NON_REENTRANT_INSTEAD = "non-reentrant"  # fallback: use_reentrant=False instead
NO_CHECKPOINT = "no-checkpoint"  # fallback: run the function without checkpointing
NO_EARLY_STOP = "no-early-stop"  # fallback: torch's checkpoint with early stop switched off (CKG009)
#: a call-time rule explains this composition, and its policy (warn or off) says: torch's
#: checkpoint as asked, and no drift rule's call-time risk stands in for it
AS_ASKED = "as-asked"
