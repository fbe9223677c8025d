"""What a call changes in the workspace: the pool's side of change sets (modes, conflicts).

    Pool.call(changes="tracked" | "transactional")
        the coordinator makes J.d/changes/<call_id>/{upper,work} (J.d: beside the journal,
        the journal's own directory, which the coordinator may touch; never the workspace)
    the call's worker: an overlay on the workspace, upper = the call's change set
        (workers.overlay); the tool sees the merged view, the workspace is untouched
    the call ends (any status) -> one more worker, on the real workspace, runs
        _apply_changes (workers.tools.changes): scans the upper directory and
        tracked:        applies it, whatever the status (as direct mode would have left it)
        transactional:  applies it only if the status is ok and none of its paths was
                        applied by another call since this one started (else CONFLICT)
        applying: an ``applying`` record, durable, first; the outcome (with ``changes``)
        after: a coordinator killed in between has the apply finished on reopen
    undo(call_id) -> a worker puts back the pre-images the apply kept (J.d/objects)

Applies are one at a time (``ChangeSets.lock``): the conflict check and the apply it allows
are one step, so two calls that changed one path cannot both pass it. The check is by path:
a call that deleted a directory and one that created a file inside it do not conflict by
name (the second's apply then makes the directory again).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from sandbx_pool.config import ChangeMode, change_mode

#: The directory beside a journal that holds its calls' change sets and pre-images.
CHANGES_SUFFIX = ".d"


def store_dir(journal_path: str) -> str:
    return journal_path + CHANGES_SUFFIX


def safe_name(call_id: str) -> str:
    """A call id as one path component (ids are the caller's: they may hold a slash)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in call_id)
    return cleaned if cleaned not in ("", ".", "..") else "_"


@dataclass
class ChangeSets:
    """Where a pool's change sets live, and which paths each applied call set, when."""

    root: str  # J.d
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

    def record(self, at: float, call_id: str, paths: frozenset[str]) -> None:
        self.applied.append((at, call_id, paths))


__all__ = ["CHANGES_SUFFIX", "ChangeMode", "ChangeSets", "change_mode", "store_dir"]
