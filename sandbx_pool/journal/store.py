"""Journal: the append-only JSON Lines record of every call, durable without blocking the loop.

The pool journals each call's intent before dispatch (``await intent()``), the worker that took
it (``started()``) and how it ended (``outcome()``). This module is the facade: it decides how
durable each record must be, tracks which calls are open, and opens, recovers and closes the
journal. The thread that encodes, writes and group-commits is ``writer``; the records are
``records``; parsing, the interrupted calls and the calls in doubt are ``reader``.

Durability by policy (``JournalSettings.policy``): ALWAYS fsyncs every record, and ``intent()``
returns after its fsync; SIDE_EFFECTS does so only for the intents of write, edit and bash, and
group-commits the rest within ``group_commit_ms``; BATCH group-commits everything, but the
intent of a write, edit or bash still returns only once the group commit that holds it is done
(the contract: an intent is durable before its side effect starts); OFF writes and leaves
flushing to the OS. Whatever the policy, ``intent()`` never blocks the event loop: it awaits a
future the writer thread resolves.

When the disk fails (ENOSPC, EIO, EDQUOT), or a journal removed or replaced under the pool
cannot be put back whole at its path (its directory gone, its lock taken by another
coordinator), ``intent()`` raises ``JournalWriteError`` for the records that could not be made
durable, and the pool refuses those calls if they have side effects. Nothing is failed for
good: the next record is tried afresh, so the journal recovers as soon as the disk does.

One coordinator writes a journal at a time. It holds an exclusive ``flock`` on ``PATH.lock``,
which the kernel releases when the holder dies however it dies, so a crash never leaves a stale
lock behind. The lock and the journal are opened close-on-exec so that no exec'd helper (the
template process, bash) inherits them and keeps the lock alive after the coordinator is gone.
"""

from __future__ import annotations

import asyncio
import enum
import fcntl
import os
import time
from typing import Any, NamedTuple

from sandbx_pool.config import JournalPolicy, JournalSettings
from sandbx_pool.errors import JournalError, JournalLocked
from sandbx_pool.journal import reader as journal_reader
from sandbx_pool.journal.reader import JournalScan
from sandbx_pool.journal.records import (
    ApplyingRecord,
    InDoubtRecord,
    IntentRecord,
    JournalRecord,
    OutcomeRecord,
    StartedRecord,
    UndoneRecord,
    summarize,
)
from sandbx_pool.journal.writer import JournalWriteError, JournalWriter, RecordMaker, Waiter
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome
from sandbx_pool.workers.schemas import SIDE_EFFECT_TOOLS


class JournalState(enum.IntEnum):
    OPEN = 1
    CLOSING = 2
    CLOSED = 3
    FAILED = 4  # the latest write or fsync failed; the next record is tried again


