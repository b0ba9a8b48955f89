"""Render the admin ``stats()`` dict in the Prometheus text exposition format (0.0.4).

Contract: :func:`render_metrics` takes the dict returned by
``AdminTarget.stats()`` and returns the text that ``GET /metrics`` serves
with content type :data:`CONTENT_TYPE`. Nothing here depends on
``prometheus_client``; the output parses with its text parser.

Input shape (every part optional; ``None`` and non-numeric values are skipped)::

    {"tiers":  {"l1": {...}, "l2": {...}, "l3": {...}},
     "queues": {"l3_backup_pages": 4, ...},
     "policy": {"write_policy": "write_through", "prefetch_threshold": 256, ...},
     "<section>": {"<name>": <number>, ...}, ...}

Output, all names prefixed ``hicache_``:

* per tier, label ``tier="l1"|"l2"|"l3"|...``, from the tier dict's keys
  (see :data:`TIER_GAUGES` and :data:`TIER_COUNTERS`)::

      hicache_tier_capacity_pages / _used_pages / _capacity_bytes / _used_bytes  gauge
      hicache_tier_load_bytes_per_second / _save_bytes_per_second                gauge
          (from ``recent_load_gbps`` / ``recent_save_gbps``, read as GB/s = 1e9 bytes/s)
      hicache_tier_hits_total / _misses_total / _evictions_total                 counter
      hicache_tier_loaded_pages_total / _loaded_bytes_total                      counter
      hicache_tier_saved_pages_total / _saved_bytes_total                        counter
      hicache_tier_corrupt_pages_total                                           counter

  other numeric keys of a tier dict become ``hicache_tier_<key>`` (untyped).
* ``queues``: ``hicache_queue_depth{queue="<name>"}`` (gauge).
* ``policy``: numbers as ``hicache_policy_value{key="<name>"}`` (gauge);
  strings and booleans as ``hicache_policy_info{key="<name>",value="<value>"} 1``.
* any other top-level section whose values are numbers:
  ``hicache_<section>_<name>`` (untyped), names sanitised to ``[a-zA-Z0-9_]``.

A name is emitted once; a later collision is dropped rather than producing
an invalid exposition.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

PREFIX = "hicache"

# tier dict key -> (metric name without prefix, help text, scale factor)
TIER_GAUGES: dict[str, tuple[str, str, float]] = {
    "capacity_pages": ("tier_capacity_pages", "Pages the tier can hold.", 1.0),
    "used_pages": ("tier_used_pages", "Pages the tier holds now.", 1.0),
    "capacity_bytes": ("tier_capacity_bytes", "Bytes the tier can hold.", 1.0),
    "used_bytes": ("tier_used_bytes", "Bytes the tier holds now.", 1.0),
    "recent_load_gbps": (
        "tier_load_bytes_per_second",
        "Recent load throughput out of the tier, bytes per second.",
        1e9,
    ),
    "recent_save_gbps": (
        "tier_save_bytes_per_second",
        "Recent save throughput into the tier, bytes per second.",
        1e9,
    ),
}

# tier dict key -> (counter name without prefix and without _total, help text)
TIER_COUNTERS: dict[str, tuple[str, str]] = {
    "hits": ("tier_hits", "Pages looked up and found in the tier."),
    "misses": ("tier_misses", "Pages looked up and not found in the tier."),
    "evictions": ("tier_evictions", "Pages evicted from the tier."),
    "pages_loaded": ("tier_loaded_pages", "Pages loaded out of the tier."),
    "bytes_loaded": ("tier_loaded_bytes", "Bytes loaded out of the tier."),
    "pages_saved": ("tier_saved_pages", "Pages saved into the tier."),
    "bytes_saved": ("tier_saved_bytes", "Bytes saved into the tier."),
    "corrupt_pages": ("tier_corrupt_pages", "Pages read from the tier that failed verification."),
}

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def sanitize_name(name: str) -> str:
    """A metric-name fragment: ``[a-zA-Z0-9_]`` only, never empty, never starting with a digit."""
    out = _NAME_BAD.sub("_", str(name)).strip("_") or "unnamed"
    if out[0].isdigit():
        out = "_" + out
    return out


def escape_label_value(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float | int) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _number(value: Any) -> float | int | None:
    """``value`` as a sample value, or None when it is not a number (bools count as 0/1)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


