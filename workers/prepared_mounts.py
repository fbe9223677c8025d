"""The part of a bash call's mount namespace that is the same for every call: made once, copied.

A call that runs programs gets a mount namespace of its own (workers.sandbox): root's secrets
and the dangerous device nodes masked, /sys read-only, then what is the call's (its /proc, the
hidden directories, a private /dev/shm, its TMPDIR's tmpfs, the protected paths). The first part
is some 25 mounts and half of the mounts' time, the same for every call of a pool, and read-only:
what every copy shares of it, no call can write (each writable mount is the call's own).
The template makes it once, in a namespace no process lives in (held by an nsfs descriptor)::

    template: unshare(NEWNS) -> masks, /sys read-only -> keep its nsfs -> setns back
    worker:   setns(prepared) -> unshare(NEWNS): a copy of its own -> the call's own mounts

Nothing a call does reaches the prepared namespace or the next call: the worker leaves it at
once for a copy (unshare), and every mount, unmount or file of the call's tmpfs is made in that
copy, which goes with the worker. No process is ever left in the prepared namespace, and a
command cannot enter it: it holds no capability, seccomp refuses setns, and the descriptor is
closed before the command starts (and is close-on-exec).

What is prepared goes stale in two ways, each checked by the worker before it enters (a few
stat calls and a poll):

* the host's mount table changed (a FUSE or NFS mount made since, which the call may be about:
  where the host's mounts are private, none of it would reach a copy). A descriptor of
  /proc/self/mountinfo, opened by the template before it checks its own and forks, polls
  POLLPRI once the table has changed since it was opened (proc(5));
* a secret appeared, went or was replaced (/etc/shadow rewritten by passwd, a new block device):
  the directories the masks' globs list are stat'ed as when the masks were made, as
  workers.rules.SecretsLayer does.

Either way the worker builds its namespace as before, and the template prepares a new one before
its next fork. Only for a pool run as root with CAP_SYS_ADMIN, whose workers stay in the
template's mount namespace until their call: a worker in a user namespace of its own cannot
join a namespace the template's user namespace owns, and a call whose overlay (a layer, a
change set) is mounted already has left that namespace; both build their own, as before.
"""

from __future__ import annotations

import contextlib
import os
import select

from sandbx_pool.workers import libc, lockdown

_MOUNTINFO = "/proc/self/mountinfo"
_STALE = select.POLLPRI | select.POLLERR

#: What the prepared namespace holds of workers.lockdown.READ_ONLY: /sys. The /proc entries are
#: made per call, on the call's own /proc (a new mount on /proc would cover them).
PREPARED_READ_ONLY = tuple(path for path in lockdown.READ_ONLY if not path.startswith("/proc"))
PER_CALL_READ_ONLY = tuple(path for path in lockdown.READ_ONLY if path.startswith("/proc"))


def _listed_dirs() -> list[str]:
    """The directories whose entries decide what the masks cover (their globs' parents)."""
    dirs = {os.path.dirname(pattern) for pattern in lockdown.masks()}
    dirs.add("/sys/class/block")  # where masks() finds the block devices
    return sorted(dirs)


def _stamp(dirs: list[str]) -> list[tuple[str, int, int, int]]:
    stamps = []
    for path in dirs:
        try:
            found = os.stat(path)
        except OSError:
            stamps.append((path, 0, 0, 0))
            continue
        stamps.append((path, found.st_dev, found.st_ino, found.st_mtime_ns))
    return stamps


