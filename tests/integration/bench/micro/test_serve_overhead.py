"""integration/bench/micro/serve_overhead.py's load sampler against a real HTTP server
exporting vLLM's two request gauges (prometheus_client's own exporter), and its table."""

from __future__ import annotations

import time
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from hicache.integration.bench.micro.serve_overhead import LoadSampler, add_ratios, table


def test_the_sampler_averages_vllms_running_and_waiting_gauges():
    registry = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "running", registry=registry)
    Gauge("vllm:num_requests_waiting", "waiting", registry=registry).set(1)
    running.set(4)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    assert isinstance(server, WSGIServer)
    try:
        with LoadSampler(f"http://127.0.0.1:{server.server_port}", interval_s=0.01) as load:
            deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
            while len(load.samples["running"]) < 2:
                assert time.monotonic() < deadline, "no sample in 60 s"
                time.sleep(0.01)
        assert load.means() == {"mean_running": 4.0, "mean_waiting": 1.0}
    finally:
        server.shutdown()
        thread.join()


def test_a_server_without_samples_has_no_means_and_the_table_says_so():
    load = LoadSampler("http://127.0.0.1:9")  # never started
    assert load.means() == {"mean_running": None, "mean_waiting": None}
    rows = [{"round": 1, "case": "null", "status": "ok", "l1_blocks": 8, "req_per_s": 2.0,
             "ttft_p50_ms": 10.0, "ttft_p99_ms": 20.0, "mean_running": 3.5,
             "mean_waiting": 0.5},
            {"round": 1, "case": "hicache", "status": "ok", "l1_blocks": 8, "req_per_s": 1.0,
             "ttft_p50_ms": 20.0, "ttft_p99_ms": 30.0, "mean_running": 1.5,
             "mean_waiting": 2.0}]
    add_ratios(rows)
    assert rows[1]["throughput_x"] == 0.5 and rows[1]["ttft_p99_x"] == 1.5
    assert table(rows).splitlines()[-1].endswith("| 1.5 | 2.0 |")


def test_waves_split_the_first_burst_from_the_steady_state():
    from hicache.integration.bench.micro.serve_overhead import waves

    ttfts = [2.0, 1.0] + [0.1] * 6 + [0.2] * 100  # 2 clients: the first wave is 2 requests
    w = waves(ttfts, concurrency=2)
    assert w["first_burst_max_ms"] == 2000.0
    assert w["steady_p99_ms"] == 200.0  # waves 1-4 (8 requests) left out
    assert waves([], 2) == {"first_burst_max_ms": None, "steady_p99_ms": None}
