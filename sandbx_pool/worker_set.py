"""The pool's workers and the calls waiting for one: which call gets which worker, how many
workers to fork, what each message from the template or a worker means for them.

Decisions only, all synchronous: methods update state and return; the pool does the I/O
(sending a call, signalling a group) afterwards. So the scheduling can be read, and tested,
without the event loop's other business in the way.

A worker's life here: STARTING (the template forked it) -> IDLE (its pid is known from the
template's Spawned and it has connected with Ready, in either order) -> BUSY (a call took it)
-> gone (the template reaped it), or QUARANTINED when it would not die after SIGKILL.
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
        spawn: Callable[[int], None],
        room: Callable[[], int] = lambda: MAX_EARLY_READY,
    ) -> None:
        self.max_workers = max_workers
        self.prefork = prefork
        self._spawn = spawn
        #: How many more workers the coordinator's descriptors can pay for (descriptors.py).
        self._room = room
        #: False until the pool is open, and again once it closes or loses its template.
        self.forking = False
        self.by_token: dict[str, Worker] = {}
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
        #: Looks at the descriptors again while calls wait for want of them (see _starved).
        self._retry: asyncio.TimerHandle | None = None
        self.starved_tries = 0

    def __repr__(self) -> str:
        return (
            f"Calls: {self.busy} active, {len(self.waiting)} queued | Workers: "
            f"{len(self.idle)} idle, {self.starting} starting, {len(self.quarantined())} stuck"
        )

    def quarantined(self) -> list[Worker]:
        return [w for w in self.by_token.values() if w.state is WorkerState.QUARANTINED]

    # -- calls ---------------------------------------------------------------------------------

    def enqueue(self, call: CallState) -> None:
        """``call`` wants a worker: ``call.assigned`` resolves when it has one."""
        if self.starts_failing and not self.waiting:
            # The first call to wait since starts began failing gets its full count of tries,
            # whatever spares failed before it came.
            self.failed_starts = 0
        self.waiting.append(call)
        self.assign()
        self.replenish(eager=False)

    def withdraw(self, call: CallState) -> None:
        """``call`` was killed while waiting; if a worker was assigned meanwhile, keep it."""
        if call.assigned.done() and call.assigned.exception() is not None:
            return  # failed for want of a worker: there is none to give back
        if call.assigned.done():
            # The worker never saw the call: it serves the next one.
            worker = call.assigned.result()
            self.busy -= 1
            worker.state = WorkerState.IDLE
            self.idle.appendleft(worker)
            self.assign()
            return
        with contextlib.suppress(ValueError):
            self.waiting.remove(call)

    def widen(self, max_workers: int) -> None:
        """Let at least ``max_workers`` calls run at once from now on (never fewer than now);
        calls that were waiting for a slot take the new ones."""
        if max_workers <= self.max_workers:
            return
        self.max_workers = max_workers
        self.replenish()
        self.assign()

    def assign(self) -> None:
        while self.waiting and self.idle and self.busy < self.max_workers:
            call = self.waiting.popleft()
            worker = self.idle.popleft()
            worker.state = WorkerState.BUSY
            self.busy += 1
            call.assigned.set_result(worker)

    def replenish(self, *, eager: bool = True) -> None:
        """Ask the template for the workers we lack.

        Workers are wanted for the queued calls that could run now (``workers`` bounds how many
        are busy: a queue of 300 behind 4 busy workers needs none yet) plus spares: ``eager``
        (a call just finished, a worker exited) keeps ``prefork`` spares; not eager (a call is
        being dispatched) keeps one, and the rest waits until the call is done, because a fork
        and a worker's start-up compete for the same cores as the call being served. While
        workers fail to start, no spares: only a waiting call is worth another try.
        """
        if not self.forking:
            return
        runnable = min(len(self.waiting), self.max_workers - self.busy)
        spares = 0 if self.starts_failing else min(self.prefork, self.max_workers)
        wanted = runnable + (spares if eager else min(spares, 1))
        missing = wanted - len(self.idle) - self.starting
        if missing <= 0:
            return
        # Those still starting have not connected yet: their descriptors are not open yet.
        room = self._room() - self.starting
        if room < missing:
            missing = max(0, room)
            if missing == 0 and self.waiting:
                self._starved()
        if missing > 0:
            self.starved_tries = 0
            self.starting += missing
            self._spawn(missing)

    def _starved(self) -> None:
        """Calls wait and no descriptor is left for a worker. Look again shortly: a worker that
        exited frees its connection on libzmq's thread, a moment after we hear of the exit.
        With no worker left to free any, the waiting calls fail after a bounded wait."""
        if self.live() == 0:
            self.starved_tries += 1
            if self.starved_tries > MAX_STARVED_TRIES:
                self.starved_tries = 0
                self._fail_waiting(
                    WorkersFailToStart(
                        "out of file descriptors: the coordinator cannot afford a worker"
                        " (raise `ulimit -n`, or close what this process holds open)"
                    )
                )
                return
        if self._retry is None or self._retry.cancelled():
            loop = asyncio.get_running_loop()
            self._retry = loop.call_later(STARVED_RETRY_S, self._retried)

    def _retried(self) -> None:
        self._retry = None
        self.replenish()

    def live(self) -> int:
        """Workers that hold descriptors of ours, or soon will: all but the exited."""
        alive = (WorkerState.IDLE, WorkerState.BUSY, WorkerState.QUARANTINED)
        return self.starting + sum(1 for w in self.by_token.values() if w.state in alive)

    def release(self, worker: Worker) -> None:
        """The call ``worker`` served is over (answered, killed or quarantined)."""
        worker.call = None
        if worker.exited.done():
            self.by_token.pop(worker.token, None)
        self.busy -= 1
        self.assign()
        self.replenish()

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
    ) -> None:
        if message.token.encode() != identity:
            logger.warning("dropped a Ready whose token does not match its identity")
            return
        if known is None:
            # Before the template's Spawned (they travel separately) or forged: keep who sent
            # it until Spawned says which process the token belongs to.
            self._early_ready[message.token] = peer_pid
            while len(self._early_ready) > MAX_EARLY_READY:
                self._early_ready.pop(next(iter(self._early_ready)))
            return
        self._accept_ready(known, peer_pid)

    def _accept_ready(self, worker: Worker, peer_pid: int | None) -> None:
        # A stranger may connect first under a token not yet in use; the connection's pid
        # (SO_PEERCRED) must be the one the template forked for it.
        if peer_pid is not None and peer_pid != worker.pid:
            logger.warning("dropped a Ready for worker {} sent by process {}", worker.pid, peer_pid)
            return
        worker.ready = True
        self._maybe_idle(worker)

    def on_spawned(self, message: Spawned) -> None:
        worker = self._worker(message.token)
        worker.watch(message.pid)
        self.by_pid[message.pid] = worker
        if message.token in self._early_ready:
            self._accept_ready(worker, self._early_ready.pop(message.token))
        self._maybe_idle(worker)

    def on_exited(self, message: Exited) -> None:
        if message.pid not in self.by_pid:
            return
        worker = self.by_pid.pop(message.pid)
        if worker.call is None:
            # With a call in flight, keep it findable: its Result may still be on its way.
            self.by_token.pop(worker.token, None)
        if worker.state is WorkerState.STARTING:
            self.starting -= 1
            if self.forking:  # not the pool closing, or its template dying
                self._failed_to_start(message.returncode)
        elif worker.state is WorkerState.IDLE:
            with contextlib.suppress(ValueError):
                self.idle.remove(worker)
        elif worker.state is WorkerState.QUARANTINED:
            logger.info("stuck worker {} finally exited ({})", worker.pid, message.returncode)
        worker.mark_exited(message.returncode)
        self.replenish()

    def on_spawn_failed(self, message: SpawnFailed) -> None:
        """The template could not fork ``message.count`` of the workers asked for, even after
        its backoff (a fork bomb or another pool holds every pid it may have, or memory is
        short). Fail the calls that were waiting for them now: the template has already waited,
        and nothing says when a pid comes back. A later call asks again (no spares meanwhile)."""
        self.starting -= message.count
        self.starts_failing = True
        runnable = min(len(self.waiting), self.max_workers - self.busy)
        unserved = runnable - self.starting - len(self.idle)
        if unserved <= 0:
            return
        error = WorkersFailToStart(f"no worker could be forked: {message.error}")
        logger.error("{}", error)
        for _ in range(unserved):
            self.waiting.popleft().assigned.set_exception(error)

    def _failed_to_start(self, returncode: int) -> None:
        self.starts_failing = True
        self.failed_starts += 1
        if self.failed_starts < MAX_FAILED_STARTS or not self.waiting:
            return
        self.failed_starts = 0
        error = WorkersFailToStart(
            f"no worker could start: {MAX_FAILED_STARTS} in a row exited before connecting"
            f" (the last: {describe_exit(returncode)}); the template's stderr says why"
        )
        # Each waiting call fails; a later call tries again, MAX_FAILED_STARTS forks at most,
        # and until one does, nothing is forked (replenish forks no spares meanwhile).
        self._fail_waiting(error)

    def _fail_waiting(self, error: WorkersFailToStart) -> None:
        logger.error("{}", error)
        while self.waiting:
            self.waiting.popleft().assigned.set_exception(error)

    def _maybe_idle(self, worker: Worker) -> None:
        if worker.state is WorkerState.STARTING and worker.ready and worker.pid is not None:
            self.starts_failing = False
            self.failed_starts = 0
            self.starting -= 1
            worker.state = WorkerState.IDLE
            self.idle.append(worker)
            self.assign()

    def on_template_lost(self) -> None:
        """No more forks, and every worker is gone with the template (PDEATHSIG)."""
        self.forking = False
        for worker in list(self.by_token.values()):
            worker.signal_group(signal.SIGKILL)
            worker.mark_exited(-signal.SIGKILL)

    def stop_retrying(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None

    def kill_all(self) -> None:
        """SIGKILL every worker's group, except those already stuck in the kernel."""
        for worker in list(self.by_token.values()):
            if worker.state is not WorkerState.QUARANTINED:
                worker.signal_group(signal.SIGKILL)
