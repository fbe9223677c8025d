"""The journal's writer thread: group commit of JSON Lines records to an O_APPEND file.

Data flow::

    event loop (Journal)                       writer thread ("sandbx-journal-...")
    --------------------                       ------------------------------------
    submit(make, sync, waiter) --> SimpleQueue --> take every queued entry (up to MAX_BATCH)
                                   of Entry        build + encode the records (summaries, sha256)
                                                   one write() to the O_APPEND fd
                                                   one fdatasync() if an entry asks for it, or
                                                     group_commit_ms after the oldest un-synced
                                                     record was queued
          future resolved <-- loop.call_soon_threadsafe <-- every waiter of the batch

The event loop only puts a closure on a queue; summarising, hashing, encoding and the disk all
happen here, so the loop never waits on I/O. Every record of a batch shares one fsync: that is
why a side-effecting call's intent costs one fsync however many calls are in flight.

Records are written as soon as the thread takes them, even when their fsync is deferred: a
coordinator killed outright still leaves them in the page cache, so only a machine crash can
lose records the policy did not ask to make durable.

A waiter is released once its record is as durable as the policy makes anything: after the
fsync that covers it (right away when its entry asks for ``sync``, else at the group commit),
or once written under OFF.

Failures are per batch, not for good. A batch whose write or fsync fails releases its waiters
with ``JournalWriteError`` (the path and the errno): their intents are not durable, so the pool
does not run those calls. A partial write is cut back off the file, so the next record never
lands glued to half a line, and the records it did not write go first in the next batch. The
next batch tries again from scratch: once the disk has room again, the journal works again
without being reopened, and no outcome is lost to the outage. Room for the next few thousand
records is kept allocated past the file's end (RESERVE_BYTES), so the outage starts only once
that is used up: one call that fills the disk does not stop the batch's side effects with it.

Before each batch that holds a side effect's intent or a flush, and at least every
CHECK_INTERVAL_S otherwise, the writer also checks that the path still names the file it holds
open (device, inode, link count) and that nobody cut the file shorter. A journal removed or replaced
under the pool is put back whole (``restore``): the file the writer still holds is copied
beside the path and renamed onto it in one step, so the path never holds a shorter history
than ours, and whatever had replaced it is moved aside, never read, followed or merged. Its
lock file is checked (re-created and re-locked if it went) first. Where that cannot be done
safely (the directory gone or moved, the lock held by another coordinator, a filesystem
without renameat2's flags), batches fail, as on a full disk, and are tried afresh.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import errno
import fcntl
import os
import queue
import stat
import threading
import time
from collections.abc import Callable
from typing import Final

import msgspec

from sandbx_pool.config import JournalPolicy, JournalSettings
from sandbx_pool.errors import JournalError
from sandbx_pool.journal import restore
from sandbx_pool.journal.records import (
    ApplyingRecord,
    IntentRecord,
    JournalRecord,
    OutcomeRecord,
    StartedRecord,
    clip,
    encoder,
)
from sandbx_pool.logs import logger
from sandbx_pool.workers import libc

#: Most entries the writer takes into one batch. Bounds how long the first waiter of a burst
#: waits for its fsync while the thread encodes the rest.
MAX_BATCH: Final = 4096

#: Most bytes of records kept for the next batch while writes fail (a full disk): past it, a
#: long outage drops them (logged) rather than growing the coordinator without bound.
MAX_UNWRITTEN_BYTES: Final = 64 * 1024 * 1024

#: Disk space kept allocated past the journal's end (fallocate, KEEP_SIZE: the file does not
#: grow): when a call fills the disk the journal is on (a workspace on the same filesystem is
#: the common case), records still land in it, about 8,000 calls' worth, instead of every
#: later side effect being refused at once. Topped up once half is used, released at close;
#: where the disk has no room for it even at open, a full disk refuses side effects at once.
RESERVE_BYTES: Final = 8 * 1024 * 1024

#: Longest a batch nobody waits on goes without checking that the journal is still at its path
#: (records written meanwhile to a file removed from it, those of read-only calls and outcomes,
#: are copied back with the rest; intents of side effects are always checked before they are
#: written).
CHECK_INTERVAL_S: Final = 0.1

#: How long the exit hook waits for the writer of a journal nobody closed. Long enough for a
#: final fsync on a slow disk, short enough that a hung disk cannot hold the interpreter hostage.
EXIT_FLUSH_TIMEOUT_S: Final = 5.0

RecordMaker = Callable[[], JournalRecord]
Waiter = tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]


class Entry:
    """One item for the writer thread: a record to build, and who waits for it."""

    __slots__ = ("make", "queued_at", "stop", "sync", "waiter")

    def __init__(
        self, make: RecordMaker | None, *, sync: bool, waiter: Waiter | None, stop: bool
    ) -> None:
        self.make = make
        self.sync = sync
        self.waiter = waiter
        self.stop = stop
        self.queued_at = time.monotonic()


class JournalWriteError(JournalError):
    """A batch of records could not be made durable. ``errno`` is the OSError's, if any."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno_


