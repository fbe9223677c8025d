"""The coordinator's view of one worker process: its lifecycle, its group, its exit."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from sandbx_pool import tree_usage
from sandbx_pool.tree_usage import TreeFigures
from sandbx_pool.workers.procfs import children
from sandbx_pool.workers.protocol import Usage

#: After SIGKILL a process the kernel does not hold is gone within a millisecond or two. One still
#: there after this long with a thread in uninterruptible sleep (state D) is held by the kernel,
#: a hung filesystem most likely, and may stay for minutes: it is quarantined at once instead of
#: after all of ``kill_wait_s``, so a stop on a hung mount releases its caller in about this
#: long. Too short costs nothing worse than a worker reported stuck that dies a moment later (it
#: is reaped as any quarantined worker is); too long is added to every stop on a hung mount.
KERNEL_HOLD_SETTLE_S = 0.05
#: Before a command is judged beyond a SIGTERM's reach (every process in state D), it is seen so
#: twice this far apart: a process is in state D for a moment many times in its life (a page read
#: from disk, an exec), and a grace taken from a command that could use it loses its output.
KERNEL_HOLD_RECHECK_S = 0.02


class Stopped(NamedTuple):
    """How ``Worker.stop`` went."""

    #: SIGTERM came first: a bash worker then answers with the output until the kill.
    warned: bool
    #: It would not die after SIGKILL: the kernel holds it, and it is quarantined.
    quarantined: bool


class WorkerState(enum.IntEnum):
    STARTING = 0  # forked, not yet both Spawned (pid known) and Ready (connected)
    IDLE = 1  # connected, waiting for its one call
    BUSY = 2  # running a call
    QUARANTINED = 3  # SIGKILLed but not dead (stuck in the kernel); no longer counts as busy
    EXITED = 4


class Worker:
    def __init__(self, token: str, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.token = token
        self.identity = token.encode()
        self.pid: int | None = None
        self.ready = False
        self.state = WorkerState.STARTING
        self.call: Any = None
        # Two views of its end: ``gone`` from our own pidfd, the moment the process is dead
        # (what a kill waits for), or the template's notice if that comes first; ``exited``
        # from the template, once it has reaped the worker and knows its status (what a crash
        # report needs). The pidfd is a hop shorter.
        self.gone: asyncio.Future[None] = loop.create_future()
        self.exited: asyncio.Future[int] = loop.create_future()
        self._pidfd: int | None = None
        self._pidfd_watched = False
        self.wchan: str | None = None
        #: The process the kernel holds: the worker itself, or (bash) a descendant of it.
        self.stuck_pid: int | None = None
        self.quarantined_at: float | None = None
        #: From the template's exit notice: what the worker's tree cost, and whether the
        #: call's memory limit killed a process of it (workers.usage).
        self.exit_usage: Usage | None = None
        self.memory_killed = False
        #: What the worker's tree had cost when the SIGKILL went (tree_usage).
        self.tree_at_kill: TreeFigures | None = None

    def __repr__(self) -> str:
        return f"<Worker pid={self.pid} {self.state.name}>"

    def signal_group(self, sig: int) -> None:
        """Signal the worker's process group (it is its session and group leader)."""
        if self.pid is None or self.exited.done():
            return
        signal_worker(self.pid, sig, starting=self.state is WorkerState.STARTING)

    def watch(self, pid: int) -> None:
        """Learn our pid (the template forked it) and hold a pidfd to learn of its death."""
        self.pid = pid
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._set_gone()

    def _set_gone(self) -> None:
        self.stop_watching()
        if not self.gone.done():
            self.gone.set_result(None)

    def stop_watching(self) -> None:
        """Release the pidfd (the pool is closing; a stuck worker may outlive it)."""
        # Taken before it is closed: a pool's finalizer (release_pidfd) may run on another
        # thread meanwhile (an environment's loop thread at exit), and must not close it twice.
        fd, self._pidfd = self._pidfd, None
        if fd is not None:
            if self._pidfd_watched:
                self._loop.remove_reader(fd)
            os.close(fd)

    def release_pidfd(self) -> None:
        """Close the pidfd without the event loop: for a pool's finalizer, when the loop may be
        closed or running on another thread (a closed descriptor leaves epoll by itself)."""
        if self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            os.close(fd)

    async def wait_gone(self, within_s: float) -> bool:
        """True once the process is dead, False if it is still alive after ``within_s``."""
        # Only a kill waits on the pidfd: a call that answered ends with the template's Exited
        # notice, and two epoll changes per worker are coordinator time on every call.
        if self._pidfd is not None and not self._pidfd_watched:
            self._pidfd_watched = True
            self._loop.add_reader(self._pidfd, self._set_gone)
        try:
            await asyncio.wait_for(asyncio.shield(self.gone), within_s)
        except TimeoutError:
            return False
        return True

    async def stop(self, *, grace_s: float, kill_wait_s: float) -> Stopped:
        """Kill the process group: SIGTERM and ``grace_s`` to clean up first if that is > 0,
        then SIGKILL. Quarantined when the worker would not die within ``kill_wait_s`` of the
        SIGKILL (stuck in the kernel); its caller is released all the same.

        The kernel's uninterruptible sleep (state D) shortens both waits: no SIGTERM reaches a
        process in it, so a command whose every process sleeps there (at the kill, or
        ``KERNEL_HOLD_SETTLE_S`` into the grace, once the rest of a pipeline took its SIGTERM)
        gets SIGKILL at once; and a worker still holding a thread there that long after SIGKILL
        is quarantined without waiting out the rest of ``kill_wait_s``."""
        warned = grace_s > 0 and not await self._stays_held(self.command_held_by_kernel)
        if warned:
            self.signal_group(signal.SIGTERM)
            settle_s = min(KERNEL_HOLD_SETTLE_S, grace_s)
            if await self.wait_gone(settle_s):
                return Stopped(warned=True, quarantined=False)
            held = await self._stays_held(self.command_held_by_kernel)
            rest_s = max(0.0, grace_s - settle_s - KERNEL_HOLD_RECHECK_S)
            if not held and await self.wait_gone(rest_s):
                return Stopped(warned=True, quarantined=False)
        if self.pid is not None and not self.exited.done():
            self.tree_at_kill = tree_usage.snapshot([self.pid, *descendants(self.pid)])
        self.signal_group(signal.SIGKILL)
        settle_s = min(KERNEL_HOLD_SETTLE_S, kill_wait_s)
        if await self.wait_gone(settle_s):
            return Stopped(warned=warned, quarantined=False)
        if not self.held_by_kernel() and await self.wait_gone(kill_wait_s - settle_s):
            return Stopped(warned=warned, quarantined=False)
        self.quarantine()
        return Stopped(warned=warned, quarantined=True)

    async def _stays_held(self, held: Callable[[], bool]) -> bool:
        """Whether ``held()`` is true now and again ``KERNEL_HOLD_RECHECK_S`` later, the worker
        still alive: a moment in state D (a page read from disk, an exec) is over by then."""
        if not held():
            return False
        return not await self.wait_gone(KERNEL_HOLD_RECHECK_S) and held()

    def held_by_kernel(self) -> bool:
        """Whether a process of the worker's tree has a thread in uninterruptible sleep."""
        if self.pid is None:
            return False
        return any(_stuck_thread(pid) is not None for pid in [self.pid, *descendants(self.pid)])

    def command_held_by_kernel(self) -> bool:
        """Whether every process the worker's call runs, but those waiting for a child, is in
        uninterruptible sleep: then none of them can take a SIGTERM, and a grace to clean up
        would only hold the caller (a ``cat`` of a file on a hung mount)."""
        if self.pid is None:
            return False
        leaves = [pid for pid in descendants(self.pid) if not children(pid)]
        return bool(leaves) and all(_stuck_thread(pid) is not None for pid in leaves)

    def mark_exited(
        self, returncode: int, usage: Usage | None = None, *, memory_killed: bool = False
    ) -> None:
        if not self.exited.done():
            self.exit_usage, self.memory_killed = usage, memory_killed
        self.state = WorkerState.EXITED
        self._set_gone()
        if not self.exited.done():
            self.exited.set_result(returncode)

    def quarantine(self) -> None:
        self.state = WorkerState.QUARANTINED
        self.quarantined_at = time.time()
        if self.pid is None:
            return
        # A worker that runs a program (bash, grep's rg) waits for it: the process to report is
        # the one in uninterruptible sleep (state D), which may be a descendant, and in a
        # threaded one (rg) the thread that is, while its main thread waits for it.
        tree = [self.pid, *descendants(self.pid)]
        self.stuck_pid, self.wchan = self.pid, read_proc(self.pid, "wchan")
        for pid in tree:
            thread = _stuck_thread(pid)
            if thread is not None:
                self.stuck_pid, self.wchan = pid, read_proc(pid, f"task/{thread}/wchan")
                break

    def proc_state(self) -> str | None:
        return proc_state(self.pid) if self.pid is not None else None

    def stuck_report(self) -> dict[str, Any]:
        """For ``Pool.stuck_workers``: where the kernel holds this quarantined worker."""
        return {
            "pid": self.pid,
            "state": self.proc_state(),
            "stuck_pid": self.stuck_pid,
            "wchan": self.wchan,
            "since": self.quarantined_at,
        }


