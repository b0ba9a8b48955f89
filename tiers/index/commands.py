"""Storage commands: the admin's and the scheduler's L3 actions that every worker applies,
carried in a ``StepPlan``.

Contract (see DESIGN.md "Admin actions"):
- The scheduler queues every command (``HiCacheScheduler.queue_command``)
  and puts those queued into the next plan it builds; each worker applies
  them once, before that step's loads and fetches (tiers/worker/core.py).
  Its own (a request's ``retain_s`` reaching L3, a cancelled prefetch) and
  the admin's (tiers/controller/admin.py: a flush's removal, attach,
  detach), which changes the scheduler's own L3 instance at once.
- The L3-changing commands (``L3_CHANGES``) are queued under the scheduler
  lock with the tree change they stand for, so no plan built after that
  change lacks them. Each worker counts those it applied and sends its count
  with the backups it reports stored: keys a rank took before a change may
  name pages that change deleted, or that went to the store it replaced;
  the scheduler keeps only those no later change removed (a flush of all L3,
  an attach or a detach removes everything).
- Commands are plain frozen dataclasses (they cross process boundaries with
  the plan). Page keys stay ``bytes`` here; only the backend boundary
  (tiers/l3/) spells them as the store's string keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hicache.tiers.index.page_keys import PageKey


@dataclass(frozen=True)
class DeletePages:
    """Drop queued backups of ``keys`` and delete them from this rank's L3 shard."""

    keys: tuple[PageKey, ...]


@dataclass(frozen=True)
class RetainPages:
    """Keep ``keys`` in this rank's L3 shard ahead of its own eviction until ``until``
    (seconds since the epoch: it crosses processes); ``until`` 0 ends it."""

    keys: tuple[PageKey, ...]
    until: float


@dataclass(frozen=True)
class CancelFetches:
    """Stop this rank's L3 reads of these fetches (``RequestFetch.req_id``) after the
    batch in flight; each ends and is reported with the pages it read."""

    fetch_ids: tuple[str, ...]


@dataclass(frozen=True)
class ClearStore:
    """Drop every queued backup and clear this rank's L3 shard."""


@dataclass(frozen=True)
class AttachStore:
    """Replace this rank's L3 backend with ``backend`` built from ``extra_config``."""

    backend: str
    extra_config: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DetachStore:
    """Drop queued backups, finish running I/O and close this rank's L3 backend."""


# What an L3 flush asks of the store.
L3Removal = DeletePages | ClearStore
# Commands after which L3 may lack pages a rank reported backed up before it: the
# scheduler counts those it queued, each worker those it applied (WorkerReport.l3_changes).
L3_CHANGES = (DeletePages, ClearStore, AttachStore, DetachStore)
StorageCommand = (DeletePages | ClearStore | RetainPages | CancelFetches | AttachStore
                  | DetachStore)
