"""The scheduler's view of an L3 store across tensor-parallel ranks.

Contract:
- Each TP rank stores its own shard of a page under its own object key
  (``StorageConfig.fingerprint`` holds the rank). A page is in L3 only if
  every rank's shard is: ``batch_exists`` is the shortest consecutive run
  over all ranks, so vLLM is never promised tokens one rank cannot load.
- MLA pages are the same on every rank (the latent cache is replicated):
  the connector builds one rank-independent shard and one writer (rank 0),
  so this view is not used there.
- ``batch_delete`` and ``clear`` reach every rank's shard at once (lookups
  miss from then on); workers still delete their own shard afterwards,
  which is idempotent.
- Nothing here waits on more than what each backend's own timeouts allow;
  an exception propagates to the caller, which treats it as a miss.
"""

from __future__ import annotations

from collections.abc import Sequence

from hicache.tiers.l3.base import StorageBackend, StorageStats


class RankShards:
    """Lookups and removals over one backend instance per TP rank (rank order)."""

    def __init__(self, shards: Sequence[StorageBackend]) -> None:
        if not shards:
            raise ValueError("RankShards needs at least one shard")
        self.shards = list(shards)

    @property
    def concurrent_lookups(self) -> bool:
        return all(shard.concurrent_lookups for shard in self.shards)

    @property
    def supports_spans(self) -> bool:
        return all(shard.supports_spans for shard in self.shards)

    def batch_exists(self, keys: list[str]) -> int:
        found = len(keys)
        for shard in self.shards:
            if found == 0:
                break
            found = min(found, shard.batch_exists(keys[:found]))
        return found

    def batch_delete(self, keys: list[str]) -> int:
        """Pages deleted from rank 0's shard (the others are deleted alike)."""
        counts = [shard.batch_delete(keys) for shard in self.shards]
        return counts[0]

    def clear(self) -> None:
        for shard in self.shards:
            shard.clear()

    def stats(self) -> StorageStats:
        return self.shards[0].stats()

    def close(self) -> None:
        for shard in self.shards:
            shard.close()
