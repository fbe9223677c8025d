"""What a command run as uid 0 loses: every capability, and what root owns without one.

bash's worker applies these in ``sandbox.confine``, inside the call's own mount namespace (a
file tool's worker the capability steps alone: it execs nothing and opens only what its path
checks let it)::

    mask_secrets           an empty, mode-0, read-only file (or directory) over each secret
    read_only_kernel_files /proc/sys, /sys...: root owns them, and writing needs no capability
    private_dev_shm        a tmpfs of its own on /dev/shm (POSIX shm is not an IPC namespace's)
    new_ipc_namespace      SysV shm, semaphores and message queues of its own
    (narrow_bounding_set   while idle: the bounding set down to what keep_root keeps)
    lock_out_root          securebits locked, the bounding set empty (while still root)
    ...run_as...
    drop_all_capabilities  ambient, effective, permitted, inheritable all empty (keep_only:
                           all but keep_root's set, for a file tool's worker)
    (then workers.seccomp: the system calls that reach past a capless uid 0)

Why not a user namespace mapping the call to an unprivileged uid: the workspace's files belong
to the pool's user (root here), and a command must keep writing them, running git in them and
installing packages into its TMPDIR as it does today. A capless uid 0 keeps exactly that: the
owner's rights over root's files, and nothing of root's power (no DAC override, no chown to
another uid, no raw sockets, no uid change, no mount, no module). What ownership still gives it
is closed here: secrets root owns (/etc/shadow), kernel files root owns (core_pattern: the
kernel runs its pipe as full root), block devices (a raw disk holds every file's content).
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import stat
from collections.abc import Iterable

from sandbx_pool.workers import libc

#: Files only root may read, which a capless uid 0 reads anyway: it owns them.
SECRETS = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh/ssh_host_*_key",
)
#: Device nodes guarded by their mode, not by a capability: a capless owner opens them.
#: ``masks()`` adds every block device.
DEVICES = ("/dev/userfaultfd", "/dev/kvm", "/dev/loop-control", "/dev/cpu_dma_latency")
#: Writable by uid 0 with no capability: core_pattern is a way out (the kernel runs its pipe as
#: full root), cgroup.procs a way out of the process limit, binfmt_misc another way out.
READ_ONLY = ("/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs", "/sys")

#: NOROOT (exec as uid 0 grants no capability), NO_SETUID_FIXUP (uid changes touch none),
#: KEEP_CAPS off, NO_CAP_AMBIENT_RAISE: each with its _LOCKED bit, so nothing undoes them.
_SECUREBITS = 0b1110_1111
_CAP_SETGID = 6
_CAP_SETUID = 7
_CAP_SETPCAP = 8


def masks() -> list[str]:
    """SECRETS, DEVICES and every block device's node, as globs."""
    try:  # one directory read, not a stat of every node in /dev
        blocks = sorted(f"/dev/{name}" for name in os.listdir("/sys/class/block"))
    except OSError:
        blocks = []
    return [*SECRETS, *DEVICES, *blocks]


def prepare() -> None:
    """In the template, before forking: what every worker would otherwise look up again."""
    for pattern in masks():
        glob.glob(pattern)


def mask_secrets(scratch: str, also: Iterable[str] = ()) -> list[str]:
    """Cover each existing ``masks()`` path with an empty, mode-0, read-only file or directory:
    a capless uid 0 can neither open it (no CAP_DAC_OVERRIDE), chmod it (EROFS) nor unmount it
    (no CAP_SYS_ADMIN). ``scratch``, a directory briefly covered in this namespace only, holds
    the two masks. ``also``: more paths to cover the same way, in the same step. Returns the
    paths covered. Only in a mount namespace of the call's own.

    Not root (a worker in a user namespace of its own, workers.containment): only those the
    pool's user could open itself. The others are root's, closed to it by their mode already,
    and each mask is a mount that costs the call some 20 us."""
    secrets = [path for pattern in masks() for path in sorted(glob.glob(pattern))]
    if os.geteuid() != 0:
        # access(2) answers for the real uid without the capabilities a user namespace gives:
        # what a command of this user could do.
        secrets = [path for path in secrets if any(os.access(path, m) for m in _ANY_ACCESS)]
    return mask(scratch, [*secrets, *also])


