"""``hicache simulate``: hit rate per tier and estimated TTFT for a grid of tier sizes.

Each grid point replays the whole trace through a fresh
:class:`~hicache.integration.bench.sim_engine.SimEngine` (the real scheduler
and HiRadixTree; no engine, no bytes). The TTFT estimate of one request is

    base_s + prefill_s_per_token * (prompt tokens not cached)
           + page_bytes * (L2 pages / l2_load_gbps + L3 pages / l3_read_gbps)

with the coefficients from :func:`calibrate`: the prefill line is fitted to
a ``hicache bench run`` result (TTFT against uncached tokens), the L2 rate is
the copy benchmark's load bandwidth (``bench_results/copy.json``), the L3 rate
the L3 benchmark's read bandwidth (``bench_results/l3.json``). Whatever is
not given keeps a stated default, and the output says where each number
came from. The estimate ignores queueing and batching; it ranks sizes, it
does not predict a loaded server's tail latency.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hicache.integration.bench.report import percentiles
from hicache.integration.bench.sim_engine import SimConfig, SimEngine, SimResult
from hicache.integration.bench.trace import TraceRecord

TIERS = ("l1", "l2", "l3")


@dataclass(frozen=True)
class CostModel:
    """Per-request TTFT estimate; ``sources`` says where each coefficient came from."""

    # TTFT that does not grow with the prompt (scheduling, first decode step), seconds.
    base_s: float = 0.02
    # Prefill seconds per prompt token that is computed (not cached).
    prefill_s_per_token: float = 2e-4
    # KV bytes of one page (all layers, K and V); 0 = loads are free.
    page_bytes: int = 0
    # Host pool -> L1 load bandwidth, GB/s.
    l2_load_gbps: float = 10.0
    # L3 -> host pool read bandwidth, GB/s.
    l3_read_gbps: float = 2.0
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def ttft_s(self, prompt_tokens: int, cached_tokens: int, l2_pages: int,
               l3_pages: int) -> float:
        load = 0.0
        if self.page_bytes:
            load = self.page_bytes * (l2_pages / (self.l2_load_gbps * 1e9)
                                      + l3_pages / (self.l3_read_gbps * 1e9))
        return self.base_s + self.prefill_s_per_token * max(0, prompt_tokens - cached_tokens) + load


def fit_prefill(points: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """Least-squares (base_s, s_per_token) of TTFT against uncached tokens; None if degenerate."""
    pts = list(points)
    if len(pts) < 3:
        return None
    xs, ys = [float(x) for x, _ in pts], [y for _, y in pts]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return None
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    if slope <= 0:
        return None
    return max(0.0, my - slope * mx), slope


def calibrate(*, bench_json: str | Path | None = None, copy_json: str | Path | None = None,
              l3_json: str | Path | None = None, page_bytes: int = 0,
              page_size: int = 32) -> CostModel:
    """A :class:`CostModel` from whichever benchmark results exist."""
    base, kw = CostModel(), {}
    sources = {k: "default" for k in ("base_s", "prefill_s_per_token", "l2_load_gbps",
                                      "l3_read_gbps")}
    if bench_json is not None and Path(bench_json).exists():
        reqs = json.loads(Path(bench_json).read_text()).get("requests", [])
        points = [(r["prompt_tokens"] - (r.get("cached_tokens") or 0), r["ttft"])
                  for r in reqs if r.get("ttft") and not r.get("error")
                  and r.get("cached_tokens") is not None]
        fit = fit_prefill(points)
        if fit is not None:
            kw["base_s"], kw["prefill_s_per_token"] = fit
            sources["base_s"] = sources["prefill_s_per_token"] = (
                f"fit to {len(points)} requests of {bench_json}")
    if copy_json is not None and Path(copy_json).exists():
        rows = json.loads(Path(copy_json).read_text()).get("rows", [])
        loads = [r for r in rows if r.get("direction") == "load" and r.get("path") == "cpu-batch"]
        if loads:
            size = min({r["page_size"] for r in loads}, key=lambda s: abs(s - page_size))
            kw["l2_load_gbps"] = statistics.median(
                r["gbps"] for r in loads if r["page_size"] == size)
            sources["l2_load_gbps"] = f"median cpu-batch load at page {size} in {copy_json}"
    if l3_json is not None and Path(l3_json).exists():
        rows = [r for r in json.loads(Path(l3_json).read_text()) if r.get("backend") == "file"]
        if rows:
            kw["l3_read_gbps"] = statistics.median(r["ours_read_gbs"] for r in rows)
            sources["l3_read_gbps"] = f"median file read in {l3_json}"
    sources["page_bytes"] = "given" if page_bytes else "0: loads cost nothing"
    return CostModel(**{**asdict(base), **kw, "page_bytes": page_bytes, "sources": sources})


def model_page_bytes(model_dir: str | Path, page_size: int, dtype_bytes: int = 2) -> int:
    """Bytes of one L2 page of a Hugging Face model directory (its config.json).

    A page holds every KV-cache group's part (tiers/index/kv_groups.py): the
    K and V of its tokens in every attention layer, sliding-window layers
    included, and for a Mamba hybrid one state checkpoint (conv + SSM state)
    per Mamba layer. Layers without a cache (MLP, MoE) count nothing. vLLM's
    padding of Mamba pages to the attention block size is left out."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attention, mamba = _layer_counts(cfg)
    total = 2 * attention * heads * head_dim * dtype_bytes * page_size
    if mamba:
        inner = cfg["mamba_num_heads"] * cfg["mamba_head_dim"]
        conv = (inner + 2 * cfg.get("n_groups", 1) * cfg["ssm_state_size"]) * (
            cfg.get("conv_kernel", 4) - 1) * dtype_bytes
        ssm_bytes = 4 if cfg.get("mamba_ssm_cache_dtype", "float32") == "float32" else dtype_bytes
        ssm = inner * cfg["ssm_state_size"] * ssm_bytes
        total += mamba * (conv + ssm)
    return total


