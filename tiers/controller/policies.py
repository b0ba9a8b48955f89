"""Policy names: the one list of what ``hicache_write_policy`` and
``hicache_storage_prefetch_policy`` accept.

The connector config (``connector/config.py``) validates against these
``Literal`` types, and the controller maps each name to the small object that
implements it. Names and meanings follow SGLang HiCache.
"""

from __future__ import annotations

from typing import Literal, get_args

WritePolicyName = Literal["write_through", "write_through_selective", "write_back"]
PrefetchPolicyName = Literal["best_effort", "wait_complete", "timeout"]

WRITE_POLICY_NAMES: tuple[str, ...] = get_args(WritePolicyName)
PREFETCH_POLICY_NAMES: tuple[str, ...] = get_args(PrefetchPolicyName)
