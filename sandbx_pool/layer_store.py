"""The layer store on disk: the pool's own directory, never a workspace (sandbx_pool.layers).

    <store>/                          0700 (0711 for a pool whose calls run as another user)
        <name>/                       one layer, made whole by one rename (nothing half made)
            layer.json                {"v", "name", "base"}: the base's real path, recorded;
                                      over an image, "base" null and "image": the Image
                                      record (its digest, layers and their directories)
            skel/  run/               over an image only: the top lower holding the mount
                                      points a call needs, where a call's /etc files are
                                      written (workers.image_root)
            upper/  work/             the overlay's upper and work directories
            root/                     an empty directory: the layer's mount point, the path a
                                      call in the layer names as its workspace
            lock                      flock'ed by the one pool that has the layer open
        .new-<pid>-<start>-<random>/  a layer being made, renamed into place when whole
        .trash-<pid>-<start>-<random>/  what reset and remove set aside, then delete
                                      (named after the pool's process: another pool sharing
                                      the store removes them only once that process is gone)

Everything here runs on a thread of the coordinator's (asyncio.to_thread), never on its event
loop: an upper directory is what a call left, as large as it liked. It is walked by descriptor,
each name opened O_NOFOLLOW relative to its directory, so a symlink a call made is copied or
removed as a symlink, never followed out of the store; directories a call chmod'ed 000 are
opened up (they are the pool user's own) before they are listed. Whiteouts (0:0 character
devices) and the overlay's ``user.overlay.*`` attributes are copied as they are; file data by
copy_file_range over the data ranges only (SEEK_DATA), so a sparse terabyte stays sparse, and
hard links stay links.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import stat

from sandbx_pool.runtime_dir import owner_is_dead, owner_tag
from sandbx_pool.workers import libc

#: A layer's name: one plain path component, at most 128 characters, not starting with a dot
#: (``.``, ``..`` and the store's own ``.new-``/``.trash-`` entries never collide with one).
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+@=-]{0,127}")
META = "layer.json"
NEW, TRASH = ".new-", ".trash-"
META_VERSION = 1

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def check_name(name: object) -> str:
    """``name`` if it is a plain layer name; ValueError naming it otherwise."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(
            f"a layer name must be a plain name (letters, digits, _ . + @ = -, not starting"
            f" with a dot, at most 128 characters), not {name!r}"
        )
    return name


def read_meta(store: str, name: str) -> dict[str, object] | None:
    """The layer's record, or None when there is no such layer."""
    try:
        with open(os.path.join(store, name, META), "rb") as f:
            meta = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"layer {name!r}: its record {META} is unreadable: {exc}") from exc
    if not isinstance(meta, dict):
        raise ValueError(f"layer {name!r}: its record {META} is not a layer's")
    over_base = isinstance(meta.get("base"), str)
    over_image = meta.get("base") is None and isinstance(meta.get("image"), dict)
    if not (over_base or over_image):
        raise ValueError(f"layer {name!r}: its record {META} is not a layer's")
    return meta


#: The top lower of a layer over an image (workers.image_root): the mount points every call
#: needs, so that none is made in the layer's upper directory (its diff would list it).
SKELETON_DIRS = ("proc", "sys", "dev", "etc")
SKELETON_FILES = ("etc/hosts", "etc/hostname", "etc/resolv.conf")


def _make_skeleton(layer: str) -> None:
    skel = os.path.join(layer, "skel")
    os.mkdir(skel, 0o755)
    for name in SKELETON_DIRS:
        os.mkdir(os.path.join(skel, name), 0o755)
    for name in SKELETON_FILES:
        os.close(os.open(os.path.join(skel, name), os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))
    os.mkdir(os.path.join(layer, "run"), 0o700)


