"""The pool's worker fleet: the template that forks workers, the WorkerSet that schedules them,
the inbox they answer on, and the doing of what the WorkerSet decides.

    TemplateHandle --Spawned/Exited/SpawnFailed--> Fleet._on_template --> WorkerSet decides
    Inbox (ROUTER) --Ready--> Fleet._on_ready -------------------------> WorkerSet decides
                                                                            |
    Fleet.acquire(call) --> WorkerSet.enqueue ------------------------------+
                                                                            v
                            Fleet.act(actions): fork, assign, fail, watch, signal, retry later
    Fleet.execute(call, worker, payload) --> call_on_worker.execute --> Fleet.act(release(worker))

The WorkerSet only decides (worker_set.py); everything here that touches a process, a socket
or a timer does it in ``act``, in the order the decision lists. A call reaches a worker only
through ``acquire`` then ``execute``, whoever runs it (Pool's calls, its own chores, a layer's
operations, a service).
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from sandbx_pool import descriptors
from sandbx_pool.call_on_worker import execute
from sandbx_pool.call_state import CallState
from sandbx_pool.config import CallSettings
from sandbx_pool.inbox import Inbox
from sandbx_pool.journal.store import Journal
from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Outcome
from sandbx_pool.pool_finalizer import Remains
from sandbx_pool.runtime_dir import parent_pid
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
from sandbx_pool.template_handle import TemplateHandle
from sandbx_pool.worker_handle import Worker, WorkerState, describe_stuck, signal_worker
from sandbx_pool.worker_set import WorkerSet
from sandbx_pool.workers.protocol import Exited, FromTemplate, Ready, Spawned, SpawnFailed


class Fleet:
    """A pool's workers, from the template's first fork to the last worker's exit."""

    def __init__(self, *, max_workers: int, prefork: int) -> None:
        self.workers = WorkerSet(
            max_workers=max_workers, prefork=prefork, room=descriptors.Budget()
        )
        #: The template, once started (None before, and for a pool never started).
        self.template: TemplateHandle | None = None
        #: The template died: no worker will be forked again (the pool refuses new calls).
        self.template_lost = False
        self.inbox = Inbox(self.workers.get, self._on_ready, self._is_worker)
        #: The WorkerSet's outstanding RetryAfter (act).
        self._retry: asyncio.TimerHandle | None = None

    def __repr__(self) -> str:
        return repr(self.workers)

    async def start(
        self,
        endpoint: str,
        loop: asyncio.AbstractEventLoop,
        remains: Remains,
        *,
        nofile: tuple[int, int],
        warm_up: bool,
        user_namespaces: bool,
    ) -> None:
        """Bind the inbox at ``endpoint`` and start the template; what they hold is entered
        in ``remains`` before it exists beyond this call, for a pool never closed."""
        remains.workers = self.workers.by_token
        self.inbox.bind(endpoint, loop)
        remains.zmq_context = self.inbox.context
        remains.zmq_sockets = self.inbox.sockets
        remains.loop = loop
        remains.reader_fds = self.inbox.watched_fds()
        self.template = TemplateHandle(
            endpoint,
            self._on_template,
            self._on_template_lost,
            nofile=nofile,
            warm_up=warm_up,
            user_namespaces=user_namespaces,
        )
        remains.launch = self.template.launch
        remains.sockets.append(self.template.socket)
        remains.reader_fds.append(self.template.socket.fileno())
        await self.template.start()

    def open(self) -> None:
        """Fork workers from now on, ahead of demand."""
        self.workers.forking = True
        self.act(self.workers.replenish())

    def widen(self, max_workers: int) -> None:
        self.act(self.workers.widen(max_workers))

    @property
    def containment(self) -> str | None:
        """The workers' containment as the template found it (``pidns``, ...); None before."""
        return self.template.containment if self.template is not None else None

    @property
    def in_user_namespaces(self) -> bool:
        return self.template is not None and self.template.user_namespaces

    # -- a call's worker ---------------------------------------------------------------------

    async def acquire(self, call: CallState) -> Worker | None:
        """Wait for an idle worker and a free slot; None if the call was killed meanwhile.
        Raises WorkersFailToStart when the workers forked for it kept failing."""
        if call.killer is not None:
            return None
        self.act(self.workers.enqueue(call))
        if not call.assigned.done():  # else an idle worker took it: no turn of the loop to wait
            either: set[asyncio.Future[Any]] = {call.assigned, call.kill_requested}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if call.killer is None:
            return call.assigned.result()
        assigned = call.assigned
        given = assigned.result() if assigned.done() and assigned.exception() is None else None
        self.act(self.workers.withdraw(call, given))
        return None

    async def execute(
        self,
        call: CallState,
        worker: Worker,
        payload: bytes,
        settings: CallSettings,
        journal: Journal | None,
    ) -> Outcome:
        """Run ``call`` on the ``worker`` it was given (call_on_worker.py); the worker is released
        to the WorkerSet whatever happens."""
        try:
            return await execute(
                call, worker, payload, send=self.inbox.send, settings=settings, journal=journal
            )
        except BaseException:
            # Whatever broke (a coordinator bug, close() giving up on the call), the worker
            # may hold the call half-run: it is never handed another, so it must not outlive it.
            worker.signal_group(signal.SIGKILL)
            raise
        finally:
            self.act(self.workers.release(worker))

    # -- doing what the WorkerSet decided --------------------------------------------------------

    def act(self, actions: list[Action]) -> None:
        """Do what the WorkerSet decided, in its order (worker_set.py)."""
        for action in actions:
            match action:
                case Fork(count):
                    if self.template is not None:
                        self.template.spawn(count)
                case Assign(call, worker):
                    call.assigned.set_result(worker)
                case Fail(call, error):
                    call.assigned.set_exception(error)
                case Watch(worker, pid):
                    worker.watch(pid)
                case Signal(pid, signum, starting):
                    signal_worker(pid, signum, starting=starting)
                case Gone(worker, returncode, usage, memory_killed):
                    worker.mark_exited(returncode, usage, memory_killed=memory_killed)
                case RetryAfter(seconds):
                    loop = asyncio.get_running_loop()
                    self._retry = loop.call_later(seconds, self._retry_now)
                case CancelRetry():
                    if self._retry is not None:
                        self._retry.cancel()
                        self._retry = None

    def _retry_now(self) -> None:
        self._retry = None
        self.act(self.workers.retry())

    # -- events from the workers and the template ----------------------------------------------

    def _on_ready(
        self, identity: bytes, message: Ready, known: Worker | None, peer_pid: int | None
    ) -> None:
        self.act(self.workers.on_ready(identity, message, known, peer_pid))

    def _is_worker(self, pid: int) -> bool:
        """Whether ``pid`` may stay connected to our socket: the template forked it."""
        template = self.template.pid if self.template is not None else None
        return template is not None and parent_pid(pid) == template

    def _on_template(self, message: FromTemplate) -> None:
        if isinstance(message, Spawned):
            self.act(self.workers.on_spawned(message))
        elif isinstance(message, Exited):
            self.act(self.workers.on_exited(message))
        elif isinstance(message, SpawnFailed):
            self.act(self.workers.on_spawn_failed(message))

    def _on_template_lost(self) -> None:
        self.template_lost = True
        for call in self.workers.waiting:
            call.request_kill(KilledBy.SHUTDOWN, "the worker template died")
        self.act(self.workers.on_template_lost())

    # -- the end ---------------------------------------------------------------------------------

    def kill_now(self) -> None:
        """SIGKILL every worker group and the template at once, without waiting."""
        for worker in list(self.workers.by_token.values()):
            worker.signal_group(signal.SIGKILL)
        if self.template is not None:
            self.template.kill()

    async def stop(self) -> None:
        """Fork no more, kill every worker, close the template and the inbox."""
        self.workers.forking = False
        self.act(self.workers.stop_retrying())
        self.act(self.workers.kill_all())
        if self.template is not None:
            await self.template.close()
        self.inbox.close()

    def stop_watching(self) -> None:
        """Last: watch no worker's exit; say which ones the kernel still holds."""
        for worker in self.workers.by_token.values():
            worker.stop_watching()
            if worker.state is WorkerState.QUARANTINED:
                logger.warning("closing with stuck worker {}", describe_stuck(worker))

    def stuck_workers(self) -> list[dict[str, Any]]:
        return [worker.stuck_report() for worker in self.workers.quarantined()]


__all__ = ["Fleet"]