class PreparedMounts:
    """A prepared mount namespace (its nsfs descriptor), the host's mount table it was made
    from (a mountinfo descriptor that polls POLLPRI once it changed) and the masks' stamps."""

    def __init__(
        self,
        namespace_fd: int,
        watch_fd: int,
        stamps: list[tuple[str, int, int, int]],
        home_ino: int,
    ) -> None:
        self.namespace_fd = namespace_fd
        self.watch_fd = watch_fd
        self.stamps = stamps
        #: The inode of the mount namespace it was made from (the template's): a worker that
        #: is no longer there (an overlay mounted already) must not leave it.
        self.home_ino = home_ino

    @classmethod
    def build(cls, scratch: str) -> PreparedMounts | None:
        """In the template (single-threaded, root with CAP_SYS_ADMIN): make the namespace and
        return to ours. None where it cannot be made; the workers then build theirs per call.

        ``scratch``: a directory the masks' tmpfs briefly covers (in the new namespace only)."""
        if os.geteuid() != 0 or not os.path.isdir(scratch):
            return None
        # Before anything is read: a change from now on makes what follows stale.
        watch = os.open(_MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
        stamps = _stamp(_listed_dirs())
        home = os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        cwd = os.open(".", os.O_PATH | os.O_CLOEXEC)
        namespace = -1
        try:
            home_ino = os.fstat(home).st_ino
            if libc.try_unshare(libc.CLONE_NEWNS) != 0:
                os.close(watch)
                return None
            try:
                namespace = _make(scratch)
            finally:
                # Back where the template lives, with its working directory (setns resets it).
                # Failing that, the template cannot go on in a namespace of masks: end it.
                try:
                    libc.setns(home, libc.CLONE_NEWNS, what="setns(the template's namespace)")
                    os.fchdir(cwd)
                except OSError:
                    os._exit(70)
        finally:
            os.close(home)
            os.close(cwd)
        if namespace < 0:
            os.close(watch)
            return None
        return cls(namespace, watch, stamps, home_ino)

    def fresh(self) -> bool:
        """Whether the host's mount table and the masked directories are as when made. Polling
        consumes the change: in the template, call it only to decide to rebuild."""
        return not _changed(self.watch_fd) and _stamp([s[0] for s in self.stamps]) == self.stamps

    def close(self) -> None:
        for fd in (self.namespace_fd, self.watch_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _make(scratch: str) -> int:
    """The mounts every call shares, in the namespace just unshared; its nsfs descriptor, or
    -1 if any step failed (then nothing of it is used)."""
    try:
        # Nothing mounted here propagates back to the host.
        libc.mount("none", "/", None, libc.MS_REC | libc.MS_SLAVE, None)
        lockdown.mask_secrets(scratch)
        lockdown.read_only_kernel_files(PREPARED_READ_ONLY)
    except OSError:
        return -1
    return os.open("/proc/self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)


def _changed(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLPRI)
    return any(events & _STALE for _, events in poller.poll(0))


class Refresher:
    """The template's side: the prepared namespace kept fresh, and for each fork a watch of
    the host's mount table opened before the check (so that nothing changes unseen between
    the check and the worker's own)."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch
        self.prepared = PreparedMounts.build(scratch)

    def for_fork(self) -> Handle | None:
        """Before a fork: what the worker inherits (it owns the watch; the template closes its
        copy after the fork with ``after_fork``)."""
        if self.prepared is None:
            return None
        watch = os.open(_MOUNTINFO, os.O_RDONLY | os.O_CLOEXEC)
        if not self.prepared.fresh():
            self.prepared.close()
            self.prepared = PreparedMounts.build(self.scratch)
            if self.prepared is None:
                os.close(watch)
                return None
        return Handle(self.prepared, watch)

    def close(self) -> None:
        if self.prepared is not None:
            self.prepared.close()
            self.prepared = None


class Handle:
    """The worker's side: the prepared namespace, entered at most once, by a copy."""

    def __init__(self, prepared: PreparedMounts, watch_fd: int) -> None:
        self.namespace_fd = prepared.namespace_fd
        self.watch_fd = watch_fd
        self.stamps = prepared.stamps
        self.home_ino = prepared.home_ino

    def enter(self) -> bool:
        """Join a copy of the prepared namespace; False (nothing done) where it is stale or
        this worker has left the template's namespace already. Closes the descriptors."""
        try:
            if (
                _changed(self.watch_fd)
                or _stamp([s[0] for s in self.stamps]) != self.stamps
                or os.stat("/proc/self/ns/mnt").st_ino != self.home_ino
            ):
                return False
            libc.setns(self.namespace_fd, libc.CLONE_NEWNS, what="setns(the prepared mounts)")
        except OSError:
            return False
        finally:
            self.close()
        # A copy of our own at once: nothing the call mounts reaches the prepared namespace.
        # Failing that we must not go on in the shared one (the caller cannot undo the setns).
        libc.unshare(libc.CLONE_NEWNS, what="unshare(a copy of the prepared mounts)")
        libc.mount("none", "/", None, libc.MS_REC | libc.MS_SLAVE, None)
        return True

    def forked(self) -> None:
        """In the template, after the fork: the watch is the worker's (the namespace's
        descriptor stays the template's)."""
        os.close(self.watch_fd)
        self.watch_fd = -1

    def close(self) -> None:
        """In the worker: both descriptors, once entered or not needed."""
        for fd in (self.namespace_fd, self.watch_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.namespace_fd = self.watch_fd = -1


#: The worker's handle, set by the template in the forked child (None: build per call).
current: Handle | None = None
#: Whether this worker has entered its copy (then it is in it, or in a copy of that).
entered = False


def enter() -> bool:
    """Enter a copy of the prepared mounts once (see Handle.enter), or say it was earlier.

    A call in a layer or a change set enters before its overlay is mounted (the overlay's own
    namespace is then a copy of this copy); the other calls when their mounts are made."""
    global current, entered
    if not entered and current is not None:
        handle, current = current, None
        entered = handle.enter()
    return entered


def drop() -> None:
    """Close the worker's handle, if it was not used (a file tool's call)."""
    global current
    if current is not None:
        current.close()
        current = None


__all__ = [
    "PER_CALL_READ_ONLY",
    "Handle",
    "PreparedMounts",
    "Refresher",
    "current",
    "drop",
    "enter",
    "entered",
]