_ANY_ACCESS = (os.R_OK, os.W_OK, os.X_OK)


def mask(scratch: str, paths: Iterable[str]) -> list[str]:
    """Cover each of ``paths`` that exists as ``mask_secrets`` does (also the pool's journal:
    a call can then neither read, truncate, rename nor remove it, wherever it lies)."""
    targets: dict[str, int] = {}
    try:
        # Each target is held open (O_PATH) and mounted on through /proc/self/fd: the scratch
        # tmpfs cannot hide it, nor a symlink swapped in meanwhile redirect the mask.
        for path in paths:
            with contextlib.suppress(OSError):  # a dangling symlink: nothing behind it
                targets[path] = os.open(path, os.O_PATH | os.O_CLOEXEC)
        if targets:
            _bind_masks(scratch, targets.values())
    finally:
        for fd in targets.values():
            os.close(fd)
    return list(targets)


def _bind_masks(scratch: str, fds: Iterable[int]) -> None:
    # A tmpfs of our own holds the masks: not a host file, which its owner (root: us) could
    # chmod. Bind mounts copy its read-only flag and keep it alive once it is detached from the
    # scratch directory, which then shows what it did before.
    flags = libc.MS_NOSUID | libc.MS_NODEV | libc.MS_NOEXEC
    # Mode 0700, not 000: a root without CAP_DAC_OVERRIDE (a pool started with it dropped)
    # must still create the masks in it; it is detached before anything else runs.
    libc.mount("mask", scratch, "tmpfs", flags, "size=4k,mode=700")
    try:
        os.close(os.open(f"{scratch}/file", os.O_CREAT | os.O_WRONLY, 0))
        os.mkdir(f"{scratch}/dir", 0)
        libc.set_read_only(scratch, recursive=False)
        for fd in fds:
            mask = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
            try:
                libc.mount(f"{scratch}/{mask}", f"/proc/self/fd/{fd}", None, libc.MS_BIND, None)
            except FileNotFoundError:
                # Removed since it was opened (the pool's journal, which its writer re-creates
                # under its own lock): nothing is left there to cover.
                continue
    finally:
        libc.umount(scratch, libc.MNT_DETACH)


def read_only_kernel_files(paths: Iterable[str] = READ_ONLY) -> None:
    """Make each of ``paths`` (READ_ONLY's), and every mount beneath it (binfmt_misc,
    cgroups), read-only."""
    for path in paths:
        if os.path.exists(path):
            libc.mount(path, path, None, libc.MS_BIND | libc.MS_REC, None)
            libc.set_read_only(path, recursive=True)


def private_dev_shm() -> None:
    if os.path.isdir("/dev/shm"):
        flags = libc.MS_NOSUID | libc.MS_NODEV
        libc.mount("shm", "/dev/shm", "tmpfs", flags, "mode=1777,size=64m")


def new_ipc_namespace() -> None:
    """SysV shm, semaphores, message queues and POSIX mqueues of our own: a capless uid 0 owns,
    so may attach, every 0600 segment root made on the host."""
    libc.unshare(libc.CLONE_NEWIPC, what="unshare(CLONE_NEWIPC)")


#: What ``keep_root`` leaves bash: Docker's default set without MKNOD and NET_RAW (no device
#: nodes to get around the filesystem rules, no packet sockets), so no SYS_PTRACE, SYS_ADMIN,
#: SYS_MODULE, NET_ADMIN...
CONTAINER_CAPS = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29, 31})


