"""What one ``hicache bench run`` measured: each request's record and the run's result.

Contract: plain dataclasses, written to and read back from JSON (``to_dict`` /
``from_dict``, ``BenchResult.to_json`` / ``from_json``); times are seconds since
the run began. The client (client.py) fills them, the report (report.py) and the
comparison (compare.py) read them; neither imports the other for them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache.integration.bench.workloads import WorkloadSpec


@dataclass
class RequestRecord:
    """One request of a run; times are seconds since the run began."""

    id: str
    client: int
    turn: int
    arrival: float
    first_token: float | None = None
    finish: float | None = None
    prompt_tokens: int = 0
    # usage.prompt_tokens_details.cached_tokens; None when the server does not report it.
    cached_tokens: int | None = None
    output_tokens: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    error: str | None = None
    # Kept in memory for the trace and for building the next turn; not in JSON.
    prompt_ids: list[int] = field(default_factory=list, repr=False, compare=False)
    answer_ids: list[int] | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("prompt_ids", "answer_ids")}
        d["itl"] = list(self.itl)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in dataclasses.fields(cls)} - {"prompt_ids", "answer_ids"}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class BenchResult:
    """Everything one run measured; ``to_json`` writes it, ``from_dict`` reads it back."""

    spec: WorkloadSpec
    base_url: str
    model: str
    requests: list[RequestRecord]
    duration_s: float
    summary: dict[str, Any]
    tiers: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec.to_dict(), "base_url": self.base_url, "model": self.model,
            "duration_s": self.duration_s, "summary": self.summary, "tiers": self.tiers,
            "requests": [r.to_dict() for r in self.requests],
        }

    def to_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        return cls(
            spec=WorkloadSpec.from_dict(d["spec"]), base_url=d["base_url"], model=d["model"],
            requests=[RequestRecord.from_dict(r) for r in d["requests"]],
            duration_s=float(d["duration_s"]), summary=d["summary"], tiers=d.get("tiers"),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> BenchResult:
        return cls.from_dict(json.loads(Path(path).read_text()))
