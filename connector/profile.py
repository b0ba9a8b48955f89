"""The step profile's vLLM side: wraps a connector's hooks when ``HICACHE_PROFILE`` is set.

See tiers/profile.py for the file, the clocks and the record's common fields.

Contract:
- ``instrument(connector, role)`` replaces the instance's vLLM hooks with
  timed wrappers (an instance attribute shadows the class method, so vLLM,
  ``MultiConnector`` and the connector's own calls all go through them); a
  no-op when profiling is off. The do-nothing connector
  (integration/vllm/null_connector.py) is instrumented the same way, so a
  profile of HiCache has a baseline of the same shape.
- Scheduler records (one per ``build_connector_meta``, covering everything
  since the previous one): ``seq`` (stamped on the step's metadata as
  ``hicache_profile_seq``, which the workers read back), ``scheduled``
  (requests and tokens vLLM scheduled), ``batch`` (tokens per request id),
  ``output_at`` (when the engine core took the workers' output of the step
  before: ``update_connector_output``),
  ``deferred`` (lookups answered
  None: the request waits a step), ``admitted`` (requests allocated for the
  first time: id, ``arrival`` wall time, prompt, local and external tokens),
  ``first_token`` (requests whose last prompt token is computed in this
  step: their first token comes out at its end).
- Worker records (one per step, at ``clear_connector_metadata``): ``seq``,
  ``forward_s`` (from the end of the hooks vLLM calls before the forward
  pass to the first hook it calls after it), ``hooks`` (the layer hooks
  inside the forward pass included), ``cpu`` during the step and
  ``cpu_between`` (since the previous step's end: the worker's idle loop and
  whatever HiCache's threads did meanwhile), ``counters`` (HiCache's report
  of the step: bytes and pages moved).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from hicache.tiers.profile import GcClock, HookClock, ProfileWriter, ThreadClock, profile_path

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "on_new_request", "update_state_after_alloc",
                   "update_connector_output", "request_finished_all_groups", "take_events",
                   "get_kv_connector_stats")
# Before the forward pass, inside it (per layer), after it.
WORKER_BEFORE = ("handle_preemptions",)
WORKER_LAYER = ("wait_for_layer_load", "save_kv_layer")
WORKER_AFTER = ("wait_for_save", "get_finished", "get_block_ids_with_load_errors",
                "build_connector_worker_meta")
SEQ_ATTR = "hicache_profile_seq"


def instrument(connector: Any, role: str) -> None:
    """Time ``connector``'s hooks into the profile file (see the module docstring)."""
    path = profile_path()
    if path is None:
        return
    name = type(connector).__name__
    profiler = (_SchedulerProfile(path, name) if role == "scheduler"
                else _WorkerProfile(path, name))
    profiler.attach(connector)


class _Profile:
    def __init__(self, path: str, role: str, connector: str) -> None:
        self.writer = ProfileWriter(path, role, connector)
        self.hooks = HookClock()
        self.threads = ThreadClock()
        self.gc = GcClock()

    def _wrap(self, connector: Any, name: str, before: Any = None, after: Any = None) -> None:
        original = getattr(connector, name, None)
        if original is None:
            return

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before(*args)
            result = self.hooks.call(name, original, *args, **kwargs)
            if after is not None:
                after(result, *args)
            return result

        setattr(connector, name, timed)


