"""The scheduler's view of an L3 store across tensor-parallel ranks.

Contract:
- Each TP rank stores its own shard of a page under its own object key
  (``StorageConfig.fingerprint`` holds the rank). A page is in L3 only if
  every rank's shard is: ``exists_prefix`` is the shortest consecutive run
  over all ranks, so vLLM is never promised tokens one rank cannot load.
- MLA pages are the same on every rank (the latent cache is replicated):
  the connector builds one rank-independent shard and one writer (rank 0),
  so this view is not used there.
- ``delete`` and ``clear`` reach every rank's shard at once (lookups
  miss from then on); workers still delete their own shard afterwards,
  which is idempotent.
- Nothing here waits on more than what each backend's own timeouts allow;
  an exception propagates to the caller, which treats it as a miss.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tiers.l3.base import Capabilities, StorageStats
from hicache.tiers.l3.guard import GuardedBackend


class RankShards:
    """Lookups and removals over one backend instance per TP rank (rank order)."""

    def __init__(self, shards: Sequence[GuardedBackend]) -> None:
        if not shards:
            raise ValueError("RankShards needs at least one shard")
        self.shards = list(shards)
        # What every shard can do (lookups and spans are all the scheduler asks; both
        # fixed when a backend is built), once, not at every lookup.
        caps = [shard.capabilities for shard in self.shards]
        self.capabilities = Capabilities(
            concurrent_lookups=all(c.concurrent_lookups for c in caps),
            spans=all(c.spans for c in caps))

    def exists_prefix(self, keys: Sequence[str]) -> int:
        found = len(keys)
        for shard in self.shards:
            if found == 0:
                break
            found = min(found, shard.exists_prefix(keys[:found]))
        return found

    def delete(self, keys: Sequence[str]) -> int:
        """Pages deleted from rank 0's shard (the others are deleted alike)."""
        counts = [shard.delete(keys) for shard in self.shards]
        return counts[0]

    def clear(self) -> None:
        for shard in self.shards:
            shard.clear()

    def stats(self) -> StorageStats:
        return self.shards[0].stats()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