class Journal:
    """The append-only writer used by the pool. Make one with ``await Journal.open(...)``."""

    def __init__(
        self,
        path: str,
        settings: JournalSettings,
        *,
        fd: int,
        lock_fd: int,
        dir_fd: int,
        interrupted: list[IntentRecord],
        unfinished_applies: list[ApplyingRecord] | None = None,
    ) -> None:
        self.path = path
        #: Change sets a previous coordinator began to apply and gave no outcome
        #: (sandbx_pool.change_sets finishes them): their calls' outcomes are still to come.
        self.unfinished_applies = list(unfinished_applies or [])
        self._settings = settings
        self._policy = settings.policy
        self._interrupted = interrupted
        self.sessions: dict[str, dict[str, Any]] = {}
        self._open_calls: set[str] = {record.call_id for record in self.unfinished_applies}
        self._closing: asyncio.Future[None] | None = None
        self._writer = JournalWriter(path, settings, fd=fd, lock_fd=lock_fd, dir_fd=dir_fd)

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        path: str | os.PathLike[str],
        settings: JournalSettings,
    ) -> Journal:
        """Lock the journal, recover it, and start its writer.

        Intents the previous coordinator left without an outcome are logged, exposed as
        ``interrupted`` (the pool then removes write/edit temp files through a worker: the
        coordinator never touches the workspace itself) and marked as reported (an
        ``in_doubt`` record each), so the next opening lists only the calls in flight at the
        latest crash. These are every tool's calls in flight, not the calls in doubt that
        ``journal in-doubt`` lists and ``run --resume`` skips (``reader.call_ledger``): a
        marked call stays in doubt there until an attempt of it ends.
        """
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(None, _open_locked, os.fspath(path))
        try:
            opened = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The thread carries on; whatever it opens must still be released.
            opening.add_done_callback(_release_abandoned)
            raise
        pending = journal_reader.interrupted(opened.scan, include_reported=False)
        journal = cls(
            opened.path,
            settings,
            fd=opened.fd,
            lock_fd=opened.lock_fd,
            dir_fd=opened.dir_fd,
            interrupted=pending,
            unfinished_applies=journal_reader.unfinished_applies(opened.scan),
        )
        journal._log_opened(opened.scan)
        #: Each shell session as the latest outcome record left it (sandbx_pool.sessions).
        journal.sessions = journal_reader.sessions(opened.scan)
        if pending:
            try:
                for record in pending:
                    journal._put(_in_doubt_maker(record), sync=False)
                await journal.flush()
            except BaseException:
                await asyncio.shield(journal.close())
                raise
        return journal

    async def flush(self) -> None:
        """Return once everything queued so far is written and fsynced (written under OFF)."""
        self._check_open()
        await self._wait(None, sync=self._policy is not JournalPolicy.OFF)

    async def close(self) -> None:
        """Flush, stop the writer thread and release the lock. Idempotent; never raises."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_future()
            waiter = (self._closing.get_loop(), self._closing)
            self._writer.submit(None, sync=True, waiter=waiter, stop=True)
        await asyncio.shield(self._closing)
        # The thread resolved the future as its very last step; this join is immediate.
        self._writer.join()

    # -- records -----------------------------------------------------------------------------

    @property
    def interrupted(self) -> list[IntentRecord]:
        """Intents that had no outcome when the journal was opened, not reported before: the
        calls in flight when the previous coordinator died, of any tool."""
        return list(self._interrupted)

    @property
    def state(self) -> JournalState:
        if self._writer.failure is not None:
            return JournalState.FAILED
        if self._writer.finished:
            return JournalState.CLOSED
        return JournalState.OPEN if self._closing is None else JournalState.CLOSING

    async def intent(
        self,
        *,
        call_id: str,
        tool: str,
        args: dict[str, Any],
        cwd: str,
        timeout_s: float | None,
        workspace: str | None = None,
        changes: str | None = None,
        layer: str | None = None,
        session: str | None = None,
        network: bool | list[str] | None = None,
    ) -> None:
        """Journal a call about to be dispatched; return once it is as durable as required.

        ALWAYS, and SIDE_EFFECTS for write/edit/bash: fsynced. BATCH for write/edit/bash: until
        the group commit that holds it. Otherwise: queued. Raises ``JournalWriteError`` (path,
        errno) when the record could not be made durable. If the awaiting task is cancelled the
        record is still written, so its call still needs an outcome.
        """
        self._check_open()
        stamp = time.time()
        limit = self._settings.summarize_over_bytes
        # A shallow copy: the record is built later on the writer thread, and a caller that
        # reuses its dict must not change what gets journaled (nor mutate it mid-iteration).
        arguments = dict(args)

        def make() -> JournalRecord:
            return IntentRecord(
                call_id=call_id,
                time=stamp,
                tool=tool,
                args=summarize(arguments, limit),
                cwd=cwd,
                timeout_s=timeout_s,
                workspace=workspace,
                changes=changes,
                layer=layer,
                session=session,
                network=network,
            )

        if call_id in self._open_calls:
            logger.warning("journal {}: second intent for open call {}", self.path, call_id)
        self._open_calls.add(call_id)
        if self._policy is JournalPolicy.ALWAYS or (
            self._policy is JournalPolicy.SIDE_EFFECTS and tool in SIDE_EFFECT_TOOLS
        ):
            await self._wait(make, sync=True)
        elif self._policy is JournalPolicy.BATCH and tool in SIDE_EFFECT_TOOLS:
            await self._wait(make, sync=False)  # released by the group commit that holds it
        else:
            self._put(make, sync=False)

    def started(self, call_id: str, pid: int) -> None:
        """Journal that worker ``pid`` received the call. Queued; returns at once."""
        self._check_open()
        stamp = time.time()
        self._put(
            lambda: StartedRecord(call_id=call_id, time=stamp, pid=pid),
            sync=self._policy is JournalPolicy.ALWAYS,
        )

    async def applying(self, call_id: str, tool: str, workspace: str, status: str) -> None:
        """Journal that a call's change set is about to be applied; return once it is on disk
        (written only, under policy OFF). Raises ``JournalWriteError``: nothing is applied."""
        stamp = time.time()
        await self._wait(
            lambda: ApplyingRecord(
                call_id=call_id, time=stamp, tool=tool, workspace=workspace, status=status
            ),
            sync=self._policy is not JournalPolicy.OFF,
        )

    async def undone(self, call_id: str, paths: list[str]) -> None:
        """Journal an undo of ``call_id``'s changes; return once it is as durable as intents."""
        stamp = time.time()
        await self._wait(
            lambda: UndoneRecord(call_id=call_id, time=stamp, paths=paths),
            sync=self._policy is not JournalPolicy.OFF,
        )

    def outcome(self, outcome: Outcome) -> None:
        """Journal how a call ended. Queued; group-committed within ``group_commit_ms``.

        Tried even while the disk is failing: once it works again, the outcome is written
        (lost otherwise, and its call then reads as in doubt: the safe side)."""
        self._check_open()
        if outcome.call_id in self._open_calls:
            self._open_calls.remove(outcome.call_id)
        else:
            logger.warning(
                "journal {}: outcome for {} has no open intent", self.path, outcome.call_id
            )
        stamp = time.time()
        limit = self._settings.summarize_over_bytes
        self._put(
            lambda: OutcomeRecord.from_outcome(outcome, time=stamp, limit=limit),
            sync=self._policy is JournalPolicy.ALWAYS,
        )

    async def settle(self, outcome: Outcome) -> None:
        """Journal how a call ended, and return once it is as durable as the policy promises:
        under ALWAYS, on disk (the caller never sees an outcome that is not); otherwise queued.
        A failing disk is logged, not raised: the call then reads as in doubt (the safe side)."""
        self.outcome(outcome)
        if self._policy is JournalPolicy.ALWAYS:
            try:
                await self.flush()
            except JournalWriteError as exc:
                logger.warning("call {}: outcome not durable: {}", outcome.call_id, exc)

    # -- the event loop's side of the queue --------------------------------------------------

    def _check_open(self) -> None:
        # Using a closed journal is a bug. A failing disk is not checked here: each record is
        # tried, and only intent() reports it, to the call it concerns.
        if self._closing is not None or self._writer.finished:
            raise JournalError(f"journal {self.path} is closed")

    def _put(self, make: RecordMaker | None, *, sync: bool, waiter: Waiter | None = None) -> None:
        self._check_open()
        self._writer.submit(make, sync=sync, waiter=waiter)

    async def _wait(self, make: RecordMaker | None, *, sync: bool) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._put(make, sync=sync, waiter=(loop, done))
        await done

    # -- reporting ---------------------------------------------------------------------------

    def _log_opened(self, scan: JournalScan) -> None:
        logger.info(
            "journal {} opened (policy {}): {} records, {} call(s) interrupted",
            self.path,
            self._policy,
            len(scan.records),
            len(self._interrupted),
        )
        for record in self._interrupted[:20]:
            logger.warning(
                "journal {}: call {} ({}) was in flight when the last coordinator stopped",
                self.path,
                record.call_id,
                record.tool,
            )
        if len(self._interrupted) > 20:
            logger.warning("journal {}: ... and {} more", self.path, len(self._interrupted) - 20)

    def __repr__(self) -> str:
        return (
            f"<Journal {self.path!r} [{self.state.name.lower()} | policy {self._policy} | "
            f"{len(self._open_calls)} open, {len(self._interrupted)} interrupted]>"
        )


