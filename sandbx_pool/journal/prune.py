"""Pruning of the journals made at the default location (a run given no ``--journal``).

Every pool opened without a journal path writes a fresh journal (and its ``.lock``) under the
runtime directory; nobody asked for them by name, so nobody removes them, and one-shot
``sandbx-pool call`` runs left hundreds. Each pool that makes one first prunes that folder:
journals older than ``[journal] default_keep_days`` go, then the oldest beyond
``default_keep_count``. A journal whose lock another coordinator holds is never touched, however
old: it is still being written. Journals at a path the user chose are never pruned.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time

from sandbx_pool.logs import logger

JOURNAL_SUFFIX = ".jsonl"
LOCK_SUFFIX = ".lock"
#: The directory of a journal's change sets (sandbx_pool.change_sets.store_dir).
CHANGES_SUFFIX = ".d"


def prune_default_journals(
    directory: str, *, keep_days: float, keep_count: int, now: float | None = None
) -> list[str]:
    """Remove the stale journals of ``directory``; return the paths removed.

    Never raises for a file that vanishes or cannot be removed meanwhile (another pool may be
    pruning the same folder): pruning is housekeeping, and a call must not fail for it.
    """
    now = time.time() if now is None else now
    journals: list[tuple[float, str]] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    for name in names:
        if not name.endswith(JOURNAL_SUFFIX):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            journals.append((os.stat(path).st_mtime, path))
    journals.sort(reverse=True)  # newest first
    cutoff = now - keep_days * 86400
    stale = [
        path for rank, (mtime, path) in enumerate(journals) if rank >= keep_count or mtime < cutoff
    ]
    removed = [path for path in stale if _remove_unless_locked(path)]
    if removed:
        logger.debug("pruned {} default-location journals in {}", len(removed), directory)
    return removed


def _remove_unless_locked(path: str) -> bool:
    lock_path = path + LOCK_SUFFIX
    try:
        lock_fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        lock_fd = None
    except OSError:
        return False
    try:
        if lock_fd is not None:
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # a live coordinator writes it
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            return False
        # Its calls' change sets and pre-images (sandbx_pool.change_sets) go with it: kept for
        # inspection and undo as long as the journal that names them.
        shutil.rmtree(path + CHANGES_SUFFIX, ignore_errors=True)
        # Under our lock, so no coordinator is between opening the lock file and locking it.
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        return True
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
