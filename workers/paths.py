"""Confinement of a call's paths to its workspace, on the worker's side.

The coordinator checks paths lexically before anything is forked (no filesystem access, so a
hung mount cannot hang it). Here, inside the disposable worker, the path is resolved for real,
symlinks included, and refused when it leads outside the workspace. A stat that hangs here
hangs only this worker, which a cancel kills.

Between that check and the open, a parallel call could swap a directory in the path for a
symlink. Nothing here opens a resolved path in one go, then: ``open_directory`` walks down from
the workspace one name at a time, each opened ``O_NOFOLLOW`` relative to the directory above,
so whatever is swapped in meanwhile is refused (ELOOP), never followed. write, edit, ls, grep
and find reach their directories that way and work relative to the descriptor from then on
(grep and find walk the whole tree so); read opens its file ``O_NOFOLLOW`` and asks the kernel
where it landed (``check_opened``).

Protected paths (``Sandbox.protected``, e.g. ``.git/hooks/**``; ``{core.hooksPath}`` is the
directory the workspace's .git/config names, read now: workers.hooks_path) are refused to write
and edit by ``check_protected``, on the resolved path relative to the workspace: ``..`` and
symlinks are resolved first, and the directory then opened is the one that path names (above).
"""

from __future__ import annotations

import errno
import functools
import os
import re

from sandbx_pool.workers import hooks_path
from sandbx_pool.workers.errors import Denied
from sandbx_pool.workers.globs import compile_glob
from sandbx_pool.workers.protocol import ExecutionContext


@functools.lru_cache(maxsize=8)
def real_workspace(workspace: str) -> str:
    """The workspace's real path, resolved once per worker (a worker serves one call) instead
    of at every path: ``resolve``, ``check_opened`` and each path grep and find report."""
    return os.path.realpath(workspace)


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve(ctx: ExecutionContext, path: str) -> str:
    """Return the real absolute path of ``path`` (relative to the call's cwd), or raise Denied."""
    if "\x00" in path:
        raise Denied(f"path contains a NUL byte: {path!r}")
    workspace = real_workspace(ctx.workspace)
    joined = os.path.join(ctx.cwd, path)
    real = os.path.realpath(joined)
    if not is_within(real, workspace):
        raise Denied(f"path {path!r} resolves outside the workspace ({real})")
    for hidden in ctx.sandbox.hidden:
        # The pool's own files (its journal, which may lie in the workspace): bash's mount
        # namespace covers them, the file tools refuse them here.
        if is_within(real, hidden) and not is_within(workspace, hidden):
            raise Denied(f"path {path!r} is the pool's own ({hidden}): no call may use it")
    return real


def relative_to_workspace(ctx: ExecutionContext, real_path: str) -> str:
    """A resolved path as reported to the caller: relative to the workspace root."""
    rel = os.path.relpath(real_path, real_workspace(ctx.workspace))
    return "." if rel == "." else rel


def check_opened(ctx: ExecutionContext, fd: int, path: str) -> None:
    """Raise Denied if the open ``fd`` is not inside the workspace (closes the race above).

    /proc/self/fd/N names the file the kernel actually opened, whatever was swapped in the path
    meanwhile. Without /proc mounted there is nothing to ask, and ``resolve`` stands alone.
    """
    try:
        opened = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return
    if not is_within(opened, real_workspace(ctx.workspace)):
        raise Denied(f"path {path!r} resolves outside the workspace ({opened})")


#: How every directory on the way down is opened: never through a symlink (ELOOP instead),
#: never waiting on a FIFO swapped in (O_DIRECTORY then fails at once).
DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_PATH = getattr(os, "O_PATH", 0)


