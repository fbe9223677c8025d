"""Putting the protected paths back after a bash call, from its snapshot (workers.protected).

Walks from the workspace again, one name at a time, ``O_NOFOLLOW``, comparing what is there
with each ``Node``: a name the call made is set aside, one it changed (content, mode, kind, a
symlink's target) is set aside and written back as it was, one it removed is written back.
A file is compared by its content (not its times: ctime ticks coarsely on some filesystems, and
a rewrite of the same bytes is no change), and written back as a new file renamed into place,
never through what is there.
"""

from __future__ import annotations

import contextlib
import os
import stat
import time
from typing import Any

from sandbx_pool.workers.hooks_path import Note
from sandbx_pool.workers.protected_snapshot import (
    DIRECTORY,
    MAX_ENTRIES,
    Node,
    lstat,
    open_directory,
    read_file,
)


def _mode(info: os.stat_result) -> int:
    """The permission bits to write back: never set-uid or set-gid (the seccomp filter refuses
    them, and no protected path needs them)."""
    return stat.S_IMODE(info.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)


class _Aside:
    """Where what the call made of one protected path goes: ``NAME.sandbx-removed-PID-NS`` next
    to it, and what was inside it to the same path inside that directory."""

    def __init__(self, parent_fd: int, rel: tuple[str, ...], stamp: str) -> None:
        self.parent_fd = parent_fd
        self.rel = rel
        self.stamp = stamp
        self.name = f"{rel[-1]}.sandbx-removed-{stamp}"
        self.dirs: dict[tuple[str, ...], int] = {}

    def move(self, dir_fd: int, name: str, inner: tuple[str, ...]) -> str:
        """Rename ``name`` (in ``dir_fd``; ``inner`` is its path below the protected path, ()
        for the path itself) aside; its new path, relative to the workspace."""
        if not inner:
            os.rename(name, self.name, src_dir_fd=dir_fd, dst_dir_fd=self.parent_fd)
            return "/".join((*self.rel[:-1], self.name))
        try:
            os.rename(name, inner[-1], src_dir_fd=dir_fd, dst_dir_fd=self._directory(inner[:-1]))
        except OSError:
            # Another filesystem below (a mount), or no Landlock right to move across
            # directories (ABI 1): next to itself, the one place left.
            aside = f"{name}.sandbx-removed-{self.stamp}"
            os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return "/".join((*self.rel, *inner[:-1], aside))
        return "/".join((*self.rel[:-1], self.name, *inner))

    def _directory(self, parts: tuple[str, ...]) -> int:
        """The directory ``parts`` inside the aside directory, made as needed."""
        fd = self.dirs.get(parts)
        if fd is None:
            if parts:
                parent, name = self._directory(parts[:-1]), parts[-1]
            else:
                parent, name = self.parent_fd, self.name
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent)
            fd = self.dirs[parts] = os.open(name, DIRECTORY, dir_fd=parent)
        return fd

    def close(self) -> None:
        for fd in self.dirs.values():
            os.close(fd)
        self.dirs.clear()


