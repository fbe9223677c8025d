"""A call's view: a directory of the host that the call sees as its ``/``, as a container would.

What an Inspect sample gets (``Sandbox.view``): the same tree for its commands and its file
tools, assembled in the call's own mount namespace (after workers.sandbox made its private
/proc, masked root's secrets and made the kernel's files read-only), then entered::

    view root V, a directory of the host    read-only: nothing can be added beside its own
    |-- usr bin sbin lib* etc               the host's, bound read-only (/etc without secrets)
    |-- proc sys                            this namespace's (the call's processes; sys ro)
    |-- dev                                 a tmpfs: null zero full random urandom tty, fd and
    |                                       std* links, a private shm; read-only
    `-- tmp, work, ... (V's own dirs)       read-write, each bound onto itself: the sample's
                                            /tmp and working directory, kept across its calls
    pivot_root(V), then the old root detached: the host's tree is no longer in the namespace

Nothing else of the host is there: no home folder, no project, no other sample's directory,
not the pool's sockets, scratch or lock directories, not [sandbox] read_only or writable.

Why pivot_root and not bind mounts over the host's tree: what to hide would be a list of the
host's directories (home folders, /srv, /work, /mnt...), never complete; here the list is what
to show. Why not chroot: the old root would stay in the namespace, a capable process could
walk back to it; pivot_root and a detach leave nothing to walk to.

V's top level is only ever changed by whoever made V (the provider: its own directories) and
by ``enter`` (mount points, the host's symlinks such as ``bin -> usr/bin``): a call never sees
it writable, so nothing there can redirect a mount.

The worker keeps running Python after the pivot: every module a tool needs is imported by then
(the template preloads and rehearses them), since the interpreter's own files are not in view.
"""

from __future__ import annotations

import contextlib
import os

from sandbx_pool.workers import libc as _libc

#: The host's directories a view shows, read-only: programs, libraries, configuration.
SYSTEM = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
#: Mount points of the view's own filesystems.
KERNEL = ("proc", "sys", "dev")
#: Device nodes a view has (the same as any command may open: workers.rules.DEVICES).
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
#: Links every program expects in /dev.
DEV_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
}
_NO_EXEC = _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC


def enter(root: str) -> None:
    """Make ``root`` this process's ``/`` as the module docstring draws it. Irreversible; only
    in a mount namespace of the call's own (whose mounts do not propagate to the host's)."""
    skeleton(root)
    # Recursive: a layer mounted on one of V's own directories (an Inspect sample over a base:
    # workers.overlay.enter_layer) comes along; nothing else is mounted below V.
    _libc.mount(root, root, None, _libc.MS_BIND | _libc.MS_REC, None)
    for name in own_directories(root):
        path = os.path.join(root, name)
        _libc.mount(path, path, None, _libc.MS_BIND | _libc.MS_REC, None)
    for name in SYSTEM:
        source = "/" + name
        if os.path.isdir(source) and not os.path.islink(source):
            target = os.path.join(root, name)
            _libc.mount(source, target, None, _libc.MS_BIND | _libc.MS_REC, None)
            _libc.set_read_only(target, recursive=True)
    # MS_REC keeps what workers.sandbox mounted beneath them: the kernel files read-only.
    _libc.mount("/proc", os.path.join(root, "proc"), None, _libc.MS_BIND | _libc.MS_REC, None)
    _libc.mount("/sys", os.path.join(root, "sys"), None, _libc.MS_BIND | _libc.MS_REC, None)
    _libc.set_read_only(os.path.join(root, "sys"), recursive=True)
    make_dev(os.path.join(root, "dev"))
    _libc.set_read_only(root, recursive=False)
    os.chdir(root)
    _libc.pivot_root(".", ".")  # the old root is now stacked on the new one...
    _libc.umount(".", _libc.MNT_DETACH)  # ...and gone from the namespace
    os.chdir("/")


def skeleton(root: str) -> None:
    """V's mount points and the host's top-level symlinks (merged /usr: ``bin -> usr/bin``),
    made where missing: the first call of a view makes them, the next find them (a call
    running beside it may make one first: that is the same entry)."""
    for name in (*SYSTEM, *KERNEL):
        source, target = "/" + name, os.path.join(root, name)
        if os.path.lexists(target):
            continue
        with contextlib.suppress(FileExistsError):
            if os.path.islink(source):
                os.symlink(os.readlink(source), target)
            elif os.path.isdir(source) or name in KERNEL:
                os.mkdir(target, 0o755)


def own_directories(root: str) -> list[str]:
    """V's directories that are not the host's: the sample's, read-write in the view."""
    shown = {*SYSTEM, *KERNEL}
    with os.scandir(root) as entries:
        return sorted(
            entry.name
            for entry in entries
            if entry.name not in shown and entry.is_dir(follow_symlinks=False)
        )


def make_dev(dev: str) -> None:
    _libc.mount("sandbx-dev", dev, "tmpfs", _NO_EXEC, "size=64k,mode=755")
    for name in DEVICES:
        source, target = "/dev/" + name, os.path.join(dev, name)
        if not os.path.exists(source):
            continue
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o666))
        with contextlib.suppress(OSError):  # /dev/tty without a terminal: the name stays
            _libc.mount(source, target, None, _libc.MS_BIND, None)
    for name, target in DEV_LINKS.items():
        os.symlink(target, os.path.join(dev, name))
    shm = os.path.join(dev, "shm")
    os.mkdir(shm)
    _libc.mount("shm", shm, "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV, "mode=1777,size=64m")
    _libc.set_read_only(dev, recursive=False)


__all__ = ["enter", "make_dev", "own_directories", "skeleton"]
