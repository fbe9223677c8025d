"""The coordinator's ROUTER socket: where every worker connects, sends its Ready and its Result,
and receives its one Call.

    worker DEALER --ipc://--> ROUTER --loop reader--> deliver(frames, peer pid)
                                                        | decode, protocol version
                                                        | Ready:  from the pid forked for its token
                                                        | Result: for the call the worker has,
                                                        |         with that call's secret
                                                        | Output: the same checks, then the
                                                        |         call's on_output (output.py)
                                                        v
                                        WorkerSet.on_ready / the call's result future

Whatever fails a check is dropped and logged: it never raises, never touches a call. The socket
is read from the event loop's own reader callback (zmq.asyncio's futures and poller cost more
per message than this whole path).

Connections are bounded too. Each costs a descriptor, and libzmq aborts the process when an
accept() meets EMFILE. The socket's directory is private (0700) and, when we are root, hidden
from the calls by a mount; without root a call's command runs as our uid and can connect. So
every accepted connection is vetted as libzmq reports it (its socket monitor, EVENT_ACCEPTED,
carries the descriptor): one whose peer (SO_PEERCRED) is not a child of the template, i.e. not
a worker, is shut down at once, and libzmq closes it on the EOF that follows. A stranger's
connection thus lives one turn of the loop, and at most the descriptor budget's reserve of
them can be open at a time unless they arrive faster than the loop runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import socket
import struct
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from sandbx_pool.logs import logger
from sandbx_pool.outcome import Status
from sandbx_pool.pool_finalizer import weakly
from sandbx_pool.runtime_dir import parent_pid
from sandbx_pool.worker_handle import Worker
from sandbx_pool.workers.protocol import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    Output,
    Ready,
    Result,
    worker_decoder,
)

_STATUSES = frozenset(status.value for status in Status)

#: What a Ready is handed to: its identity, the message, the worker known under that identity
#: (None if none is) and the pid that opened the connection (None where ZeroMQ cannot say).
ReadyHandler = Callable[[bytes, Ready, "Worker | None", "int | None"], None]


#: SO_PEERCRED's struct ucred: pid, uid, gid.
_UCRED = struct.Struct("3i")


class Inbox:
    def __init__(
        self,
        find_worker: Callable[[str], Worker | None],
        on_ready: ReadyHandler,
        is_worker: Callable[[int], bool] = lambda pid: True,
    ) -> None:
        self._find_worker = find_worker
        self._on_ready = on_ready
        #: Whether the process of that pid may stay connected (see the module docstring).
        self._is_worker = is_worker
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._fd: int | None = None
        self._monitor_fd: int | None = None
        self._path = ""
        #: Connections shut down because their peer was not a worker.
        self.refused = 0

    def bind(self, endpoint: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._context = zmq.Context(io_threads=1)
        self._router = self._context.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._router.setsockopt(zmq.LINGER, 0)
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_ACCEPTED)
        self._router.bind(endpoint)
        self._path = endpoint.removeprefix("ipc://")
        self._fd = int(self._router.getsockopt(zmq.FD))
        self._monitor_fd = int(self._monitor.getsockopt(zmq.FD))
        # Weakly: the loop may outlive a pool dropped without close() (see pool_finalizer.py).
        loop.add_reader(self._fd, weakly(self._receive))
        loop.add_reader(self._monitor_fd, weakly(self._vet_connections))
        # The FD signals a message only once ZeroMQ has seen the queue empty, which takes a
        # first look: until then nothing would ever wake the reader above.
        self._vet_connections()

    def send(self, identity: bytes, payload: bytes) -> None:
        """Send to the worker connected as ``identity``; zmq.ZMQError if it is not (any more)."""
        assert self._router is not None
        assert self._loop is not None
        self._router.send_multipart([identity, payload], flags=zmq.NOBLOCK)
        # ZeroMQ's FD is edge-triggered and a send can consume the edge of a message that
        # arrived meanwhile: look again once this turn of the loop is over.
        self._loop.call_soon(self._receive)

    @property
    def context(self) -> zmq.Context[zmq.Socket[bytes]] | None:
        """The ZeroMQ context (for the pool's finalizer)."""
        return self._context

    @property
    def sockets(self) -> list[zmq.Socket[bytes]]:
        """The ROUTER socket and its monitor (for the pool's finalizer)."""
        return [s for s in (self._monitor, self._router) if s is not None]

    def watched_fds(self) -> list[int]:
        """The descriptors the loop watches for us (for the pool's finalizer)."""
        return [fd for fd in (self._fd, self._monitor_fd) if fd is not None]

    def close(self) -> None:
        if self._loop is not None:
            for fd in (self._fd, self._monitor_fd):
                if fd is not None:
                    self._loop.remove_reader(fd)
            self._fd = self._monitor_fd = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        if self._context is not None:
            self._context.term()

    def _vet_connections(self) -> None:
        """Shut down each newly accepted connection whose peer is not a worker."""
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return
        while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._vet(int(event["value"]))

    def _vet(self, fd: int) -> None:
        # A duplicate: the descriptor is libzmq's, and closing it under libzmq would be fatal.
        # By now libzmq may have closed it and the number may be reused: only a connection to
        # our socket's path is looked at, and that one is vetted on its own merits.
        try:
            conn = socket.socket(fileno=os.dup(fd))
        except OSError:
            return
        with conn, contextlib.suppress(OSError):
            if conn.family != socket.AF_UNIX or conn.getsockname() != self._path:
                return
            # The listening socket has that name too (and SO_PEERCRED says we made it): shut
            # down, every later accept() would fail and libzmq abort.
            if conn.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
            pid = _UCRED.unpack(cred)[0]
            if not self._is_worker(pid):
                self.refused += 1
                if parent_pid(pid) is None:
                    # Gone before we looked: a worker killed as the pool closed (its template
                    # reaped it), or one that crashed. Its connection is dead; nothing to warn of.
                    logger.debug("shut a connection from process {}, already gone", pid)
                else:
                    logger.warning("refused a connection from process {} (not a worker)", pid)
                conn.shutdown(socket.SHUT_RDWR)

    def _receive(self) -> None:
        """Handle every message waiting on the socket (its FD became readable)."""
        router = self._router
        if router is None or router.closed:
            return
        while int(router.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            frames = router.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                self.deliver([f.bytes for f in frames], peer_pid(frames[-1]))
            except Exception:  # one bad message must never stop the receive path
                logger.exception("error while handling a worker message")

    def deliver(self, frames: list[bytes], peer_pid: int | None = None) -> None:
        """One message from the socket: a Ready goes to ``on_ready``, a valid Result completes
        its call, anything else is dropped and logged."""
        if len(frames) != 2:
            logger.warning("dropped a message of {} frames", len(frames))
            return
        identity, payload = frames
        try:
            message = worker_decoder.decode(payload)
        # DecodeError is a ValueError, like the UnicodeDecodeError of a str that is not UTF-8;
        # a value nested deep enough raises RecursionError.
        except (ValueError, RecursionError) as exc:
            logger.warning("dropped an undecodable message ({} bytes): {}", len(payload), exc)
            return
        if message.v != PROTOCOL_VERSION:
            logger.warning("dropped a message of protocol version {!r}", message.v)
            return
        worker = self._find_worker(identity.decode(errors="replace"))
        if isinstance(message, Ready):
            self._on_ready(identity, message, worker, peer_pid)
            return
        kind = "result" if isinstance(message, Result) else "output"
        if worker is None or worker.call is None:
            logger.warning("dropped a {} from a worker with no call", kind)
        elif message.call_id != worker.call.call_id:
            logger.warning("dropped a {} for the wrong call from worker {}", kind, worker.pid)
        elif not hmac.compare_digest(message.secret.encode(), worker.call.secret.encode()):
            logger.warning("dropped a {} without its call's secret (worker {})", kind, worker.pid)
        elif isinstance(message, Output):
            worker.call.deliver_output(message)
        elif message.status not in _STATUSES:
            logger.warning("dropped a result of unknown status {!r}", message.status)
        elif not worker.call.result.done():
            worker.call.result.set_result(message)


def peer_pid(frame: zmq.Frame) -> int | None:
    """The pid of the process that opened the frame's connection: ZeroMQ reads SO_PEERCRED
    for ipc:// and reports it as the last field of "Peer-Address" (host:uid:gid:pid)."""
    try:
        return int(str(frame.get("Peer-Address")).rsplit(":", 1)[1])
    except (zmq.ZMQError, ValueError, IndexError):
        return None


__all__ = ["Inbox", "peer_pid"]
