"""Paths beneath a directory, reached without following a symlink in any component.

A change set is applied, its pre-images read and an undo written by a worker on the real
workspace (workers.upper_scan), while other calls may run on it: a direct call can swap a
directory of the change set for a symlink (``rm -r d; ln -s ../.git/hooks d``) between the
scan and the write. A path string opened as it is would then follow the link, and a file the
call left at ``d/pre-commit`` would land in ``.git/hooks``, run at the user's next commit. So
nothing here opens a path string from the root: every name is resolved from the root's
descriptor by the kernel, refusing any symlink on the way::

    openat2(root_fd, rel, how={flags, mode, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS})
        Linux 5.6: one system call; a symlink anywhere in ``rel`` (its last name included) is
        ELOOP, a ``..`` that would climb out is EXDEV
    else (ENOSYS: an older kernel, or a seccomp filter that answers so)
        one name at a time from the root's descriptor, each opened O_NOFOLLOW relative to the
        one above (the same walk workers.paths.open_directory does for the file tools)

A parent reached so is a descriptor: what is done to its entry (unlinkat, mkdirat, renameat,
symlinkat, fstatat with AT_SYMLINK_NOFOLLOW) acts on that directory, whatever is renamed or
swapped above it afterwards. ``Swapped`` names the first component that is not a directory
reached that way (a symlink, a file) where a directory must be: the caller's conflict.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from sandbx_pool.workers import libc

#: openat2(2)'s number: the generic table's, the same on every architecture.
_SYS_OPENAT2 = 437
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_PATH = getattr(os, "O_PATH", 0)
#: Every directory on the way: never through a symlink, never waiting on a FIFO swapped in.
_DIRECTORY = os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class _OpenHow(ctypes.Structure):
    _fields_ = (
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    )


#: Whether openat2 answers here; found out by the first call (ENOSYS: the walk from then on).
_openat2_works: bool | None = None


class Swapped(Exception):
    """``path`` (relative to the root) is not a directory reached without a symlink, where the
    change set needs one: it was swapped for a symlink or a file since the scan."""

    def __init__(self, path: str) -> None:
        super().__init__(f"{path} is a symlink or not a directory")
        self.path = path


def _openat2(dir_fd: int, rel: str, flags: int, mode: int) -> int:
    global _openat2_works
    # openat2 is strict where openat is lenient: a mode without O_CREAT, or O_PATH with any
    # flag but O_DIRECTORY, O_NOFOLLOW and O_CLOEXEC, is EINVAL.
    if flags & _PATH:
        flags &= _PATH | os.O_DIRECTORY | os.O_NOFOLLOW
    how = _OpenHow(
        flags | os.O_CLOEXEC,
        mode if flags & os.O_CREAT else 0,
        _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS,
    )
    path = os.fsencode(rel)
    try:
        fd = libc.syscall(
            f"openat2 {rel}",
            _SYS_OPENAT2,
            dir_fd,
            ctypes.c_char_p(path),
            ctypes.byref(how),
            ctypes.sizeof(how),
        )
    except OSError as exc:
        if exc.errno == errno.ENOSYS and _openat2_works is None:
            _openat2_works = False
            return _walk(dir_fd, rel, flags, mode)
        if exc.errno == errno.EXDEV:
            raise OSError(errno.ELOOP, "climbs out of the directory", rel) from None
        raise
    _openat2_works = True
    return fd


def _walk(dir_fd: int, rel: str, flags: int, mode: int) -> int:
    """openat2's answer without it: each directory on the way opened O_NOFOLLOW from the one
    above (ELOOP at a symlink), then the last name O_NOFOLLOW."""
    names = [name for name in rel.split("/") if name not in ("", ".")]
    if ".." in names:
        raise OSError(errno.ELOOP, "climbs out of the directory", rel)
    if not names:
        return os.open(".", flags | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    fd = os.dup(dir_fd)
    try:
        for name in names[:-1]:
            try:
                child = os.open(name, _DIRECTORY | _PATH, dir_fd=fd)
            except NotADirectoryError:
                # O_DIRECTORY's ENOTDIR comes before O_NOFOLLOW's ELOOP: say which, as
                # openat2 does (a symlink on the way is ELOOP, a file ENOTDIR).
                if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), rel) from None
                raise
            os.close(fd)
            fd = child
        return os.open(names[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
    finally:
        os.close(fd)


def open_at(dir_fd: int, rel: str, flags: int, mode: int = 0o600) -> int:
    """``rel`` opened beneath ``dir_fd``, no symlink followed in any name (ELOOP instead)."""
    if _openat2_works is False:
        return _walk(dir_fd, rel, flags, mode)
    return _openat2(dir_fd, rel, flags, mode)


def _parent_and_name(rel: str) -> tuple[str, str]:
    parent, _, name = rel.rpartition("/")
    return parent, name


class Beneath:
    """A directory held by its descriptor; every path given is relative to it, and is reached
    without following a symlink."""

    def __init__(self, root: str) -> None:
        # The root itself is the user's choice (a workspace may be reached through a symlink,
        # and J.d lies where the journal does): opened as it is named, once.
        self.root = root
        self.fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Beneath:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self, rel: str, flags: int, mode: int = 0o600) -> int:
        """``rel`` itself, opened; OSError as it comes (ELOOP: a symlink on the way or at it)."""
        return open_at(self.fd, rel, flags, mode)

    def parent(self, rel: str) -> tuple[int, str]:
        """A descriptor of ``rel``'s directory (O_PATH: good as ``dir_fd``; the caller closes
        it) and ``rel``'s last name. Swapped when a directory on the way is a symlink or not a
        directory; FileNotFoundError when one is missing."""
        parent, name = _parent_and_name(rel)
        return self.directory(parent, path_only=True), name

    def directory(self, rel: str, *, path_only: bool = False) -> int:
        """A descriptor of the directory ``rel`` ("" is the root); Swapped as ``parent``."""
        flags = _DIRECTORY | (_PATH if path_only else os.O_RDONLY)
        try:
            return self.open(rel or ".", flags)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise Swapped(self._first_not_directory(rel)) from None
            raise

    def _first_not_directory(self, rel: str) -> str:
        """The shallowest component of ``rel`` that is not a directory (what to name)."""
        names = rel.split("/")
        for depth in range(1, len(names) + 1):
            prefix = "/".join(names[:depth])
            st = self.lstat(prefix)
            if st is None or not stat.S_ISDIR(st.st_mode):
                return prefix
        return rel

    def lstat(self, rel: str) -> os.stat_result | None:
        """``rel``'s own stat, or None when nothing is there to reach: missing, or below a
        name that is not a directory reached without a symlink (a symlink's target is never
        looked at: ``lnk/x``, with ``lnk -> /etc``, is not there)."""
        parent, name = _parent_and_name(rel)
        try:
            fd = self.open(parent or ".", _DIRECTORY | _PATH)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                return None
            raise
        try:
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(fd)

    def readlink(self, rel: str) -> str:
        fd, name = self.parent(rel)
        try:
            return os.readlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def listdir(self, rel: str) -> list[str]:
        """The names in directory ``rel``, sorted; Swapped as ``parent``."""
        fd = self.directory(rel)
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    def getxattr(self, rel: str, attribute: str) -> bytes | None:
        try:
            fd = self.open(rel, _DIRECTORY | os.O_RDONLY)
        except OSError:
            return None
        try:
            return os.getxattr(fd, attribute)
        except OSError:
            return None
        finally:
            os.close(fd)

    def read_file(self, rel: str) -> int:
        """A descriptor to read the regular file ``rel`` (never a FIFO's wait, never a link)."""
        fd = self.open(rel, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", rel)
        os.set_blocking(fd, True)
        return fd


__all__ = ["Beneath", "Swapped", "open_at"]
