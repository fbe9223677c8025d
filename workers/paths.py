"""Confinement of a call's paths to its workspace, on the worker's side.

The coordinator checks paths lexically before anything is forked (no filesystem access, so a
hung mount cannot hang it). Here, inside the disposable worker, the path is resolved for real,
symlinks included, and refused when it leads outside the workspace. A stat that hangs here
hangs only this worker, which a cancel kills.

Residual race: between this check and the open, another process could swap a directory in the
path for a symlink. The tools open the resolved path, which narrows it to a component changed in
that window.
"""

from __future__ import annotations

import os

from workers.errors import Denied
from workers.protocol import ExecutionContext


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve(ctx: ExecutionContext, path: str) -> str:
    """Return the real absolute path of ``path`` (relative to the call's cwd), or raise Denied."""
    if "\x00" in path:
        raise Denied(f"path contains a NUL byte: {path!r}")
    workspace = os.path.realpath(ctx.workspace)
    joined = os.path.join(ctx.cwd, path)
    real = os.path.realpath(joined)
    if not is_within(real, workspace):
        raise Denied(f"path {path!r} resolves outside the workspace ({real})")
    return real


def relative_to_workspace(ctx: ExecutionContext, real_path: str) -> str:
    """A resolved path as reported to the caller: relative to the workspace root."""
    workspace = os.path.realpath(ctx.workspace)
    rel = os.path.relpath(real_path, workspace)
    return "." if rel == "." else rel