class _SchedulerProfile(_Profile):
    def __init__(self, path: str, connector: str) -> None:
        super().__init__(path, "scheduler", connector)
        self.seq = 0
        self.t0 = time.time()
        self.deferred = 0
        self.admitted: list[dict[str, Any]] = []
        self.prompt_len: dict[str, int] = {}
        self.output_at: float | None = None

    def attach(self, connector: Any) -> None:
        for name in SCHEDULER_HOOKS:
            after = {"get_num_new_matched_tokens": self._answered,
                     "update_state_after_alloc": self._allocated,
                     "request_finished_all_groups": self._finished}.get(name)
            before = self._output if name == "update_connector_output" else None
            self._wrap(connector, name, before=before, after=after)
        original = connector.build_connector_meta

        @functools.wraps(original)
        def build(scheduler_output: Any) -> Any:
            meta = self.hooks.call("build_connector_meta", original, scheduler_output)
            self._step(scheduler_output, meta)
            return meta

        connector.build_connector_meta = build

    def _output(self, *args: Any) -> None:
        self.output_at = time.time()

    def _answered(self, result: Any, *args: Any) -> None:
        if result[0] is None:
            self.deferred += 1

    def _allocated(self, result: Any, request: Any, blocks: Any, external: int) -> None:
        rid = request.request_id
        if rid in self.prompt_len:
            return
        self.prompt_len[rid] = request.num_prompt_tokens
        self.admitted.append({
            "id": rid, "arrival": round(float(request.arrival_time), 6),
            "prompt": request.num_prompt_tokens, "local": request.num_computed_tokens,
            "external": external})

    def _finished(self, result: Any, request: Any, *args: Any) -> None:
        self.prompt_len.pop(request.request_id, None)

    def _first_tokens(self, out: Any) -> list[str]:
        """Requests whose last prompt token is computed in this step."""
        done = []
        computed = {r.req_id: r.num_computed_tokens for r in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for rid, n in out.num_scheduled_tokens.items():
            prompt = self.prompt_len.get(rid)
            start = computed.get(rid)
            if prompt is not None and start is not None and start < prompt <= start + n:
                done.append(rid)
        return done

    def _step(self, out: Any, meta: Any) -> None:
        self.seq += 1
        try:
            setattr(meta, SEQ_ATTR, self.seq)
        except AttributeError:
            pass
        now = time.time()
        self.writer.write({
            "seq": self.seq, "t0": round(self.t0, 6), "t1": round(now, 6),
            "output_at": None if self.output_at is None else round(self.output_at, 6),
            "hooks": self.hooks.take(), "cpu": self.threads.delta(), "gc": self.gc.take(),
            "scheduled": {"requests": len(out.num_scheduled_tokens),
                          "tokens": out.total_num_scheduled_tokens},
            "batch": dict(out.num_scheduled_tokens),
            "deferred": self.deferred, "admitted": self.admitted,
            "first_token": self._first_tokens(out)})
        self.t0, self.deferred, self.admitted, self.output_at = now, 0, [], None


class _WorkerProfile(_Profile):
    def __init__(self, path: str, connector: str) -> None:
        super().__init__(path, "worker", connector)
        self.seq: int | None = None
        self.t0 = 0.0
        self.cpu_between: dict[str, float] = {}
        self.forward_start: float | None = None
        self.forward_end: float | None = None
        self.in_forward = False
        self.counters: dict[str, float] = {}

    def attach(self, connector: Any) -> None:
        self._wrap(connector, "bind_connector_metadata", before=self._begin,
                   after=self._bound)
        for name in WORKER_BEFORE:
            self._wrap(connector, name)
        self._wrap(connector, "start_load_kv", before=self._load_starts,
                   after=self._load_done)
        for name in WORKER_LAYER:
            self._wrap(connector, name, before=self._layer)
        for name in WORKER_AFTER:
            self._wrap(connector, name, before=self._after_forward,
                       after=self._report if name == "build_connector_worker_meta" else None)
        self._wrap(connector, "clear_connector_metadata", after=self._end)

    def _begin(self, meta: Any) -> None:
        self.cpu_between = self.threads.delta()
        self.t0 = time.time()
        self.seq = getattr(meta, SEQ_ATTR, None)
        self.forward_start = self.forward_end = None
        self.in_forward = False
        self.counters = {}

    def _bound(self, result: Any, meta: Any) -> None:
        self.forward_start = time.perf_counter()

    def _load_starts(self, *args: Any) -> None:
        if self.in_forward:  # vLLM starts asynchronous loads after the forward pass
            self._after_forward()

    def _load_done(self, *args: Any) -> None:
        if not self.in_forward and self.forward_end is None:
            self.forward_start = time.perf_counter()

    def _layer(self, *args: Any) -> None:
        self.in_forward = True

    def _after_forward(self, *args: Any) -> None:
        if self.forward_end is None:
            self.forward_end = time.perf_counter()

    def _report(self, result: Any, *args: Any) -> None:
        counters = getattr(result, "counters", None)
        if counters:
            self.counters = dict(counters)

    def _end(self, *args: Any) -> None:
        forward = (None if self.forward_start is None or self.forward_end is None
                   else round(self.forward_end - self.forward_start, 6))
        self.writer.write({
            "seq": self.seq, "t0": round(self.t0, 6), "t1": round(time.time(), 6),
            "forward_s": forward, "hooks": self.hooks.take(), "cpu": self.threads.delta(),
            "cpu_between": self.cpu_between, "gc": self.gc.take(), "counters": self.counters})
