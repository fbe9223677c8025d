"""Replacing a file atomically, under a directory lock, and the temp files a kill leaves.

write and edit never change a file in place. The new content goes to a temp file in the
target's directory, which is fsynced and renamed over the target, then the directory is
fsynced. A kill at any moment leaves the old content or the new one, never part of it.

It may leave the temp, ``.<name>.sbx-tmp-<random>``. Temps are made and renamed only while
their writer holds the directory's lock, so any temp seen by someone holding that lock belongs
to a dead writer. Every write and edit deletes those first (``sweep_leftovers``): a directory
holds at most one leftover, until its next write or edit. Recovery calls
``remove_leftover_temps`` on the directories of the write and edit calls a crashed coordinator
left in doubt. A file of the user's named like a temp (``.x.sbx-tmp-y``) would be deleted too.

The lock is an exclusive flock on the target's directory, held from before edit reads the file
until after the rename: parallel edits of one file (each in its own worker) are serialised and
none is lost. It is on the directory, not the file, because the rename swaps the file's inode:
a lock on the old inode would not stop the next writer. The price: writes to different files of
one directory wait for each other too (they are short); other directories never wait.

Functions here raise OSError as it comes; the tools turn it into their error, naming the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator

from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.paths import check_opened
from sandbx_pool.workers.protocol import ExecutionContext

#: Marks write's temp files: ``.<basename>.sbx-tmp-<random>``.
TEMP_MARKER = ".sbx-tmp-"

#: Longest basename kept in a temp name, so the temp name stays under NAME_MAX (255 bytes).
_MAX_TEMP_STEM = 200


@contextlib.contextmanager
def locked_directory(
    directory: str, display: str, ctx: ExecutionContext | None = None
) -> Iterator[int]:
    """Yield an fd of ``directory`` holding its exclusive flock.

    With ``ctx``, the directory actually opened must be inside the workspace (``check_opened``):
    every later step is relative to the fd, so nothing swapped in the path can redirect them.
    """
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if ctx is not None:
            check_opened(ctx, fd, display)
        # Blocks while another worker writes in this directory; a cancel kills us meanwhile,
        # and the kernel drops a killed holder's lock with its fd.
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def replace_in(dir_fd: int, name: str, data: bytes, display: str) -> bool:
    """Atomically make ``name`` (in the locked directory ``dir_fd``) hold ``data``.

    Returns True when the file did not exist before. Every step is relative to ``dir_fd``, so a
    directory renamed or swapped for a symlink meanwhile cannot redirect the write.
    """
    try:
        old: os.stat_result | None = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        old = None
    if old is not None and stat.S_ISDIR(old.st_mode):
        raise ToolError(f"{display} is a directory", code="EISDIR")
    if old is not None and not stat.S_ISREG(old.st_mode):
        raise ToolError(f"{display} is not a regular file")
    if old is not None and not os.access(name, os.W_OK, dir_fd=dir_fd):
        # Replacing needs only the directory's permission; refuse as open() for writing
        # would, so that a file its writer may not write stays as it is.
        raise ToolError(f"{display}: permission denied", code="EACCES")

    stem = os.fsdecode(os.fsencode(name)[:_MAX_TEMP_STEM])
    temp = f".{stem}{TEMP_MARKER}{os.urandom(4).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    # 0o666 minus the umask for a new file, as open() would do.
    fd = os.open(temp, flags, 0o666, dir_fd=dir_fd)
    try:
        try:
            if old is not None:
                # The umask must not narrow an existing file's mode; keep its owner if we may.
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
                if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                    with contextlib.suppress(PermissionError):
                        os.fchown(fd, old.st_uid, old.st_gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            # Durable before it becomes visible: a crash after the rename never shows a
            # half-written file.
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        # The rename itself is durable only once the directory is.
        os.fsync(dir_fd)
    except BaseException:
        _discard(dir_fd, temp)
        raise
    return old is None


def _discard(dir_fd: int, name: str) -> None:
    # After a successful rename the temp name is gone already; that is fine too.
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def _is_temp_name(name: str) -> bool:
    # The glob ``.*.sbx-tmp-*`` without fnmatch, which would cost a microsecond per entry.
    return name.startswith(".") and name.find(TEMP_MARKER, 1) != -1


def sweep_leftovers(dir_fd: int) -> list[str]:
    """Delete the temp files (``.*.sbx-tmp-*``) in the directory ``dir_fd``, whose lock we hold.

    While we hold the lock no temp is in use: each one found belongs to a worker killed
    mid-write. Returns the names removed.
    """
    removed: list[str] = []
    with os.scandir(dir_fd) as it:
        for entry in it:
            if _is_temp_name(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=dir_fd)
                    removed.append(entry.name)
    return sorted(removed)


def remove_leftover_temps(directory: str) -> list[str]:
    """Delete write's temp files left in ``directory`` by killed workers (for recovery).

    Takes the directory's write lock, so a write still under way there is never robbed of its
    temp file. Returns the names removed; a missing directory has none.
    """
    if not os.path.isdir(directory):
        return []
    with locked_directory(directory, directory) as dir_fd:
        return sweep_leftovers(dir_fd)
