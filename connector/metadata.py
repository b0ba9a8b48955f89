"""vLLM's envelopes for the step plan and the workers' report.

The scheduler core builds a plain ``StepPlan`` and consumes a plain
``WorkerReport`` (``tiers/index/plans.py``, where the contract is written);
vLLM moves ``KVConnectorMetadata`` scheduler -> workers and merges
``KVConnectorWorkerMetadata`` over ranks with ``aggregate``. These two
classes are both at once, so nothing is copied field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hicache.tiers.index.plans import StepPlan, WorkerReport


@dataclass
class HiCacheStepMetadata(StepPlan, KVConnectorMetadata):
    """A ``StepPlan`` as vLLM's per-step connector metadata."""

    @classmethod
    def wrap(cls, plan: StepPlan) -> HiCacheStepMetadata:
        return cls(**{f.name: getattr(plan, f.name) for f in fields(StepPlan)})


@dataclass
class HiCacheWorkerReport(WorkerReport, KVConnectorWorkerMetadata):
    """A ``WorkerReport`` as vLLM's worker -> scheduler metadata."""

    @classmethod
    def wrap(cls, report: WorkerReport) -> HiCacheWorkerReport:
        return cls(**{f.name: getattr(report, f.name) for f in fields(WorkerReport)})

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, HiCacheWorkerReport)
        merged = self.merge(other)
        assert isinstance(merged, HiCacheWorkerReport)
        return merged