def open_directory(
    ctx: ExecutionContext, real: str, display: str, ancestors: list[int] | None = None
) -> int:
    """An fd of the directory ``real`` (a path ``resolve`` returned), reached from the workspace
    one name at a time, each ``O_NOFOLLOW`` relative to the one above: a component swapped for a
    symlink since ``resolve`` is Denied, never followed, whatever it points to.

    With ``ancestors``, the fds of the directories above (the workspace first; O_PATH, good as
    ``dir_fd`` only) are appended to it for the caller to close; otherwise they are closed
    here. Raises OSError as it comes.
    """
    rel = os.path.relpath(real, real_workspace(ctx.workspace))
    names = [] if rel == "." else rel.split(os.sep)
    # The directories on the way are opened O_PATH: that needs search permission only, as a
    # path lookup does (a call may run as a user who may not list them); the last one is read.
    fd = os.open(real_workspace(ctx.workspace), DIRECTORY_FLAGS | (_PATH if names else 0))
    for depth, name in enumerate(names, start=1):
        flags = DIRECTORY_FLAGS | (_PATH if depth < len(names) else 0)
        try:
            child = os.open(name, flags, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.ELOOP:
                raise Denied(f"path {display!r} changed to a symlink while it was opened") from exc
            raise
        if ancestors is None:
            os.close(fd)
        else:
            ancestors.append(fd)
        fd = child
    return fd


def reach(root: str | None, target: str) -> tuple[int, int] | None:
    """The (device, inode) of ``target``, a directory lexically below the pool's workspace
    ``root``, reached from ``root`` one name at a time, ``O_NOFOLLOW``; None when there is
    nothing to check (no root, ``/``, or ``target`` not below it). Raises Denied when a name on
    the way is a symlink or not a directory, OSError as it comes.

    A call's own workspace (a batch line's ``workspace``, Ray's) or view is a folder of the
    pool's, checked lexically by the coordinator: an earlier call running at the root could
    have made that folder a symlink to ``/``, and the call would then be confined to ``/``.
    The pool's root itself is the user's choice, symlinks and all; so is ``/`` (Ray's node
    pools, whose calls all name absolute workspaces)."""
    if root is None or root == "/" or not is_within(target, root) or target == root:
        return None
    names = os.path.relpath(target, root).split(os.sep)
    fd = os.open(root, DIRECTORY_FLAGS | _PATH)
    try:
        for name in names:
            try:
                child = os.open(name, DIRECTORY_FLAGS | _PATH, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Denied(f"{target} is reached through a symlink below {root}") from exc
                raise
            os.close(fd)
            fd = child
        found = os.fstat(fd)
    finally:
        os.close(fd)
    return (found.st_dev, found.st_ino)


@functools.lru_cache(maxsize=8)
def _protected_globs(globs: tuple[str, ...]) -> list[tuple[str, re.Pattern[str], bool]]:
    compiled = []
    for glob in globs:
        regex, dir_only = compile_glob(glob)
        # Case-insensitive, as git's own checks of ".git" are: on a case-insensitive filesystem
        # ".GIT/Config" is the same file, and refusing it elsewhere costs nothing real.
        compiled.append((glob, re.compile(regex.pattern, re.DOTALL | re.IGNORECASE), dir_only))
    return compiled


def protected_by(ctx: ExecutionContext, real: str) -> str | None:
    """The protected glob that covers the resolved path ``real``, or None.

    A glob covers a path it matches and everything below a directory it matches, so
    ``.git/hooks`` protects ``.git/hooks/x/y`` too; a glob ending in ``/`` (directories only)
    covers what is below what it matches.
    """
    if not ctx.sandbox.protected:
        return None
    root = real_workspace(ctx.workspace)
    rel = os.path.relpath(real, root)
    if rel == ".":
        return None
    parts = rel.split(os.sep)
    globs = _protected_globs(hooks_path.expand(root, ctx.sandbox.protected)[0])
    for depth in range(1, len(parts) + 1):
        prefix = "/".join(parts[:depth])
        below = depth < len(parts)
        for glob, regex, dir_only in globs:
            if (below or not dir_only) and regex.fullmatch(prefix) is not None:
                return glob
    return None


def check_protected(ctx: ExecutionContext, real: str, display: str) -> None:
    """Raise Denied if no call may change ``real`` (``Sandbox.protected``)."""
    glob = protected_by(ctx, real)
    if glob is not None:
        raise Denied(f"{display} is protected ({glob!r}): no call may change it")
