"""The mooncake L3 backend's settings: SGLang's extra-config keys and their fallbacks.

Contract:
- Extra-config keys, SGLang's names (``MooncakeExtraConfig``; anything else is a
  ``StorageConfigError`` naming the key and the allowed keys); each falls back
  to the environment variable SGLang documents (``ENV_VARS``), then to a default:
    ``master_server_address``  ``MOONCAKE_MASTER``            required, "host:port"
    ``local_hostname``         ``MOONCAKE_LOCAL_HOSTNAME``    "localhost"
    ``metadata_server``        ``MOONCAKE_TE_META_DATA_SERVER`` "P2PHANDSHAKE"
    ``global_segment_size``    ``MOONCAKE_GLOBAL_SEGMENT_SIZE`` "4gb" (int bytes or
                               "<n>[kb|mb|gb|tb]", binary units); each TP rank
                               contributes ``global_segment_size // tp_size``
    ``local_buffer_size``      (no env)                       "16mb"
    ``protocol``               ``MOONCAKE_PROTOCOL``          "tcp" (tcp | rdma)
    ``device_name``            ``MOONCAKE_DEVICE``            "" (auto); a JSON object
                               maps TP rank -> device, as SGLang allows
- ``MooncakeSettings.from_config(config)``: the resolved settings of one TP
  rank (its share of the global segment, its device); bad keys or values are a
  ``StorageConfigError`` naming the key and the allowed values.
- ``parse_size(key, value)``: bytes from an int or ``"<n>[kb|mb|gb|tb]"``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator

from hicache.tiers.l3.base import EXTRA_CONFIG, StorageConfig, StorageConfigError, validate_extra
from hicache.tiers.l3.verify import Verify, verify_field
from hicache.tiers.settings import Settings

# extra-config key -> the environment variable SGLang documents as its fallback
ENV_VARS: dict[str, str] = {
    "master_server_address": "MOONCAKE_MASTER",
    "local_hostname": "MOONCAKE_LOCAL_HOSTNAME",
    "metadata_server": "MOONCAKE_TE_META_DATA_SERVER",
    "global_segment_size": "MOONCAKE_GLOBAL_SEGMENT_SIZE",
    "protocol": "MOONCAKE_PROTOCOL",
    "device_name": "MOONCAKE_DEVICE",
}
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _to_bytes(value: Any) -> int:
    """Bytes from an int or a string like ``"4gb"`` / ``"512MB"`` / ``"1048576"`` (binary units)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)b?\s*", value.lower())
        if m:
            return int(m.group(1)) * _UNITS[m.group(2)]
    raise ValueError("not a size; allowed values: a non-negative int of bytes or a string "
                     "like '4gb', '512mb', '64kb'")


def parse_size(key: str, value: Any) -> int:
    """``_to_bytes`` for extra-config ``key``; StorageConfigError naming it if not a size."""
    try:
        return _to_bytes(value)
    except ValueError as exc:
        raise StorageConfigError(f"{EXTRA_CONFIG}.{key}={value!r}: {exc}") from None


ByteSize = Annotated[int, BeforeValidator(_to_bytes)]
_SIZE = "int bytes or '<n>[kb|mb|gb|tb]' (binary units)"


def _env(key: str) -> str:
    return f"env {ENV_VARS[key]}"


class MooncakeExtraConfig(Settings):
    """The mooncake backend's ``hicache_storage_backend_extra_config`` (SGLang's keys),
    after the environment fallbacks of ``ENV_VARS``."""

    master_server_address: str = Field(
        pattern=r"^[^\s:]+:\d{1,5}$",
        description=f"'host:port' of a running mooncake_master; {_env('master_server_address')}")
    local_hostname: str = Field(
        "localhost", min_length=1,
        description=f"address this client advertises; {_env('local_hostname')}")
    metadata_server: str = Field(
        "P2PHANDSHAKE", min_length=1,
        description=f"transfer-engine metadata server; {_env('metadata_server')}")
    global_segment_size: ByteSize = Field(
        4 << 30, description=f"memory the engine contributes to the store, split over its TP "
        f"ranks: {_SIZE}; {_env('global_segment_size')}")
    local_buffer_size: ByteSize = Field(16 << 20, description=f"client buffer: {_SIZE}")
    protocol: Literal["tcp", "rdma"] = Field(
        "tcp", description=f"transfer protocol; {_env('protocol')}")
    device_name: str = Field(
        "", description="device name, '' (auto) or a JSON object mapping TP rank to "
        f"device name; {_env('device_name')}")
    verify: Verify = verify_field()

    @field_validator("device_name")
    @classmethod
    def _json_object_if_braced(cls, value: str) -> str:
        if value.strip().startswith("{"):
            try:
                if not isinstance(json.loads(value), dict):
                    raise ValueError
            except ValueError:
                raise ValueError("starts with '{' but is not a JSON object") from None
        return value


@dataclass(frozen=True)
class MooncakeSettings:
    """The resolved client settings of one backend instance (one TP rank)."""

    master_server_address: str
    local_hostname: str
    metadata_server: str
    # this rank's share of the engine's global segment, in bytes
    global_segment_size: int
    local_buffer_size: int
    protocol: str
    # this rank's device ('' = auto)
    device_name: str
    # where checksums of reads in place run (verify.py)
    verify: Verify = "auto"

    @classmethod
    def from_config(cls, config: StorageConfig) -> MooncakeSettings:
        raw = {k: v for k, v in config.extra_config.items() if v is not None}
        for key, env in ENV_VARS.items():
            if key not in raw and os.environ.get(env):
                raw[key] = os.environ[env]
        extra = validate_extra(raw, MooncakeExtraConfig, "mooncake")
        device = extra.device_name
        if device.strip().startswith("{"):
            device = str(json.loads(device).get(str(config.tp_rank), ""))
        return cls(extra.master_server_address, extra.local_hostname, extra.metadata_server,
                   extra.global_segment_size // max(config.tp_size, 1), extra.local_buffer_size,
                   extra.protocol, device, extra.verify)
