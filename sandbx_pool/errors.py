"""Exceptions: misuse and broken infrastructure only. A tool's failure is an Outcome."""

from __future__ import annotations


class SandbxPoolError(Exception):
    """Base class of everything sandbx-pool raises."""


class PoolClosed(SandbxPoolError):
    """The pool is closing or closed; it takes no more calls."""


class PoolNotStarted(SandbxPoolError):
    """The pool was used before ``async with`` (or ``await pool.start()``)."""


class TemplateLost(SandbxPoolError):
    """The template process that forks workers died; the pool cannot start more calls."""


class WorkersFailToStart(SandbxPoolError):
    """Workers keep exiting before they connect; the calls waiting for one end as ``error``
    outcomes carrying this message (it is never raised to a caller)."""


class ConfigError(SandbxPoolError):
    """A configuration file or value is invalid; the message names the file and the key."""


class WorkspaceError(SandbxPoolError):
    """The pool's workspace is missing or not a directory (``Pool.start`` refuses it)."""


class JournalLocked(SandbxPoolError):
    """Another coordinator is writing this journal."""


class JournalError(SandbxPoolError):
    """The journal cannot be opened or written."""


class LayerUnavailable(SandbxPoolError):
    """``pool.layer`` cannot make a layer here: no overlay mounts (root without CAP_SYS_ADMIN,
    user namespaces refused, an old kernel). The message says why; so does sandbx-pool doctor."""


class ServiceNotRunning(SandbxPoolError):
    """A write or resize for a service that has ended (or not started yet): the message says
    how it ended (sandbx_pool.services)."""


class UndoConflict(SandbxPoolError):
    """``undo`` refused: a path the call changed was changed again since (by a later call,
    named, or outside the pool). Nothing was changed."""

    def __init__(self, message: str, path: str, later_call: str | None) -> None:
        super().__init__(message)
        self.path = path
        self.later_call = later_call


class ImageError(SandbxPoolError):
    """An image could not be pulled or stored: skopeo's failure, a blob that does not match its
    digest, a layer entry that would land outside its layer, a reference the store does not
    hold. The message is one line naming the reference, the blob or the entry; nothing of the
    image is left half-stored."""