def signal_worker(pid: int, sig: int, *, starting: bool) -> None:
    """Signal the process group the worker ``pid`` leads, and ``pid`` itself while it is
    ``starting``. The caller knows the pid is still the worker's (not yet reaped)."""
    # Only "no such process" is expected: the group may be gone already, or (for a worker
    # still starting) not made yet, which is why the pid itself is signalled too.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)
    if starting:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def read_proc(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/{name}") as f:
            return f.read().strip() or None
    except OSError:
        return None


def proc_state(pid: int, *, thread: int | None = None) -> str | None:
    """The State: line of /proc/PID/status ("D (disk sleep)"), or of one of its threads',
    None once it is gone."""
    status = "status" if thread is None else f"task/{thread}/status"
    for line in (read_proc(pid, status) or "").splitlines():
        if line.startswith("State:"):
            return line.split(":", 1)[1].strip()
    return None


def _stuck_thread(pid: int) -> int | None:
    """A thread of ``pid`` in uninterruptible sleep (the main thread first), or None."""
    if (proc_state(pid) or "").startswith("D"):
        return pid
    try:
        threads = sorted(int(tid) for tid in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return None
    for tid in threads[:64]:  # bounded: rg runs a few threads, not thousands
        if (proc_state(pid, thread=tid) or "").startswith("D"):
            return tid
    return None


def descendants(pid: int) -> list[int]:
    """The process's descendants, breadth first."""
    found: list[int] = []
    queue = [pid]
    while queue and len(found) < 1024:  # bounded: a fork bomb is not ours to walk
        below = children(queue.pop(0))
        found += below
        queue += below
    return found


def describe_stuck(worker: Worker) -> str:
    described = f"pid {worker.pid}, state {worker.proc_state()}, wchan {worker.wchan}"
    if worker.stuck_pid not in (None, worker.pid):
        described += f" (of its descendant {worker.stuck_pid})"
    return described
