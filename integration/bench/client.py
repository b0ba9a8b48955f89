"""Streaming workload client for any OpenAI-compatible server: ``hicache bench run``.

Contract
========

:func:`run_bench` plays a :class:`~hicache.integration.bench.workloads.WorkloadSpec`
against ``{base_url}/v1/completions``: ``spec.clients`` asyncio tasks share
one ``httpx.AsyncClient``; each sends its ``spec.turns`` requests one after
the other (``think_time_s`` apart). Every request is::

    {"model": M, "prompt": [token ids], "max_tokens": answer_tokens, "temperature": 0,
     "ignore_eos": true, "stream": true, "return_token_ids": true,
     "stream_options": {"include_usage": true, "continuous_usage_stats": false}}

Measured per request (:class:`RequestRecord`, times in seconds since the run
began): ``arrival`` when it is sent; ``first_token`` at the first streamed
chunk that carries generated text or token ids (``ttft`` = first_token -
arrival); ``itl`` the gaps between later token-carrying chunks (a chunk with
``k`` tokens contributes ``k`` gaps of ``gap / k``, so ITL stays per token);
``finish`` when the stream ends. The final usage chunk gives
``prompt_tokens``, ``output_tokens`` (``completion_tokens``) and
``cached_tokens`` (``usage.prompt_tokens_details.cached_tokens``; vLLM sends
it only with ``--enable-prompt-tokens-details``, else it is ``None``).

Answer token ids (needed by ``multiturn`` to build the next prompt) come from
``choices[0].token_ids`` (vLLM with ``return_token_ids``); a server that does
not send them needs ``tokenizer=`` (a Hugging Face name or path; the text is
re-tokenized without special tokens), else the run raises :class:`BenchError`.

A failed request (HTTP error, broken stream, ``request_timeout`` exceeded)
is recorded with ``error`` and ends its client's conversation; the run goes
on. With ``admin_url`` (HiCache's admin endpoint), ``/stats`` is read before
and after the run and :attr:`BenchResult.tiers` holds the per-tier page
counter deltas::

    {"page_size": 32,                      # tokens per page, from GET /config
     "prompt_tokens": 12345,               # of the completed requests
     "l1": {"hits": 10, "hit_tokens": 320, "hit_rate": 0.026},
     "l2": {"hits": 40, "misses": 60, "hit_tokens": 1280, "hit_rate": 0.10},
     "l3": {...}}                          # only when an L3 backend is attached

(``hit_tokens``/``hit_rate`` are None when the page size is unknown).
With ``trace_path``, every completed request is written as a
:mod:`~hicache.integration.bench.trace` record (prompt token ids, and the
generated ids as ``output`` when known).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from hicache.integration.bench.records import BenchResult, RequestRecord
from hicache.integration.bench.report import summarize
from hicache.integration.bench.trace import TraceRecord, write_trace
from hicache.integration.bench.workloads import WorkloadSpec

TIER_NAMES = ("l1", "l2", "l3")
# The run's records live in records.py (report.py reads them too); named here as well.
__all__ = ["BenchError", "BenchResult", "RequestRecord", "run_bench", "run_bench_sync",
           "tier_deltas"]


class BenchError(RuntimeError):
    """The benchmark cannot run (no model, or answer ids needed but unavailable)."""


# ---- admin endpoint -------------------------------------------------------------


async def _admin_post(http: httpx.AsyncClient, url: str, token: str | None,
                      body: dict[str, Any]) -> bool:
    """POST to the admin endpoint; whether it answered 2xx (a failed hint is counted,
    never a failed request)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = await http.post(url, json=body, headers=headers)
    except httpx.HTTPError:
        return False
    return r.is_success