def _layer_counts(cfg: dict) -> tuple[int, int]:
    """(attention layers, Mamba layers) of a config: Nemotron-H's pattern ("M"
    Mamba, "*" attention), a ``layers_block_type`` list, else all attention."""
    pattern = cfg.get("hybrid_override_pattern")
    if pattern:
        return pattern.count("*"), pattern.count("M")
    kinds = cfg.get("layers_block_type")
    if kinds:
        return (sum(k in ("attention", "full_attention") for k in kinds),
                sum(k in ("mamba", "linear_attention") for k in kinds))
    return cfg["num_hidden_layers"], 0


@dataclass(frozen=True)
class Grid:
    """The sizes to try; every combination is one replay."""

    l1_blocks: tuple[int, ...]
    l2_pages: tuple[int, ...] = (0,)
    # None = no L3, -1 = unbounded.
    l3_pages: tuple[int | None, ...] = (None,)
    write_policies: tuple[str, ...] = ("write_through",)
    block_size: int = 32
    page_size: int = 32
    prefetch_threshold: int = 256
    # L2 evictions ("lru", "oracle") and whether the trace's client actions count.
    evictions: tuple[str, ...] = ("lru",)
    hints: tuple[bool, ...] = (True,)
    tlru_tail_pages: int = 64

    def configs(self) -> list[SimConfig]:
        out = []
        for l1 in self.l1_blocks:
            for l2 in self.l2_pages:
                for l3 in self.l3_pages:
                    # Without an L2 there is no connector: no L3, policy, eviction or hints.
                    if l2 == 0 and l3 is not None:
                        continue
                    for policy in self.write_policies if l2 else ("write_through",):
                        for eviction in self.evictions if l2 else ("lru",):
                            for hints in self.hints if l2 else (True,):
                                out.append(SimConfig(
                                    l1_blocks=l1, l2_pages=l2, l3_pages=l3,
                                    block_size=self.block_size, page_size=self.page_size,
                                    write_policy=policy,
                                    prefetch_threshold=self.prefetch_threshold,
                                    eviction=eviction, hints=hints,
                                    tlru_tail_pages=self.tlru_tail_pages))
        return list(dict.fromkeys(out))


