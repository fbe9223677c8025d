"""A worker's one ZeroMQ connection: a DEALER peer that speaks ZMTP 3.0 itself.

ZMTP is ZeroMQ's wire protocol (rfc.zeromq.org/spec/23): a 64-byte greeting each way, a
READY command each way naming the socket type (and, from a DEALER, its routing identity),
then frames. The coordinator's end is libzmq's own ROUTER socket, unchanged: to it, a worker
is a DEALER like any other, routed by the identity it announced, its pid read by libzmq from
the connection's credentials (SO_PEERCRED).

Why not libzmq on this end too: a libzmq context starts two threads (I/O and reaper), and a
worker lives for one call. Measured in a loop of forked workers serving one read each, the
context, its threads and their teardown cost 3-3.5 ms of the worker's 8-9 ms of CPU and 200
of its 660 copy-on-write faults, and importing pyzmq added 2 MiB of anonymous memory and 59
memory mappings to the template, which every fork copies and every exit tears down. A worker
does one thing at a time: one blocking unix socket and this module do the job.

What is implemented is what a DEALER talking to a ROUTER needs: the NULL mechanism (the
only one the coordinator uses), READY with Socket-Type and Identity, single-frame messages
both ways (short and long frames), and commands from the peer skipped (ZMTP 3.1's PING
included). Anything else from the peer (another mechanism, a socket type a DEALER cannot
talk to, a message larger than allowed) raises ProtocolError.
"""

from __future__ import annotations

import select
import socket
import struct

#: ZMTP 3.0, NULL mechanism, as-server 0 (NULL has no roles); the rest is filler.
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" * 32

#: Frame flags (ZMTP 3.0, section 3.3).
_MORE = 0x01
_LONG = 0x02
_COMMAND = 0x04

#: Socket types a DEALER may be connected to (ZMTP socket compatibility rules).
_PEERS_OF_DEALER = {b"ROUTER", b"DEALER", b"REP"}


class ProtocolError(ConnectionError):
    """The peer broke ZMTP, or is not a socket a DEALER can talk to."""


class Dealer:
    """One blocking ZMTP connection to a ZeroMQ ROUTER (connect() makes one to an ipc://
    endpoint)."""

    def __init__(self, sock: socket.socket, identity: bytes, *, max_message_bytes: int) -> None:
        """Speak ZMTP over ``sock``, a connected stream socket (see connect())."""
        if not 0 < len(identity) < 256 or identity[0] == 0:
            raise ValueError("a routing identity is 1-255 bytes and does not start with 0")
        self.identity = identity
        self.max_message_bytes = max_message_bytes
        self._sock = sock

    def fileno(self) -> int:
        return self._sock.fileno()

    def handshake(self, *, timeout_s: float) -> None:
        """Send our greeting and READY in one write, then read and check the peer's (libzmq
        answers from its I/O thread at once), waiting ``timeout_s`` at most for each read.
        Raises TimeoutError, ProtocolError or another ConnectionError.

        No message may follow our READY before the peer's READY has arrived: until libzmq has
        sent its own, it takes every frame for a handshake command, and a message for a
        protocol error (it hangs up).
        """
        ready = _command(
            b"READY", _metadata({b"Socket-Type": b"DEALER", b"Identity": self.identity})
        )
        self._sock.sendall(GREETING + ready)
        _set_timeout(self._sock, socket.SO_RCVTIMEO, timeout_s)
        try:
            self._check_greeting(self._read_exact(len(GREETING)))
            flags, body = self._read_frame()
        except TimeoutError as exc:
            raise TimeoutError(f"no ZMTP handshake from the peer within {timeout_s:g} s") from exc
        finally:
            _set_timeout(self._sock, socket.SO_RCVTIMEO, 0)
        if not flags & _COMMAND or body[:6] != b"\x05READY":
            raise ProtocolError("the peer's handshake did not start with READY")
        socket_type = _properties(body[6:]).get(b"Socket-Type")
        if socket_type not in _PEERS_OF_DEALER:
            raise ProtocolError(f"a DEALER cannot talk to a {socket_type!r} socket")

    def send(self, payload: bytes, *, timeout_s: float) -> None:
        """Send one single-frame message, waiting ``timeout_s`` at most for a peer that has
        stopped reading."""
        _set_timeout(self._sock, socket.SO_SNDTIMEO, timeout_s)
        self._sock.sendall(_frame(payload, flags=0))

    def recv(self, *, timeout_s: float) -> bytes | None:
        """The next message's one frame, for a caller that polled the socket readable; None
        when only commands were waiting (poll again). A frame once begun must arrive whole
        within ``timeout_s``."""
        _set_timeout(self._sock, socket.SO_RCVTIMEO, timeout_s)
        try:
            while True:
                flags, body = self._read_frame()
                if not flags & _COMMAND:
                    break
                # PING and the like: nothing a one-call peer must answer.
                if not select.select([self._sock], [], [], 0)[0]:
                    return None
        finally:
            _set_timeout(self._sock, socket.SO_RCVTIMEO, 0)
        if flags & _MORE:
            raise ProtocolError("a multipart message where one frame was expected")
        return body

    def close(self) -> None:
        self._sock.close()

    def _check_greeting(self, peer: bytes) -> None:
        if peer[0] != 0xFF or not peer[9] & 0x01 or peer[10] < 3:
            raise ProtocolError("the peer does not speak ZMTP 3")
        mechanism = peer[12:32].rstrip(b"\x00")
        if mechanism != b"NULL":
            raise ProtocolError(f"the peer wants the {mechanism!r} mechanism, not NULL")

    def _read_frame(self) -> tuple[int, bytes]:
        flags = self._read_exact(1)[0]
        if flags & _LONG:
            (size,) = struct.unpack(">Q", self._read_exact(8))
        else:
            size = self._read_exact(1)[0]
        if size > self.max_message_bytes:
            raise ProtocolError(f"a frame of {size} bytes, over {self.max_message_bytes}")
        return flags, self._read_exact(size)

    def _read_exact(self, size: int) -> bytes:
        data = bytearray(size)
        view, got = memoryview(data), 0
        while got < size:
            try:
                n = self._sock.recv_into(view[got:])
            except BlockingIOError as exc:  # SO_RCVTIMEO ran out
                raise TimeoutError("the peer stopped sending in the middle of a frame") from exc
            if n == 0:
                raise ConnectionResetError("the peer closed the connection")
            got += n
        return bytes(data)


