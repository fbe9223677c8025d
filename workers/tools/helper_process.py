"""A forked helper: part of a tool's work on the machine's second core, its answer over a pipe.

find hands the later part of a big walk to one child (``workers.tools.find``). The worker is
single-threaded (its ZMTP is its own, no libzmq threads), so fork is sound there, and cheap:
``bare_fork`` skips Python's after-fork callbacks, which a child that leaves with ``os._exit``
never needs. The child inherits everything that confines the worker (Landlock, and seccomp
where it applies), its process group (a cancel or a timeout is one killpg, which takes the
child too) and its PID namespace (the child dies with the worker, as everything in it does);
PDEATHSIG is armed besides, for a worker without a namespace of its own.

What the child may do: run ``work``, write the bytes it returns to the pipe, ``os._exit``. It
never returns into the worker's code, so it never touches the worker's connection, and it
ends on SIGTERM (the worker's own handler would answer the coordinator's stop for it).

Nothing here is ever an error for the caller: fork refused (EAGAIN under a process limit, a
seccomp filter), a child that dies, or says more than it may, is ``None``, and the caller
does the work itself.
"""

from __future__ import annotations

import _signal
import contextlib
import os
import signal
from collections.abc import Callable

from sandbx_pool.workers import containment
from sandbx_pool.workers.bare_fork import fork

#: The child's exit status when ``work`` raised or its answer could not be written.
EXIT_FAILED = 70


class Helper:
    """A running child: its pid and the read end of the pipe its answer comes through."""

    def __init__(self, pid: int, read_fd: int, limit: int) -> None:
        self.pid = pid
        self._read_fd = read_fd
        self._limit = limit

    def result(self) -> bytes | None:
        """The child's answer once it exits; None when it died, failed, or said too much.

        Blocks until the child closes the pipe. A child stuck on a hung file system blocks
        the worker as the walk itself would: the call's timeout (a killpg) ends both."""
        chunks: list[bytes] = []
        size = 0
        try:
            while size <= self._limit:
                chunk = os.read(self._read_fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError:
            self.kill()
            return None
        finally:
            os.close(self._read_fd)
            self._read_fd = -1
        if size > self._limit:
            self.kill()
            return None
        if not self._reap_cleanly():
            return None
        return b"".join(chunks)

    def kill(self) -> None:
        """Ends the child (if it still runs) and reaps it; safe to call more than once."""
        if self.pid <= 0:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self._reap_cleanly()
        if self._read_fd >= 0:
            os.close(self._read_fd)
            self._read_fd = -1

    def _reap_cleanly(self) -> bool:
        if self.pid <= 0:
            return False
        pid, self.pid = self.pid, 0
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return False
        return os.waitstatus_to_exitcode(status) == 0


def start(work: Callable[[], bytes], limit: int) -> Helper | None:
    """``work`` run in a forked child; None when the child cannot be had (the caller then does
    the work itself). ``limit``: the most bytes the answer may have."""
    parent = os.getpid()
    try:
        read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    except OSError:
        return None
    try:
        pid = fork()
    except OSError:  # EAGAIN (a process limit), EPERM/ENOSYS (a filter), ENOMEM
        os.close(read_fd)
        os.close(write_fd)
        return None
    if pid == 0:  # pragma: no cover - the child leaves with os._exit, coverage never sees it
        code = EXIT_FAILED
        try:
            os.close(read_fd)
            _signal.signal(signal.SIGTERM, _signal.SIG_DFL)
            containment.set_parent_death_signal()
            # The worker died before PDEATHSIG was armed. (A worker that is its namespace's
            # init is pid 1 to itself, and so to us.)
            if os.getppid() != parent:
                os._exit(EXIT_FAILED)
            answer = work()
            if len(answer) <= limit:
                view = memoryview(answer)
                while view:
                    view = view[os.write(write_fd, view) :]
                code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    return Helper(pid, read_fd, limit)
