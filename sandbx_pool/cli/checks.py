"""Input checks every command makes before it starts a pool, each a one-line usage error.

The pool never stats the workspace itself (a hung mount would hang the coordinator, design.md);
a command line can, once, before anything starts: a typo in ``--workspace`` is then one line
naming it, not a pool that answers every call with ``. not found``.
"""

from __future__ import annotations

import os


def workspace_problem(workspace: str) -> str | None:
    """Why ``workspace`` cannot be one, or None when it is an existing directory."""
    try:
        if os.path.isdir(workspace):
            return None
        if os.path.exists(workspace):
            return f"--workspace {workspace}: not a directory"
    except (OSError, ValueError) as exc:  # ValueError: an embedded NUL
        return f"--workspace {workspace!r}: {exc}"
    return f"--workspace {workspace}: no such directory"