def connect(endpoint: str, identity: bytes, *, max_message_bytes: int, timeout_s: float) -> Dealer:
    """A Dealer connected to the ROUTER bound at ``endpoint`` (not yet shaken hands), waiting
    ``timeout_s`` at most: a coordinator that stopped accepting leaves its listen queue full,
    and a unix socket's connect then waits."""
    if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):
        raise ValueError(f"only ipc:// endpoints with a path are supported, not {endpoint!r}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        dealer = Dealer(sock, identity, max_message_bytes=max_message_bytes)
        _set_timeout(sock, socket.SO_SNDTIMEO, timeout_s)
        sock.connect(endpoint.removeprefix("ipc://"))
    except BlockingIOError as exc:
        sock.close()
        raise TimeoutError(f"no connection to {endpoint} within {timeout_s:g} s") from exc
    except BaseException:
        sock.close()
        raise
    return dealer


def rehearse() -> None:
    """Run a DEALER's whole exchange (handshake, a message each way) against a ROUTER's
    canned bytes over a socketpair.

    For the template (workers.template.warm_up): CPython rewrites a function's bytecode in
    place as it specializes it, over its first calls, and in a forked worker each such write
    copies a page of the template. Rehearsed before any fork, the code every worker runs to
    reach its coordinator is already specialized, and stays shared.
    """
    ours, router = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    with ours, router:
        router_ready = _command(b"READY", _metadata({b"Socket-Type": b"ROUTER"}))
        router.sendall(GREETING + router_ready + _frame(b"call", flags=0))
        dealer = Dealer(ours, b"rehearsal", max_message_bytes=64)
        dealer.handshake(timeout_s=1.0)
        dealer.send(b"ready", timeout_s=1.0)
        dealer.recv(timeout_s=1.0)


def _set_timeout(sock: socket.socket, option: int, seconds: float) -> None:
    whole = int(seconds)
    value = struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
    sock.setsockopt(socket.SOL_SOCKET, option, value)


def _frame(body: bytes, *, flags: int) -> bytes:
    if len(body) < 256:
        return bytes((flags, len(body))) + body
    return bytes((flags | _LONG,)) + struct.pack(">Q", len(body)) + body


def _command(name: bytes, data: bytes) -> bytes:
    return _frame(bytes((len(name),)) + name + data, flags=_COMMAND)


def _metadata(properties: dict[bytes, bytes]) -> bytes:
    """A READY command's metadata: name (1-byte length) and value (4-byte length) pairs."""
    return b"".join(
        bytes((len(name),)) + name + struct.pack(">I", len(value)) + value
        for name, value in properties.items()
    )


def _properties(data: bytes) -> dict[bytes, bytes]:
    """A command's metadata: name (1-byte length) and value (4-byte length) pairs."""
    found: dict[bytes, bytes] = {}
    at = 0
    while at < len(data):
        name_end = at + 1 + data[at]
        if name_end + 4 > len(data):
            raise ProtocolError("malformed READY metadata")
        (size,) = struct.unpack(">I", data[name_end : name_end + 4])
        found[data[at + 1 : name_end]] = data[name_end + 4 : name_end + 4 + size]
        at = name_end + 4 + size
    if at != len(data):
        raise ProtocolError("malformed READY metadata")
    return found


__all__ = ["GREETING", "Dealer", "ProtocolError", "connect", "rehearse"]
