"""A call in a layer over a container image: the image's layers, plus the layer's own, as ``/``.

The coordinator (sandbx_pool.layers) gives the call the image's unpacked layers, bottom first
(``ExecutionContext.layer_image``), each a directory of the image store ready to be an overlay
lower (whiteouts 0:0 character devices, opaque directories ``user.overlay.opaque=y``). In the
worker's own mount namespace (``mount``, before the confinement)::

    lowerdir = <layer>/skel : image layer N : ... : image layer 1   top first, each named by a
                                    descriptor (/proc/self/fd/K): 18 bytes a layer, where a
                                    store path takes 100 and the page of mount options fills
                                    at about 35; past a page, fsconfig's "lowerdir+" adds
                                    them one at a time (Linux 6.8)
    upperdir, workdir = <layer>/upper, <layer>/work  (the layer's, kept between calls)
    mounted on <layer>/root

``skel`` is the layer's own top lower, made with it: empty ``proc``, ``sys``, ``dev`` and
``etc/{hosts,hostname,resolv.conf}``, the mount points every call needs. A mount point made in
the merged tree instead would land in the upper directory, and ``Layer.diff`` would list it
as a change the call never made.

Then, once the confinement's own mount steps are done (workers.sandbox: the call's /proc,
root's secrets masked), the call enters it (``enter``), as a container runtime starts one::

    /proc          this namespace's (the call's processes only)
    /sys           the host's, read-only
    /dev           a tmpfs: null zero full random urandom tty, fd and std* links, a private shm
    /etc/hosts     localhost and the layer's name; /etc/hostname the name (a UTS namespace of
                   the call's own carries it); /etc/resolv.conf the host's when the call has a
                   network, else empty: bound from a tmpfs of the call's, written by it, never
                   by the layer
    pivot_root, the old root detached: nothing of the host's tree is left in the namespace

Unlike a view (workers.view) nothing of the host is bound in, programs included: bash runs
the image's ``/bin/bash``, else its ``/bin/sh``. The root stays writable: a call writes
anywhere in the image's tree, and what it writes lands in the upper directory. A pool without
root (a user namespace per worker that maps its uid to itself) then enters one more user
namespace, mapping uid and gid 0 to its own (``become_root``): the call is root in its
namespace, as in a rootless container, and the files it makes are the pool user's outside;
an image whose config names a User gets that uid instead (workers.image_user, ``become``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import stat

from sandbx_pool.workers import _libc, view
from sandbx_pool.workers.errors import ToolError

#: The legacy mount(2) copies one page of options; past it, the new mount API (fsconfig).
_OPTIONS_PAGE = 4096

#: The new mount API's system calls: generic numbers, the same on every architecture.
_SYS_MOVE_MOUNT, _SYS_FSOPEN, _SYS_FSCONFIG, _SYS_FSMOUNT = 429, 430, 431, 432
_FSOPEN_CLOEXEC = _FSMOUNT_CLOEXEC = 1
_FSCONFIG_SET_FLAG, _FSCONFIG_SET_STRING, _FSCONFIG_CMD_CREATE = 0, 1, 6
_MOVE_MOUNT_F_EMPTY_PATH = 4
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 1, 2, 4
#: What the call's mounts go on, and what each must be in the merged tree (the skeleton's,
#: unless an earlier call in the layer replaced it).
MOUNT_POINTS = {
    "proc": stat.S_IFDIR,
    "sys": stat.S_IFDIR,
    "dev": stat.S_IFDIR,
    "etc": stat.S_IFDIR,
    "etc/hosts": stat.S_IFREG,
    "etc/hostname": stat.S_IFREG,
    "etc/resolv.conf": stat.S_IFREG,
}

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
#: The root's name in the call's UTS namespace and /etc/hosts: the layer's name, as a host
#: name may spell it.
_NOT_IN_HOSTNAME = re.compile(r"[^A-Za-z0-9-]+")


class ImageMountError(ToolError):
    """The image's layers could not be mounted: the call is refused (``error``)."""