class JournalWriter:
    """Owns the journal's file descriptors and the thread that writes to them.

    It closes the journal and then the lock file when it stops, so the lock is released only
    after the last record is on disk.
    """

    def __init__(
        self, path: str, settings: JournalSettings, *, fd: int, lock_fd: int, dir_fd: int
    ) -> None:
        self.path = path
        self._name = os.path.basename(path)
        self._delay = settings.group_commit_ms / 1000.0
        self._fsync = settings.policy is not JournalPolicy.OFF
        self._fd = fd
        self._lock_fd = lock_fd
        # The directory the journal was opened in: where it is put back if removed, through
        # this descriptor, so that no name on the way there is resolved again.
        self._dir_fd = dir_fd
        # Bytes of the file known to be whole records: where a failed write is cut back to,
        # and what a shorter file (truncated under us) is measured against.
        self._size = os.fstat(fd).st_size
        # Where the blocks fallocate() keeps for us past the end stop (0: none kept).
        self._reserved_to = 0
        self._checked_at = time.monotonic()
        # The intent and started lines of calls without an outcome yet: written again after a
        # cut, so that each outcome follows its call's intent. Only this thread touches it.
        self._open_lines: dict[str, list[bytes]] = {}
        self._unwritten = bytearray()  # records a failed write left, for the next batch
        #: The latest batch's failure; None again once a batch succeeds.
        self.failure: JournalWriteError | None = None
        self.finished = False  # the thread drained the queue for the last time
        self._stopping = False
        # Orders submit() against the thread's last drain: nothing may be queued after it that
        # nobody would ever resolve.
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Entry] = queue.SimpleQueue()
        # Daemon, so that a journal nobody closed cannot hang interpreter exit; the exit hook
        # still writes what was queued.
        self._thread = threading.Thread(
            target=self._run, name=f"sandbx-journal-{os.path.basename(path)}", daemon=True
        )
        self._thread.start()
        atexit.register(self.stop_at_exit)

    # -- the event loop's side -----------------------------------------------------------------

    def submit(
        self,
        make: RecordMaker | None,
        *,
        sync: bool,
        waiter: Waiter | None = None,
        stop: bool = False,
    ) -> None:
        """Queue a record (or a barrier when ``make`` is None). ``sync``: fsync it promptly.

        The waiter, if any, is released once the record is durable, or with the error that
        kept it from being so. Once the thread is gone, waiters are resolved at once.
        """
        with self._lock:
            if stop:
                atexit.unregister(self.stop_at_exit)
            if self.finished:
                if waiter is not None:
                    settle(waiter, None if stop else self.closed_error())
                return
            self._queue.put(Entry(make, sync=sync, waiter=waiter, stop=stop))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop_at_exit(self) -> None:
        if self._thread.is_alive():
            self._queue.put(Entry(None, sync=True, waiter=None, stop=True))
            self._thread.join(EXIT_FLUSH_TIMEOUT_S)

    def closed_error(self) -> JournalError:
        return JournalError(f"journal {self.path} is closed")

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        unsynced_since: float | None = None  # when the oldest written, un-synced record was queued
        stop_waiters: list[Waiter] = []
        waiting: list[Waiter] = []  # released at the next fsync (or the next failure)
        try:
            self._reserve()
            while not self._stopping:
                deadline = None if unsynced_since is None else unsynced_since + self._delay
                entries = self._take(deadline)
                error: JournalWriteError | None = None
                try:
                    # Before encoding: after a cut, the calls in flight *before* this batch are
                    # written again, then this batch's records.
                    if self._check_due(entries):
                        self._check_file()
                except JournalWriteError as exc:
                    error = exc
                # What a failed write left unwritten goes first, in order: an outcome lost to a
                # full disk would leave its call in doubt for good.
                buffer, self._unwritten = self._unwritten, bytearray()
                written = False
                must_sync = False
                for entry in entries:
                    if entry.make is not None:
                        self._encode(entry.make, buffer)
                        if unsynced_since is None:
                            unsynced_since = entry.queued_at
                    must_sync = must_sync or entry.sync
                    if entry.stop:
                        self._stopping = True
                    if entry.waiter is not None:
                        # Stop waiters are released only once the files are closed (_finish).
                        (stop_waiters if entry.stop else waiting).append(entry.waiter)
                try:
                    if error is not None:
                        raise error
                    if buffer:
                        self._append(buffer)
                    written = True
                    if not self._fsync:
                        unsynced_since = None
                    elif unsynced_since is not None and (
                        must_sync
                        or self._stopping
                        or time.monotonic() - unsynced_since >= self._delay
                    ):
                        # fdatasync suffices: an append's new size is data it flushes. Never
                        # retried: see _failed.
                        self._sync("fdatasync", os.fdatasync, self._fd)
                        unsynced_since = None
                except JournalWriteError as exc:
                    error = exc
                    unsynced_since = None  # those records are lost or unknown: not waited on
                    if not written:
                        self._keep_unwritten(buffer)
                    self._failed(exc)
                else:
                    if buffer and self.failure is not None:
                        self._recovered()
                    self._reserve()
                if error is not None or unsynced_since is None:
                    for waiter in waiting:
                        settle(waiter, error)
                    waiting = []
        except BaseException as exc:
            # A bug here must surface, not leave every later intent() waiting forever.
            self._failed(JournalWriteError(f"journal {self.path}: writer failed: {exc!r}"))
            for waiter in waiting:
                settle(waiter, self.failure)
            raise
        finally:
            self._finish(stop_waiters)

    def _take(self, deadline: float | None) -> list[Entry]:
        try:
            if deadline is None:
                first = self._queue.get()
            else:
                first = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return []
        batch = [first]
        while len(batch) < MAX_BATCH:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def _encode(self, make: RecordMaker, buffer: bytearray) -> None:
        start = len(buffer)
        record = make()
        try:
            encoder.encode_into(record, buffer, -1)
        except (TypeError, ValueError, OverflowError, RecursionError) as exc:
            # Arguments or a value JSON cannot hold (a file name that is not UTF-8): keep the
            # record and say why its payload is missing, rather than lose the call.
            del buffer[start:]
            logger.warning("journal {}: {} record degraded: {}", self.path, record.call_id, exc)
            record = _degraded(record, exc)
            encoder.encode_into(record, buffer, -1)
        buffer.extend(b"\n")
        if isinstance(record, IntentRecord):
            self._open_lines[record.call_id] = [bytes(buffer[start:])]
        elif isinstance(record, StartedRecord | ApplyingRecord):
            if (lines := self._open_lines.get(record.call_id)) is not None:
                lines.append(bytes(buffer[start:]))
        elif isinstance(record, OutcomeRecord):
            self._open_lines.pop(record.call_id, None)

    # -- the file ------------------------------------------------------------------------------

    def _append(self, data: bytes | bytearray) -> None:
        view = memoryview(data)
        try:
            while view:
                written = os.write(self._fd, view)
                if written <= 0:
                    raise OSError(f"write() wrote {written} bytes")
                view = view[written:]
        except OSError as exc:
            # A write that stopped halfway (ENOSPC) leaves half a line: cut it off, so the next
            # record starts on a line of its own. If even that fails, the file is checked again
            # (and cut) before the next write.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._size)
            raise self._error("write", exc) from exc
        self._size += len(data)

    def _reserve(self) -> None:
        """Keep RESERVE_BYTES allocated past the end, topped up once half of it is used."""
        if self._size + RESERVE_BYTES // 2 < self._reserved_to:
            return
        mode = libc.FALLOC_FL_KEEP_SIZE
        code = libc.try_fallocate(self._fd, mode, self._size, RESERVE_BYTES)
        if code == 0:
            self._reserved_to = self._size + RESERVE_BYTES
        elif self._reserved_to == 0 and code not in (errno.EOPNOTSUPP, errno.ENOSYS):
            # Once per journal, not per batch: a disk too full for it already will be retried
            # quietly at every batch.
            self._reserved_to = -1
            logger.warning(
                "journal {}: no room kept past its end ({}): a full disk refuses side effects"
                " at once",
                self.path,
                os.strerror(code),
            )

    def _release_reserve(self) -> None:
        # Truncating to the current size frees the blocks kept past it (ext4, xfs, tmpfs);
        # hole punching past the end does not on ext4.
        if self._reserved_to != 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, os.fstat(self._fd).st_size)

    def _sync(self, what: str, sync: Callable[[int], None], fd: int) -> None:
        try:
            sync(fd)
        except OSError as exc:
            raise self._error(what, exc) from exc

    def _check_due(self, entries: list[Entry]) -> bool:
        # Always before a record someone waits on (a side effect's intent, a flush): that is
        # the contract. Otherwise at most every CHECK_INTERVAL_S: four stat calls per batch
        # cost read-only bursts (many small batches) about a quarter of their speed.
        if any(entry.sync or entry.waiter is not None for entry in entries):
            return True
        now = time.monotonic()
        if now - self._checked_at < CHECK_INTERVAL_S or not entries:
            return False
        self._checked_at = now
        return True

    def _check_file(self) -> None:
        """Make sure the records about to be written land in the journal at ``path``."""
        try:
            held = os.fstat(self._fd)
            try:
                named: os.stat_result | None = os.stat(self.path)
            except FileNotFoundError:
                named = None
        except OSError as exc:
            raise self._error("stat", exc) from exc
        if named is None or held.st_nlink == 0 or not _same_file(named, held):
            self._put_back("removed" if named is None else "replaced", held)
            return
        self._check_lock()
        if held.st_size > self._size:
            # The tail of a write that failed, whose cut failed too: only we write here.
            try:
                os.ftruncate(self._fd, self._size)
            except OSError as exc:
                raise self._error("cut a torn write", exc) from exc
        elif held.st_size < self._size:  # cut shorter under us: records may be gone
            self._resume_at(held.st_size, "was truncated")

    def _check_lock(self) -> None:
        lock_name = self._name + ".lock"
        try:
            held = os.fstat(self._lock_fd)
            named = os.stat(self.path + ".lock")
            if held.st_nlink and _same_file(named, held):
                return
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise self._error("stat", exc) from exc
        # Without its lock file, a second coordinator could take the journal: take it again.
        # Not through a symlink: the lock is truncated once taken.
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(lock_name, flags, 0o600, dir_fd=self._dir_fd)
        except OSError as exc:
            raise self._error("re-create lock", exc) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            raise JournalWriteError(
                f"journal {self.path}: its lock file was replaced and another coordinator"
                f" holds the new one: {_describe(exc)}",
                exc.errno,
            ) from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)
            raise self._error("re-create lock", exc) from exc
        os.close(self._lock_fd)
        self._lock_fd = fd
        logger.warning("journal {}: its lock file was removed; re-created and locked", self.path)

    def _put_back(self, how: str, held: os.stat_result) -> None:
        """The journal was removed or replaced: put our whole history back at the path (see
        ``restore``), then write on in that copy."""
        directory = os.path.dirname(self.path)
        try:
            in_place = restore.directory_in_place(self._dir_fd, directory)
        except OSError as exc:
            raise self._error("stat directory", exc) from exc
        if not in_place:
            raise JournalWriteError(
                f"journal {self.path}: its directory was removed or moved under the pool;"
                " not put back",
                errno.ENOENT,
            )
        self._check_lock()  # before the path changes: no second coordinator may get in
        # Only whole records: not the tail of a torn write nobody cut yet.
        size = min(held.st_size, self._size)
        mode = stat.S_IMODE(held.st_mode)
        try:
            fd, aside = restore.put_back(self._dir_fd, self._name, self._fd, size, mode)
        except OSError as exc:
            raise self._error(f"put back (it was {how})", exc) from exc
        # The blocks kept past the end of the file we leave: it may live on where it was moved.
        self._release_reserve()
        old, self._fd = self._fd, fd
        with contextlib.suppress(OSError):
            os.close(old)
        self._reserved_to = 0  # the copy's is made after the next batch
        # The renames must be durable too, or a crash could bring back what had replaced it.
        self._sync("fsync directory", os.fsync, self._dir_fd)
        logger.warning(
            "journal {} was {} under the pool: put back at its path, whole ({} bytes, copied"
            " from the file the pool held){}",
            self.path,
            how if aside is None else "replaced",  # a dangling symlink reads as removed
            size,
            "" if aside is None else f"; what had replaced it is kept as {directory}/{aside}",
        )
        if size < self._size:  # cut shorter before it went
            self._resume_at(size, "was truncated")

    def _resume_at(self, size: int, note: str) -> None:
        """Carry on at the end of a file cut shorter than we wrote it: end its last line, then
        repeat the records of the calls in flight, so that their outcomes follow an intent."""
        logger.error(
            "journal {} {} under the pool ({} bytes, expected {})",
            self.path,
            note,
            size,
            self._size,
        )
        self._size = size
        prefix = b""
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            prefix = b"\n"
        self._append(prefix + b"".join(b"".join(lines) for lines in self._open_lines.values()))

    def _error(self, what: str, exc: OSError) -> JournalWriteError:
        return JournalWriteError(f"journal {self.path}: {what} failed: {_describe(exc)}", exc.errno)

    def _failed(self, exc: JournalWriteError) -> None:
        # Never retry a failed fsync: the kernel may have dropped the dirty pages already and a
        # second fsync would report success for records that are gone. The records of that
        # batch count as not durable (their calls were refused); what recovers is the *next*
        # batch, written and fsynced afresh.
        with self._lock:
            first = self.failure is None
            self.failure = exc
        if first:
            logger.error(
                "journal {}: records not durable, side effects refused: {}", self.path, exc
            )

    def _keep_unwritten(self, records: bytearray) -> None:
        # Records never written (the write failed and was cut back, or the file check failed
        # first) are tried again with the next batch. Their waiters were released with the
        # error all the same: a side effect whose intent was late is refused, and its intent
        # then lands followed by that refusal. Records that were written but whose fsync failed
        # are not kept: they may be in the file already (see _failed).
        if len(records) > MAX_UNWRITTEN_BYTES:
            logger.error(
                "journal {}: {} bytes of records could not be written and are dropped",
                self.path,
                len(records),
            )
            return
        # A copy: the failed write's memoryview (kept alive by its traceback) pins the original.
        self._unwritten = bytearray(records)

    def _recovered(self) -> None:
        with self._lock:
            self.failure = None
        logger.warning("journal {}: writing again", self.path)

    def _finish(self, stop_waiters: list[Waiter]) -> None:
        with self._lock:
            self.finished = True
            leftovers: list[Entry] = []
            while True:
                try:
                    leftovers.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        self._release_reserve()
        # The journal first, then the lock that guards it.
        for fd in (self._fd, self._lock_fd, self._dir_fd):
            try:
                os.close(fd)
            except OSError as exc:
                logger.warning("journal {}: close failed: {}", self.path, exc)
        for entry in leftovers:
            if entry.waiter is not None:
                settle(entry.waiter, None if entry.stop else self.closed_error())
        for waiter in stop_waiters:
            settle(waiter, None)


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _describe(exc: OSError) -> str:
    """``ENOSPC (No space left on device)``: the errno by name, for messages people grep."""
    if exc.errno is None:
        return str(exc)
    name = errno.errorcode.get(exc.errno, f"errno {exc.errno}")
    return f"{name} ({exc.strerror or os.strerror(exc.errno)})"


def settle(waiter: Waiter, error: JournalError | None) -> None:
    """Resolve a waiter's future on its own loop, from any thread."""
    loop, future = waiter
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(_resolve, future, error)


def _resolve(future: asyncio.Future[None], error: JournalError | None) -> None:
    if future.done():  # the waiting task was cancelled
        return
    if error is None:
        future.set_result(None)
    elif isinstance(error, JournalWriteError):
        future.set_exception(JournalWriteError(str(error), error.errno))
    else:
        future.set_exception(JournalError(str(error)))


def _degraded(record: JournalRecord, exc: Exception) -> JournalRecord:
    note = {"unencodable": clip(str(exc), 200)}
    if isinstance(record, IntentRecord):
        return msgspec.structs.replace(record, args=note)
    if isinstance(record, OutcomeRecord):
        return msgspec.structs.replace(record, value_summary=note, changes=None)
    raise exc
