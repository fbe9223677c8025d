"""sandbx-pool: every agent tool call in a disposable worker process reached over ZeroMQ.

from sandbx_pool import Pool, CancelToken

async with Pool(workspace) as pool:
    outcome = await pool.call("read", {"path": "README.md"}, timeout=5)
"""

from loguru import logger

from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import Config, JournalPolicy, load_config
from sandbx_pool.errors import (
    ConfigError,
    JournalError,
    JournalLocked,
    PoolClosed,
    PoolNotStarted,
    SandbxPoolError,
    TemplateLost,
)
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.pool import Pool, PoolState
from workers.protocol import Limits
from workers.schemas import tool_schemas

# A library logs but never chooses sinks: applications opt in with logger.enable("sandbx_pool").
logger.disable("sandbx_pool")
logger.disable("workers")

__all__ = [
    "CancelToken",
    "Config",
    "ConfigError",
    "JournalError",
    "JournalLocked",
    "JournalPolicy",
    "KilledBy",
    "Limits",
    "Outcome",
    "Pool",
    "PoolClosed",
    "PoolNotStarted",
    "PoolState",
    "SandbxPoolError",
    "Status",
    "TemplateLost",
    "load_config",
    "tool_schemas",
]