def shrink_bounding_set(
    last_cap: int, keep: frozenset[int], *, held: Iterable[int] | None = None
) -> None:
    """Drop every capability but ``keep`` from the bounding set (what exec'd programs can hold).

    ``held``: what is still in it, when known (``narrow_bounding_set`` dropped the rest while
    idle). Each drop is a credential commit, 3 µs of CPU: 41 of them were 0.14 ms of a call.
    """
    for cap in range(last_cap + 1) if held is None else held:
        if cap in keep:
            continue
        code = libc.try_prctl(libc.PR_CAPBSET_DROP, cap)
        if code == errno.EPERM:  # no CAP_SETPCAP, so not root: nothing to drop
            return
        if code not in (0, errno.EINVAL):  # EINVAL: a capability this kernel lacks
            raise OSError(code, f"prctl(PR_CAPBSET_DROP, {cap}): {os.strerror(code)}")


def narrow_bounding_set(last_cap: int) -> frozenset[int] | None:
    """While idle, before the call is known: drop from the bounding set what no call keeps
    (all but CONTAINER_CAPS). The bounding set bounds only what an exec grants, never what the
    worker holds, so the confinement's steps still have every capability they need. Returns
    what is left, for ``lock_out_root``; None where nothing could be dropped (not root)."""
    if not libc.capget()[0] >> _CAP_SETPCAP & 1:
        return None
    try:
        shrink_bounding_set(last_cap, CONTAINER_CAPS)
    except OSError:
        return None  # lock_out_root tries them all again, and reports the failure
    return CONTAINER_CAPS


def lock_out_root(last_cap: int, *, held: Iterable[int] | None = None) -> None:
    """While still root: an empty bounding set (nothing exec'd ever gains a capability) and
    locked securebits (exec as uid 0 grants none, a uid change restores none). Needs
    CAP_SETPCAP: without it (a pool not run as root) there is nothing to lock out. ``held``:
    what is left in the bounding set, when known (``narrow_bounding_set``)."""
    if not libc.capget()[0] >> _CAP_SETPCAP & 1:
        return
    if libc.prctl_get(libc.PR_GET_SECUREBITS) != _SECUREBITS:
        libc.prctl(libc.PR_SET_SECUREBITS, _SECUREBITS, what="prctl(PR_SET_SECUREBITS)")
    shrink_bounding_set(last_cap, frozenset(), held=held)


def bounding_set(last_cap: int) -> int:
    """The capabilities this process's bounding set still holds, as a mask (CapBnd)."""
    held = 0
    for cap in range(last_cap + 1):
        if libc.prctl_get(libc.PR_CAPBSET_READ, cap):
            held |= 1 << cap
    return held


def drop_all_capabilities(*, keep_user_switch: bool = False) -> None:
    """Empty the ambient, effective, permitted and inheritable sets (after run_as's setuid,
    which needed CAP_SETUID), and check that nothing else is left.

    ``keep_user_switch`` keeps CAP_SETUID and CAP_SETGID in the worker's own sets, for a command
    started as another user (bash's ``user``): the child switches after the fork, and execs as
    that user with an empty bounding set, so the command holds none of them.
    """
    keep_only(frozenset({_CAP_SETGID, _CAP_SETUID}) if keep_user_switch else frozenset())


def keep_only(keep: frozenset[int]) -> None:
    """Empty the ambient and inheritable sets, and the effective and permitted ones but for
    what of ``keep`` this process holds (a uid switch may have cleared it already); check that
    nothing else is left."""
    libc.prctl(libc.PR_CAP_AMBIENT, libc.PR_CAP_AMBIENT_CLEAR_ALL, what="prctl(PR_CAP_AMBIENT)")
    kept = libc.capget()[1] & sum(1 << cap for cap in keep)
    libc.capset(kept)
    if libc.capget() != (kept, kept, 0):
        raise OSError(errno.EPERM, "capabilities remain after capset")
