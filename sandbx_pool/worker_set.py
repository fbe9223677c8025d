"""The pool's workers and the calls waiting for one: which call gets which worker, how many
workers to fork, what each message from the template or a worker means for them.

Decide, then act. Each method updates the set's state (its queues and counts, and its
workers' lifecycle states) and returns the actions to take, as values (scheduling_actions.py);
the pool performs them at once, in order, in one place:

    Pool: an event (a call, a Ready, a template message, a RetryAfter's timer)
        |  WorkerSet method: its state updated, list[Action] returned
        v
    Pool._act(actions): Fork, Assign, Fail, Watch, Signal, Gone, RetryAfter, CancelRetry

The set itself never forks, signals, opens a pidfd, resolves a future or sets a timer, and
needs no clock: it asks for a RetryAfter and is called back (``retry``). So its rules are tested
without a process (tests/test_worker_set.py): the test feeds it the template's and the workers'
messages and reads the actions back. The one question it asks of the world is how many more
workers the coordinator's descriptors can pay for (``room``, descriptors.py); the Worker objects
it makes carry futures of the running loop, which only the pool settles (Gone, and a call's
execution).

A worker's life here: STARTING (the template forked it) -> IDLE (its pid is known from the
template's Spawned and it has connected with Ready, in either order) -> BUSY (a call took it)
-> EXITED (the template reaped it, or died), or QUARANTINED when it would not die after
SIGKILL. Only a pid the template has not reaped (``by_pid``) is ever signalled: a reaped one may
already be another process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections import deque
from collections.abc import Callable

from sandbx_pool.call_state import CallState, describe_exit
from sandbx_pool.errors import WorkersFailToStart
from sandbx_pool.logs import logger
from sandbx_pool.scheduling_actions import (
    Action,
    Assign,
    CancelRetry,
    Fail,
    Fork,
    Gone,
    RetryAfter,
    Signal,
    Watch,
)
from sandbx_pool.worker_handle import Worker, WorkerState
from sandbx_pool.workers.protocol import Exited, Ready, Spawned, SpawnFailed

#: Workers in a row that may exit before connecting (a bug, a limit, a host that refuses what a
#: worker sets up, the coordinator's socket removed from under it) before the calls waiting for
#: one are failed. Unbounded, the template would fork and the calls wait, forever.
MAX_FAILED_STARTS = 5

#: Readies that arrived before the template's Spawned for their token, kept until it comes.
#: Bounded, so that a flood of forged Readies cannot grow the coordinator's memory.
MAX_EARLY_READY = 1024


#: While calls wait for descriptors and no worker is alive to free some: look again this often,
#: this many times, then fail the waiting calls.
STARVED_RETRY_S = 0.05
MAX_STARVED_TRIES = 40


class WorkerSet:
    def __init__(
        self,
        *,
        max_workers: int,
        prefork: int,
        room: Callable[[], int] = lambda: MAX_EARLY_READY,
    ) -> None:
        self.max_workers = max_workers
        self.prefork = prefork
        #: How many more workers the coordinator's descriptors can pay for (descriptors.py).
        self._room = room
        #: False until the pool is open, and again once it closes or loses its template.
        self.forking = False
        self.by_token: dict[str, Worker] = {}
        #: Workers the template forked and has not reaped: only their pids are theirs to signal.
        self.by_pid: dict[int, Worker] = {}
        self.idle: deque[Worker] = deque()
        self.waiting: deque[CallState] = deque()
        self.busy = 0
        self.starting = 0
        #: Whether the last worker to end its start exited instead of connecting.
        self.starts_failing = False
        #: Workers that exited before connecting, in a row, for the calls waiting now.
        self.failed_starts = 0
        self._early_ready: dict[str, int | None] = {}
        #: A RetryAfter is outstanding: calls wait for want of descriptors (see _starved).
        self.retry_pending = False
        self.starved_tries = 0

    def __repr__(self) -> str:
        return (
            f"Calls: {self.busy} active, {len(self.waiting)} queued | Workers: "
            f"{len(self.idle)} idle, {self.starting} starting, {len(self.quarantined())} stuck"
        )

    def quarantined(self) -> list[Worker]:
        return [w for w in self.by_token.values() if w.state is WorkerState.QUARANTINED]

    # -- calls ---------------------------------------------------------------------------------

    def enqueue(self, call: CallState) -> list[Action]:
        """``call`` wants a worker: an Assign (now or later) or a Fail answers it."""
        if self.starts_failing and not self.waiting:
            # The first call to wait since starts began failing gets its full count of tries,
            # whatever spares failed before it came.
            self.failed_starts = 0
        self.waiting.append(call)
        return [*self._assign(), *self._replenish(eager=False)]

    def withdraw(self, call: CallState, given: Worker | None) -> list[Action]:
        """``call`` was killed while waiting; ``given`` is the worker an Assign gave it meanwhile
        (None if none did, or a Fail answered it): keep that worker."""
        if given is not None:
            self.busy -= 1
            if given.state is WorkerState.EXITED:
                # It died between its Assign and now: nobody gets it; another is forked.
                return [*self._assign(), *self._replenish()]
            # The worker never saw the call: it serves the next one.
            given.state = WorkerState.IDLE
            self.idle.appendleft(given)
            return self._assign()
        with contextlib.suppress(ValueError):
            self.waiting.remove(call)
        return []

    def widen(self, max_workers: int) -> list[Action]:
        """Let at least ``max_workers`` calls run at once from now on (never fewer than now);
        calls that were waiting for a slot take the new ones."""
        if max_workers <= self.max_workers:
            return []
        self.max_workers = max_workers
        return [*self._replenish(), *self._assign()]

    def _assign(self) -> list[Action]:
        actions: list[Action] = []
        while self.waiting and self.idle and self.busy < self.max_workers:
            call = self.waiting.popleft()
            worker = self.idle.popleft()
            worker.state = WorkerState.BUSY
            self.busy += 1
            actions.append(Assign(call, worker))
        return actions

    def replenish(self) -> list[Action]:
        """Fork what is missing (the pool has just opened)."""
        return self._replenish()

    def _replenish(self, *, eager: bool = True) -> list[Action]:
        """Ask the template for the workers we lack.

        Workers are wanted for the queued calls that could run now (``workers`` bounds how many
        are busy: a queue of 300 behind 4 busy workers needs none yet) plus spares: ``eager``
        (a call just finished, a worker exited) keeps ``prefork`` spares; not eager (a call is
        being dispatched) keeps one, and the rest waits until the call is done, because a fork
        and a worker's start-up compete for the same cores as the call being served. While
        workers fail to start, no spares: only a waiting call is worth another try.
        """
        if not self.forking:
            return []
        runnable = min(len(self.waiting), self.max_workers - self.busy)
        spares = 0 if self.starts_failing else min(self.prefork, self.max_workers)
        wanted = runnable + (spares if eager else min(spares, 1))
        missing = wanted - len(self.idle) - self.starting
        if missing <= 0:
            return []
        # Those still starting have not connected yet: their descriptors are not open yet.
        room = self._room() - self.starting
        if room < missing:
            missing = max(0, room)
            if missing == 0 and self.waiting:
                return self._starved()
        if missing <= 0:
            return []
        self.starved_tries = 0
        self.starting += missing
        return [Fork(missing)]

    def _starved(self) -> list[Action]:
        """Calls wait and no descriptor is left for a worker. Look again shortly: a worker that
        exited frees its connection on libzmq's thread, a moment after we hear of the exit.
        With no worker left to free any, the waiting calls fail after a bounded wait."""
        if self.live() == 0:
            self.starved_tries += 1
            if self.starved_tries > MAX_STARVED_TRIES:
                self.starved_tries = 0
                return self._fail_waiting(
                    WorkersFailToStart(
                        "out of file descriptors: the coordinator cannot afford a worker"
                        " (raise `ulimit -n`, or close what this process holds open)"
                    )
                )
        if self.retry_pending:
            return []
        self.retry_pending = True
        return [RetryAfter(STARVED_RETRY_S)]

    def retry(self) -> list[Action]:
        """The time of the outstanding RetryAfter has come: look at the descriptors again."""
        self.retry_pending = False
        return self._replenish()

    def stop_retrying(self) -> list[Action]:
        if not self.retry_pending:
            return []
        self.retry_pending = False
        return [CancelRetry()]

    def live(self) -> int:
        """Workers that hold descriptors of ours, or soon will: all but the exited."""
        alive = (WorkerState.IDLE, WorkerState.BUSY, WorkerState.QUARANTINED)
        return self.starting + sum(1 for w in self.by_token.values() if w.state in alive)

    def _owns_pid(self, worker: Worker) -> bool:
        """Whether the worker's pid is still its own: known from Spawned, not yet reaped."""
        return worker.pid is not None and self.by_pid.get(worker.pid) is worker

    def release(self, worker: Worker) -> list[Action]:
        """The call ``worker`` served is over (answered, killed or quarantined)."""
        worker.call = None
        if not self._owns_pid(worker):  # reaped mid-call (on_exited kept it findable): forget it
            self.by_token.pop(worker.token, None)
        self.busy -= 1
        return [*self._assign(), *self._replenish()]

    # -- messages ------------------------------------------------------------------------------

    def get(self, token: str) -> Worker | None:
        return self.by_token.get(token)

    def _worker(self, token: str) -> Worker:
        worker = self.by_token.get(token)
        if worker is None:
            worker = Worker(token, asyncio.get_running_loop())
            self.by_token[token] = worker
        return worker

    def on_ready(
        self, identity: bytes, message: Ready, known: Worker | None, peer_pid: int | None
    ) -> list[Action]:
        if message.token.encode() != identity:
            logger.warning("dropped a Ready whose token does not match its identity")
            return []
        if known is None:
            # Before the template's Spawned (they travel separately) or forged: keep who sent
            # it until Spawned says which process the token belongs to.
            self._early_ready[message.token] = peer_pid
            while len(self._early_ready) > MAX_EARLY_READY:
                self._early_ready.pop(next(iter(self._early_ready)))
            return []
        return self._accept_ready(known, peer_pid)

    def _accept_ready(self, worker: Worker, peer_pid: int | None) -> list[Action]:
        # A stranger may connect first under a token not yet in use; the connection's pid
        # (SO_PEERCRED) must be the one the template forked for it.
        if peer_pid is not None and peer_pid != worker.pid:
            logger.warning("dropped a Ready for worker {} sent by process {}", worker.pid, peer_pid)
            return []
        worker.ready = True
        return self._maybe_idle(worker)

    def on_spawned(self, message: Spawned) -> list[Action]:
        worker = self._worker(message.token)
        worker.pid = message.pid
        actions: list[Action] = [Watch(worker, message.pid)]
        self.by_pid[message.pid] = worker
        if message.token in self._early_ready:
            actions += self._accept_ready(worker, self._early_ready.pop(message.token))
        return actions + self._maybe_idle(worker)

    def on_exited(self, message: Exited) -> list[Action]:
        if message.pid not in self.by_pid:
            return []
        worker = self.by_pid.pop(message.pid)
        if worker.call is None:
            # With a call in flight, keep it findable: its Result may still be on its way.
            self.by_token.pop(worker.token, None)
        actions: list[Action] = []
        if worker.state is WorkerState.STARTING:
            self.starting -= 1
            if self.forking:  # not the pool closing, or its template dying
                actions += self._failed_to_start(message.returncode)
        elif worker.state is WorkerState.IDLE:
            with contextlib.suppress(ValueError):
                self.idle.remove(worker)
        elif worker.state is WorkerState.QUARANTINED:
            logger.info("stuck worker {} finally exited ({})", worker.pid, message.returncode)
        worker.state = WorkerState.EXITED
        gone = Gone(worker, message.returncode, message.usage, message.memory_killed)
        return [*actions, gone, *self._replenish()]

    def on_spawn_failed(self, message: SpawnFailed) -> list[Action]:
        """The template could not fork ``message.count`` of the workers asked for, even after
        its backoff (a fork bomb or another pool holds every pid it may have, or memory is
        short). Fail the calls that were waiting for them now: the template has already waited,
        and nothing says when a pid comes back. A later call asks again (no spares meanwhile)."""
        self.starting -= message.count
        self.starts_failing = True
        runnable = min(len(self.waiting), self.max_workers - self.busy)
        unserved = runnable - self.starting - len(self.idle)
        if unserved <= 0:
            return []
        error = WorkersFailToStart(f"no worker could be forked: {message.error}")
        logger.error("{}", error)
        return [Fail(self.waiting.popleft(), error) for _ in range(unserved)]

    def _failed_to_start(self, returncode: int) -> list[Action]:
        self.starts_failing = True
        self.failed_starts += 1
        if self.failed_starts < MAX_FAILED_STARTS or not self.waiting:
            return []
        self.failed_starts = 0
        error = WorkersFailToStart(
            f"no worker could start: {MAX_FAILED_STARTS} in a row exited before connecting"
            f" (the last: {describe_exit(returncode)}); the template's stderr says why"
        )
        # Each waiting call fails; a later call tries again, MAX_FAILED_STARTS forks at most,
        # and until one does, nothing is forked (replenish forks no spares meanwhile).
        return self._fail_waiting(error)

    def _fail_waiting(self, error: WorkersFailToStart) -> list[Action]:
        logger.error("{}", error)
        actions: list[Action] = []
        while self.waiting:
            actions.append(Fail(self.waiting.popleft(), error))
        return actions

    def _maybe_idle(self, worker: Worker) -> list[Action]:
        if worker.state is WorkerState.STARTING and worker.ready and worker.pid is not None:
            self.starts_failing = False
            self.failed_starts = 0
            self.starting -= 1
            worker.state = WorkerState.IDLE
            self.idle.append(worker)
            return self._assign()
        return []

    def _kill(self, worker: Worker) -> list[Action]:
        """SIGKILL for the worker's group, if its pid is still its own."""
        if worker.pid is None or not self._owns_pid(worker):
            return []
        starting = worker.state is WorkerState.STARTING
        return [Signal(worker.pid, signal.SIGKILL, starting=starting)]

    def on_template_lost(self) -> list[Action]:
        """No more forks, and every worker is gone with the template (PDEATHSIG)."""
        self.forking = False
        actions: list[Action] = []
        for worker in list(self.by_token.values()):
            actions += self._kill(worker)
            worker.state = WorkerState.EXITED
            actions.append(Gone(worker, -signal.SIGKILL))
        # No Exited will come: nobody we know reaps them now, and their pids are not ours.
        self.by_pid.clear()
        return actions

    def kill_all(self) -> list[Action]:
        """SIGKILL every worker's group, except those already stuck in the kernel."""
        actions: list[Action] = []
        for worker in list(self.by_token.values()):
            if worker.state is not WorkerState.QUARANTINED:
                actions += self._kill(worker)
        return actions