def mount(layer_dir: str, lowers: tuple[str, ...], root: str, options: str, *, upper: bool) -> None:
    """Mount the image's overlay on ``root`` (see above), in a mount namespace this worker has
    already made. ``upper``: with the layer's upper and work directories (a call); without,
    the image alone, read-only (what ``Layer.diff`` compares the upper directory with).
    ``lowers``: bottom first, as the Image lists them."""
    top_first = [os.path.join(layer_dir, "skel"), *reversed(lowers)]
    fds: list[int] = []
    try:
        for path in top_first:
            try:
                fds.append(os.open(path, _DIRECTORY))
            except OSError as exc:
                raise ImageMountError(
                    f"the image's layer {path} cannot be opened ({os.strerror(exc.errno or 0)}):"
                    " it is gone from the image store, or was never unpacked"
                ) from exc
        named = [f"/proc/self/fd/{fd}" for fd in fds]
        rest = options
        if upper:
            upper_dir = os.path.join(layer_dir, "upper")
            work_dir = os.path.join(layer_dir, "work")
            if any(c in layer_dir for c in ",:\\"):
                raise ImageMountError(
                    f"cannot mount a layer whose path holds ',', ':' or '\\': {layer_dir}"
                )
            rest = f"upperdir={upper_dir},workdir={work_dir},{options}"
        # nodev: an image is anyone's tarball, and a device node in it (a disk, /dev/mem)
        # would open as its mode says, capability or not. nosuid: no_new_privs holds for
        # the call's programs already; this holds for anything else that could exec them.
        flags = _libc.MS_NOSUID | _libc.MS_NODEV | (0 if upper else _libc.MS_RDONLY)
        data = f"lowerdir={':'.join(named)},{rest}"
        try:
            if len(data.encode()) < _OPTIONS_PAGE:
                _libc.mount("sandbx-image", root, "overlay", flags, data)
            else:
                _mount_many(named, rest, root, read_only=not upper)
        except OSError as exc:
            raise ImageMountError(
                f"cannot mount the image's {len(lowers)} layers on {root}: {exc}"
            ) from exc
    finally:
        for fd in fds:
            os.close(fd)


def _mount_many(lowers: list[str], rest: str, root: str, *, read_only: bool) -> None:
    """The overlay through the new mount API, one lower at a time (``lowerdir+``, Linux 6.8):
    no page of options to fill. ENOSYS or EINVAL before 6.8, said as such by the caller."""
    fs = _libc.syscall("fsopen", _SYS_FSOPEN, ctypes.c_char_p(b"overlay"), _FSOPEN_CLOEXEC)
    try:
        _fsconfig(fs, "source", "sandbx-image")
        for lower in lowers:
            _fsconfig(fs, "lowerdir+", lower)
        for option in rest.split(","):
            key, _, value = option.partition("=")
            _fsconfig(fs, key, value if value else None)
        if read_only:
            _fsconfig(fs, "ro", None)
        _libc.syscall("fsconfig create", _SYS_FSCONFIG, fs, _FSCONFIG_CMD_CREATE, None, None, 0)
        attributes = (
            _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV | (_MOUNT_ATTR_RDONLY if read_only else 0)
        )
        mnt = _libc.syscall("fsmount", _SYS_FSMOUNT, fs, _FSMOUNT_CLOEXEC, attributes)
    finally:
        os.close(fs)
    try:
        _libc.syscall(
            "move_mount",
            _SYS_MOVE_MOUNT,
            mnt,
            ctypes.c_char_p(b""),
            -100,  # AT_FDCWD
            ctypes.c_char_p(os.fsencode(root)),
            _MOVE_MOUNT_F_EMPTY_PATH,
        )
    finally:
        os.close(mnt)


def _fsconfig(fs: int, key: str, value: str | None) -> None:
    command = _FSCONFIG_SET_STRING if value is not None else _FSCONFIG_SET_FLAG
    encoded = ctypes.c_char_p(value.encode()) if value is not None else None
    _libc.syscall(f"fsconfig {key}", _SYS_FSCONFIG, fs, command, ctypes.c_char_p(key.encode()),
                  encoded, 0)  # fmt: skip


def hostname_of(layer_dir: str) -> str:
    """The call's host name: the layer's name as a host name may spell it (63 characters)."""
    name = _NOT_IN_HOSTNAME.sub("-", os.path.basename(layer_dir)).strip("-")
    return (name or "sandbx")[:63].rstrip("-") or "sandbx"


