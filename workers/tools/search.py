"""The tree walk by descriptor: grep's Python engine (workers.tools.grep) walks with it, and
find (workers.tools.find) keeps its guarantees and its order in a loop of its own.

The walk must never hang and never loop, whatever the tree holds:

* it never follows a symlink, to a directory or to a file. Following one could leave the
  workspace, revisit a directory forever (``loop -> .``), or land on a FIFO. Symlinked files
  are therefore not searched by grep; find lists the symlink itself.
* it never opens anything but a regular file, judged from the directory entry's type (lstat,
  not stat). A FIFO opened for reading waits for a writer; a device can block or have effects
  on open. grep's open also re-checks with fstat, in case the entry was swapped meanwhile.
* an unreadable directory or file is skipped and counted in ``skipped``, not an error.
* it never opens anything outside the workspace, whatever a parallel call does to the tree
  meanwhile (swap a directory for a symlink to /etc with ``renameat2(RENAME_EXCHANGE)``...):
  it walks by descriptor. The root is reached from the workspace one name at a time
  (``workers.paths.open_directory``); every directory below is opened by its single name,
  ``O_NOFOLLOW``, relative to its parent's descriptor, and every file likewise, so a name that
  became a symlink is refused by the kernel (ELOOP, counted in ``skipped``), never followed.
  Landlock alone would not stop it: the file tools may read the system's directories. This
  is also cheaper than walking by path: the kernel resolves one name per open, not the whole
  path. The price: one descriptor per level of depth, so a tree deeper than the open-files
  limit has its deepest levels skipped (and counted).

Results come in a stable order: each directory's entries are visited sorted by name.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable, Container, Iterator

from sandbx_pool.workers.paths import (
    DIRECTORY_FLAGS,
    open_directory,
    real_workspace,
    relative_to_workspace,
)
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.tools.gitignore import NAMES as IGNORE_NAMES
from sandbx_pool.workers.tools.gitignore import GitIgnore


def is_regular(entry: os.DirEntry[str]) -> bool:
    try:
        # The entry's own type (lstat): a symlink to a file is not followed, and a FIFO or
        # device is never opened.
        return entry.is_file(follow_symlinks=False)
    except OSError:
        return False


def _is_directory(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


class TreeWalk:
    """Every entry under the directory ``root_fd`` (not closed here), preorder, each directory
    sorted, walked by descriptor (see the module docstring).

    Iterating yields ``(relative path, entry, dir_fd)`` with ``/`` separators; ``dir_fd`` is the
    open directory holding the entry (for opening it by name), valid until the next item, as is
    the entry's own ``stat``. Directories named in ``prune`` are yielded but not entered;
    entries ``ignore`` excludes (.gitignore) are neither yielded nor entered. ``skipped`` counts
    what could not be read below the root; the root itself is listed at construction, which
    raises OSError if it cannot be.
    """

    def __init__(
        self,
        root_fd: int,
        prune: Container[str] = (),
        ignore: GitIgnore | None = None,
        *,
        hidden: bool = True,
        files: Callable[[str], bool | None] | None = None,
    ) -> None:
        self.prune = prune
        self.ignore = ignore
        self.hidden = hidden
        self.files = files
        self.skipped = 0
        self._root = root_fd
        self._present: set[str] = set()
        self._top = self._list(root_fd)
        if ignore is not None:
            ignore.enter("", root_fd, self._present)

    def _list(self, fd: int) -> Iterator[os.DirEntry[str]]:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda entry: entry.name)
        if self.ignore is not None:
            # Which ignore files the directory holds: GitIgnore.enter opens only those.
            self._present = {entry.name for entry in entries if entry.name in IGNORE_NAMES}
        return iter(entries)

    def _enter(self, name: str, parent: int) -> tuple[int, Iterator[os.DirEntry[str]]] | None:
        try:
            fd = os.open(name, DIRECTORY_FLAGS, dir_fd=parent)
        except OSError:
            self.skipped += 1  # a symlink swapped in (ELOOP), unreadable, or gone
            return None
        try:
            return fd, self._list(fd)
        except OSError:
            os.close(fd)
            self.skipped += 1
            return None

    def __iter__(self) -> Iterator[tuple[str, os.DirEntry[str], int]]:
        # An explicit stack rather than recursion: depth is bounded by the tree (and the
        # open-files limit), not by Python's recursion limit.
        stack: list[tuple[str, int, Iterator[os.DirEntry[str]]]] = [("", self._root, self._top)]
        try:
            while stack:
                prefix, fd, entries = stack[-1]
                entry = next(entries, None)
                if entry is None:
                    stack.pop()
                    if fd != self._root:
                        os.close(fd)
                    continue
                rel = f"{prefix}{entry.name}"
                is_dir = _is_directory(entry)  # False for a symlinked directory: never entered
                if self._left_out(rel, entry.name, is_dir):
                    continue
                yield rel, entry, fd
                if is_dir and entry.name not in self.prune:
                    child = self._enter(entry.name, fd)
                    if child is not None:
                        if self.ignore is not None:
                            self.ignore.enter(f"{rel}/", child[0], self._present)
                        stack.append((f"{rel}/", *child))
        finally:
            for _, fd, _ in stack:
                if fd != self._root:
                    os.close(fd)

    def _left_out(self, rel: str, name: str, is_dir: bool) -> bool:
        if not is_dir and self.files is not None:
            verdict = self.files(rel)
            if verdict is not None:
                return not verdict
        if not self.hidden and name.startswith("."):
            return True
        return self.ignore is not None and self.ignore.ignored(rel, is_dir)


class Root:
    """The search root, reached from the workspace one name at a time; closes what it opened.

    ``parent`` is the directory holding it and ``name`` its name in there (None when the root
    is the workspace itself, and ``parent`` the workspace); ``above`` the fds of the directories
    from the workspace down to ``parent``, excluded.
    """

    def __init__(self, ctx: ExecutionContext, real: str, display: str) -> None:
        self.above: list[int] = []
        self._opened = contextlib.ExitStack()
        workspace = real_workspace(ctx.workspace)
        self.name = None if real == workspace else os.path.basename(real)
        try:
            self.parent = open_directory(
                ctx, real if self.name is None else os.path.dirname(real), display, self.above
            )
        except BaseException:
            self.close()
            raise
        self._opened.callback(os.close, self.parent)
        rel = relative_to_workspace(ctx, real)
        #: What the root's entries are reported under: their path in the workspace.
        self.prefix = "" if rel == "." else f"{rel}/"

    def mode(self) -> int:
        """The root's type (lstat). Raises OSError, ELOOP for a symlink: ``resolve`` leaves one
        only where it loops (or where one was swapped in since), and none is followed."""
        if self.name is None:
            return stat.S_IFDIR
        mode = os.stat(self.name, dir_fd=self.parent, follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
        return mode

    def open_directory(self) -> int:
        if self.name is None:
            return self.parent
        fd = os.open(self.name, DIRECTORY_FLAGS, dir_fd=self.parent)
        self._opened.callback(os.close, fd)
        return fd

    def ancestors(self) -> list[int]:
        """The fds of the directories above the root, the workspace first."""
        return self.above if self.name is None else [*self.above, self.parent]

    def close(self) -> None:
        self._opened.close()
        for fd in self.above:
            os.close(fd)
        self.above = []

    def __enter__(self) -> Root:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
