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
import os
import signal

from sandbx_pool.workers import _libc
from sandbx_pool.workers.procfs import children


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    _libc.prctl(_libc.PR_SET_PDEATHSIG, sig, what="prctl(PR_SET_PDEATHSIG)")


def set_child_subreaper() -> None:
    _libc.prctl(_libc.PR_SET_CHILD_SUBREAPER, 1, what="prctl(PR_SET_CHILD_SUBREAPER)")


class PidNamespaces:
    """Puts each next child in a PID namespace of its own.

    unshare(CLONE_NEWPID) changes only where the caller's *next* children go, and only once:
    it fails while the caller's children already go to another namespace. So after each fork
    the template goes back to its own namespace with setns() and unshares again for the next.
    """

    def __init__(self) -> None:
        self._own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def enter_new(self) -> None:
        _libc.unshare(_libc.CLONE_NEWPID, what="unshare(CLONE_NEWPID)")

    def leave(self) -> None:
        _libc.setns(self._own, _libc.CLONE_NEWPID, what="setns(pid)")


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
