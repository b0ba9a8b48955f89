"""The SGLang side-by-side runner's pure parts (integration/bench/gpu/sglang_e2e.py): its
workload matches e2e.py's token for token, and its tables. SGLang itself only runs on the
lent GPU (its HiCache moves KV with CUDA kernels): see docs/gpu.md "SGLang HiCache side by side"."""

from __future__ import annotations

import pytest

from hicache.integration.bench.gpu import e2e, sglang_e2e


def test_the_workload_is_e2e_s():
    assert sglang_e2e.conversations([8192], 2, 2048) == [(2048, -1), (8192, 0), (8192, 1)]
    history = e2e.prompt_tokens(100, 5, 1000)
    answer = [7, 8]
    got = sglang_e2e.returning_prompt(history, answer, 5, 3, 1000)
    assert got == history + answer + e2e.prompt_tokens(e2e.QUESTION_TOKENS, 53, 1000)


def test_tiers_come_from_the_cached_tokens_details():
    assert sglang_e2e.tiers({"cached_tokens_details": {"device": 0, "host": 8192,
                                                       "storage": 0, "storage_backend": "file"}}
                            ) == {"device": 0, "host": 8192, "storage": 0}
    assert sglang_e2e.tiers({}) == {}


def test_table_takes_medians_and_ratios_to_recompute():
    def row(branch, ttft, conv=0):
        return {"history": 8192, "conv": conv, "branch": branch, "ttft": ttft,
                "cached": 8192 if branch != "recompute" else 0, "tiers": {}}
    rows = [row("recompute", t, c) for c, t in enumerate((0.05, 0.07))] + [
        row("l2", 0.02, 0), row("l2", 0.04, 1), row("l3", 0.5, -1)]  # warm-up not counted
    (line,) = sglang_e2e.table(rows)
    assert line["recompute"]["ttft_ms"] == pytest.approx(60)
    assert line["l2"]["vs_recompute"] == pytest.approx(0.5)
    assert "l3" not in line
    text = sglang_e2e.report({"command": "c", "sglang_version": "0.5.17", "start_seconds": 1.0,
                              "table": [line]})
    assert "| 8192 |" in text and "30.0 (0.50x)" in text
