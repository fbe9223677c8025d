"""Confinement of a call's paths to its workspace, on the worker's side.

The coordinator checks paths lexically before anything is forked (no filesystem access, so a
hung mount cannot hang it). Here, inside the disposable worker, the path is resolved for real,
symlinks included, and refused when it leads outside the workspace. A stat that hangs here
hangs only this worker, which a cancel kills.

Residual race: between this check and the open, another process could swap a directory in the
path for a symlink. read, write, edit and ls close it: once they hold the file (or the target's
directory) open, ``check_opened`` asks the kernel where that open file really is and refuses it
if it is outside; every later step works relative to that descriptor. grep and find walk by
path and re-check only the root, so a directory swapped for a symlink in the middle of their
walk could still be entered: the residual race, documented in the README.
"""

from __future__ import annotations

import functools
import os

from sandbx_pool.workers.errors import Denied
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
