"""The package's logger, and the sinks the command line gives it.

Every module logs through ``sandbx_pool.logs.logger`` (loguru's), so that this module runs before
the first message. Following loguru's advice for libraries, ``sandbx_pool`` is disabled here
until an application calls ``logger.enable("sandbx_pool")`` (the CLI does, through
``configure_logging``): a library logs but never chooses sinks.
"""

from __future__ import annotations

import sys

from loguru import logger

logger.disable("sandbx_pool")

__all__ = ["configure_logging", "logger"]

_LEVELS = ["ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]


def configure_logging(verbosity: int = 0, json_file: str | None = None) -> None:
    """Readable logs on stderr at a level set by -v/-q; optionally JSON lines in a file too."""
    index = max(0, min(len(_LEVELS) - 1, 1 + verbosity))
    logger.remove()
    logger.add(
        sys.stderr,
        level=_LEVELS[index],
        format="<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> {message}",
    )
    if json_file is not None:
        logger.add(json_file, level="DEBUG", serialize=True)
    logger.enable("sandbx_pool")
