"""What the scheduler (worker_set.py) decides and the pool does (``Pool._act``): one small
value per kind of side effect.

Each action carries what doing it needs, as the WorkerSet saw it when it decided: a Signal
carries the pid and whether the worker was still starting, because by the time the pool sends
it the WorkerSet may already count the worker as gone. The order of a list is the order the
effects must happen in (a worker is signalled before its futures say it is gone, its pidfd is
opened before it is given a call).
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbx_pool.call_state import CallState
from sandbx_pool.errors import WorkersFailToStart
from sandbx_pool.worker_handle import Worker
from sandbx_pool.workers.protocol import Usage


@dataclass(frozen=True, slots=True)
class Fork:
    """Ask the template for ``count`` more workers."""

    count: int


@dataclass(frozen=True, slots=True)
class Assign:
    """``call`` has ``worker``: resolve ``call.assigned`` with it."""

    call: CallState
    worker: Worker


@dataclass(frozen=True, slots=True)
class Fail:
    """``call`` gets no worker: fail ``call.assigned`` with ``error``."""

    call: CallState
    error: WorkersFailToStart


@dataclass(frozen=True, slots=True)
class Watch:
    """The template forked ``worker`` as ``pid``: hold a pidfd to learn of its death."""

    worker: Worker
    pid: int


@dataclass(frozen=True, slots=True)
class Signal:
    """Send ``signum`` to the group the worker ``pid`` leads, and to ``pid`` itself if it was
    ``starting`` (its group may not be made yet). Decided only while the pid is the worker's:
    once the template has reaped it, the pid may be another process's."""

    pid: int
    signum: int
    starting: bool = False


@dataclass(frozen=True, slots=True)
class Gone:
    """``worker`` is dead (``returncode`` as subprocess gives it): settle its futures, close its
    pidfd. (The WorkerSet has already counted it as exited.)"""

    worker: Worker
    returncode: int
    #: What the worker's tree cost, and whether its memory limit killed in it: the
    #: template's figures (Exited), for a call that could not answer.
    usage: Usage | None = None
    memory_killed: bool = False


@dataclass(frozen=True, slots=True)
class RetryAfter:
    """Call ``WorkerSet.retry()`` in ``seconds`` (calls wait for descriptors; see _starved)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class CancelRetry:
    """The RetryAfter outstanding is not wanted any more."""


Action = Fork | Assign | Fail | Watch | Signal | Gone | RetryAfter | CancelRetry

__all__ = [
    "Action",
    "Assign",
    "CancelRetry",
    "Fail",
    "Fork",
    "Gone",
    "RetryAfter",
    "Signal",
    "Watch",
]
