"""What a call changes in the workspace: the pool's side of change sets.

    Pool.call(changes="tracked" | "transactional"), a write, edit or bash call
        the coordinator makes J.d/changes/<call_id>/{upper,work} (J.d: beside the journal,
        the journal's own directory, which the coordinator may touch; never the workspace)
    the call's worker: an overlay on the workspace, upper = the call's change set
        (workers.overlay); the tool sees the merged view, the workspace is untouched
    the call ends, whatever its status --> settle(): one more worker, on the real workspace,
        runs _apply_changes (workers.tools.change_actions), which scans the upper directory and
        tracked:        applies it whatever the status (what direct mode would have left)
        transactional:  applies it only if the status is ok and none of its paths was
                        applied by another call since this one started (else CONFLICT)
        an ``applying`` record, durable, comes first, the outcome (with ``changes``) after:
        a coordinator killed in between has the apply finished when the journal is reopened
        (finish_interrupted), from the kept upper directory and pre-images
        the worker writes the change list to J.d/changes/<id>/report.json (read here: it may
        be far longer than a Result), and answers what kept it from applying: a directory
        swapped for a symlink (CONFLICT), a change set past max_change_paths or
        max_change_bytes (CHANGE_SET_TOO_LARGE); protected paths are never applied
    undo(call_id) --> a worker puts back the pre-images the apply kept (J.d/objects), unless
        images.json or an object is not what the call's outcome journaled (images_sha256), or
        a path is no longer what the call left (UndoConflict, naming the later call); a second
        undo is a ValueError ("already undone")

Applies and undos are one at a time (``ChangeSets.lock``): the conflict check and the apply it
allows are one step, so two calls that changed one path cannot both pass it. The check is by
path: a call that deleted a directory and one that made a file in it do not conflict by name
(the second's apply then makes the directory again). The upper directories stay in J.d until
the journal is removed, for inspection: a discarded call's is the only copy of what it did.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sandbx_pool.config import ChangeMode, change_mode
from sandbx_pool.errors import UndoConflict
from sandbx_pool.journal.prune import CHANGES_SUFFIX
from sandbx_pool.journal.reader import read_journal
from sandbx_pool.journal.records import ApplyingRecord, OutcomeRecord, UndoneRecord
from sandbx_pool.journal.store import Journal
from sandbx_pool.journal.writer import JournalWriteError
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.workers.protocol import CHANGES_LISTED
from sandbx_pool.workers.protocol import ChangeReport as Report
from sandbx_pool.workers.protocol import change_report_decoder as report_decoder

#: The ``reason`` of an outcome written on reopen for a call whose apply a coordinator began
#: and did not finish.
APPLIED_ON_REOPEN = "its changes were applied when the journal was reopened"

#: The error_code of a call whose change set passed [workspace] max_change_paths or bytes.
CHANGE_SET_TOO_LARGE = "CHANGE_SET_TOO_LARGE"
#: The apply worker's change list, in the call's directory of J.d.
REPORT = "report.json"

#: Runs one of the coordinator's own actions on a worker: (call id, action, args, workspace).
RunInternal = Callable[[str, str, dict[str, Any], str], Awaitable[Outcome]]


def store_dir(journal_path: str) -> str:
    return journal_path + CHANGES_SUFFIX


def refuse_without_store(journal_path: str, call_id: str) -> None:
    """An undo where the journal's J.d is missing: the ValueError that says why (the call is
    unknown, direct, never applied, or J.d is gone), without making J.d."""
    applied_call(read_journal(journal_path).records, call_id, journal_path)
    raise ValueError(f"cannot undo {call_id}: {store_dir(journal_path)} is missing")


def safe_name(call_id: str) -> str:
    """A call id as one path component (ids are the caller's: they may hold a slash)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in call_id)
    return cleaned if cleaned not in ("", ".", "..") else "_"


@dataclass
class ChangeSets:
    """Where a pool's change sets live, and which paths each applied call set, when."""

    root: str  # J.d
    #: [workspace] max_change_paths, max_change_bytes: a larger change set is not applied.
    max_paths: int | None = None
    max_bytes: int | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: (monotonic time of the apply, call id, paths), oldest first.
    applied: list[tuple[float, str, frozenset[str]]] = field(default_factory=list)

    @property
    def objects(self) -> str:
        return os.path.join(self.root, "objects")

    def call_dir(self, call_id: str) -> str:
        return os.path.join(self.root, "changes", safe_name(call_id))

    def images(self, call_id: str) -> str:
        return os.path.join(self.call_dir(call_id), "images.json")

    def report(self, call_id: str) -> str:
        """Where the apply worker writes the change list (out of band: it may be long)."""
        return os.path.join(self.call_dir(call_id), REPORT)

    def make_call_dir(self, call_id: str) -> str:
        """The call's upper and work directories, made fresh (an earlier attempt's, with the
        same id, is set aside: it is its own record of what that attempt did)."""
        directory = self.call_dir(call_id)
        os.makedirs(os.path.join(self.root, "changes"), mode=0o700, exist_ok=True)
        os.makedirs(self.objects, mode=0o700, exist_ok=True)
        if os.path.lexists(directory):
            os.rename(directory, f"{directory}.{os.urandom(4).hex()}")
        os.mkdir(directory, 0o700)
        os.mkdir(os.path.join(directory, "upper"), 0o755)
        os.mkdir(os.path.join(directory, "work"), 0o700)
        return directory

    def taken_since(self, started_at: float) -> dict[str, str]:
        """Paths applied by calls whose apply came after ``started_at``, each with its call."""
        taken: dict[str, str] = {}
        for at, call_id, paths in self.applied:
            if at > started_at:
                taken.update(dict.fromkeys(paths, call_id))
        return taken

    def record(self, call_id: str, paths: frozenset[str], *, oldest_running: float) -> None:
        """``call_id`` set ``paths`` now. Entries older than every call still running can
        conflict with none of them any more: dropped."""
        self.applied = [entry for entry in self.applied if entry[0] > oldest_running]
        self.applied.append((time.monotonic(), call_id, paths))

    # The journal's own directory, on the coordinator's side: never the workspace's filesystem.

    def _listed_instead(self, call_id: str) -> bool:
        return os.path.exists(os.path.join(self.call_dir(call_id), CHANGES_LISTED))

    def _nothing_changed(self, call_id: str) -> bool:
        try:
            return not os.listdir(os.path.join(self.call_dir(call_id), "upper"))
        except OSError:
            return False  # the apply worker will say what is wrong

    def _kept(self, call_id: str) -> bool:
        return os.path.isdir(self.call_dir(call_id))

    def _pre_images(self, call_id: str) -> str:
        """The call's images.json; ValueError naming what of J.d is missing."""
        images = self.images(call_id)
        if not os.path.isfile(images):
            raise ValueError(f"cannot undo {call_id}: its pre-images are missing ({images})")
        if not os.path.isdir(self.objects):
            raise ValueError(f"cannot undo {call_id}: {self.objects} is missing")
        return images

    def _apply_args(self, call_id: str, apply: bool, taken: dict[str, str]) -> dict[str, Any]:
        return {
            "call_id": call_id,
            "upper": os.path.join(self.call_dir(call_id), "upper"),
            "images": self.images(call_id),
            "objects": self.objects,
            "apply": apply,
            "taken": taken,
            "report": self.report(call_id),
            "max_paths": self.max_paths,
            "max_bytes": self.max_bytes,
        }

    def _read_undo_report(self, call_id: str) -> Report | None:
        try:
            with open(self.report(call_id) + ".undo", "rb") as f:
                return report_decoder.decode(f.read())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("undo of {}: its report cannot be read: {}", call_id, exc)
            return None

    def _read_report(self, call_id: str, done: Outcome) -> Report | None:
        """The change list the apply worker wrote; None when it answered nothing (it failed
        before, and ``done`` says why) or the report is unreadable."""
        if done.value is None:
            return None
        try:
            with open(self.report(call_id), "rb") as f:
                return report_decoder.decode(f.read())
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("call {}: its change list cannot be read: {}", call_id, exc)
            return None

    async def settle(
        self,
        *,
        call_id: str,
        mode: ChangeMode,
        started_at: float,
        outcome: Outcome,
        workspace: str,
        journal: Journal | None,
        run: RunInternal,
        oldest_running: float,
    ) -> Outcome:
        """Scan the call's change set and apply it or not (see above): ``outcome`` with
        ``changes``, or turned into a conflict or a failure to apply."""
        if self._listed_instead(call_id):
            # No overlay here: the worker listed the workspace before and after, and its Result
            # holds the changes, made in place (None: it was killed before it could say).
            return outcome
        if self._nothing_changed(call_id):
            # The upper directory is the whole change set: empty, there is nothing to scan or
            # apply, and no second worker is taken (a `true`, a failed command).
            return msgspec.structs.replace(outcome, changes=[])
        # A quarantined worker may still be writing to its upper directory (a process stuck
        # in the kernel, released later): what it holds now is not what the call did.
        tracked = mode is ChangeMode.TRACKED and not outcome.quarantined
        apply = tracked or outcome.status is Status.OK
        async with self.lock:
            taken = self.taken_since(started_at) if mode is ChangeMode.TRANSACTIONAL else {}
            if apply and journal is not None:
                try:
                    await journal.applying(call_id, outcome.tool, workspace, str(outcome.status))
                except JournalWriteError as exc:
                    apply, error = False, f"its changes were not applied: {exc}"
                    outcome = msgspec.structs.replace(outcome, status=Status.ERROR, error=error)
            args = self._apply_args(call_id, apply, taken)
            done = await run(f"{call_id}-changes", "_apply_changes", args, workspace)
            report = self._read_report(call_id, done)
            if report is not None:
                # Whatever the answer, what landed counts for the later calls' conflicts.
                paths = frozenset(c["path"] for c in report.changes if c.get("applied"))
                if paths:
                    self.record(call_id, paths, oldest_running=oldest_running)
        return with_changes(outcome, done, report, applying=apply)

    async def finish_interrupted(self, journal: Journal, run: RunInternal) -> None:
        """Finish the applies a coordinator began and did not end (an ``applying`` record, no
        outcome): the apply runs again (it is idempotent, and takes its pre-images once),
        then the call's outcome is journaled, with its changes."""
        for record in journal.unfinished_applies:
            if not self._kept(record.call_id):
                logger.warning(
                    "call {}: its changes were being applied, but {} is gone: not finished",
                    record.call_id,
                    self.call_dir(record.call_id),
                )
                continue
            args = self._apply_args(record.call_id, True, {})
            done = await run(f"{record.call_id}-changes", "_apply_changes", args, record.workspace)
            report = self._read_report(record.call_id, done)
            status = Status(record.status) if record.status in set(Status) else Status.OK
            outcome = Outcome(
                call_id=record.call_id,
                tool=record.tool,
                status=status,
                reason=APPLIED_ON_REOPEN,
                started=True,
            )
            outcome = with_changes(outcome, done, report)
            if outcome.changes is not None:
                logger.info("call {}: {}", record.call_id, APPLIED_ON_REOPEN)
            await journal.settle(outcome)

    async def undo(
        self, call_id: str, journal: Journal, run: RunInternal, *, oldest_running: float
    ) -> list[str]:
        """Put back what ``call_id`` changed; the paths. ValueError for a call that has
        nothing to undo (unknown, direct mode, never applied, its J.d gone); UndoConflict
        when a path was changed since."""
        async with self.lock:
            await journal.flush()
            scan = read_journal(journal.path)
            if self._listed_instead(call_id):
                raise ValueError(
                    f"cannot undo {call_id}: it was tracked by listing the workspace (no"
                    " overlay here), which keeps no pre-images"
                )
            position, workspace, digest = applied_call(scan.records, call_id, journal.path)
            if digest is None:
                raise ValueError(
                    f"cannot undo {call_id}: no hash of its pre-images was journaled with its"
                    " changes (an older sandbx-pool applied them), so they cannot be trusted"
                )
            args = {
                "images": self._pre_images(call_id),
                "objects": self.objects,
                "images_sha256": digest,
                "report": self.report(call_id) + ".undo",
            }
            done = await run(f"{call_id}-undo", "_undo_changes", args, workspace)
            value = done.value
            if value is None:
                raise ValueError(f"cannot undo {call_id}: {done.error}")
            if value.get("missing"):
                missing = ", ".join(value["missing"])
                raise ValueError(f"cannot undo {call_id}: the pre-images of {missing} are missing")
            if value.get("forged"):
                forged = value["forged"]
                raise UndoConflict(
                    f"cannot undo {call_id}: its kept pre-images ({forged}) are not what was"
                    " journaled with its changes (a hash mismatch); nothing was changed",
                    forged,
                    None,
                )
            if not value["undone"]:
                path = value["changed"][0]
                later = _later_change(scan.records[position + 1 :], path)
                by = f"by call {later}" if later is not None else "outside the pool"
                what = "nothing was changed"
                if value.get("partly"):
                    # Swapped between the check and the write: it stopped there, never wrote
                    # through it; what it had put back stays so, and is journaled.
                    report = self._read_undo_report(call_id)
                    if report is not None and report.undone:
                        await journal.undone(call_id, report.undone)
                    what = "it stopped there; what it had put back is journaled as undone"
                raise UndoConflict(
                    f"cannot undo {call_id}: {path} was changed {by} since; {what}",
                    path,
                    later,
                )
            undo_report = self._read_undo_report(call_id)
            if undo_report is None:
                raise ValueError(f"cannot undo {call_id}: its undo's report is unreadable")
            paths = undo_report.undone
            if undo_report.protected:
                logger.warning(
                    "undo of {}: protected paths left as they are: {}",
                    call_id,
                    ", ".join(undo_report.protected),
                )
            self.record(f"undo of {call_id}", frozenset(paths), oldest_running=oldest_running)
            await journal.undone(call_id, paths)
            return paths


def applied_call(
    records: list[Any], call_id: str, journal_path: str
) -> tuple[int, str, str | None]:
    """Where the call's latest applied outcome is in ``records``, its workspace, and the hash
    of its images journaled with it. ValueError when there is nothing to undo, the call's
    undo already journaled included."""
    found: tuple[int, OutcomeRecord] | None = None
    workspace: str | None = None
    undone = False
    for position, record in enumerate(records):
        if record.call_id != call_id:
            continue
        if isinstance(record, OutcomeRecord):
            found, undone = (position, record), False
        elif isinstance(record, ApplyingRecord):
            workspace = record.workspace
        elif isinstance(record, UndoneRecord):
            undone = True
    if found is None:
        raise ValueError(f"no call {call_id!r} in the journal {journal_path}")
    position, outcome = found
    if outcome.changes is None:
        raise ValueError(f"call {call_id} ran in direct mode: it has no changes to undo")
    if workspace is None or not any(change.get("applied") for change in outcome.changes):
        raise ValueError(f"call {call_id}'s changes were never applied: nothing to undo")
    if undone:
        raise ValueError(f"call {call_id} was already undone")
    return position, workspace, outcome.images_sha256


def _later_change(records: list[Any], path: str) -> str | None:
    """The first call after the one undone that changed ``path`` (an undo counts: named
    ``undo of ID``)."""
    for record in records:
        if isinstance(record, OutcomeRecord) and record.changes:
            if any(c.get("path") == path and c.get("applied") for c in record.changes):
                return record.call_id
        elif isinstance(record, UndoneRecord) and path in record.paths:
            return f"undo of {record.call_id}"
    return None


def with_changes(
    outcome: Outcome, done: Outcome, report: Report | None, *, applying: bool = True
) -> Outcome:
    """``outcome`` with what ``_apply_changes`` did (``report``, its change list: exactly the
    paths applied are ``applied``): a conflict (status error, CONFLICT), a change set too
    large (CHANGE_SET_TOO_LARGE), the protected paths set aside, or the reason the change set
    could not be read or applied."""
    value = done.value
    if value is None or report is None:
        why = done.error if value is None else "its change list is unreadable"
        error = f"the call's changes could not be read or applied: {why}"
        return msgspec.structs.replace(outcome, status=Status.ERROR, error=error, changes=None)
    listed = report.changes
    outcome = msgspec.structs.replace(
        outcome, changes=listed, images_sha256=value.get("images_sha256")
    )
    if report.protected and value.get("applied"):
        outcome = _protected_set_aside(outcome, report.protected)
    if value.get("too_large") and applying:
        # (A change set that was not to be applied anyway keeps its call's status: it is only
        # not listed, past the bound.)
        error = (
            f"the call's change set is too large: {value['too_large']}; nothing was applied"
            " (it is kept beside the journal)"
        )
        return msgspec.structs.replace(
            outcome, status=Status.ERROR, error=error, error_code=CHANGE_SET_TOO_LARGE
        )
    swapped = value.get("swapped")
    if swapped is not None:
        landed = sum(1 for change in listed if change.get("applied"))
        what = f"only {landed} of its paths were applied" if landed else "nothing was applied"
        error = (
            f"conflict: {swapped} is no longer a directory (a symlink or a file) since the"
            f" call's changes were scanned; {what}"
        )
        return msgspec.structs.replace(
            outcome, status=Status.ERROR, error=error, error_code="CONFLICT"
        )
    conflict = value.get("conflict")
    if conflict is not None and outcome.status is Status.OK:
        error = (
            f"conflict: {conflict['path']} was changed by call {conflict['call_id']} while this"
            " call ran; its changes were not applied"
        )
        return msgspec.structs.replace(
            outcome, status=Status.ERROR, error=error, error_code="CONFLICT"
        )
    return outcome


def _protected_set_aside(outcome: Outcome, paths: list[str]) -> Outcome:
    """The protected paths of an applied change set, listed in the value's
    ``protected_set_aside`` as bash lists what it set aside: never applied (the workspace's
    stays as it was: ``restored``), the call's version kept in its change set only."""
    entries = [{"path": path, "to": None, "restored": True} for path in paths]
    value = dict(outcome.value or {})
    value["protected_set_aside"] = [*value.get("protected_set_aside", []), *entries]
    return msgspec.structs.replace(outcome, value=value)


__all__ = [
    "APPLIED_ON_REOPEN",
    "CHANGES_SUFFIX",
    "CHANGE_SET_TOO_LARGE",
    "ChangeMode",
    "ChangeSets",
    "applied_call",
    "change_mode",
    "refuse_without_store",
    "store_dir",
    "with_changes",
]
