"""What a pool holds outside Python's memory, released even when ``close()`` never runs.

A pool nobody closes (mini-swe-agent's batch runner drops its environments) would keep its
template and workers, the template's thread, its sockets and descriptors, and its directories
(20 MB of TMPDIRs) until the interpreter exits, or forever for the directories. So the pool
registers ``release`` with ``weakref.finalize``: it runs when the pool is garbage collected,
or at interpreter exit, unless ``close()`` ran first and detached it.

Two rules make that work:

* Nothing that outlives the pool may hold it: the template's thread gets a ``Launch`` (no
  callbacks), and the event loop's readers hold the pool's objects through ``weakly``. A
  strong reference from either would keep a dropped pool alive as long as the loop or the
  thread, that is forever.
* ``release`` holds only a ``Remains``, never the pool, and does everything synchronously: the
  loop may be closed, or running in another thread, when the collector calls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import weakref
from collections.abc import Callable
from typing import Any

import zmq

from sandbx_pool.template_launch import Launch


class Remains:
    """A pool's resources outside Python's memory, for ``release``; filled in as it starts."""

    def __init__(self) -> None:
        self.launch: Launch | None = None
        self.dirs: list[str] = []
        self.sockets: list[socket.socket] = []
        # Both held here: weak references die before a finalizer runs, so the context cannot
        # find its socket by itself, and term() would wait for it forever.
        self.zmq_context: zmq.Context[Any] | None = None
        self.zmq_sockets: list[zmq.Socket[Any]] = []
        #: The pool's workers, by token (WorkerSet.by_token): their pidfds are ours to close.
        self.workers: dict[str, Any] = {}
        #: Synchronous closers of what has its own thread (the journal's writer: it flushes).
        self.stoppers: list[Callable[[], None]] = []
        #: The loop and the descriptors it watches for us (the sockets above).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.reader_fds: list[int] = []


def release(remains: Remains) -> None:
    """Kill the template's group (its workers die with it: their parent-death signal), stop
    its thread, close the sockets and remove the directories. Synchronous, idempotent."""
    launch = remains.launch
    if launch is not None:
        process = launch.process
        # The template leads its own session; killpg reaches it and whatever it forked there.
        # Its pid cannot have been reused: its thread has not reaped it yet (stop is not set).
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        launch.stop.set()  # the thread reaps it and ends
    _forget_readers(remains)
    for stop in remains.stoppers:
        stop()
    remains.stoppers = []
    for worker in list(remains.workers.values()):
        worker.release_pidfd()
    for sock in remains.sockets:
        sock.close()
    for zmq_socket in remains.zmq_sockets:
        zmq_socket.close(linger=0)
    remains.zmq_sockets = []
    context, remains.zmq_context = remains.zmq_context, None
    if context is not None and not context.closed:
        context.destroy(linger=0)
    for directory in remains.dirs:
        shutil.rmtree(directory, ignore_errors=True)
    remains.dirs = []


def _forget_readers(remains: Remains) -> None:
    """Have a loop that lives on forget our descriptors before they are closed: a number it
    still watched would be reused by the next socket, and registering that one would fail."""
    loop, fds = remains.loop, remains.reader_fds
    remains.reader_fds = []
    if loop is None or loop.is_closed() or not fds:
        return
    try:
        on_its_thread = asyncio.get_running_loop() is loop
    except RuntimeError:
        on_its_thread = False
    if on_its_thread:  # collected on the loop's own thread: at once
        for fd in fds:
            loop.remove_reader(fd)
        return
    for fd in fds:
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(loop.remove_reader, fd)


def weakly(method: Callable[[], None]) -> Callable[[], None]:
    """``method`` (bound) called through a weak reference: for callbacks the event loop keeps,
    so that they do not keep its object (and the pool behind it) alive."""
    ref = weakref.WeakMethod(method)

    def call() -> None:
        target = ref()
        if target is not None:
            target()

    return call


__all__ = ["Launch", "Remains", "release", "weakly"]
