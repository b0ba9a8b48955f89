"""``free_port``: a port nobody is handed unasked (below the kernel's ephemeral range),
free when returned; the OS's own pick where that range leaves no room."""

from __future__ import annotations

import socket

from hicache.integration.bench import mooncake_service
from hicache.integration.bench.mooncake_service import FREE_PORT_FLOOR, HOST, free_port


def test_free_ports_lie_below_the_ephemeral_range_and_can_be_bound():
    low = mooncake_service._ephemeral_low()
    for _ in range(20):
        port = free_port()
        assert FREE_PORT_FLOOR <= port < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, port))  # free when returned


def test_without_room_below_the_range_the_os_picks(monkeypatch):
    monkeypatch.setattr(mooncake_service, "_ephemeral_low", lambda: FREE_PORT_FLOOR + 10)
    port = free_port()
    assert not FREE_PORT_FLOOR <= port < FREE_PORT_FLOOR + 10
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, port))


def test_stop_removes_the_log_folder_it_made_and_keeps_one_it_was_given(tmp_path):
    with mooncake_service.start_mooncake() as made:
        assert (made.log_dir / "mooncake_master.log").exists()
    assert not made.log_dir.exists()
    given = tmp_path / "logs"
    with mooncake_service.start_mooncake(log_dir=given):
        pass
    assert (given / "mooncake_master.log").exists()
