"""Keeping everything a call starts inside its worker, and ending it with the worker.

Two mechanisms, chosen once by the template process (``probe_pid_namespaces``, then
``probe_user_namespaces``):

* ``pidns``: each worker is pid 1 of a new PID namespace. When it exits, the kernel kills every
  process left in the namespace, including ones that called setsid() or double-forked. Needs
  CAP_SYS_ADMIN (root here): ``PidNamespaces``. In a pool that is not root, where the kernel
  lets anyone make a user namespace (Debian, Fedora; not ``user.max_user_namespaces = 0``, nor
  Ubuntu's AppArmor restriction), ``UserNamespaces``: each worker is made in one of its own that
  maps only the pool's uid and gid to themselves (so the files a call writes keep their owner),
  and the PID namespace it is pid 1 of belongs to that user namespace. The worker holds every
  capability there, over the namespaces it makes and nothing of the host's, so the mount, IPC
  and network namespaces a root worker makes (workers.sandbox) are its too; it drops them all
  before its tool runs (workers.lockdown), and a call cannot make a user namespace of its own
  (workers.seccomp).
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
import resource
import signal

from sandbx_pool.workers import _libc, bare_fork
from sandbx_pool.workers.procfs import children


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    _libc.prctl(_libc.PR_SET_PDEATHSIG, sig, what="prctl(PR_SET_PDEATHSIG)")


def release_standard_streams(devnull: int) -> None:
    """Point descriptors 0, 1 and 2 at ``devnull`` (an open /dev/null, closed here).

    For a process that may end up asleep in the kernel (a worker or a rules helper on a hung
    mount): whatever the caller of the pool gave us as stdin, stdout and stderr (a pipe to
    `cat`, a `$(...)`) must not stay open in it, or the caller's reader waits for the
    filesystem, long after the call's outcome came back. What such a process has to say goes
    over its socket, or is its exit status."""
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if devnull > 2:
        os.close(devnull)


def set_child_subreaper() -> None:
    _libc.prctl(_libc.PR_SET_CHILD_SUBREAPER, 1, what="prctl(PR_SET_CHILD_SUBREAPER)")


class PidNamespaces:
    """Puts each next child in a PID namespace of its own.

    unshare(CLONE_NEWPID) changes only where the caller's *next* children go, and only once:
    it fails while the caller's children already go to another namespace. So after each fork
    the template goes back to its own namespace with setns() and unshares again for the next.
    """

    user_namespace = False

    def __init__(self) -> None:
        self._own = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)

    def enter_new(self) -> None:
        _libc.unshare(_libc.CLONE_NEWPID, what="unshare(CLONE_NEWPID)")

    def leave(self) -> None:
        _libc.setns(self._own, _libc.CLONE_NEWPID, what="setns(pid)")

    def fork(self) -> int:
        """One fork into a new PID namespace; the caller's own children go to its own again.
        Each try needs a new namespace: one whose first process could not be forked refuses
        every later fork (ENOMEM), whatever frees up meanwhile."""
        self.enter_new()
        try:
            pid = bare_fork.fork()
        except BaseException:
            self.leave()
            raise
        if pid != 0:
            self.leave()
        return pid

    def enter_child(self) -> None:
        """In the child, first thing: nothing to do."""


class UserNamespaces:
    """Makes each next child in a user namespace of its own, pid 1 of a PID namespace that
    namespace owns, in one clone(2) (workers.bare_fork.clone). The child maps its ids
    (``enter_child``): until it does, the kernel shows it as the overflow uid.

    Not unshare(CLONE_NEWUSER) in the template followed by the root path's PID namespaces: a
    process cannot go back to a PID namespace its user namespace does not own (setns needs
    CAP_SYS_ADMIN over it), and the template would then share one user namespace with every
    call. Not a fork followed by the child's unshare: a PID namespace takes its first process
    from the next fork, so each worker would cost two forks and an intermediate process.
    """

    user_namespace = True
    _FLAGS = _libc.CLONE_NEWUSER | _libc.CLONE_NEWPID

    def __init__(self) -> None:
        # The effective ids, as the kernel reads them: the one mapping a process without
        # CAP_SETUID in the parent namespace may write is its own euid (egid) to itself.
        uid, gid = os.geteuid(), os.getegid()
        self._uid_map = f"{uid} {uid} 1".encode()
        self._gid_map = f"{gid} {gid} 1".encode()

    def fork(self) -> int:
        return bare_fork.clone(self._FLAGS)

    def enter_child(self) -> None:
        """In the child, first thing: map the pool's uid and gid to themselves. setgroups(2)
        must be refused in the namespace first (the kernel's rule for a gid map written
        without CAP_SETGID in the parent: else dropping a group could grant access)."""
        for name, data in (
            ("setgroups", b"deny"),
            ("uid_map", self._uid_map),
            ("gid_map", self._gid_map),
        ):
            fd = os.open(f"/proc/self/{name}", os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        global _own_user_namespace
        _own_user_namespace = True


#: Set in a worker that UserNamespaces made, once its ids are mapped.
_own_user_namespace = False


def in_own_user_namespace() -> bool:
    """Whether this worker holds its capabilities in a user namespace of its own (not root's:
    the workers.sandbox steps that keep root's are then moot, and file tools drop them too)."""
    return _own_user_namespace


def nproc_counts_per_user_namespace() -> bool:
    """Whether RLIMIT_NPROC counts a user's processes per user namespace (Linux 5.14, ucounts):
    then, in a worker's own user namespace, it limits what the call forks, and nothing else of
    the pool's user's, as a pids cgroup would (a pool without root rarely has one delegated)."""
    release = os.uname().release.split("-", 1)[0].split(".")
    try:
        return (int(release[0]), int(release[1])) >= (5, 14)
    except (IndexError, ValueError):
        return False


def limit_processes_in_own_user_namespace(processes: int) -> None:
    """Cap the tasks (processes and threads) of this worker's user namespace, itself included,
    at ``processes``: a fork past it fails with EAGAIN. Only in a user namespace of its own: in
    the host's, the count would be every process of the pool's user."""
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


Namespaces = PidNamespaces | UserNamespaces


def probe_pid_namespaces() -> PidNamespaces | None:
    """PidNamespaces if this process may create them, else None (fall back to subreaper)."""
    try:
        namespaces = PidNamespaces()
        namespaces.enter_new()
        namespaces.leave()
    except OSError:
        return None
    return namespaces


#: Exit status of the probe's child when a step failed; 0 when all held.
_PROBE_FAILED = 1


def probe_user_namespaces() -> UserNamespaces | None:
    """UserNamespaces if a child made as each worker is can map its ids and make a mount
    namespace of its own there (what Ubuntu's AppArmor restriction refuses: the clone
    succeeds, the capabilities in it do not), else None. Costs one clone and wait.

    Never for root (a container's, without CAP_SYS_ADMIN): the one id such a map holds is 0,
    so ``run_as`` and bash's ``user`` could not switch to another uid there (a map of every
    id must be written by the parent, once per worker, while the worker waits for it); and a
    container runtime's seccomp profile refuses user namespaces anyway."""
    if os.geteuid() == 0 or not bare_fork.clone_supported():
        return None
    namespaces = UserNamespaces()
    try:
        pid = namespaces.fork()
    except OSError:
        return None
    if pid == 0:
        status = _PROBE_FAILED
        try:
            namespaces.enter_child()
            _libc.unshare(_libc.CLONE_NEWNS, what="unshare(CLONE_NEWNS)")
            _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
            status = 0
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    return namespaces if os.waitstatus_to_exitcode(status) == 0 else None


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