def enter(root: str, layer_dir: str, *, network: bool) -> None:
    """Make the mounted image ``root`` this process's ``/`` (see above). Irreversible; only
    in the call's own mount namespace (whose mounts do not propagate to the host's)."""
    _check_mount_points(root)
    hostname = hostname_of(layer_dir)
    files = _write_files(os.path.join(layer_dir, "run"), hostname, network=network)
    # MS_REC keeps what workers.sandbox mounted beneath them: the kernel files read-only.
    _libc.mount("/proc", os.path.join(root, "proc"), None, _libc.MS_BIND | _libc.MS_REC, None)
    _libc.mount("/sys", os.path.join(root, "sys"), None, _libc.MS_BIND | _libc.MS_REC, None)
    _libc.set_read_only(os.path.join(root, "sys"), recursive=True)
    view.make_dev(os.path.join(root, "dev"))
    for name, source in files.items():
        _libc.mount(source, os.path.join(root, "etc", name), None, _libc.MS_BIND, None)
    if _libc.try_unshare(_libc.CLONE_NEWUTS) == 0:
        _libc.sethostname(hostname)
    os.chdir(root)
    _libc.pivot_root(".", ".")  # the old root is now stacked on the new one...
    _libc.umount(".", _libc.MNT_DETACH)  # ...and gone from the namespace
    os.chdir("/")


def _check_mount_points(root: str) -> None:
    """Each mount point is what it must be, and no symlink: mount(2) follows one. A call
    cannot replace one (each is in use while it runs, and overlayfs renames no lower
    directory), but the upper directory is a plain directory of the store, and ``/proc`` left
    there as a symlink to a directory of the host must refuse the call, not be mounted
    through. (Nothing changes the layer meanwhile: its calls run one at a time, and this one
    has started nothing yet.)"""
    for name, kind in MOUNT_POINTS.items():
        try:
            st = os.lstat(os.path.join(root, name))
        except FileNotFoundError:
            st = None
        if st is None or stat.S_IFMT(st.st_mode) != kind:
            what = "a directory" if kind == stat.S_IFDIR else "a regular file"
            raise ImageMountError(
                f"/{name} in this layer is not {what} (an earlier call removed or replaced it):"
                " the call cannot be given its /proc, /sys, /dev and /etc files; reset the layer"
            )


def _write_files(run: str, hostname: str, *, network: bool) -> dict[str, str]:
    """/etc/hosts, /etc/hostname and /etc/resolv.conf as a container runtime gives them, on a
    tmpfs of this call's at the layer's ``run`` (gone with the namespace)."""
    flags = _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC
    _libc.mount("sandbx-etc", run, "tmpfs", flags, "size=64k,mode=0755")
    resolv = b""
    if network:
        # The host's as it is: a call with a network shares the host's (or reaches out through
        # the pool's proxy, which resolves names itself).
        with contextlib.suppress(OSError), open("/etc/resolv.conf", "rb") as f:
            resolv = f.read(64 * 1024)
    contents = {
        "hosts": (
            f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"127.0.1.1\t{hostname}\n"
        ).encode(),
        "hostname": f"{hostname}\n".encode(),
        "resolv.conf": resolv,
    }
    paths = {}
    for name, data in contents.items():
        path = os.path.join(run, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, 0o644)
        paths[name] = path
    return paths


def become_root() -> None:
    """In a user namespace that maps the pool's uid to itself (a pool without root): one more,
    mapping 0 to it, so that the call is uid 0 as in a rootless container. After every mount:
    the mount namespace stays its parent's."""
    become(0, 0)


def become(inner_uid: int, inner_gid: int) -> None:
    """``become_root`` for the image's User (workers.image_user): the one more user namespace
    maps ``inner_uid`` and ``inner_gid`` to the pool's own, so that the call is them. A root
    pool has no need of one: it switches with setuid where run_as would (workers.sandbox)."""
    uid, gid = os.geteuid(), os.getegid()
    if uid == 0:
        return
    _libc.unshare(_libc.CLONE_NEWUSER, what="unshare(CLONE_NEWUSER)")
    maps = (
        ("setgroups", "deny"),
        ("uid_map", f"{inner_uid} {uid} 1"),
        ("gid_map", f"{inner_gid} {gid} 1"),
    )
    for name, line in maps:
        try:
            with open(f"/proc/self/{name}", "w") as f:
                f.write(line)
        except OSError as exc:
            if name == "setgroups" and exc.errno == errno.ENOENT:
                continue
            raise


__all__ = [
    "MOUNT_POINTS",
    "ImageMountError",
    "become",
    "become_root",
    "enter",
    "hostname_of",
    "mount",
]
