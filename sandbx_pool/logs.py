"""The package's logger, and the sinks the command line gives it.

Every module logs through ``sandbx_pool.logs.logger`` (loguru's), so that this module runs before
the first message. Following loguru's advice for libraries, ``sandbx_pool`` is disabled here
until an application calls ``logger.enable("sandbx_pool")`` (the CLI does, through
``configure_logging``): a library logs but never chooses sinks.

One exception, for the command line's sake: importing loguru costs about 50 ms (it imports
inspect, logging, multiprocessing and calendar), a sixth of a one-shot ``sandbx-pool call``,
which at its default verbosity prints nothing but warnings and errors. So when the command line
is the program (its module is loaded before this one) and loguru is not loaded yet, ``logger``
is a ``_DeferredLogger``: loguru is imported by the first message that can be shown. An
application that uses the library gets loguru's own logger, as before.
"""

from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Final

from sandbx_pool.terminal import escape_controls, unguarded

if TYPE_CHECKING:
    from loguru import Logger, Record

__all__ = ["configure_logging", "logger"]

_LEVELS: Final = ["ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]
_NUMBERS: Final = {"TRACE": 5, "DEBUG": 10, "INFO": 20, "WARNING": 30, "ERROR": 40}

#: The command line's modules, loaded before this one when it is the program.
_COMMAND_LINE: Final = "sandbx_pool.cli.main"


class _DeferredLogger:
    """The methods the package calls, each importing loguru only when its message would be
    shown: at or above the level configure_logging set (before it, nothing is shown: the
    package is disabled, as a library's should be)."""

    def __init__(self) -> None:
        self.level: str | None = None
        self._real: Logger | None = None
        # The journal's writer thread logs too: one of two first messages installs the sinks.
        self._loading = threading.Lock()

    def configure(self, level: str, json_file: str | None) -> None:
        if json_file is None and _NUMBERS[level] >= _NUMBERS["WARNING"]:
            self.level = level  # loguru comes with the first warning, if one ever comes
        else:
            # A JSON file is created now (a bad path is the command's usage error), and a
            # verbose level has messages coming at once: loguru is needed now.
            self._load(level, json_file)

    def _load(self, level: str, json_file: str | None) -> Logger:
        with self._loading:
            if self._real is None:
                from loguru import logger as real

                _install_sinks(real, level, json_file)
                self.level, self._real = level, real
            return self._real

    def _shown(self, level: str) -> Logger | None:
        if self._real is not None:
            return self._real
        if self.level is None or _NUMBERS[level] < _NUMBERS[self.level]:
            return None
        return self._load(self.level, None)

    def _log(self, level: str, message: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        real = self._shown(level)
        if real is not None:
            # depth 2: the record names our caller (whose module enable/disable goes by).
            real.opt(depth=2).log(level, message, *args, **kwargs)

    def debug(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._log("DEBUG", message, args, kwargs)

    def info(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._log("INFO", message, args, kwargs)

    def warning(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._log("WARNING", message, args, kwargs)

    def error(self, message: str, *args: Any, **kwargs: Any) -> None:
        self._log("ERROR", message, args, kwargs)

    def exception(self, message: str, *args: Any, **kwargs: Any) -> None:
        real = self._shown("ERROR")
        if real is not None:
            real.opt(depth=1, exception=True).error(message, *args, **kwargs)

    def remove(self) -> None:
        """Close the sinks (loguru's remove), if loguru was ever needed."""
        if self._real is not None:
            self._real.remove()


#: The stderr sink's line; ``{extra[shown]}`` is the message as a terminal may show it.
_FORMAT: Final = "<green>{time:HH:mm:ss.SSS}</green> <level>{level: <7}</level> {extra[shown]}\n"


def _install_sinks(real: Logger, level: str, json_file: str | None) -> None:
    real.remove()
    # Past the command line's guard (sandbx_pool.terminal): through it, loguru's colours would
    # be escaped too. The message is escaped here instead: it names call ids, paths, errors.
    stream = unguarded(sys.stderr)
    terminal = stream.isatty()

    def line(record: Record) -> str:
        message = record["message"]
        record["extra"]["shown"] = escape_controls(message) if terminal else message
        return _FORMAT + ("{exception}" if record["exception"] else "")

    real.add(stream, level=level, format=line)
    if json_file is not None:
        real.add(json_file, level="DEBUG", serialize=True)
    real.enable("sandbx_pool")


if _COMMAND_LINE in sys.modules and "loguru" not in sys.modules:
    # The deferred logger has the methods the package calls, which is all mypy is told.
    logger: Logger = _DeferredLogger()  # type: ignore[assignment]
else:
    from loguru import logger

    logger.disable("sandbx_pool")


def configure_logging(verbosity: int = 0, json_file: str | None = None) -> None:
    """Readable logs on stderr at a level set by -v/-q; optionally JSON lines in a file too."""
    level = _LEVELS[max(0, min(len(_LEVELS) - 1, 1 + verbosity))]
    if isinstance(logger, _DeferredLogger):
        logger.configure(level, json_file)
    else:
        _install_sinks(logger, level, json_file)