def begin(store: str, name: str, *, mode: int, image: bool = False) -> str:
    """A fresh ``.new-<owner>-<random>`` directory with empty upper, work and root (and, for
    a layer over an image, its skeleton)."""
    temp = os.path.join(store, f"{NEW}{owner_tag()}-{os.urandom(4).hex()}")
    os.mkdir(temp, mode)
    for part, part_mode in (("upper", 0o755), ("work", 0o700), ("root", 0o755)):
        os.mkdir(os.path.join(temp, part), part_mode)
    if image:
        _make_skeleton(temp)
    return temp


def commit(
    store: str, temp: str, name: str, base: str | None, image: dict[str, object] | None = None
) -> None:
    """Record ``base`` (or ``image``) in ``temp`` and rename it to ``name``; FileExistsError
    if a layer of that name appeared meanwhile (``temp`` is then left for the caller to
    discard)."""
    record: dict[str, object] = {"v": META_VERSION, "name": name, "base": base}
    if image is not None:
        record["image"] = image
    path = os.path.join(temp, META)
    with open(path, "w") as f:
        json.dump(record, f)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(store, _DIRECTORY)
    try:
        try:
            libc.renameat2(fd, os.path.basename(temp), name, libc.RENAME_NOREPLACE)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(errno.EEXIST, f"layer {name!r} exists already") from exc
            raise
        os.fsync(fd)
    finally:
        os.close(fd)


