"""Change sets as a feature of the pool's calls (call_seam.py); what they are: change_sets.py.

    ChangeCalls.open (Pool.start, its journal open): J.d made and hidden from the first call
    a tracked or transactional write, edit or bash call:
        prepare  the store (J.d, or the runtime directory without a journal), hidden
        admit    the call's overlay directory in J.d, in the call's context
        settle   its change set applied or kept aside (ChangeSets.settle); a tracked call of
                 another tool: ``changes=[]``
    Pool.undo --> ChangeCalls.undo

The store is made on first need and hidden from every call from then on; the sandbox that
hides it is the pool's (``hide``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec

from sandbx_pool.call_on_worker import Unsendable, encode_call
from sandbx_pool.call_seam import CallFeature
from sandbx_pool.call_state import CallState
from sandbx_pool.change_sets import ChangeSets, RunInternal, refuse_without_store, store_dir
from sandbx_pool.config import ChangeMode, WorkspaceSettings
from sandbx_pool.journal.store import Journal
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.workers.schemas import SIDE_EFFECT_TOOLS


class ChangeCalls(CallFeature):
    """A pool's change sets: where they are kept, and each call's made, settled, undone."""

    def __init__(
        self,
        settings: WorkspaceSettings,
        hide: Callable[[str], None],
        run: RunInternal,
        running_since: Callable[[], float],
    ) -> None:
        self._settings = settings
        #: Hides a directory of the pool's from every call (Pool._hide).
        self._hide = hide
        #: Runs the apply and undo actions on a worker (CallRunner.internal).
        self._run = run
        #: When the oldest call in flight started (what a change set's record keeps).
        self._running_since = running_since
        self._store: ChangeSets | None = None
        self._journal: Journal | None = None
        self._runtime_dir: str | None = None
        #: J.d did not exist when the pool opened its journal (undo then says it is missing).
        self._store_was_missing = False

    def open(self, runtime_dir: str, journal: Journal | None) -> None:
        """The pool has its runtime directory and its journal (if any). With a journal, J.d
        is made and hidden now, whatever the pool's mode: a call that reached it before the
        pool needed it (a direct bash with the journal in the workspace) could forge what a
        later undo writes."""
        self._runtime_dir, self._journal = runtime_dir, journal
        if journal is not None:
            self._store_was_missing = not os.path.isdir(store_dir(journal.path))
            self.store()

    def store(self) -> ChangeSets:
        """The pool's change sets, beside its journal (in its runtime directory without one:
        gone with the pool), hidden from every call from the first one on."""
        if self._store is None:
            assert self._runtime_dir is not None
            root = (
                store_dir(self._journal.path)
                if self._journal is not None
                else os.path.join(self._runtime_dir, "changes")
            )
            os.makedirs(root, mode=0o700, exist_ok=True)
            settings = self._settings
            self._store = ChangeSets(
                root, max_paths=settings.max_change_paths, max_bytes=settings.max_change_bytes
            )
            self._hide(root)
        return self._store

    # -- the hooks (call_seam.py) ------------------------------------------------------------------

    def prepare(self, call: CallState) -> Outcome | None:
        if _keeps_changes(call):
            try:
                self.store()
            except OSError as exc:
                return call.outcome(Status.ERROR, error=f"cannot keep the call's changes: {exc}")
        return None

    def admit(self, call: CallState, payload: bytes) -> bytes | Outcome:
        """Give the call its overlay's directory; the Call encoded again with it."""
        if not _keeps_changes(call):
            return payload
        try:
            call.changes_dir = self.store().make_call_dir(call.call_id)
            assert call.context is not None
            call.context = msgspec.structs.replace(
                call.context,
                changes_dir=call.changes_dir,
                changes_scan=call.changes is ChangeMode.TRACKED,
            )
            return encode_call(call)
        except (OSError, Unsendable) as exc:
            return call.outcome(Status.ERROR, error=f"cannot keep the call's changes: {exc}")

    async def settle(self, call: CallState, outcome: Outcome) -> Outcome:
        """Apply the call's change set or keep it aside (change_sets.py)."""
        if call.changes_dir is not None:
            return await self.store().settle(
                call_id=call.call_id,
                mode=call.changes,
                started_at=call.started_at,
                outcome=outcome,
                workspace=call.view or call.workspace or "",
                journal=self._journal,
                run=self._run,
                oldest_running=self._oldest_running(),
            )
        if call.changes is not ChangeMode.DIRECT:
            return msgspec.structs.replace(outcome, changes=[])
        return outcome

    # -- after the calls ------------------------------------------------------------------------

    async def finish_interrupted(self) -> None:
        """Finish the applies a killed coordinator began (change_sets.py)."""
        if self._journal is not None and self._journal.unfinished_applies:
            await self.store().finish_interrupted(self._journal, self._run)

    async def undo(self, call_id: str) -> list[str]:
        """Pool.undo's work (it says what it does)."""
        journal = self._journal
        if journal is None:
            raise ValueError("undo needs the pool's journal: this pool has none")
        store = self.store()
        if self._store_was_missing and not os.path.isdir(store.call_dir(call_id)):  # noqa: ASYNC240 (J.d, the pool's own)
            await journal.flush()
            refuse_without_store(journal.path, call_id)
        return await store.undo(call_id, journal, self._run, oldest_running=self._oldest_running())

    def _oldest_running(self) -> float:
        return min(self._running_since(), time.monotonic())


def _keeps_changes(call: CallState) -> bool:
    return call.changes is not ChangeMode.DIRECT and call.tool in SIDE_EFFECT_TOOLS


__all__ = ["ChangeCalls"]
