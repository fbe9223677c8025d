"""Keeping everything a call starts inside its worker, and ending it with the worker.

Two mechanisms, chosen once by the template process (``probe``):

* ``pidns``: each worker is pid 1 of a new PID namespace. When it exits, the kernel kills every
  process left in the namespace, including ones that called setsid() or double-forked. Needs
  CAP_SYS_ADMIN (root here).
* ``subreaper``: the worker is a child subreaper (PR_SET_CHILD_SUBREAPER), so orphans of its
  descendants are reparented to it and it can find and kill them before it exits. It cannot
  hold anything once the worker itself is SIGKILLed: those orphans go to the template, which
  is also a subreaper and kills every child that is not a live worker.

Either way, a worker ends its call with ``kill_descendants()`` before it answers, so a
background daemon never outlives the call that started it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

_libc = ctypes.CDLL(None, use_errno=True)

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
CLONE_NEWPID = 0x20000000


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")


def set_child_subreaper() -> None:
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


class PidNamespaces:
    """Puts each next child in a PID namespace of its own.

    unshare(CLONE_NEWPID) changes only where the caller's *next* children go, and only once:
    it fails while the caller's children already go to another namespace. So after each fork
    the template goes back to its own namespace with setns() and unshares again for the next.
    """

    def __init__(self) -> None:
        self._own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def enter_new(self) -> None:
        _check(_libc.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")

    def leave(self) -> None:
        _check(_libc.setns(self._own, CLONE_NEWPID), "setns(pid)")


def probe_pid_namespaces() -> PidNamespaces | None:
    """PidNamespaces if this process may create them, else None (fall back to subreaper)."""
    try:
        namespaces = PidNamespaces()
        namespaces.enter_new()
        namespaces.leave()
    except OSError:
        return None
    return namespaces


def in_own_pid_namespace() -> bool:
    return os.getpid() == 1


def children(pid: int | None = None) -> list[int]:
    """Pids of the children (every thread's) of process ``pid`` (None: this one), from /proc."""
    proc = f"/proc/{'self' if pid is None else pid}"
    pids: list[int] = []
    # Either may vanish as we read: a process or a thread that has exited has no children.
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        for tid in os.listdir(f"{proc}/task"):
            with (
                contextlib.suppress(FileNotFoundError, ProcessLookupError),
                open(f"{proc}/task/{tid}/children") as f,
            ):
                pids.extend(int(p) for p in f.read().split())
    return pids


def reap_all() -> None:
    """Reap every child that has exited, without blocking."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_descendants() -> None:
    """SIGKILL everything this worker started, directly or not, and reap it.

    Blocks until they are reaped, except for a process stuck in the kernel (state D), which
    nothing can end; the coordinator's deadline covers that case.
    """
    if in_own_pid_namespace():
        # kill(-1) from a namespace's init reaches every other process in the namespace.
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)
        while True:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return
    # Subreaper: orphans of our descendants are our children; kill until none is left.
    while True:
        pids = children()
        if not pids:
            reap_all()
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
