"""The worker's ZMTP DEALER against libzmq's own ROUTER, and against peers that break ZMTP."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from sandbx_pool.workers import zmtp

MAX = 1 << 20


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/router.sock"


@pytest.fixture
def router(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.bind(endpoint)
    yield sock
    sock.close(linger=0)
    context.term()


@pytest.fixture
def dealer(router: zmq.Socket[bytes], endpoint: str) -> Iterator[zmtp.Dealer]:
    """A DEALER whose handshake with the router is done (identity ``worker-7``)."""
    connection = zmtp.connect(endpoint, b"worker-7", max_message_bytes=MAX, timeout_s=5)
    try:
        connection.handshake(timeout_s=5)
        yield connection
    finally:
        connection.close()


def test_a_libzmq_router_routes_by_the_identity_announced(
    router: zmq.Socket[bytes], dealer: zmtp.Dealer
) -> None:
    dealer.send(b"ready", timeout_s=5)
    assert router.recv_multipart() == [b"worker-7", b"ready"]
    # Short (< 256 bytes) and long frames, both ways.
    for size in (0, 255, 256, 300_000):
        router.send_multipart([b"worker-7", b"c" * size])
        assert dealer.recv(timeout_s=5) == b"c" * size
        dealer.send(b"r" * size, timeout_s=5)
        assert router.recv_multipart() == [b"worker-7", b"r" * size]


def test_libzmq_reads_the_peer_credentials_of_our_connection(
    router: zmq.Socket[bytes], dealer: zmtp.Dealer
) -> None:
    # The coordinator checks a Ready's pid against the one the template forked.
    dealer.send(b"ready", timeout_s=5)
    frames = router.recv_multipart(copy=False)
    assert str(frames[-1].get("Peer-Address")).rsplit(":", 1)[1] == str(os.getpid())


def test_a_libzmq_socket_a_dealer_cannot_talk_to_ends_the_handshake(endpoint: str) -> None:
    # Which side notices first is a race: libzmq hangs up on our READY, or we refuse its.
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    publisher.bind(endpoint)
    try:
        dealer = zmtp.connect(endpoint, b"w", max_message_bytes=MAX, timeout_s=5)
        try:
            with pytest.raises(ConnectionError):
                dealer.handshake(timeout_s=5)
        finally:
            dealer.close()
    finally:
        publisher.close(linger=0)
        context.term()


class FakePeer:
    """A unix socket server that sends the given bytes to whoever connects, then ``later``
    once ``go`` is set, then hangs up."""

    def __init__(self, path: Path, reply: bytes, later: bytes = b"") -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(1)
        self.reply, self.later = reply, later
        self.go = threading.Event()
        if not later:
            self.go.set()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        # The dealer may hang up first (it refused us): a reset is the expected end.
        with conn, contextlib.suppress(ConnectionResetError, BrokenPipeError):
            conn.sendall(self.reply)
            self.go.wait(10)
            conn.sendall(self.later)
            conn.shutdown(socket.SHUT_WR)
            while conn.recv(4096):
                pass

    def close(self) -> None:
        self.go.set()
        self.thread.join(5)
        self.server.close()


def router_ready(socket_type: bytes = b"ROUTER") -> bytes:
    body = b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return bytes((0x04, len(body))) + body


def talk_to(tmp_path: Path, reply: bytes, *, max_message_bytes: int = MAX) -> bytes:
    path = tmp_path / "fake.sock"
    peer = FakePeer(path, reply)
    dealer = zmtp.connect(f"ipc://{path}", b"w", max_message_bytes=max_message_bytes, timeout_s=5)
    try:
        dealer.handshake(timeout_s=5)
        return dealer.recv(timeout_s=5)
    finally:
        dealer.close()
        peer.close()


def test_commands_between_messages_are_skipped(tmp_path: Path) -> None:
    ping = b"\x04\x07\x04PING\x00\x00"  # ZMTP 3.1 PING: ttl 0, no context
    message = b"\x00\x05hello"
    assert talk_to(tmp_path, zmtp.GREETING + router_ready() + ping + message) == b"hello"


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"HTTP/1.1 400 Bad Request\r\n" + b"\x00" * 64, "does not speak ZMTP 3"),
        (zmtp.GREETING.replace(b"NULL", b"CURV"), "CURV"),
        (zmtp.GREETING + b"\x00\x05hello", "did not start with READY"),
        (zmtp.GREETING + b"\x04\x07\x05READY\x0b", "malformed READY metadata"),
        (zmtp.GREETING + router_ready(b"PUB"), "cannot talk to a b'PUB'"),
        (zmtp.GREETING + router_ready() + b"\x01\x01a\x00\x01b", "multipart"),
        (zmtp.GREETING + router_ready() + b"\x02" + struct.pack(">Q", 2 * MAX), "over"),
    ],
    ids=["not-zmtp", "mechanism", "no-ready", "bad-metadata", "pub", "multipart", "too-large"],
)
def test_a_peer_that_breaks_zmtp_is_refused(tmp_path: Path, reply: bytes, error: str) -> None:
    with pytest.raises(zmtp.ProtocolError, match=error):
        talk_to(tmp_path, reply)


def test_a_peer_that_hangs_up_mid_frame_is_a_reset(tmp_path: Path) -> None:
    with pytest.raises(ConnectionResetError):
        talk_to(tmp_path, zmtp.GREETING + router_ready() + b"\x00\x05hel")


def test_a_command_alone_leaves_the_caller_polling(tmp_path: Path) -> None:
    path = tmp_path / "fake.sock"
    ping = b"\x04\x07\x04PING\x00\x00"
    peer = FakePeer(path, zmtp.GREETING + router_ready() + ping, later=b"\x00\x04call")
    dealer = zmtp.connect(f"ipc://{path}", b"w", max_message_bytes=MAX, timeout_s=5)
    try:
        dealer.handshake(timeout_s=5)
        assert select.select([dealer], [], [], 5)[0]  # the PING
        assert dealer.recv(timeout_s=5) is None  # nothing else yet: back to waiting
        peer.go.set()
        assert select.select([dealer], [], [], 5)[0]
        assert dealer.recv(timeout_s=5) == b"call"
    finally:
        dealer.close()
        peer.close()


def test_a_peer_that_stalls_mid_frame_times_out(tmp_path: Path) -> None:
    path = tmp_path / "fake.sock"
    peer = FakePeer(path, zmtp.GREETING + router_ready() + b"\x00\x05hel", later=b"lo")
    dealer = zmtp.connect(f"ipc://{path}", b"w", max_message_bytes=MAX, timeout_s=5)
    try:
        dealer.handshake(timeout_s=5)
        with pytest.raises(TimeoutError, match="middle of a frame"):
            dealer.recv(timeout_s=0.2)
    finally:
        dealer.close()
        peer.close()


def test_a_peer_that_stops_accepting_times_the_connection_out(tmp_path: Path) -> None:
    # A listener whose queue is full (backlog 0, one connection waiting) and never accepts:
    # a unix socket's connect waits for room, so it must be bounded.
    path = tmp_path / "stalled.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(0)
    first = zmtp.connect(f"ipc://{path}", b"a", max_message_bytes=MAX, timeout_s=5)
    try:
        with pytest.raises(TimeoutError, match="no connection"):
            zmtp.connect(f"ipc://{path}", b"b", max_message_bytes=MAX, timeout_s=0.2)
    finally:
        first.close()
        server.close()


def test_the_template_s_rehearsal_speaks_the_whole_exchange_and_leaves_nothing_open() -> None:
    # The rehearsal raises if its canned ROUTER side and the DEALER disagree (a handshake or
    # a frame the DEALER refuses), so a change to either one shows here before every
    # template start fails.
    before = set(os.listdir("/proc/self/fd"))
    zmtp.rehearse()
    assert set(os.listdir("/proc/self/fd")) == before
