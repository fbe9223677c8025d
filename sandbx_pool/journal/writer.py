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
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Final

import msgspec

from sandbx_pool.config import JournalPolicy, JournalSettings
from sandbx_pool.errors import JournalError
from sandbx_pool.journal.records import IntentRecord, JournalRecord, OutcomeRecord, clip, encoder
from sandbx_pool.logs import logger

#: Most entries the writer takes into one batch. Bounds how long the first waiter of a burst
#: waits for its fsync while the thread encodes the rest.
MAX_BATCH: Final = 4096

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


class JournalWriter:
    """Owns the journal's file descriptors and the thread that writes to them.

    It closes the journal and then the lock file when it stops, so the lock is released only
    after the last record is on disk.
    """

    def __init__(self, path: str, settings: JournalSettings, *, fd: int, lock_fd: int) -> None:
        self.path = path
        self._delay = settings.group_commit_ms / 1000.0
        self._fsync = settings.policy is not JournalPolicy.OFF
        self._fd = fd
        self._lock_fd = lock_fd
        self.failure: JournalError | None = None
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

        After a failure, records nobody waits for are dropped (the failure was logged and is
        raised to whoever waits); once the thread is gone, waiters are resolved at once.
        """
        with self._lock:
            if stop:
                atexit.unregister(self.stop_at_exit)
            if self.finished:
                if waiter is not None:
                    settle(waiter, None if stop else self.closed_error())
                return
            if self.failure is not None and waiter is None and not stop:
                return
            self._queue.put(Entry(make, sync=sync, waiter=waiter, stop=stop))

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def stop_at_exit(self) -> None:
        if self._thread.is_alive():
            self._queue.put(Entry(None, sync=True, waiter=None, stop=True))
            self._thread.join(EXIT_FLUSH_TIMEOUT_S)

    def closed_error(self) -> JournalError:
        return self.failure or JournalError(f"journal {self.path} is closed")

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        unsynced_since: float | None = None  # when the oldest written, un-synced record was queued
        stop_waiters: list[Waiter] = []
        try:
            while not self._stopping:
                deadline = None if unsynced_since is None else unsynced_since + self._delay
                buffer = bytearray()
                must_sync = False
                waiters: list[Waiter] = []
                for entry in self._take(deadline):
                    if entry.make is not None and self.failure is None:
                        self._encode(entry.make, buffer)
                        if unsynced_since is None:
                            unsynced_since = entry.queued_at
                    must_sync = must_sync or entry.sync
                    if entry.stop:
                        self._stopping = True
                    if entry.waiter is not None:
                        # Stop waiters are released only once the files are closed (_finish).
                        (stop_waiters if entry.stop else waiters).append(entry.waiter)
                if self.failure is None:
                    try:
                        if buffer:
                            self._write_all(buffer)
                        if not self._fsync:
                            unsynced_since = None
                        elif unsynced_since is not None and (
                            must_sync or time.monotonic() - unsynced_since >= self._delay
                        ):
                            # fdatasync suffices: an append's new size is data it flushes.
                            os.fdatasync(self._fd)
                            unsynced_since = None
                    except OSError as exc:
                        self._fail(exc)
                for waiter in waiters:
                    settle(waiter, self.failure)
        except BaseException as exc:
            # A bug here must surface, not leave every later intent() waiting forever.
            self._fail(exc)
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
        except (TypeError, ValueError, OverflowError) as exc:
            # Arguments or a value JSON cannot hold (a file name that is not UTF-8): keep the
            # record and say why its payload is missing, rather than lose the call.
            del buffer[start:]
            logger.warning("journal {}: {} record degraded: {}", self.path, record.call_id, exc)
            encoder.encode_into(_degraded(record, exc), buffer, -1)
        buffer.extend(b"\n")

    def _write_all(self, buffer: bytearray) -> None:
        view = memoryview(buffer)
        while view:
            written = os.write(self._fd, view)
            if written <= 0:
                raise OSError(f"write() wrote {written} bytes")
            view = view[written:]

    def _fail(self, exc: BaseException) -> None:
        # After a failed fsync the page cache may have dropped the dirty pages: retrying could
        # report success for records that are gone, so the journal stops for good.
        with self._lock:
            if self.failure is not None:
                return
            self.failure = JournalError(f"journal {self.path}: write failed: {exc}")
        logger.error("journal {}: write failed, journaling stopped: {}", self.path, exc)

    def _finish(self, stop_waiters: list[Waiter]) -> None:
        with self._lock:
            self.finished = True
            leftovers: list[Entry] = []
            while True:
                try:
                    leftovers.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for fd in (self._fd, self._lock_fd):  # the journal first, then the lock that guards it
            try:
                os.close(fd)
            except OSError as exc:
                logger.warning("journal {}: close failed: {}", self.path, exc)
        for entry in leftovers:
            if entry.waiter is not None:
                settle(entry.waiter, None if entry.stop else self.closed_error())
        for waiter in stop_waiters:
            settle(waiter, None)


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
    else:
        future.set_exception(JournalError(str(error)))


def _degraded(record: JournalRecord, exc: Exception) -> JournalRecord:
    note = {"unencodable": clip(str(exc), 200)}
    if isinstance(record, IntentRecord):
        return msgspec.structs.replace(record, args=note)
    if isinstance(record, OutcomeRecord):
        return msgspec.structs.replace(record, value_summary=note)
    raise exc
