"""Which ``rg`` grep runs, and whether the mount it would search lets it: a leaf module.

Two questions that the worker's grep (workers.tools.ripgrep) and the coordinator's ``sandbx-pool
doctor`` both ask. They live here, not in the tool, so that the doctor can ask them without
importing the tools: ``workers.tools`` loads every tool with it, and the coordinator loads no
tool it never runs. Imports nothing of the package's but ``libc``.
"""

from __future__ import annotations

import os
import sys
import sysconfig

from sandbx_pool.workers import libc


def find_rg(env: dict[str, str]) -> str | None:
    """The rg binary: next to this interpreter (the ``ripgrep`` wheel's), else on the call's
    PATH (which its Landlock rules let it execute), else None."""
    candidates = [os.path.dirname(sys.executable), sysconfig.get_path("scripts")]
    candidates += [d for d in env.get("PATH", "").split(":") if d.startswith("/")]
    for directory in candidates:
        path = os.path.join(directory, "rg")
        if os.access(path, os.X_OK):
            return path
    return None


def symlinks_refused(path: str) -> bool:
    """Whether the kernel follows no symlink on the mount holding ``path`` (see workers.sandbox):
    rg walks by path, so grep runs it only there."""
    try:
        return bool(os.statvfs(path).f_flag & libc.ST_NOSYMFOLLOW)
    except OSError:
        return False


__all__ = ["find_rg", "symlinks_refused"]
