"""Lexical confinement, checked before anything is forked.

Only string operations: the coordinator never stats the workspace (a hung mount would hang it
and every caller with it). Symlinks are resolved later, inside the worker (workers.paths).
"""

from __future__ import annotations

import os

from sandbx_pool.workers.schemas import ToolArgs


def within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_cwd(workspace: str, cwd: str | None) -> str:
    """The call's absolute cwd; raise ValueError when it leaves the workspace."""
    if cwd is None:
        return workspace
    joined = os.path.normpath(os.path.join(workspace, cwd))
    if not within(joined, workspace):
        raise ValueError(f"cwd {cwd!r} is outside the workspace")
    return joined


def check_view(workspace: str, view: str) -> None:
    """Raise ValueError unless ``view`` is an absolute, normalised directory strictly inside
    the workspace (a view of the workspace's root itself, or of ``/``, would show it all)."""
    if "\x00" in view or not os.path.isabs(view) or os.path.normpath(view) != view:
        raise ValueError(f"view {view!r} is not an absolute, normalised path")
    if view == workspace or not within(view, workspace):
        raise ValueError(f"view {view!r} is not inside the workspace")


def denial(workspace: str, cwd: str, args: ToolArgs) -> str | None:
    """Why ``args`` are refused before any fork, or None when their paths stay inside."""
    path = getattr(args, "path", None)
    if not isinstance(path, str):
        return None
    if "\x00" in path:
        return f"path contains a NUL byte: {path!r}"
    joined = os.path.normpath(os.path.join(cwd, path))
    if not within(joined, workspace):
        return f"path {path!r} is outside the workspace"
    return None
