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

The lock serialises the writers of one directory, held from before edit reads the file until
after the rename: parallel edits of one file (each in its own worker) are serialised and none is
lost. It is per directory, not per file, because the rename swaps the file's inode: a lock on
the old inode would not stop the next writer. The price: writes to different files of one
directory wait for each other too (they are short); other directories never wait.

What is locked is an object no call can open, so that no call can hold it: a file named for the
directory's (st_dev, st_ino) in the pool's lock directory (``Sandbox.lock_dir``). bash never
reaches that directory: it is in none of bash's Landlock rules, and covered by an empty mount in
bash's mount namespace where the pool is root. (Before, the lock was a flock on the directory
itself, and a bash call running ``flock DIR sleep 100`` stalled every write there until its
timeout.) The directory is sticky and writable by all (1733, not listable): a call may run as
another user (``user``, ``run_as``), and its worker must still open and make lock files there;
the sticky bit keeps one user from removing another's, and lock files are never removed while
the pool lives (removing a lock file others wait on would split them across two inodes).

Without a lock directory (``lock_dir`` None: the tools run outside a pool, in tests or
recovery's own helper), the directory itself is flocked, as before: correct between writers,
but a process that flocks the directory stalls them. On a machine where bash can reach the lock
directory (neither root for the mount nor Landlock), a call could again stall writes until
their timeout, and no more: holding the lock never lets anyone lose an update.

Functions here raise OSError as it comes; the tools turn it into their error, naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator

from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.paths import open_directory
from sandbx_pool.workers.protocol import ExecutionContext

#: Marks write's temp files: ``.<basename>.sbx-tmp-<random>``.
TEMP_MARKER = ".sbx-tmp-"

#: Longest basename kept in a temp name, so the temp name stays under NAME_MAX (255 bytes).
_MAX_TEMP_STEM = 200


@contextlib.contextmanager
def locked_directory(
    directory: str, display: str, ctx: ExecutionContext | None = None
) -> Iterator[int]:
    """Yield an fd of ``directory`` while holding its exclusive write lock.

    With ``ctx``, ``directory`` is a path ``resolve`` returned, opened one name at a time from
    the workspace (``open_directory``): every later step is relative to the fd, so nothing
    swapped in the path can redirect them; the lock is taken in ``ctx.sandbox.lock_dir``.
    """
    if ctx is None:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    else:
        fd = open_directory(ctx, directory, display)
    try:
        lock_dir = ctx.sandbox.lock_dir if ctx is not None else None
        lock = fd if lock_dir is None else _open_lock_file(lock_dir, fd, display)
        try:
            # Blocks while another worker writes in this directory; a cancel kills us meanwhile,
            # and the kernel drops a killed holder's lock with its fd.
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield fd
        finally:
            if lock != fd:
                os.close(lock)
    finally:
        os.close(fd)


def lock_file_name(directory: os.stat_result) -> str:
    """The name of the lock file of a directory (by identity: a rename keeps its lock)."""
    return f"{directory.st_dev:x}-{directory.st_ino:x}"


def _open_lock_file(lock_dir: str, dir_fd: int, display: str) -> int:
    path = os.path.join(lock_dir, lock_file_name(os.fstat(dir_fd)))
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC  # flock needs no write access
    try:
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            # Made by another writer meanwhile. Not O_CREAT on an existing file, which
            # fs.protected_regular refuses for another user's file in a sticky directory.
            return os.open(path, flags)
        try:
            os.fchmod(fd, 0o644)  # whatever the umask: other users' workers open it too
        except OSError:
            os.close(fd)
            raise
        return fd
    except OSError as exc:
        raise ToolError(
            f"cannot take the write lock for {display}: {exc.strerror or exc}",
            code=errno.errorcode.get(exc.errno or 0),
        ) from exc


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
                # The umask must not narrow an existing file's mode, nor the rename change its
                # owner (_keep_owner).
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
                _keep_owner(fd, old, display)
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


def _keep_owner(fd: int, old: os.stat_result, display: str) -> None:
    """Give the temp ``fd`` the owner and group of the file it replaces, or refuse the write.

    The temp is made by the writer, so it is the writer's; giving it to another uid (or a group
    the writer is not in) takes CAP_CHOWN, which a worker holds only with ``keep_root`` (a root
    pool's file tools are capless, as its commands are: workers.sandbox), and never in a pool
    not run as root. Replacing the file all the same would hand another user's file to the
    writer, silently: refused instead (``EPERM``), before anything changed. bash, which writes
    in place, keeps the owner; nothing can keep it and stay atomic.
    """
    made = os.fstat(fd)
    if (old.st_uid, old.st_gid) == (made.st_uid, made.st_gid):
        return
    try:
        os.fchown(fd, old.st_uid, old.st_gid)
    except PermissionError:
        raise ToolError(
            f"{display}: cannot replace it and keep its owner (uid {old.st_uid}, gid "
            f"{old.st_gid}): the writer (uid {made.st_uid}) may not give a file away",
            code="EPERM",
        ) from None


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


def remove_leftover_temps(directory: str, ctx: ExecutionContext | None = None) -> list[str]:
    """Delete write's temp files left in ``directory`` by killed workers (for recovery).

    Takes the directory's write lock (in ``ctx``'s lock directory, as write does), so a write
    still under way there is never robbed of its temp file. Returns the names removed; a
    missing directory has none.
    """
    if not os.path.isdir(directory):
        return []
    with locked_directory(directory, directory, ctx) as dir_fd:
        return sweep_leftovers(dir_fd)