def parse_sizes(text: str, key: str, *, allow_none: bool = False) -> tuple[int | None, ...]:
    """"80,160" -> (80, 160); "none" -> None and "inf" -> -1 where allowed (L3)."""
    out: list[int | None] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if allow_none and part in ("none", "off", "no"):
            out.append(None)
        elif allow_none and part in ("inf", "unbounded", "-1"):
            out.append(-1)
        else:
            try:
                value = int(part)
            except ValueError:
                value = -1
            if value < 0:
                allowed = "integers >= 0" + (", 'none' or 'inf'" if allow_none else "")
                raise ValueError(f"{key}: {part!r} is not a size; allowed: {allowed}")
            out.append(value)
    if not out:
        raise ValueError(f"{key}: give at least one size")
    return tuple(out)


def parse_switches(text: str, key: str) -> tuple[bool, ...]:
    """"on,off" -> (True, False); anything else is a ValueError naming ``key``."""
    words = {"on": True, "off": False, "true": True, "false": False}
    out = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part not in words:
            raise ValueError(f"{key}: {part!r} is not a switch; allowed: on, off, on,off")
        out.append(words[part])
    if not out:
        raise ValueError(f"{key}: give on, off or on,off")
    return tuple(dict.fromkeys(out))


def summarize(result: SimResult, cost: CostModel) -> dict[str, Any]:
    cfg = result.config
    ttfts = [cost.ttft_s(o.prompt_tokens, o.cached_pages * cfg.page_size, o.l2_pages,
                         o.l3_pages) for o in result.outcomes]
    rates = result.hit_rates()
    pct = percentiles(ttfts, (50, 90, 99), scale=1e3)
    row: dict[str, Any] = {
        "l1_blocks": cfg.l1_blocks, "l2_pages": cfg.l2_pages,
        "l3_pages": "none" if cfg.l3_pages is None else ("inf" if cfg.l3_pages < 0
                                                         else cfg.l3_pages),
        "write_policy": cfg.write_policy if cfg.l2_pages else "-",
        "eviction": cfg.eviction if cfg.l2_pages else "-",
        "hints": ("on" if cfg.hints else "off") if cfg.l2_pages else "-",
        **{f"hit_{k}": round(v, 4) for k, v in rates.items()},
        "est_ttft_ms_mean": round(1e3 * statistics.fmean(ttfts), 3) if ttfts else None,
        "est_ttft_ms_p50": pct["p50"],
        "est_ttft_ms_p90": pct["p90"],
        "est_ttft_ms_p99": pct["p99"],
        "l2_evicted_pages": result.l2_evicted_pages,
        "l3_evicted_pages": result.l3_evicted_pages,
        "prefetches": result.prefetches,
        "prefetch_pages": result.prefetch_pages,
        "requests": len(result.outcomes),
    }
    if cost.page_bytes:
        row["l2_gib"] = round(cfg.l2_pages * cost.page_bytes / 2**30, 3)
    return row


def run_grid(records: Sequence[TraceRecord], grid: Grid, cost: CostModel,
             progress: bool = True) -> list[dict[str, Any]]:
    configs = grid.configs()
    rows = []
    if progress:
        from rich.progress import track

        iterator: Iterable[SimConfig] = track(configs, description="simulating")
    else:
        iterator = configs
    for cfg in iterator:
        rows.append(summarize(SimEngine(cfg).run(records), cost))
    return rows


