"""Protected paths in bash: held read-only where a mount can hold them, and put back as they were
after the call wherever one cannot.

``[sandbox] protected`` names what a call must not leave for later: a git hook or config, a
``.git/commondir`` that points git at a directory of the call's choosing, a hook in the directory
``core.hooksPath`` names, a husky or pre-commit hook. Each runs at the user's next ``git commit``,
outside any sandbox. The write and edit tools refuse such paths (``workers.paths``); for bash,
which writes through the kernel::

    expand()        the call's patterns, ``{core.hooksPath}`` replaced by the directory the
                    workspace's .git/config names, read now (workers.hooks_path)
    protect()       in bash's mount namespace, where it has one: each pattern's fixed prefix
                    (``.git/hooks`` for ``.git/hooks/**``) that exists is bound read-only onto
                    itself (EROFS; EBUSY for rm and mv); every existing directory above it
                    (``.git``) onto itself, read-write: a mount point cannot be renamed, so
                    ``mv .git old; cp -a old .git`` cannot swap in a copy with writable hooks
    snapshot()      before the command starts (workers.protected_snapshot): each prefix as it
                    is. One a read-only mount holds, by identity only; every other one (no mount
                    namespace: a pool that is not root, a container without CAP_SYS_ADMIN; or a
                    prefix that does not exist yet, which no mount can hold) as a tree: names,
                    kinds and modes, each file's content, each symlink's target, bounded
    Snapshot.restore()
                    once the command and everything it started are dead (workers.
                    protected_restore): each prefix walked again from the workspace, one name at
                    a time, O_NOFOLLOW. What the call made is set aside; what it changed
                    (content, mode, a symlink or a file in place of a directory) is set aside and
                    written back as it was; what it removed is written back. The value's
                    ``protected_set_aside`` lists each, ``protected_unguarded`` what could not
                    be held and why.

Set aside, not refused, because there is nothing to mount on before a path exists, and Landlock
grants whole hierarchies, never "all of the workspace but this name". Renamed, not deleted: the
user may have made or changed the same path meanwhile, outside the sandbox (``git init`` while a
long call runs), and that must not be lost. Renamed to ``NAME.sandbx-removed-PID-NS`` next to
the protected path, and what was inside one to the same path inside that directory
(``.git/hooks.sandbx-removed-PID-NS/pre-commit``): never next to itself inside a hooks directory,
where a hook that runs ``pre-commit.d/*`` would still run it. Renaming never follows a symlink,
and neither does a restore: it writes a new file and renames it into place, so a symlink the call
planted at a protected path (to a file outside the workspace) is set aside, its target untouched.

It runs in the worker after ``kill_descendants()``, so nothing of the call can race it. A ``.git``
the call made stays (its objects and commits are its work); its ``config`` and ``hooks`` are set
aside (git runs without either). Limits: a worker killed before it answers (SIGKILL with
``grace_s = 0``, a worker that crashed, the coordinator gone; and where the worker is not its
PID namespace's init, the command itself, which may signal it) restores nothing; a file is
written back owned by the worker's user, without set-uid or set-gid bits; past the budget a
change is set aside, not undone, and a prefix of more than MAX_ENTRIES names is not guarded;
each case is named in ``protected_unguarded``. A pattern with no fixed prefix (``*.pem``) would
need a walk of the whole workspace after each call: only write and edit enforce it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from sandbx_pool.workers import hooks_path, libc
from sandbx_pool.workers.hooks_path import Note
from sandbx_pool.workers.protected_restore import Restore
from sandbx_pool.workers.protected_snapshot import DIRECTORY, Budget, Node, take

#: Set to "restore" in the template's environment to hold protected paths by the snapshot alone,
#: without read-only mounts, where a mount namespace is available (tests: the fallback of a pool
#: that is not root, exercised as root).
HOLD_ENV = "SANDBX_POOL_PROTECTED"


def fixed_prefix(pattern: str) -> tuple[str, ...]:
    """The components of ``pattern`` before its first wildcard (``.git/hooks/**``: .git, hooks)."""
    fixed: list[str] = []
    for part in pattern.strip("/").split("/"):
        if not part or any(c in part for c in "*?["):
            break
        if part in (".", ".."):
            return ()  # lexically outside or ambiguous: not a path to hold or remove
        fixed.append(part)
    return tuple(fixed)


def _prefixes(patterns: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Each pattern's fixed prefix, none below another (held with it)."""
    return _outermost({p for p in map(fixed_prefix, patterns) if p})


def _outermost(found: set[tuple[str, ...]]) -> list[tuple[str, ...]]:
    return sorted(p for p in found if not any(p[:depth] in found for depth in range(1, len(p))))


def _resolved(root: str, parts: tuple[str, ...]) -> tuple[str, ...] | None:
    """Where the prefix ``parts`` leads through the symlinks on its way, when that is elsewhere
    inside the workspace (a ``.git`` that is a symlink to the git directory): held too."""
    path = os.path.join(root, *parts)
    real = os.path.realpath(path)
    if real in (path, root) or not _within(real, root):
        return None
    return tuple(os.path.relpath(real, root).split(os.sep))


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


# -- in the mount namespace ------------------------------------------------------------------


def protect(workspace: str, patterns: tuple[str, ...]) -> list[str]:
    """In our mount namespace: each protected prefix that exists read-only, each directory above
    it pinned (bound onto itself). Returns the paths made read-only."""
    if os.environ.get(HOLD_ENV) == "restore":
        return []
    root = os.path.realpath(workspace)
    lexical = _prefixes(hooks_path.expand(root, patterns)[0])
    prefixes = _outermost({*lexical, *filter(None, (_resolved(root, p) for p in lexical))})
    _pin(root, prefixes)
    covered: list[str] = []
    for parts in prefixes:
        path = os.path.realpath(os.path.join(root, *parts))
        if path == root or not _within(path, root) or not os.path.lexists(path):
            continue
        if path in covered:
            continue
        try:
            libc.mount(path, path, None, libc.MS_BIND | libc.MS_REC, None)
            libc.set_read_only(path, recursive=True)
        except OSError:
            continue
        covered.append(path)
    return covered


def pin_directories_above(workspace: str, paths: list[str]) -> None:
    """Bind each directory between the workspace and each of ``paths`` (absolute, real) onto
    itself, so that no call can move it: the pool's journal, when it lies in a subdirectory of
    the workspace, would otherwise go with ``mv logs elsewhere`` (its file is masked, its
    directory is not), and the writer could not re-create it where it belongs."""
    root = os.path.realpath(workspace)
    inside = [os.path.relpath(p, root) for p in paths if _within(p, root) and p != root]
    _pin(root, [tuple(rel.split(os.sep)) for rel in inside])


def _pin(root: str, prefixes: list[tuple[str, ...]]) -> None:
    """Bind every existing real directory strictly above each prefix onto itself: a mount point
    cannot be renamed or removed (EBUSY), whatever is done to what it holds."""
    # Shallowest first: a bind of ".git" made after the read-only ".git/hooks" would cover it.
    ancestors = sorted({p[:depth] for p in prefixes for depth in range(1, len(p))}, key=len)
    for parts in ancestors:
        path = os.path.join(root, *parts)
        if os.path.realpath(path) != path or not os.path.isdir(path):
            continue  # a symlink (or nothing): never a mount on what it leads to
        with contextlib.suppress(OSError):
            libc.mount(path, path, None, libc.MS_BIND | libc.MS_REC, None)


# -- the snapshot, and the restore after the call --------------------------------------------


class Snapshot:
    """The protected paths of one workspace before a bash call, to restore once it is over."""

    def __init__(self, root: str, top: Node | None, notes: list[Note]) -> None:
        self.root = root
        self.top = top
        self.notes = notes
        self._restored: dict[str, Any] | None = None

    def restore(self) -> dict[str, Any]:
        """Put every protected path back as it was (once: later calls answer the same); the
        value's fields that say what was done, each present only when not empty. Never raises."""
        if self._restored is None:
            moved: list[dict[str, Any]] = []
            notes = list(self.notes)
            if self.top is not None:
                Restore(moved, notes).run(self.root, self.top)
            self._restored = {
                **({"protected_set_aside": moved} if moved else {}),
                **({"protected_unguarded": notes} if notes else {}),
            }
        return self._restored


def snapshot(workspace: str, patterns: tuple[str, ...]) -> Snapshot:
    """Each protected prefix of ``workspace`` as it is now (see the module's docstring)."""
    root = os.path.realpath(workspace)
    if not patterns:
        return Snapshot(root, None, [])
    expanded, notes = hooks_path.expand(root, patterns)
    try:
        top_fd = os.open(root, DIRECTORY)
    except OSError as exc:
        return Snapshot(root, None, [*notes, {"path": ".", "reason": f"not snapshotted: {exc}"}])
    top = Node(None, whole=False)
    budget = Budget()
    try:
        prefixes = _prefixes(expanded)
        for parts in prefixes:
            if not take(top_fd, top, parts, budget, notes):
                continue
            # A symlink on the way: where it leads, inside the workspace, is guarded too.
            target = _resolved(root, parts)
            if target is not None and not any(
                target[:d] in prefixes for d in range(1, len(target) + 1)
            ):
                take(top_fd, top, target, budget, notes)
    finally:
        os.close(top_fd)
    return Snapshot(root, top, notes)
