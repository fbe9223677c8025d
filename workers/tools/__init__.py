"""The seven agent tools, as the worker runtime calls them.

Each tool is a function of the call's validated arguments (the Struct that
``workers.schemas.parse_args`` returns for it) and its ExecutionContext. It returns the ``value``
of an ``ok`` result, or raises one of ``workers.errors`` for any other status.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.tools.bash import run_bash
from sandbx_pool.workers.tools.changes import apply_changes, undo_changes
from sandbx_pool.workers.tools.files import edit_file, list_directory, read_file, write_file
from sandbx_pool.workers.tools.find import find_paths
from sandbx_pool.workers.tools.grep import grep_files
from sandbx_pool.workers.tools.layers import diff_layer, open_layer
from sandbx_pool.workers.tools.recovery import check_workspace, remove_temps
from sandbx_pool.workers.tools.service import run_service

ToolFunction = Callable[[Any, ExecutionContext], dict[str, Any]]

TOOLS: dict[str, ToolFunction] = {
    "read": read_file,
    "write": write_file,
    "edit": edit_file,
    "ls": list_directory,
    "grep": grep_files,
    "find": find_paths,
    "bash": run_bash,
}

#: Every action a worker can run: the tools plus the coordinator's internal ones.
WORKER_ACTIONS: dict[str, ToolFunction] = {
    **TOOLS,
    "_remove_temps": remove_temps,
    "_check_workspace": check_workspace,
    "_apply_changes": apply_changes,
    "_undo_changes": undo_changes,
    "_layer_open": open_layer,
    "_layer_diff": diff_layer,
    "_service": run_service,
}

__all__ = ["TOOLS", "WORKER_ACTIONS", "ToolFunction"]
