"""Protected paths in bash: held read-only while a call runs, and what it made set aside after.

``[sandbox] protected`` (``.git/hooks/**``, ``.git/config``, ``.git/commondir`` by default)
names what a call must not leave for later: a hook, a git config or a commondir that points git
at a directory of the call's choosing runs at the user's next ``git commit``, unsandboxed. The
write and edit tools refuse such paths (``workers.paths.check_protected``); for bash, which
writes through the kernel, two steps in its mount namespace and one after it ends::

    protect()        each pattern's fixed prefix (``.git/hooks`` for ``.git/hooks/**``) that
                     exists is bound read-only onto itself: EROFS, and EBUSY for rm and mv.
                     Every existing directory above it (``.git``) is bound onto itself too,
                     read-write: a mount point cannot be renamed, so ``mv .git old; cp -a old
                     .git`` cannot swap in a copy whose hooks are writable.
    absent()         the prefixes that do not exist when the command starts (a repository the
                     call is about to ``git init``, a ``.git/commondir`` nobody wrote)
    set_aside_created()
                     once the command and everything it started are dead: each of those that
                     exists now was made during the call, and is renamed aside, next to itself
                     (``NAME.sandbx-removed-PID-NS``, a name git never reads).

Set aside after the call, not refused during it, because there is nothing to mount on before
the path exists, and Landlock grants whole hierarchies, never "all of the workspace but this
name". Renamed, not deleted: the same path may have been made meanwhile outside the sandbox
(the user running ``git init`` while a long call runs), and that must not be lost. It runs in
the worker after ``kill_descendants()``, so nothing of the call can race it, and walks from the
workspace one name at a time, ``O_NOFOLLOW``: a symlink the call planted is set aside, never
followed.
A ``.git`` the call made stays (its objects and commits are its work); its ``config`` and
``hooks`` are set aside (git runs without either). The limit: a worker killed before it answers
(SIGKILL with ``grace_s = 0``, a worker that crashed, the coordinator gone) sets nothing aside.

A pattern with no fixed prefix (``*.pem``) would need a walk of the whole workspace after each
call: only write and edit enforce it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time

from sandbx_pool.workers import _libc

#: How directories on the way down are opened: never through a symlink.
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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
    return sorted({p for p in map(fixed_prefix, patterns) if p})


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def protect(workspace: str, patterns: tuple[str, ...]) -> list[str]:
    """In our mount namespace: each protected prefix that exists read-only, each directory above
    it pinned (bound onto itself). Returns the paths made read-only."""
    root = os.path.realpath(workspace)
    prefixes = _prefixes(patterns)
    _pin(root, prefixes)
    covered: list[str] = []
    for parts in prefixes:
        path = os.path.realpath(os.path.join(root, *parts))
        if path == root or not _within(path, root) or not os.path.lexists(path):
            continue
        try:
            _libc.mount(path, path, None, _libc.MS_BIND | _libc.MS_REC, None)
            _libc.set_read_only(path, recursive=True)
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
            _libc.mount(path, path, None, _libc.MS_BIND | _libc.MS_REC, None)


#: A protected prefix that did not exist, and the depth (1-based) of its first missing name.
Missing = tuple[tuple[str, ...], int]


def absent(workspace: str, patterns: tuple[str, ...]) -> list[Missing]:
    """The protected prefixes that do not exist (as names: a dangling symlink exists), each with
    the depth of its first missing component: from there down, whatever appears is the call's."""
    root = os.path.realpath(workspace)
    missing: list[Missing] = []
    for parts in _prefixes(patterns):
        for depth in range(1, len(parts) + 1):
            if not os.path.lexists(os.path.join(root, *parts[:depth])):
                missing.append((parts, depth))
                break
    return missing


def set_aside_created(workspace: str, missing: list[Missing]) -> list[dict[str, str]]:
    """Set aside what the call made of each prefix ``absent`` found missing; return what moved
    where, relative to the workspace. From the first missing component down, a real directory
    is kept and entered (a ``.git`` from ``git init``), anything else is set aside: the prefix
    itself, or a symlink or file standing in for a directory on the way (a ``.git`` file naming
    another git directory). Never raises: what cannot be moved stays, and is not reported."""
    removed: list[dict[str, str]] = []
    try:
        top = os.open(os.path.realpath(workspace), _DIRECTORY)
    except OSError:
        return removed
    try:
        for parts, first_missing in missing:
            with contextlib.suppress(OSError):
                if (gone := _set_aside_one(top, parts, first_missing)) is not None:
                    removed.append(gone)
    finally:
        os.close(top)
    return removed


def _moved(parts: tuple[str, ...], aside: str) -> dict[str, str]:
    return {"path": "/".join(parts), "to": "/".join((*parts[:-1], aside))}


def _set_aside_one(top: int, parts: tuple[str, ...], first_missing: int) -> dict[str, str] | None:
    fd = top
    try:
        for depth, name in enumerate(parts, start=1):
            try:
                info = os.lstat(name, dir_fd=fd)
            except FileNotFoundError:
                return None  # not there: nothing was made
            made = depth >= first_missing
            if made and (depth == len(parts) or not stat.S_ISDIR(info.st_mode)):
                aside = _set_aside(fd, name)
                return _moved(parts[:depth], aside)
            try:
                child = os.open(name, _DIRECTORY, dir_fd=fd)
            except OSError as exc:
                if not made or exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    return None  # what was there before the call is not the call's
                # Swapped for a symlink since the lstat: that is set aside.
                return _moved(parts[:depth], _set_aside(fd, name))
            if fd != top:
                os.close(fd)
            fd = child
        return None
    finally:
        if fd != top:
            os.close(fd)


def _set_aside(dir_fd: int, name: str) -> str:
    """Rename ``name`` to a name git never reads, next to it; return the new name.

    Moved, not deleted: the same path may have been made meanwhile by someone outside the
    sandbox (the user running ``git init`` while a long call runs), whose work must not be
    lost. Renaming never follows a symlink, whatever ``name`` is."""
    aside = f"{name}.sandbx-removed-{os.getpid()}-{time.time_ns()}"
    os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    return aside
