"""The coordinator's own actions at start: check its workspace, and after a crash remove what
interrupted writes left behind.

The journal knows which writes and edits were in flight when a coordinator died; their temp
files may still sit next to their targets. The coordinator never touches the workspace (a hung
mount would hang it), so it asks a worker, which resolves each path as any tool would.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from sandbx_pool.workers.errors import Denied
from sandbx_pool.workers.paths import resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import CheckWorkspaceArgs, RemoveTempsArgs
from sandbx_pool.workers.tools.atomic import remove_leftover_temps


def remove_temps(args: RemoveTempsArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Journal recovery: sweep the directories of writes and edits a crash left in doubt."""
    removed: list[str] = []
    for directory in sorted({os.path.dirname(path) for path in args.paths}):
        try:
            real = resolve(ctx, directory)
        except Denied:
            continue  # a path that leads outside now is nobody's business here
        removed += [os.path.join(real, name) for name in remove_leftover_temps(real, ctx)]
    return {"removed": removed}


def check_workspace(args: CheckWorkspaceArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """What is wrong with the workspace as a pool's workspace (``problem``), None if nothing:
    it must be a directory (a symlink to one is one)."""
    try:
        mode = os.stat(ctx.workspace).st_mode
    except FileNotFoundError:
        return {"problem": "no such directory"}
    except OSError as exc:
        return {"problem": exc.strerror or str(exc)}
    return {"problem": None if stat.S_ISDIR(mode) else "not a directory"}
