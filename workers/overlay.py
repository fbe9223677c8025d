"""The call's view of its workspace in tracked and transactional mode: an overlay.

    worker, before confine(): a mount namespace of its own (slave of the host's)
        overlay on the workspace:  lowerdir = the workspace itself (read only through it)
                                   upperdir = <changes_dir>/upper  (the call's change set)
                                   workdir  = <changes_dir>/work
    tool: sees the merged view; every byte it writes, every file it removes (a whiteout),
    lands in upperdir, never in the workspace
    after the call: another worker, on the real workspace, scans upperdir and applies it or
    not (workers.changes; the coordinator decides: sandbx_pool.changes)

The upper directory is made by the coordinator beside the journal (``J.d/changes/<call_id>``),
on the journal's filesystem, not the workspace's: overlayfs refuses an upper directory inside
its lower one. ``userxattr``: overlayfs marks opaque directories with ``user.overlay.opaque``
rather than a ``trusted.`` attribute, so the scanning worker, which holds no capability, can
read the mark. ``redirect_dir=nofollow`` and ``metacopy=off``: a renamed directory is copied whole
and a chmod copies the file's data, so the upper directory alone says what each path became
(no redirect or metadata-only entry pointing back into the lower layer).

The namespace is the worker's, so the mount goes with it: nothing is left mounted on the host,
whatever happens to the call. confine() makes a nested namespace for bash afterwards, which
inherits this mount.
"""

from __future__ import annotations

import os

from sandbx_pool.workers import _libc
from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.protocol import ExecutionContext

OPTIONS = "userxattr,redirect_dir=nofollow,metacopy=off,index=off"


class OverlayError(ToolError):
    """The call's overlay could not be mounted: the call is refused (status ``error``), never
    run on the workspace itself."""


def enter(ctx: ExecutionContext) -> None:
    """Mount the call's overlay on its workspace (its view's directory, for a call made in a
    view), in a mount namespace of this worker's own."""
    assert ctx.changes_dir is not None
    workspace = os.path.realpath(ctx.sandbox.view or ctx.workspace)
    upper = os.path.join(ctx.changes_dir, "upper")
    work = os.path.join(ctx.changes_dir, "work")
    for path in (workspace, upper, work):
        if any(c in path for c in ",:\\"):
            raise OverlayError(
                f"cannot mount an overlay on a path holding ',', ':' or '\\': {path}"
            )
    if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
        raise OverlayError(
            "the call's changes cannot be kept apart: no mount namespace here (the pool needs"
            ' root with CAP_SYS_ADMIN; or use changes = "direct")'
        )
    try:
        _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
        options = f"lowerdir={workspace},upperdir={upper},workdir={work},{OPTIONS}"
        _libc.mount("sandbx-changes", workspace, "overlay", 0, options)
    except OSError as exc:
        raise OverlayError(f"cannot mount the call's overlay on {workspace}: {exc}") from exc


__all__ = ["OPTIONS", "OverlayError", "enter"]