def headroom(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per grid point with an oracle row: the total hit rate of each LRU row of the
    same sizes and write policy against the oracle's (hints as in the oracle row)."""
    def point(r: dict[str, Any]) -> tuple[Any, ...]:
        return (r["l1_blocks"], r["l2_pages"], r["l3_pages"], r["write_policy"])

    out = []
    for oracle in (r for r in rows if r["eviction"] == "oracle"):
        for lru in (r for r in rows if r["eviction"] == "lru" and point(r) == point(oracle)):
            out.append({
                "l1_blocks": oracle["l1_blocks"], "l2_pages": oracle["l2_pages"],
                "l3_pages": oracle["l3_pages"], "write_policy": oracle["write_policy"],
                "lru_hints": lru["hints"], "oracle_hints": oracle["hints"],
                "lru_hit_total": lru["hit_total"], "oracle_hit_total": oracle["hit_total"],
                "headroom_points": round(100 * (oracle["hit_total"] - lru["hit_total"]), 2),
            })
    return out


def smallest_sizes(rows: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Per policy (write policy, eviction, hints): the smallest grid point whose total
    hit rate reaches ``target`` (a share), L1 first, then L2, then L3 (none before
    any size, unbounded last); ``None`` sizes where no point reaches it."""
    def l3_order(v: Any) -> float:
        return -1.0 if v == "none" else math.inf if v == "inf" else float(v)

    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["write_policy"], r["eviction"], r["hints"]), []).append(r)
    out = []
    for (policy, eviction, hints), group in groups.items():
        reaching = sorted((r for r in group if r["hit_total"] >= target), key=lambda r: (
            r["l1_blocks"], r["l2_pages"], l3_order(r["l3_pages"])))
        best = reaching[0] if reaching else None
        out.append({"write_policy": policy, "eviction": eviction, "hints": hints,
                    "target": target,
                    **{k: best[k] if best else None
                       for k in ("l1_blocks", "l2_pages", "l3_pages", "hit_total")}})
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Total hit rate (stacked by tier) of every grid point, and estimated TTFT."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"L1 {r['l1_blocks']} / L2 {r['l2_pages']} / L3 {r['l3_pages']}"
              + (f"\n{r['write_policy']}, {r['eviction']}, hints {r['hints']}"
                 if r["write_policy"] != "-" else "") for r in rows]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(rows) + 2), 7), sharex=True)
    bottom = [0.0] * len(rows)
    for tier, color in zip(TIERS, ("#4c72b0", "#55a868", "#c44e52"), strict=True):
        vals = [100 * r[f"hit_{tier}"] for r in rows]
        ax1.bar(range(len(rows)), vals, bottom=bottom, color=color, label=tier.upper())
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax1.set_ylabel("prompt tokens cached (%)")
    ax1.legend(loc="upper left")
    ax1.set_title("Simulated hit rate per tier")
    ax2.bar(range(len(rows)), [r["est_ttft_ms_mean"] or 0 for r in rows], color="#8172b2")
    ax2.set_ylabel("estimated mean TTFT (ms)")
    ax2.set_xticks(range(len(rows)), labels, rotation=60, ha="right", fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_table(rows: list[dict[str, Any]], cost: CostModel) -> Any:
    from rich.table import Table

    table = Table(title="hicache simulate: share of prompt tokens served by each tier")
    cols = {"l1_blocks": "L1 blocks", "l2_pages": "L2 pages", "l3_pages": "L3 pages",
            "write_policy": "policy", "eviction": "eviction", "hints": "hints",
            "hit_l1": "L1", "hit_l2": "L2", "hit_l3": "L3",
            "hit_total": "total", "est_ttft_ms_mean": "est. TTFT ms", "est_ttft_ms_p90": "p90"}
    if cost.page_bytes:
        cols = {"l2_gib": "L2 GiB", **cols}
    for title in cols.values():
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*[f"{100 * r[c]:.1f}%" if c.startswith("hit_") else str(r.get(c))
                        for c in cols])
    return table
