"""The snapshot of the protected paths before a bash call (workers.protected): what each was.

A tree of ``Node``s from the workspace down to each protected prefix: the directories on the
way (only the names that lead to a prefix), and each prefix as a whole, every name below it with
its kind, mode and stat, each file's content and each symlink's target, within MAX_ENTRIES,
MAX_BYTES and MAX_DEPTH. A prefix a read-only mount holds (workers.protected.protect) is kept by
its identity alone: nothing can change it. A name that did not exist is a Node without ``info``:
whatever is there after the call is the call's. Taken by descriptor, one name at a time,
``O_NOFOLLOW``; a file is read ``O_NONBLOCK`` (a FIFO swapped in meanwhile cannot hold it).

What it costs a bash call, with the default patterns and a fresh repository's hooks (14 files,
23 KB), snapshot and restore together, measured here: 0.36 ms without a mount namespace, where
every file is read before and compared after; 0.1 ms where the read-only binds hold them.
"""

from __future__ import annotations

import os
import stat

from sandbx_pool.workers.hooks_path import Note

#: How directories are opened: never through a symlink.
DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: How files are read: never through a symlink, never waiting on a FIFO swapped in meanwhile.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

#: The most names the snapshot of one call takes, and bytes of content it keeps. Each bash call
#: without a mount namespace reads this much before it runs (and compares after): a fresh
#: repository's hooks are 14 files, 23 KB. A prefix with more names is not guarded; a file past
#: the bytes is guarded by its stat only (changed: set aside, not written back).
MAX_ENTRIES = 1000
MAX_BYTES = 1 << 20
#: And the deepest it goes below a prefix: one descriptor is open per level, and the walks
#: recurse.
MAX_DEPTH = 32


class Node:
    """A name as it was before the call."""

    __slots__ = ("children", "data", "given_up", "held", "info", "whole")

    def __init__(self, info: os.stat_result | None, *, whole: bool) -> None:
        self.info = info  # None: nothing was there
        #: A protected path, guarded with all it holds; else a directory on the way to one.
        self.whole = whole
        self.held = False  # a read-only mount holds it: only its identity was kept
        self.given_up = False  # too large to snapshot: not guarded (and said so)
        #: A file's content (None: past the budget, or unreadable) or a symlink's target.
        self.data: bytes | str | None = None
        #: A directory's entries: all of them when whole, else the names on the way.
        self.children: dict[str, Node] = {}


class OverBudget(Exception):
    """The snapshot of a prefix would pass a bound (the message says which)."""


class Budget:
    def __init__(self) -> None:
        self.entries = MAX_ENTRIES
        self.bytes = MAX_BYTES

    def take_entry(self) -> None:
        self.entries -= 1
        if self.entries < 0:
            raise OverBudget(f"more than {MAX_ENTRIES} names to snapshot: not guarded")


def lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.lstat(name, dir_fd=dir_fd)
    except OSError:
        return None


def open_directory(dir_fd: int, name: str) -> int | None:
    try:
        return os.open(name, DIRECTORY, dir_fd=dir_fd)
    except OSError:
        return None  # not a directory (any more), or a symlink


def take(top_fd: int, top: Node, parts: tuple[str, ...], budget: Budget, notes: list[Note]) -> bool:
    """Add the prefix ``parts`` to the tree, walking down from the workspace ``top_fd``; whether
    a symlink stands on its way (or at it)."""
    node, fd = top, top_fd
    try:
        for depth, name in enumerate(parts, start=1):
            child = node.children.get(name)
            if child is None:
                child = node.children[name] = Node(lstat(fd, name), whole=False)
            if child.info is None:
                # Nothing here: from this name down, whatever appears is the call's.
                for rest in parts[depth:]:
                    child = child.children.setdefault(rest, Node(None, whole=False))
                child.whole = True
                return False
            if child.whole:
                # Taken already: a file or symlink on the way to another prefix too.
                return stat.S_ISLNK(child.info.st_mode)
            if depth == len(parts) or not stat.S_ISDIR(child.info.st_mode):
                # The prefix, or a file or symlink in place of a directory on the way (a .git
                # file naming the git directory): guarded as it is.
                child.whole = True
                _fill(fd, name, child, budget, "/".join(parts[:depth]), notes)
                return stat.S_ISLNK(child.info.st_mode)
            sub = open_directory(fd, name)
            if sub is None:
                notes.append({"path": "/".join(parts), "reason": "changed while snapshotted"})
                return False
            if fd != top_fd:
                os.close(fd)
            node, fd = child, sub
    finally:
        if fd != top_fd:
            os.close(fd)
    return False


def _fill(dir_fd: int, name: str, node: Node, budget: Budget, rel: str, notes: list[Note]) -> None:
    """Take the protected path ``name`` as it is: its identity if a read-only mount holds it,
    else its whole tree."""
    if _held(dir_fd, name):
        node.held = True
        return
    taken: list[Note] = []
    try:
        budget.take_entry()
        _fill_tree(dir_fd, name, node, budget, rel, taken)
    except OverBudget as exc:
        node.given_up = True
        node.children = {}
        taken = [{"path": rel, "reason": str(exc)}]
    except OSError as exc:
        node.given_up = True
        node.children = {}
        taken = [{"path": rel, "reason": f"cannot be snapshotted, not guarded: {exc}"}]
    notes.extend(taken)


def _held(dir_fd: int, name: str) -> bool:
    """Whether ``name`` lies on a read-only mount (protect()'s bind): nothing can change it."""
    try:
        fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return False
    try:
        return bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    except OSError:
        return False
    finally:
        os.close(fd)


def _fill_tree(
    dir_fd: int,
    name: str,
    node: Node,
    budget: Budget,
    rel: str,
    notes: list[Note],
    depth: int = 0,
) -> None:
    assert node.info is not None
    if depth > MAX_DEPTH:
        raise OverBudget(f"more than {MAX_DEPTH} directories deep to snapshot: not guarded")
    mode = node.info.st_mode
    if stat.S_ISREG(mode):
        if node.info.st_size > budget.bytes:
            reason = f"past the snapshot's {MAX_BYTES} bytes: a change is set aside, not undone"
            notes.append({"path": rel, "reason": reason})
            return
        node.data = read_file(dir_fd, name, node.info.st_size)
        if node.data is None:
            notes.append({"path": rel, "reason": "unreadable: a change is set aside, not undone"})
            return
        budget.bytes -= len(node.data)
    elif stat.S_ISLNK(mode):
        node.data = os.readlink(name, dir_fd=dir_fd)
    elif stat.S_ISDIR(mode):
        fd = os.open(name, DIRECTORY, dir_fd=dir_fd)
        try:
            listed: list[tuple[str, os.stat_result]] = []
            with os.scandir(fd) as entries:
                for entry in entries:
                    budget.take_entry()
                    listed.append((entry.name, entry.stat(follow_symlinks=False)))
            for child_name, info in listed:
                child = node.children[child_name] = Node(info, whole=True)
                _fill_tree(fd, child_name, child, budget, f"{rel}/{child_name}", notes, depth + 1)
        finally:
            os.close(fd)


def read_file(dir_fd: int, name: str, size: int) -> bytes | None:
    """The content of the regular file ``name`` (at most ``size`` + 1 bytes: more is a change)."""
    try:
        fd = os.open(name, _FILE, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        chunks: list[bytes] = []
        left = size + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 16))):
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)