class _Family:
    def __init__(self, name: str, mtype: str, help_text: str) -> None:
        self.name = name
        self.mtype = mtype
        self.help = help_text
        self.samples: list[tuple[dict[str, str], float | int]] = []


class _Builder:
    def __init__(self) -> None:
        self.families: dict[str, _Family] = {}

    def add(
        self, name: str, mtype: str, help_text: str, labels: dict[str, str], value: float | int
    ) -> None:
        base = name[: -len("_total")] if name.endswith("_total") else name
        fam = self.families.get(name)
        if fam is None:
            # x and x_total would parse as one family: keep the first.
            if base != name and base in self.families:
                return
            if f"{name}_total" in self.families:
                return
            fam = self.families[name] = _Family(name, mtype, help_text)
        elif fam.mtype != mtype:
            return
        if any(existing == labels for existing, _ in fam.samples):
            return
        fam.samples.append((labels, value))

    def render(self) -> str:
        lines: list[str] = []
        for fam in self.families.values():
            lines.append(f"# HELP {fam.name} {escape_help(fam.help)}")
            lines.append(f"# TYPE {fam.name} {fam.mtype}")
            for labels, value in fam.samples:
                if labels:
                    body = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
                    lines.append(f"{fam.name}{{{body}}} {format_value(value)}")
                else:
                    lines.append(f"{fam.name} {format_value(value)}")
        return "\n".join(lines) + "\n" if lines else ""


def render_metrics(stats: Mapping[str, Any]) -> str:
    """The Prometheus text exposition of ``stats`` (see the module docstring)."""
    b = _Builder()
    reserved = {f"{PREFIX}_{n}" for n, _, _ in TIER_GAUGES.values()}
    reserved |= {f"{PREFIX}_{n}_total" for n, _ in TIER_COUNTERS.values()}
    reserved |= {f"{PREFIX}_{n}" for n, _ in TIER_COUNTERS.values()}
    reserved |= {f"{PREFIX}_queue_depth", f"{PREFIX}_policy_info", f"{PREFIX}_policy_value"}

    tiers = stats.get("tiers")
    if isinstance(tiers, Mapping):
        for tier, tstats in tiers.items():
            if not isinstance(tstats, Mapping):
                continue
            labels = {"tier": str(tier)}
            for key, raw in tstats.items():
                value = _number(raw)
                if value is None:
                    continue
                if key in TIER_GAUGES:
                    name, help_text, scale = TIER_GAUGES[key]
                    scaled = value * scale if scale != 1.0 else value
                    b.add(f"{PREFIX}_{name}", "gauge", help_text, labels, scaled)
                elif key in TIER_COUNTERS:
                    name, help_text = TIER_COUNTERS[key]
                    b.add(f"{PREFIX}_{name}_total", "counter", help_text, labels, value)
                else:
                    name = f"{PREFIX}_tier_{sanitize_name(key)}"
                    if name in reserved:
                        continue
                    b.add(name, "untyped", f"Tier statistic {key!s}.", labels, value)

    queues = stats.get("queues")
    if isinstance(queues, Mapping):
        for queue, raw in queues.items():
            value = _number(raw)
            if value is not None:
                b.add(
                    f"{PREFIX}_queue_depth",
                    "gauge",
                    "Items waiting in a HiCache queue.",
                    {"queue": str(queue)},
                    value,
                )

    policy = stats.get("policy")
    if isinstance(policy, Mapping):
        for key, raw in policy.items():
            if isinstance(raw, (str, bool)):
                text = raw if isinstance(raw, str) else str(raw).lower()
                b.add(
                    f"{PREFIX}_policy_info",
                    "gauge",
                    "Configured HiCache policies (value label), always 1.",
                    {"key": str(key), "value": text},
                    1,
                )
                continue
            value = _number(raw)
            if value is not None:
                b.add(
                    f"{PREFIX}_policy_value",
                    "gauge",
                    "Numeric HiCache policy settings.",
                    {"key": str(key)},
                    value,
                )

    for section, body in stats.items():
        if section in ("tiers", "queues", "policy") or not isinstance(body, Mapping):
            continue
        for key, raw in body.items():
            value = _number(raw)
            if value is None:
                continue
            name = f"{PREFIX}_{sanitize_name(section)}_{sanitize_name(key)}"
            if name in reserved:
                continue
            b.add(name, "untyped", f"HiCache statistic {section!s}.{key!s}.", {}, value)

    return b.render()