async def _admin_get(http: httpx.AsyncClient, url: str, token: str | None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = await http.get(url, headers=headers, timeout=30)
    if r.status_code != 200:
        raise BenchError(f"GET {url} answered {r.status_code}: {r.text[:300]}")
    return r.json()


def tier_deltas(before: dict[str, Any], after: dict[str, Any], page_size: int | None,
                prompt_tokens: int) -> dict[str, Any]:
    """Per-tier hit/miss page deltas between two ``/stats`` answers (see the module doc)."""
    out: dict[str, Any] = {"page_size": page_size, "prompt_tokens": prompt_tokens}
    tiers_after = after.get("tiers", {})
    tiers_before = before.get("tiers", {})
    for name in TIER_NAMES:
        if name not in tiers_after:
            continue
        a, b = tiers_after[name], tiers_before.get(name, {})
        t: dict[str, Any] = {}
        for key in ("hits", "misses"):
            if isinstance(a.get(key), (int, float)):
                t[key] = int(a[key] - b.get(key, 0))
        if isinstance(a.get("capacity_pages"), int):
            t["capacity_pages"] = a["capacity_pages"]
        hits = t.get("hits")
        if page_size and hits is not None:
            t["hit_tokens"] = hits * page_size
            t["hit_rate"] = hits * page_size / prompt_tokens if prompt_tokens else None
        else:
            t["hit_tokens"] = t["hit_rate"] = None
        out[name] = t
    return out


async def tiers_since(http: httpx.AsyncClient, admin_url: str | None, token: str | None,
                      before: dict[str, Any] | None, page_size: int | None,
                      records: Sequence[RequestRecord]) -> dict[str, Any] | None:
    """The per-tier deltas since ``before`` over the completed ``records`` (None
    without an admin endpoint)."""
    if admin_url is None:
        return None
    after = await _admin_get(http, f"{admin_url}/stats", token)
    return tier_deltas(before or {}, after, page_size,
                       sum(r.prompt_tokens for r in records if r.error is None))


def write_served(path: str | Path, records: Sequence[RequestRecord],
                 hints_of: Callable[[RequestRecord], dict[str, Any] | None] = lambda r: None,
                 prefetched: Mapping[str, tuple[float, int]] | None = None) -> None:
    """The completed ``records`` as a trace ``hicache simulate`` replays (trace.py):
    prompt and answer ids, arrival and finish, the hints each carried and when its
    history was prefetched (``prefetched``: request id -> (time, tokens))."""
    prefetched = prefetched or {}
    write_trace(path, [
        TraceRecord(id=r.id, arrival=r.arrival, finish=r.finish,
                    output_tokens=r.output_tokens, prompt=tuple(r.prompt_ids),
                    prompt_tokens=len(r.prompt_ids),
                    output=None if r.answer_ids is None else tuple(r.answer_ids),
                    hints=hints_of(r), prefetch_at=prefetched.get(r.id, (None, 0))[0],
                    prefetch_tokens=prefetched.get(r.id, (None, 0))[1])
        for r in records if r.error is None])


def _page_size_of(config: dict[str, Any]) -> int | None:
    for section in ("engine", "hicache"):
        v = (config.get(section) or {}).get("page_size")
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


# ---- one request ----------------------------------------------------------------


class _RequestFailed(Exception):
    """One request failed; the message is its RequestRecord.error."""


class _Retokenizer:
    """Lazily loaded Hugging Face tokenizer for servers that return no token ids."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._tok: Any = None

    def __bool__(self) -> bool:
        return self.name is not None

    async def encode(self, text: str) -> list[int]:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, self.name)
        return list(self._tok.encode(text, add_special_tokens=False))


async def _stream_one(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                      rec: RequestRecord, clock: Callable[[], float]) -> str:
    """Send one streaming request and fill ``rec``; returns the generated text."""
    text: list[str] = []
    ids: list[int] = []
    got_ids = False
    last: float | None = None
    chunks = 0
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")[:500]
            raise _RequestFailed(f"HTTP {resp.status_code}: {detail}")
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = clock()
            try:
                pieces = _parse_chunk(data, rec)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise _RequestFailed(f"malformed stream chunk ({type(e).__name__}: {e}): "
                                     f"{data[:200]}") from None
            for piece, tok in pieces:
                if tok is not None:
                    got_ids = True
                    ids.extend(tok)
                n = len(tok) if tok else (1 if piece else 0)
                if not n:
                    continue
                text.append(piece)
                chunks += n
                if last is None:
                    rec.first_token = now
                    rec.ttft = now - rec.arrival
                else:
                    rec.itl.extend([(now - last) / n] * n)
                last = now
    rec.finish = clock()
    if rec.first_token is None:
        raise _RequestFailed("the stream ended without any generated token")
    if not rec.output_tokens:
        rec.output_tokens = len(ids) if got_ids else chunks
    rec.answer_ids = ids if got_ids else None
    return "".join(text)


def _parse_chunk(data: str, rec: RequestRecord) -> list[tuple[str, list[int] | None]]:
    """Take the usage of one SSE chunk into ``rec``; its choices' (text, token ids)."""
    chunk = json.loads(data)
    if "error" in chunk or chunk.get("object") == "error":  # vLLM / SGLang / older servers
        raise _RequestFailed(f"server error in stream: {json.dumps(chunk)[:500]}")
    usage = chunk.get("usage")
    if usage:
        rec.prompt_tokens = int(usage.get("prompt_tokens", rec.prompt_tokens))
        rec.output_tokens = int(usage.get("completion_tokens", rec.output_tokens))
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            rec.cached_tokens = int(details["cached_tokens"])
    out = []
    for choice in chunk.get("choices") or []:
        tok = choice.get("token_ids")
        out.append((choice.get("text") or "", None if tok is None else [int(t) for t in tok]))
    return out


# ---- the run --------------------------------------------------------------------


async def run_bench(
    base_url: str,
    spec: WorkloadSpec,
    *,
    model: str | None = None,
    admin_url: str | None = None,
    admin_token: str | None = None,
    trace_path: str | Path | None = None,
    progress: bool = True,
    request_timeout: float = 600.0,
    tokenizer: str | None = None,
) -> BenchResult:
    """Run ``spec`` against ``base_url`` (an OpenAI-compatible server; see the module doc)."""
    base_url = base_url.rstrip("/")
    limits = httpx.Limits(max_connections=spec.clients + 4,
                          max_keepalive_connections=spec.clients + 4)
    timeout = httpx.Timeout(request_timeout, connect=min(request_timeout, 30.0))
    retok = _Retokenizer(tokenizer)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as http:
        if model is None:
            model = await _first_model(http, base_url)
        before = page_size = None
        if admin_url is not None:
            admin_url = admin_url.rstrip("/")
            before = await _admin_get(http, f"{admin_url}/stats", admin_token)
            page_size = _page_size_of(await _admin_get(http, f"{admin_url}/config", admin_token))

        if spec.prefetch_lead_s and admin_url is None:
            raise BenchError("workload key prefetch_lead_s needs the admin endpoint "
                             "(--admin-url): pause-time prefetches go to its POST /prefetch")
        records: list[RequestRecord] = []
        prefetches = {"calls": 0, "failed": 0}
        # Request id -> (when its history's POST /prefetch was sent, history tokens).
        prefetched: dict[str, tuple[float, int]] = {}
        t0 = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - t0

        with _ProgressBar(progress, spec.total_requests) as advance:

            gate = asyncio.Semaphore(spec.max_in_flight or spec.clients)

            async def conversation(client: int) -> None:
                prompt = spec.first_prompt(client)
                answer: list[int] | None = None
                for turn in range(spec.turns):
                    if turn:
                        if spec.think_time_s:
                            await asyncio.sleep(spec.think_time_s)
                        history = [*prompt, *(answer or [])]
                        prompt = spec.next_prompt(client, turn, prompt, answer)
                        pause = spec.pause_of(client, turn)  # agent: a tool call
                        lead = min(spec.prefetch_lead_s, pause)
                        await asyncio.sleep(pause - lead)
                        if lead:  # the session is due back: its history into L2 now
                            started = clock()
                            prefetched[f"c{client}-t{turn}"] = (started, len(history))
                            prefetches["calls"] += 1
                            if not await _admin_post(http, f"{admin_url}/prefetch",
                                                     admin_token, {"prefix": history}):
                                prefetches["failed"] += 1
                            await asyncio.sleep(max(0.0, lead - (clock() - started)))
                    async with gate:  # a slot per request; turns queue for it anew
                        rec = RequestRecord(id=f"c{client}-t{turn}", client=client, turn=turn,
                                            arrival=clock(), prompt_tokens=len(prompt),
                                            prompt_ids=prompt)
                        records.append(rec)
                        body = _request_body(model, prompt, spec.answer_tokens, _hints(spec))
                        try:
                            text = await asyncio.wait_for(
                                _stream_one(http, f"{base_url}/v1/completions", body, rec, clock),
                                request_timeout)
                        except (httpx.HTTPError, _RequestFailed, asyncio.TimeoutError) as e:
                            rec.error = _describe(e, request_timeout)
                            rec.finish = clock()
                            advance(spec.turns - turn)
                            return
                    advance(1)
                    answer = rec.answer_ids
                    if answer is None and spec.needs_answer_ids and turn + 1 < spec.turns:
                        if not retok:
                            raise BenchError(
                                f"{base_url} returned no token ids (choices[].token_ids with "
                                f"return_token_ids=true); scenario multiturn needs the answer's "
                                f"ids to build the next prompt: pass tokenizer= (the served "
                                f"model's Hugging Face tokenizer) to re-tokenize the text")
                        answer = rec.answer_ids = await retok.encode(text)

            tasks = [asyncio.ensure_future(conversation(c)) for c in range(spec.clients)]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
        duration = clock()

        tiers = await tiers_since(http, admin_url, admin_token, before, page_size, records)

    records.sort(key=lambda r: (r.arrival, r.client))
    if trace_path is not None:
        write_served(trace_path, records, lambda r: _hints(spec), prefetched)
    summary = summarize(records, duration)
    if spec.prefetch_lead_s:
        summary["prefetch_calls"], summary["prefetch_failed"] = (prefetches["calls"],
                                                                 prefetches["failed"])
    return BenchResult(spec=spec, base_url=base_url, model=model, requests=records,
                       duration_s=duration, summary=summary, tiers=tiers)


def run_bench_sync(base_url: str, spec: WorkloadSpec, **kwargs: Any) -> BenchResult:
    """:func:`run_bench` from synchronous code (same keyword arguments)."""
    return asyncio.run(run_bench(base_url, spec, **kwargs))


def _hints(spec: WorkloadSpec) -> dict[str, Any] | None:
    """The workload's HiCache per-request controls (other servers ignore them)."""
    return {"retain_s": spec.retain_s} if spec.retain_s else None


def _request_body(model: str, prompt: list[int], answer_tokens: int,
                  hints: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": answer_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }
    if hints:
        body["kv_transfer_params"] = {"hicache": hints}
    return body


async def _first_model(http: httpx.AsyncClient, base_url: str) -> str:
    try:
        r = await http.get(f"{base_url}/v1/models", timeout=30)
        r.raise_for_status()
        models = r.json().get("data") or []
    except (httpx.HTTPError, ValueError) as e:
        raise BenchError(f"cannot list models at {base_url}/v1/models ({_describe(e, 30)}); "
                         f"pass model=") from e
    if not models:
        raise BenchError(f"{base_url}/v1/models lists no model; pass model=")
    return str(models[0]["id"])


def _describe(e: BaseException, timeout: float) -> str:
    if isinstance(e, asyncio.TimeoutError):
        return f"timeout: no complete answer within {timeout:g} s"
    msg = str(e) or type(e).__name__
    return msg if isinstance(e, _RequestFailed) else f"{type(e).__name__}: {msg}"


class _ProgressBar:
    """``with _ProgressBar(on, total) as advance: advance(n)``; a no-op when off."""

    def __init__(self, on: bool, total: int) -> None:
        self._progress: Any = None
        self._task: Any = None
        if on:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(TextColumn("requests"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), transient=False)
            self._task = self._progress.add_task("requests", total=total)

    def __enter__(self) -> Callable[[int], None]:
        if self._progress is not None:
            self._progress.start()
        return self._advance

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()

    def _advance(self, n: int) -> None:
        if self._progress is not None:
            self._progress.advance(self._task, n)
