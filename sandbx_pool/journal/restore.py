"""Putting a journal removed or replaced under the pool back at its path, whole.

The writer thread still holds the journal's file open when its path loses it (``rm``, ``mv``,
another file renamed over it). That descriptor has every record written so far, so nothing
forces the path to hold less::

    held fd (our whole history) --copy--> .NAME.sbx-keep-RANDOM   (beside the path, O_EXCL)
                                          fsync
    empty NAME:    renameat2(RENAME_NOREPLACE)  temp -> NAME
    occupied NAME: renameat2(RENAME_EXCHANGE)   temp <-> NAME, then
                   renameat2(RENAME_NOREPLACE)  temp -> NAME.replaced-TIME   (what was there)
    the caller:    fsync the directory, write on in the copy

At every moment the name holds either what someone else put there or our complete copy, never
a part of it. Nothing already at the name is replaced outright, read, or followed (a rename
moves a symlink or a directory itself): it is not ours to destroy or to merge into our history
(an editor's save, another run's journal), so it keeps a name of its own. Everything goes
through a descriptor of the journal's directory, opened with the journal, so no name on the
way there is resolved again. A filesystem without renameat2's flags (NFS) answers EINVAL: the
journal is then not put back, and the writer fails its batches as on a full disk.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import time
from typing import Final

from sandbx_pool.logs import logger
from sandbx_pool.workers import libc

#: How often placing the copy retries when the name keeps changing meanwhile (emptied between
#: the two renames, or filled), and how many ``.replaced-`` names it tries.
PLACE_TRIES: Final = 5

#: Bytes copied a time: one read and one write each.
COPY_CHUNK: Final = 1 << 20


def directory_in_place(dir_fd: int, directory: str) -> bool:
    """Whether ``directory`` still names the directory ``dir_fd`` holds, and it exists: one
    removed (link count 0), moved or replaced is not re-made nor followed."""
    held = os.fstat(dir_fd)
    try:
        named = os.stat(directory)
    except FileNotFoundError:
        return False
    return held.st_nlink > 0 and (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def put_back(dir_fd: int, name: str, source: int, size: int, mode: int) -> tuple[int, str | None]:
    """Copy the first ``size`` bytes of ``source`` to ``name`` in ``dir_fd``, as above.

    Returns the copy's descriptor (read-write, O_APPEND; the directory not yet fsynced) and the
    name that what had taken ``name`` now has, if anything had. Raises OSError with nothing
    changed at ``name`` and no temp file left.
    """
    temp = f".{name}.sbx-keep-{secrets.token_hex(6)}"
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(temp, flags, mode, dir_fd=dir_fd)
    try:
        _copy(source, fd, size)
        os.fsync(fd)
        aside = _place(dir_fd, temp, name)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    return fd, aside


def _copy(source: int, target: int, size: int) -> None:
    offset = 0
    while offset < size:
        chunk = os.pread(source, min(COPY_CHUNK, size - offset), offset)
        if not chunk:
            raise OSError(errno.EIO, f"journal shorter than {size} bytes while copied")
        view = memoryview(chunk)
        while view:
            written = os.write(target, view)
            if written <= 0:
                raise OSError(errno.EIO, f"write() wrote {written} bytes")
            view = view[written:]
        offset += len(chunk)


def _place(dir_fd: int, temp: str, name: str) -> str | None:
    for _ in range(PLACE_TRIES):
        try:
            libc.renameat2(dir_fd, temp, name, libc.RENAME_NOREPLACE)
            return None
        except FileExistsError:
            pass
        try:
            libc.renameat2(dir_fd, temp, name, libc.RENAME_EXCHANGE)
        except FileNotFoundError:  # emptied since: take it as empty
            continue
        # Ours is in place: from here on nothing may fail the put-back, or the caller would
        # remove the temp name, which now holds what was there.
        return _keep_aside(dir_fd, temp, name)
    raise OSError(errno.EAGAIN, f"{name} kept changing while being put back")


def _keep_aside(dir_fd: int, temp: str, name: str) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for attempt in range(PLACE_TRIES):
        aside = f"{name}.replaced-{stamp}" + (f"-{attempt}" if attempt else "")
        try:
            libc.renameat2(dir_fd, temp, aside, libc.RENAME_NOREPLACE)
        except FileExistsError:
            continue
        except OSError as exc:
            logger.warning("journal {}: cannot rename what replaced it ({}): {}", name, temp, exc)
            break
        return aside
    return temp