def lock(store: str, name: str) -> int:
    """An exclusive flock on the layer, held while this pool has it open; BlockingIOError when
    another pool (this process's or another's) holds it."""
    fd = os.open(os.path.join(store, name, "lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def reset(store: str, name: str) -> None:
    """Empty the layer: fresh upper and work directories, the old ones set aside, then removed."""
    layer = os.path.join(store, name)
    trash = set_aside(store, [os.path.join(layer, "upper"), os.path.join(layer, "work")])
    os.mkdir(os.path.join(layer, "upper"), 0o755)
    os.mkdir(os.path.join(layer, "work"), 0o700)
    remove_tree(trash)


def remove(store: str, name: str) -> None:
    remove_tree(set_aside(store, [os.path.join(store, name)]))


def fork(store: str, source: str, name: str, *, mode: int) -> None:
    """A new layer ``name`` over the same base with a copy of ``source``'s upper directory."""
    meta = read_meta(store, source)
    if meta is None:
        raise ValueError(f"no layer {source!r} in {store}")
    image = meta.get("image") if meta.get("base") is None else None
    temp = begin(store, name, mode=mode, image=image is not None)
    try:
        os.rmdir(os.path.join(temp, "upper"))
        copy_tree(os.path.join(store, source, "upper"), os.path.join(temp, "upper"))
        if isinstance(image, dict):
            commit(store, temp, name, None, image)
        else:
            commit(store, temp, name, str(meta["base"]))
    except BaseException:
        remove_tree(temp)
        raise


def set_aside(store: str, paths: list[str]) -> str:
    """Move ``paths`` (entries of the store) into a new ``.trash-<random>`` of the store."""
    trash = os.path.join(store, f"{TRASH}{owner_tag()}-{os.urandom(6).hex()}")
    os.mkdir(trash, 0o700)
    for index, path in enumerate(paths):
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, os.path.join(trash, str(index)))
    return trash


def remove_leftovers(store: str) -> None:
    """What a killed pool left mid-way: half-made layers, trash not yet deleted (a live
    pool's, sharing the store, are its own)."""
    with contextlib.suppress(FileNotFoundError), os.scandir(store) as entries:
        names = [
            entry.name
            for entry in entries
            if owner_is_dead(entry.name, NEW) or owner_is_dead(entry.name, TRASH)
        ]
    for name in names:
        remove_tree(os.path.join(store, name))


def open_up(upper: str) -> list[tuple[str, int]]:
    """Make every directory of ``upper`` listable and searchable by its owner (the diff's
    worker holds no capability, and a call may have chmod'ed one 000); the modes changed,
    for ``close_down``. Only while no call runs in the layer (its turn is held)."""
    changed: list[tuple[str, int]] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        path = os.path.join(upper, rel) if rel else upper
        st = os.stat(path, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            continue
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o500 != 0o500:
            os.chmod(path, mode | 0o500)
            changed.append((path, mode))
        stack.extend(os.path.join(rel, name) for name in os.listdir(path))
    return changed


def close_down(changed: list[tuple[str, int]]) -> None:
    """Put back the modes ``open_up`` changed, deepest first."""
    for path, mode in reversed(changed):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(path, mode)


# -- walking a tree a call made ------------------------------------------------------------------


def _open_dir(parent: int | None, name: str) -> int:
    """``name`` (in ``parent``) opened as a directory, never through a symlink; a directory
    the call made unreadable is made readable first (the pool's user owns it)."""
    try:
        return os.open(name, _DIRECTORY, dir_fd=parent)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=parent, follow_symlinks=True)  # a directory: lstat'ed
        return os.open(name, _DIRECTORY, dir_fd=parent)


def remove_tree(path: str) -> None:
    """Remove ``path`` and everything under it, by descriptor (see above). Iterative: a call
    can nest directories deeper than Python recurses."""
    parent, name = os.path.split(path)
    try:
        top = os.open(parent, _DIRECTORY)
    except FileNotFoundError:
        return
    try:
        _remove_entry(top, name)
    finally:
        os.close(top)


def _remove_entry(parent: int, name: str) -> None:
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=parent)
        return
    # A stack of (directory fd, its parent fd, its name, names left to remove in it).
    stack: list[tuple[int, int, str, list[str]]] = []
    fd = _open_dir(parent, name)
    os.fchmod(fd, 0o700)
    stack.append((fd, parent, name, os.listdir(fd)))
    while stack:
        fd, up, here, left = stack[-1]
        if not left:
            stack.pop()
            os.close(fd)
            os.rmdir(here, dir_fd=up)
            continue
        child = left.pop()
        st = os.stat(child, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            child_fd = _open_dir(fd, child)
            os.fchmod(child_fd, 0o700)
            stack.append((child_fd, fd, child, os.listdir(child_fd)))
        else:
            os.unlink(child, dir_fd=fd)


def copy_tree(source: str, target: str) -> None:
    """Copy the upper directory ``source`` to ``target`` (which must not exist): see above."""
    src_top = _open_dir(None, source)
    try:
        os.mkdir(target, 0o700)
        dst_top = os.open(target, _DIRECTORY)
        try:
            _copy_dir(src_top, dst_top)
        finally:
            os.close(dst_top)
    finally:
        os.close(src_top)


def _enter(fd: int, st: os.stat_result) -> None:
    """A source directory the call made unlistable or unsearchable, opened up while it is
    copied (its mode is put back after, and copied as it was)."""
    if os.geteuid() != 0 and stat.S_IMODE(st.st_mode) & 0o700 != 0o700:
        os.fchmod(fd, stat.S_IMODE(st.st_mode) | 0o700)


def _copy_dir(src_top: int, dst_top: int) -> None:
    links: dict[tuple[int, int], str] = {}  # (dev, ino) -> its first copy, relative to target
    top_st = os.fstat(src_top)
    _enter(src_top, top_st)
    # A stack of (source dir fd, target dir fd, source stat, names left to copy, path): one
    # descriptor pair a level, closed when the level is done.
    stack: list[tuple[int, int, os.stat_result, list[str], str]] = []
    stack.append((src_top, dst_top, top_st, sorted(os.listdir(src_top)), ""))
    try:
        while stack:
            src, dst, dir_st, left, rel = stack[-1]
            if not left:
                stack.pop()
                _copy_attributes(src, dst, dir_st)
                if stat.S_IMODE(os.fstat(src).st_mode) != stat.S_IMODE(dir_st.st_mode):
                    os.fchmod(src, stat.S_IMODE(dir_st.st_mode))
                if src != src_top:
                    os.close(src)
                    os.close(dst)
                continue
            name = left.pop()
            path = f"{rel}/{name}" if rel else name
            st = os.stat(name, dir_fd=src, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.mkdir(name, 0o700, dir_fd=dst)
                child_src = _open_dir(src, name)
                try:
                    child_dst = os.open(name, _DIRECTORY, dir_fd=dst)
                except BaseException:
                    os.close(child_src)
                    raise
                _enter(child_src, st)
                stack.append((child_src, child_dst, st, os.listdir(child_src), path))
            elif st.st_nlink > 1 and (st.st_dev, st.st_ino) in links:
                first = links[(st.st_dev, st.st_ino)]
                os.link(first, name, src_dir_fd=dst_top, dst_dir_fd=dst, follow_symlinks=False)
            else:
                _copy_entry(src, dst, name, st)
                if st.st_nlink > 1:
                    links[(st.st_dev, st.st_ino)] = path
    finally:
        for src, dst, *_ in stack:
            if src != src_top:
                os.close(src)
                os.close(dst)


def _copy_entry(src: int, dst: int, name: str, st: os.stat_result) -> None:
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(name, dir_fd=src), name, dir_fd=dst)
        _chown(dst, name, st)
        return
    if stat.S_ISREG(st.st_mode):
        fd_in = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd_out = os.open(name, flags, 0o600, dir_fd=dst)
            try:
                _copy_data(fd_in, fd_out, st.st_size)
                _copy_xattrs(fd_in, fd_out)
                if os.geteuid() == 0:
                    os.fchown(fd_out, st.st_uid, st.st_gid)
                os.fchmod(fd_out, mode)
            finally:
                os.close(fd_out)
        finally:
            os.close(fd_in)
        return
    # A whiteout (0:0 character device), a FIFO, a socket, a device the call made: made again
    # as it is (a device needs root, as making it did).
    os.mknod(name, st.st_mode, st.st_rdev, dir_fd=dst)
    _chown(dst, name, st)


def _copy_data(fd_in: int, fd_out: int, size: int) -> None:
    position = 0
    while position < size:
        try:
            data = os.lseek(fd_in, position, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole from here
                break
            raise
        hole = os.lseek(fd_in, data, os.SEEK_HOLE)
        offset = data
        while offset < hole:
            try:
                copied = os.copy_file_range(fd_in, fd_out, hole - offset, offset, offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                chunk = os.pread(fd_in, min(hole - offset, 1 << 20), offset)
                copied = os.pwrite(fd_out, chunk, offset) if chunk else 0
            if copied == 0:
                break
            offset += copied
        position = hole
    os.ftruncate(fd_out, size)


def _copy_xattrs(fd_in: int, fd_out: int) -> None:
    """The overlay's own marks (``user.overlay.*``, ``trusted.overlay.*`` where root)."""
    with contextlib.suppress(OSError):
        for key in os.listxattr(fd_in):
            if key.startswith(("user.", "trusted.")):
                with contextlib.suppress(OSError):
                    os.setxattr(fd_out, key, os.getxattr(fd_in, key))


def _copy_attributes(src: int, dst: int, st: os.stat_result) -> None:
    _copy_xattrs(src, dst)
    if os.geteuid() == 0:
        os.fchown(dst, st.st_uid, st.st_gid)
    os.fchmod(dst, stat.S_IMODE(st.st_mode))


def _chown(dst: int, name: str, st: os.stat_result) -> None:
    if os.geteuid() == 0:
        os.chown(name, st.st_uid, st.st_gid, dir_fd=dst, follow_symlinks=False)


__all__ = [
    "NAME",
    "begin",
    "check_name",
    "close_down",
    "commit",
    "copy_tree",
    "fork",
    "lock",
    "open_up",
    "read_meta",
    "remove",
    "remove_leftovers",
    "remove_tree",
    "reset",
]
