"""integration/bench/micro/trace_replay.py's /metrics scraper (integration/bench/
metrics_poll.py's poller) against real HTTP servers: answered scrapes are counted,
a server that answers 503 is polled on and counted nothing. The HiCache cases'
connector keys: the same L2 whichever L1 a case runs on."""

from __future__ import annotations

import threading
import time
from wsgiref.simple_server import WSGIServer, make_server

import pytest
from prometheus_client import CollectorRegistry, start_http_server

from hicache.integration.bench.micro.trace_replay import Scraper


@pytest.fixture
def exporter():
    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    assert isinstance(server, WSGIServer)
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    thread.join()


def test_the_scraper_counts_the_scrapes_that_answered(exporter):
    with Scraper(exporter, interval_s=0.01) as scraper:
        deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
        while scraper.scrapes < 3:
            assert time.monotonic() < deadline, "no scrape in 60 s"
            time.sleep(0.01)
    assert not scraper._thread.is_alive()


def test_a_scrape_that_fails_is_skipped_not_counted():
    polled = []

    def unavailable(environ, start_response):
        polled.append(environ["PATH_INFO"])
        start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
        return [b"busy"]

    server = make_server("127.0.0.1", 0, unavailable)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with Scraper(f"http://127.0.0.1:{server.server_port}", interval_s=0.01) as scraper:
            deadline = time.monotonic() + 60  # a hang guard, not a timing assertion
            while len(polled) < 3:
                assert time.monotonic() < deadline, "no poll in 60 s"
                time.sleep(0.01)
        assert scraper.scrapes == 0 and set(polled) == {"/metrics"}
    finally:
        server.shutdown()
        thread.join()


def test_hicache_cases_get_the_same_l2_on_either_l1():
    """``hicache-l1-all`` runs on the floor's L1 with the L2 pages ``hicache`` gets."""
    import argparse

    from hicache.integration.bench.micro.trace_replay import CASES, hicache_extra

    args = argparse.Namespace(l2_ratio=4.0, l1_blocks=400, extra='{"hicache_l3_admission": "all"}')
    cases = {c.name: c for c in CASES}
    small = hicache_extra(cases["hicache"], args, 400)
    big = hicache_extra(cases["hicache-l1-all"], args, 30_000)
    assert small["hicache_ratio"] * 400 == pytest.approx(big["hicache_ratio"] * 30_000) == 1600
    assert small["hicache_l3_admission"] == big["hicache_l3_admission"] == "all"
    assert "l3" not in big and cases["hicache-l1-all"].l1 == "all"
