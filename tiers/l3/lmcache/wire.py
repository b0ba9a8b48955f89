"""The ZMQ wire of a stock LMCache multi-process server (``lmcache server``), without lmcache.

Contract:
- A request is the frames ``[uid, operation, *payloads]`` sent on a DEALER
  socket, each frame msgpack: ``uid`` an int unique on the socket,
  ``operation`` LMCache's frozen numeric id (``OPERATIONS``; every server
  since those ids were frozen understands them), each payload one argument.
  The reply is ``[uid, operation]`` plus one frame holding the result
  unless the handler returned None. Replies are matched by ``uid``; a reply
  whose uid is no longer awaited (its call timed out) is dropped.
- ``call_many(requests, timeout_s)`` sends every request before reading any
  reply (one pipelined round trip) and returns the results in request order.
  It raises ``ServerTimeout`` when a reply is missing at the deadline (an
  LMCache handler that raises sends no reply at all) and ``ServerGone`` as
  soon as the socket reports that the connection dropped, or at once when it
  is not connected (so a dead server costs nothing per call, not a timeout).
- ``reconnected()`` says whether the connection dropped and came back since
  the last time it was asked (the server may have restarted: registrations
  and its shared memory are new).
- Thread-safe: one lock around each call; calls from several threads take
  turns on the socket. ``close()`` drops unsent messages (linger 0).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

# LMCache's frozen numeric operation ids (lmcache/v1/multiprocess/transport/zmq_impl/wire.py).
OPERATIONS: dict[str, int] = {
    "lookup": 8,
    "wait_prefetch_status": 10,
    "free_lookup_locks": 12,
    "end_session": 13,
    "register_kv_cache_engine_driven_context": 14,
    "unregister_kv_cache_engine_driven_context": 15,
    "prepare_store": 16,
    "commit_store": 17,
    "prepare_retrieve": 18,
    "commit_retrieve": 19,
    "get_chunk_size": 21,
    "ping": 22,
}
Request = tuple[str, Sequence[Any]]


class ServerTimeout(TimeoutError):
    """A reply did not arrive in time."""


class ServerGone(ConnectionError):
    """The connection to the server is down."""


class WireClient:
    """One DEALER socket to an LMCache server, pipelined and thread-safe."""

    def __init__(self, url: str, connect_timeout_s: float) -> None:
        self.url = url
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(url)
        self._uids = itertools.count()
        self._lock = threading.Lock()
        self._connected = False
        self._dropped = False
        self._closed = False
        deadline = time.monotonic() + connect_timeout_s
        with self._lock:
            while not self._connected and time.monotonic() < deadline:
                if self._monitor.poll(50):
                    self._drain_monitor()

    # ---- connection state -------------------------------------------------------------

    def _drain_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED:
                self._connected = False
                self._dropped = True

    @property
    def connected(self) -> bool:
        with self._lock:
            if not self._closed:
                self._drain_monitor()
            return self._connected

    def reconnected(self) -> bool:
        """True once after the connection dropped and came back."""
        with self._lock:
            if self._closed:
                return False
            self._drain_monitor()
            if self._dropped and self._connected:
                self._dropped = False
                return True
            return False

    # ---- calls -------------------------------------------------------------------------

    def call(self, operation: str, *args: Any, timeout_s: float) -> Any:
        return self.call_many([(operation, args)], timeout_s)[0]

    def call_many(self, requests: Sequence[Request], timeout_s: float) -> list[Any]:
        """Results of ``requests`` in order, after one pipelined round trip."""
        if not requests:
            return []
        with self._lock:
            if self._closed:
                raise ServerGone("client closed")
            self._drain_monitor()
            if not self._connected:
                raise ServerGone(f"not connected to {self.url}")
            order: dict[int, int] = {}
            for i, (operation, args) in enumerate(requests):
                uid = next(self._uids)
                order[uid] = i
                frames = [msgspec.msgpack.encode(uid),
                          msgspec.msgpack.encode(OPERATIONS[operation])]
                frames += [msgspec.msgpack.encode(a) for a in args]
                self._sock.send_multipart(frames, copy=False)
            results: list[Any] = [None] * len(requests)
            deadline = time.monotonic() + timeout_s
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            poller.register(self._monitor, zmq.POLLIN)
            while order:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    raise ServerTimeout(f"{len(order)} of {len(requests)} replies from "
                                        f"{self.url} missing after {timeout_s:g} s")
                ready = dict(poller.poll(left_ms))
                if self._monitor in ready:
                    self._drain_monitor()
                    if not self._connected:
                        raise ServerGone(f"connection to {self.url} dropped")
                if self._sock not in ready:
                    continue
                while self._sock.poll(0):
                    frames = self._sock.recv_multipart()
                    i = order.pop(msgspec.msgpack.decode(frames[0]), -1)
                    if i >= 0 and len(frames) > 2:
                        results[i] = msgspec.msgpack.decode(frames[2])
            return results

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._ctx.term()