def _in_doubt_maker(record: IntentRecord) -> RecordMaker:
    stamp = time.time()
    return lambda: InDoubtRecord(call_id=record.call_id, time=stamp, tool=record.tool)


class _Opened(NamedTuple):
    path: str
    fd: int
    lock_fd: int
    dir_fd: int  # the journal's directory: where a journal removed under the pool goes back
    scan: JournalScan

    def close(self) -> None:
        for fd in (self.fd, self.lock_fd, self.dir_fd):
            os.close(fd)


def _open_locked(given: str) -> _Opened:
    """Take the lock, open the journal for appending and recover it. Runs on a thread."""
    path = os.path.abspath(given)
    directory = os.path.dirname(path)
    lock_path = path + ".lock"
    try:
        os.makedirs(directory, exist_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise JournalError(f"cannot open journal {path}: {exc}") from exc
    try:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        os.close(dir_fd)
        raise JournalError(f"cannot open journal {path}: {exc}") from exc
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise JournalLocked(
                f"journal {path} is being written by another coordinator "
                f"(pid {holder}, lock {lock_path})"
            ) from None
        # The holder's pid, for the message a second coordinator gets.
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        created = not os.path.exists(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            if created:
                # The new file's directory entry must be durable too, or a crash could lose
                # the whole journal along with the intents fsynced into it.
                os.fsync(dir_fd)
            scan = journal_reader.recover(fd, path)
        except BaseException:
            os.close(fd)
            raise
    except BaseException as exc:
        os.close(lock_fd)
        os.close(dir_fd)
        if isinstance(exc, OSError):
            raise JournalError(f"cannot open journal {path}: {exc}") from exc
        raise
    return _Opened(path, fd, lock_fd, dir_fd, scan)


def _release_abandoned(opening: asyncio.Future[_Opened]) -> None:
    if opening.cancelled() or opening.exception() is not None:
        return
    opening.result().close()
