"""sandbx-pool: every agent tool call in a disposable worker process reached over ZeroMQ.

    from sandbx_pool import Pool, CancelToken

    async with Pool(workspace) as pool:
        outcome = await pool.call("read", {"path": "README.md"}, timeout=5)

The package has two sides that share one installed namespace:

* the coordinator (everything here but ``workers``): the Pool, its journal, the batch runner,
  the command line and the integrations;
* ``sandbx_pool.workers`` (the repository's ``workers/`` folder): what runs inside the template
  and its disposable workers. What each side may import of the other is stated once, in
  ``sandbx_pool.workers``'s docstring (``COORDINATOR_MAY_IMPORT``).

The public names below are loaded on first use (PEP 562), not at import: the template runs
``sandbx_pool.workers.template``, and importing it must not load the coordinator (asyncio,
pyzmq, loguru) into every worker it forks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandbx_pool.cancel import CancelToken
    from sandbx_pool.config import Config, JournalPolicy, load_config
    from sandbx_pool.errors import (
        ConfigError,
        ImageError,
        JournalError,
        JournalLocked,
        LayerUnavailable,
        PoolClosed,
        PoolNotStarted,
        SandbxPoolError,
        ServiceNotRunning,
        TemplateLost,
        UndoConflict,
        WorkspaceError,
    )
    from sandbx_pool.images.image import Image
    from sandbx_pool.images.store import ImageStore
    from sandbx_pool.layers import Layer
    from sandbx_pool.outcome import KilledBy, Outcome, Status
    from sandbx_pool.output import OutputChunk
    from sandbx_pool.pool import Pool, PoolState
    from sandbx_pool.services import Service, ServiceStatus
    from sandbx_pool.workers.protocol import Limits
    from sandbx_pool.workers.schemas import tool_schemas

#: Where each public name lives.
_HOMES = {
    "CancelToken": "sandbx_pool.cancel",
    "Config": "sandbx_pool.config",
    "JournalPolicy": "sandbx_pool.config",
    "load_config": "sandbx_pool.config",
    "ConfigError": "sandbx_pool.errors",
    "ImageError": "sandbx_pool.errors",
    "Image": "sandbx_pool.images.image",
    "ImageStore": "sandbx_pool.images.store",
    "JournalError": "sandbx_pool.errors",
    "JournalLocked": "sandbx_pool.errors",
    "LayerUnavailable": "sandbx_pool.errors",
    "PoolClosed": "sandbx_pool.errors",
    "PoolNotStarted": "sandbx_pool.errors",
    "SandbxPoolError": "sandbx_pool.errors",
    "ServiceNotRunning": "sandbx_pool.errors",
    "TemplateLost": "sandbx_pool.errors",
    "UndoConflict": "sandbx_pool.errors",
    "WorkspaceError": "sandbx_pool.errors",
    "Layer": "sandbx_pool.layers",
    "KilledBy": "sandbx_pool.outcome",
    "Outcome": "sandbx_pool.outcome",
    "Status": "sandbx_pool.outcome",
    "OutputChunk": "sandbx_pool.output",
    "Pool": "sandbx_pool.pool",
    "PoolState": "sandbx_pool.pool",
    "Service": "sandbx_pool.services",
    "ServiceStatus": "sandbx_pool.services",
    "Limits": "sandbx_pool.workers.protocol",
    "tool_schemas": "sandbx_pool.workers.schemas",
}

__all__ = [
    "CancelToken",
    "Config",
    "ConfigError",
    "Image",
    "ImageError",
    "ImageStore",
    "JournalError",
    "JournalLocked",
    "JournalPolicy",
    "KilledBy",
    "Layer",
    "LayerUnavailable",
    "Limits",
    "Outcome",
    "OutputChunk",
    "Pool",
    "PoolClosed",
    "PoolNotStarted",
    "PoolState",
    "SandbxPoolError",
    "Service",
    "ServiceNotRunning",
    "ServiceStatus",
    "Status",
    "TemplateLost",
    "UndoConflict",
    "WorkspaceError",
    "load_config",
    "tool_schemas",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'sandbx_pool' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
