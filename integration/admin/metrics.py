"""The admin ``GET /metrics``: the ``stats()`` dict as Prometheus text, via ``prometheus_client``.

Contract: :func:`render_metrics` takes the dict ``AdminTarget.stats()``
returns and gives the text served with content type :data:`CONTENT_TYPE`
(the text exposition format 0.0.4). A ``prometheus_client`` collector
yields one metric family per row of ``tiers/metrics.py`` that has samples
(its ``section`` / ``key`` say where they are, see that module), then an
untyped family per numeric stats key no row names (``fallback_name``);
``generate_latest`` renders them from a registry of its own, so nothing
here touches the process-wide registry or vLLM's metrics.

Values that are ``None`` or not numbers are skipped (bools count as 0 / 1,
except where a ``text`` row takes them, as in ``policy``); so are
sections that are not dicts. A family name is used once: a fallback never
takes a table name, and a later family whose samples would collide with an
earlier one's is dropped rather than producing an invalid exposition.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UnknownMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from hicache.tiers.metrics import EVERY_KEY, METRICS, MetricSpec, fallback_name

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

_Scalar = CounterMetricFamily | GaugeMetricFamily | UnknownMetricFamily
_FAMILY_TYPES: dict[
    str, type[CounterMetricFamily] | type[GaugeMetricFamily] | type[UnknownMetricFamily]
] = {
    "counter": CounterMetricFamily,
    "gauge": GaugeMetricFamily,
    "untyped": UnknownMetricFamily,
}
# Sample names a family of each kind writes, as suffixes of its name.
_SUFFIXES = {"counter": ("", "_total", "_created"), "gauge": ("",), "untyped": ("",),
             "histogram": ("", "_bucket", "_sum", "_count", "_created")}


def render_metrics(stats: Mapping[str, Any]) -> str:
    """The Prometheus text exposition of ``stats`` (see the module docstring)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    return generate_latest(registry).decode("utf-8")


class StatsCollector(Collector):
    """The metric families of one ``stats()`` dict."""

    def __init__(self, stats: Mapping[str, Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        families = _Families()
        for spec in METRICS:
            _add_row(families, spec, self._stats)
        _add_fallbacks(families, self._stats)
        yield from families.metrics()


def _number(value: Any) -> float | int | None:
    """``value`` as a sample value, or None when it is not a number (bools count as 0/1)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, (int, float)):
        return value
    return None


def _sections(stats: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    for section, body in stats.items():
        if isinstance(body, Mapping):
            yield str(section), body


def _has_text_row(section: str) -> bool:
    return any(m.section == section and m.values == "text" for m in METRICS)


def _add_row(families: _Families, spec: MetricSpec, stats: Mapping[str, Any]) -> None:
    body = stats.get(spec.section)
    if not isinstance(body, Mapping):
        return
    if spec.kind == "histogram":
        _add_histogram(families, spec, body.get(spec.key))
        return
    if spec.section == "tiers":
        for tier, tier_stats in body.items():
            if isinstance(tier_stats, Mapping):
                value = _number(tier_stats.get(spec.key))
                if value is not None:
                    scaled = value * spec.scale if spec.scale != 1.0 else value
                    families.add(spec.name, spec.kind, spec.help, spec.labels, [str(tier)], scaled)
        return
    items = body.items() if spec.key == EVERY_KEY else [(spec.key, body.get(spec.key))]
    text_elsewhere = spec.values == "number" and _has_text_row(spec.section)
    for key, raw in items:
        labels = [str(key)] if spec.key == EVERY_KEY else []
        if spec.values == "text":
            if isinstance(raw, (str, bool)):
                text = raw if isinstance(raw, str) else str(raw).lower()
                families.add(spec.name, spec.kind, spec.help, spec.labels, [*labels, text], 1)
            continue
        if text_elsewhere and isinstance(raw, bool):
            continue
        value = _number(raw)
        if value is not None:
            families.add(spec.name, spec.kind, spec.help, spec.labels, labels, value)


def _add_histogram(families: _Families, spec: MetricSpec, raw: Any) -> None:
    """A cumulative histogram as ``LatencyBuckets.as_dict()`` gives it."""
    if not isinstance(raw, Mapping):
        return
    try:
        buckets = [(floatToGoString(bound), float(count)) for bound, count in raw["buckets"]]
        buckets.append(("+Inf", float(raw["count"])))
        total = float(raw["sum"])
    except (KeyError, TypeError, ValueError):
        return
    if families.claim(spec.name, "histogram"):
        families.put(HistogramMetricFamily(spec.name, spec.help, buckets=buckets,
                                           sum_value=total))


def _add_fallbacks(families: _Families, stats: Mapping[str, Any]) -> None:
    """Untyped families for the numeric keys no row of the table names."""
    named = {(m.section, m.key) for m in METRICS}
    for section, body in _sections(stats):
        if (section, EVERY_KEY) in named:
            continue
        if section == "tiers":
            for tier, tier_stats in body.items():
                if not isinstance(tier_stats, Mapping):
                    continue
                for key, raw in tier_stats.items():
                    value = _number(raw)
                    if value is not None and (section, key) not in named:
                        families.add(fallback_name(section, key), "untyped",
                                     f"Tier statistic {key!s}.", ("tier",), [str(tier)], value,
                                     fallback=True)
            continue
        for key, raw in body.items():
            value = _number(raw)
            if value is not None and (section, key) not in named:
                families.add(fallback_name(section, key), "untyped",
                             f"HiCache statistic {section}.{key!s}.", (), [], value,
                             fallback=True)


class _Families:
    """The families of one collection, each name used once (see the module docstring)."""

    def __init__(self) -> None:
        self._families: dict[str, Metric] = {}
        self._label_names: dict[str, tuple[str, ...]] = {}
        self._label_sets: dict[str, set[tuple[str, ...]]] = {}
        self._claimed: set[str] = set()
        self._reserved = {n for m in METRICS for n in _sample_names(m.name, m.kind)}

    def claim(self, name: str, kind: str, fallback: bool = False) -> bool:
        """Take ``name`` for a new family of ``kind``; False when it would collide."""
        names = _sample_names(name, kind)
        if names & self._claimed or (fallback and names & self._reserved):
            return False
        self._claimed |= names
        return True

    def put(self, family: Metric) -> None:
        self._families[family.name] = family

    def add(self, name: str, kind: str, help_text: str, label_names: tuple[str, ...],
            labels: list[str], value: float, *, fallback: bool = False) -> None:
        family = self._families.get(name)
        if family is None:
            if not self.claim(name, kind, fallback):
                return
            scalar = _FAMILY_TYPES[kind](name, help_text, labels=list(label_names))
            self.put(scalar)
            family = scalar
            self._label_names[name], self._label_sets[name] = label_names, set()
        elif (family.type != ("unknown" if kind == "untyped" else kind)
              or self._label_names[name] != label_names):
            return
        if not isinstance(family, _Scalar) or tuple(labels) in self._label_sets[name]:
            return  # a histogram is put whole; a label set is written once
        self._label_sets[name].add(tuple(labels))
        family.add_metric(labels, value)

    def metrics(self) -> Iterator[Metric]:
        return iter(self._families.values())


def _sample_names(name: str, kind: str) -> set[str]:
    base = name[: -len("_total")] if kind == "counter" and name.endswith("_total") else name
    return {base + suffix for suffix in _SUFFIXES[kind]}
