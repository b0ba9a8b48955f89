"""The file backend's extra config: directory, capacity, fsync, O_DIRECT, where checksums run.

Contract: ``FileExtraConfig`` is the file backend's
``hicache_storage_backend_extra_config`` (anything else is a
``StorageConfigError`` naming the key). Directory: ``path``, else
``$HICACHE_FILE_STORAGE_DIR``, else ``/tmp/hicache``.
"""

from __future__ import annotations

from pydantic import Field, NonNegativeFloat

from hicache.tiers.l3.file.page_io import DirectIO
from hicache.tiers.l3.verify import Verify, verify_field
from hicache.tiers.settings import Settings

GB = 1_000_000_000
DIR_ENV = "HICACHE_FILE_STORAGE_DIR"
DEFAULT_DIR = "/tmp/hicache"


class FileExtraConfig(Settings):
    """The file backend's ``hicache_storage_backend_extra_config``."""

    path: str | None = Field(
        None, description=f"directory of the pages; empty or null = ${DIR_ENV}, "
        f"else {DEFAULT_DIR}")
    capacity_gb: NonNegativeFloat = Field(
        0, description="GB (1e9 bytes) the pages may take; 0 = unlimited")
    fsync: bool = Field(False, description="fsync every page file before it is renamed in")
    direct_io: DirectIO = Field(
        "off", description="O_DIRECT page I/O for NVMe / GDS-style stores larger than the "
        "page cache: off; auto = where the filesystem accepts it; on = required")
    verify: Verify = verify_field()
