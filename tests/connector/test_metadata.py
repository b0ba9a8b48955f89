"""vLLM's envelopes carry the plain plan and report unchanged."""

from hicache.connector.metadata import HiCacheStepMetadata, HiCacheWorkerReport
from hicache.tiers.index.commands import DetachStore
from hicache.tiers.index.plans import PagePlan, RequestLoad, StepPlan


def test_step_metadata_wraps_every_field_of_the_plan():
    plan = StepPlan(loads=[RequestLoad("r", (PagePlan(1, b"k", 0, (5,)),))],
                    stores=[PagePlan(2, b"j", 0, (6, 7))], release_after_store=["q"],
                    storage_commands=[DetachStore()])
    meta = HiCacheStepMetadata.wrap(plan)
    assert isinstance(meta, StepPlan)
    assert (meta.loads, meta.stores, meta.release_after_store, meta.fetches,
            meta.storage_commands) == (plan.loads, plan.stores, ["q"], [], [DetachStore()])


def test_worker_reports_aggregate_into_the_vllm_envelope():
    a = HiCacheWorkerReport({1}, {"r": [3]}, {"bytes": 2.0})
    b = HiCacheWorkerReport({2}, {"r": [2]}, {"bytes": 3.0})
    merged = a.aggregate(b)
    assert isinstance(merged, HiCacheWorkerReport)
    assert (merged.bad_slots, merged.fetched, merged.counters) == ({1, 2}, {"r": [3, 2]},
                                                                   {"bytes": 5.0})