class Restore:
    """One walk of the workspace against a snapshot, and what it did."""

    def __init__(self, moved: list[dict[str, Any]], notes: list[Note]) -> None:
        self.moved = moved
        self.notes = notes
        self.stamp = f"{os.getpid()}-{time.time_ns()}"

    def run(self, root: str, top: Node) -> None:
        try:
            top_fd = os.open(root, DIRECTORY)
        except OSError as exc:
            self.notes.append({"path": ".", "reason": f"not restored: {exc}"})
            return
        try:
            self._on_the_way(top_fd, top, ())
        except Exception as exc:  # a bug here must not take the call's output with it
            self.notes.append({"path": ".", "reason": f"restore failed: {exc!r}"})
        finally:
            os.close(top_fd)

    def _report(self, rel: tuple[str, ...], to: str | None, restored: bool) -> None:
        self.moved.append({"path": "/".join(rel), "to": to, "restored": restored})

    def _note(self, rel: tuple[str, ...], reason: str) -> None:
        self.notes.append({"path": "/".join(rel), "reason": reason})

    def _on_the_way(self, dir_fd: int, node: Node, rel: tuple[str, ...]) -> None:
        for name, child in node.children.items():
            try:
                self._check(dir_fd, name, child, (*rel, name))
            except OSError as exc:
                self._note((*rel, name), f"not restored: {exc}")

    def _check(self, dir_fd: int, name: str, node: Node, rel: tuple[str, ...]) -> None:
        now = lstat(dir_fd, name)
        if node.whole:
            if node.given_up:
                return
            aside = _Aside(dir_fd, rel, self.stamp)
            try:
                if node.info is None:
                    if now is not None:
                        self._report(rel, aside.move(dir_fd, name, ()), restored=False)
                elif node.held:
                    if now is None or (now.st_dev, now.st_ino) != (
                        node.info.st_dev,
                        node.info.st_ino,
                    ):
                        to = aside.move(dir_fd, name, ()) if now is not None else None
                        self._report(rel, to, restored=False)
                        self._note(rel, "replaced though a read-only mount held it: not undone")
                else:
                    self._whole(dir_fd, name, node, rel, (), now, aside)
            finally:
                aside.close()
            return
        if node.info is None and now is None:
            return  # nothing was there, nothing is
        sub = None
        if now is not None and stat.S_ISDIR(now.st_mode):
            sub = open_directory(dir_fd, name)
        if sub is None:
            to = None
            if now is not None:
                to = _Aside(dir_fd, rel, self.stamp).move(dir_fd, name, ())
            if node.info is None:
                # A file or symlink standing in for a directory on the way (a .git file that
                # names another git directory): the call's, set aside.
                self._report(rel, to, restored=False)
                return
            # A directory on the way, moved or replaced: made again, to hold what it held.
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            sub = os.open(name, DIRECTORY, dir_fd=dir_fd)
            os.fchmod(sub, _mode(node.info))
            self._report(rel, to, restored=True)
        try:
            self._on_the_way(sub, node, rel)
        finally:
            os.close(sub)

    def _whole(
        self,
        dir_fd: int,
        name: str,
        node: Node,
        rel: tuple[str, ...],
        inner: tuple[str, ...],
        now: os.stat_result | None,
        aside: _Aside,
    ) -> None:
        """Compare ``name``, which existed as ``node``, with what is there ``now``; undo what
        changed. ``inner``: its path below the protected path (where ``aside`` puts it)."""
        assert node.info is not None
        if now is not None and stat.S_IFMT(now.st_mode) == stat.S_IFMT(node.info.st_mode):
            if stat.S_ISDIR(now.st_mode):
                sub = open_directory(dir_fd, name)
                if sub is not None:
                    try:
                        if self._directory(sub, node, rel, inner, aside):
                            return
                    finally:
                        os.close(sub)
            elif _unchanged(dir_fd, name, node, now):
                return
        to = aside.move(dir_fd, name, inner) if now is not None else None
        self._report(rel, to, restored=self._recreate(dir_fd, name, node, rel))

    def _directory(
        self, fd: int, node: Node, rel: tuple[str, ...], inner: tuple[str, ...], aside: _Aside
    ) -> bool:
        """Undo what changed in the directory ``fd`` (which existed as ``node``); False if it is
        to be replaced whole: more new names than a snapshot would take."""
        assert node.info is not None
        new: list[str] = []
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.name not in node.children:
                    new.append(entry.name)
                    if len(new) > MAX_ENTRIES:
                        return False
        if stat.S_IMODE(os.fstat(fd).st_mode) != stat.S_IMODE(node.info.st_mode):
            os.fchmod(fd, _mode(node.info))
            self._report(rel, None, restored=True)
        for name in new:
            try:
                self._report((*rel, name), aside.move(fd, name, (*inner, name)), restored=False)
            except OSError as exc:
                self._note((*rel, name), f"not set aside: {exc}")
        for name, child in node.children.items():
            try:
                self._whole(fd, name, child, (*rel, name), (*inner, name), lstat(fd, name), aside)
            except OSError as exc:
                self._note((*rel, name), f"not restored: {exc}")
        return True

    def _recreate(self, dir_fd: int, name: str, node: Node, rel: tuple[str, ...]) -> bool:
        """Write ``name`` back as ``node`` was; False where it cannot be (and a note says why)."""
        assert node.info is not None
        mode = node.info.st_mode
        try:
            if stat.S_ISDIR(mode):
                os.mkdir(name, 0o700, dir_fd=dir_fd)
                fd = os.open(name, DIRECTORY, dir_fd=dir_fd)
                try:
                    done = [self._recreate(fd, n, c, (*rel, n)) for n, c in node.children.items()]
                    os.fchmod(fd, _mode(node.info))
                finally:
                    os.close(fd)
                return all(done)
            if isinstance(node.data, str) and stat.S_ISLNK(mode):
                temporary = f".{name}.sandbx-restore-{self.stamp}"
                os.symlink(node.data, temporary, dir_fd=dir_fd)
            elif isinstance(node.data, bytes) and stat.S_ISREG(mode):
                temporary = f".{name}.sandbx-restore-{self.stamp}"
                _write(dir_fd, temporary, node.data, _mode(node.info))
            else:
                if not stat.S_ISREG(mode):  # a file's own note says why it has no content
                    self._note(rel, "set aside, not restored: neither file nor directory")
                return False
            os.rename(temporary, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError as exc:
            self._note(rel, f"set aside, not restored: {exc}")
            return False
        return True


def _unchanged(dir_fd: int, name: str, node: Node, now: os.stat_result) -> bool:
    """Whether the file or symlink ``name`` (of ``now``'s kind, ``node``'s) is as it was."""
    before = node.info
    assert before is not None
    if stat.S_IMODE(now.st_mode) != stat.S_IMODE(before.st_mode):
        return False
    if stat.S_ISLNK(now.st_mode):
        try:
            return os.readlink(name, dir_fd=dir_fd) == node.data
        except OSError:
            return False
    if stat.S_ISREG(now.st_mode) and isinstance(node.data, bytes):
        # The content, not the times: ctime ticks coarsely on some filesystems, and a rewrite
        # with the same bytes (``git init`` again) is no change.
        return now.st_size == len(node.data) and read_file(dir_fd, name, now.st_size) == node.data
    # Past the budget, or neither file nor symlink: by identity and times (ctime cannot be set).
    same = ("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")
    return all(getattr(now, field) == getattr(before, field) for field in same)


def _write(dir_fd: int, name: str, data: bytes, mode: int) -> None:
    """A new file ``name`` holding ``data``, made afresh (never through what is there)."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, mode)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise
    os.close(fd)
