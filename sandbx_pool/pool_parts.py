"""What an open pool is made of, and how it is put together and taken apart: its directories,
journal, the sandbox its workers are given, its fleet (fleet.py), its features (call_seam.py), its
calls in flight. Pool (pool.py), the public façade, is this plus what its users call.

    Pool.start --> PoolParts._open:
        telemetry (a missing extra: ConfigError first) --> descriptors raised -->
        runtime dir, TMPDIR root, lock dir (pool_finalizer.py releases them if close never runs) -->
        the sandbox, the stores hidden --> journal opened, hidden; sessions restored; J.d made
        --> fleet started (inbox bound, template launched) --> OPEN, workers forked -->
        the workspace asked of a worker --> leftovers of interrupted writes removed -->
        interrupted applies finished
    Pool.close --> PoolParts._close: every call killed (shutdown), their drivers awaited
        (bounded), then _teardown: fleet stopped, features closed, journal and telemetry
        closed, directories removed (once, by the finalizer's function)
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import os
import time
import weakref

import msgspec

from sandbx_pool import descriptors, preflight
from sandbx_pool.call_run import CallRunner
from sandbx_pool.call_seam import Features
from sandbx_pool.call_state import CallState
from sandbx_pool.change_calls import ChangeCalls
from sandbx_pool.config import Config, JournalPolicy, change_mode, load_config
from sandbx_pool.errors import PoolClosed, WorkspaceError
from sandbx_pool.fleet import Fleet
from sandbx_pool.gate import Approver, Gate
from sandbx_pool.images.store import ImageStore
from sandbx_pool.journal import reader as journal_reader
from sandbx_pool.journal.prune import LOCK_SUFFIX, prune_default_journals
from sandbx_pool.journal.store import Journal
from sandbx_pool.layer_calls import LayerCalls
from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Outcome
from sandbx_pool.pool_finalizer import Remains, release
from sandbx_pool.proxy_handle import NetworkProxy
from sandbx_pool.runtime_dir import (
    default_journal_path,
    default_journals_dir,
    make_lock_dir,
    make_private_dir,
    make_tmp_root,
)
from sandbx_pool.services import Services
from sandbx_pool.sessions import Sessions
from sandbx_pool.telemetry import Telemetry, open_telemetry
from sandbx_pool.workers.protocol import Sandbox

#: How long Pool.start waits for a worker to say whether the workspace is a directory.
WORKSPACE_CHECK_S = 2.0


class PoolState(enum.IntEnum):
    NEW = 0
    OPEN = 1
    CLOSING = 2
    CLOSED = 3


class PoolParts:
    """An open pool's parts (Pool's arguments are documented there)."""

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        *,
        workers: int | None,
        journal: str | os.PathLike[str] | None,
        config: str | os.PathLike[str] | Config | None,
        approve: Approver | None,
        changes: str | None,
    ) -> None:
        self.config = config if isinstance(config, Config) else load_config(config)
        #: What calls may do to the workspace unless they say (sandbx_pool.change_sets).
        self.changes = change_mode(
            changes if changes is not None else self.config.workspace.changes
        )
        if workers is not None:
            self.config = self.config.override(pool={"workers": workers})
        # abspath is lexical: the coordinator never touches the workspace's filesystem.
        self.workspace = os.path.abspath(os.fspath(workspace))
        self.max_workers = self.config.workers()
        self.prefork = (
            self.config.pool.prefork if self.config.pool.prefork is not None else self.max_workers
        )
        self._journal_path = os.fspath(journal) if journal is not None else None
        self._gate = Gate(self.config.gate.rules, approve)
        self.config.sandbox.user()  # an unknown run_as user is a ConfigError here, not later
        self._sandbox: Sandbox | None = None
        self._tmp_root: str | None = None
        self._lock_dir: str | None = None
        self.state = PoolState.NEW
        self.journal: Journal | None = None
        #: Spans of its calls, when ``[telemetry] otlp_endpoint`` is set (telemetry.py).
        self.telemetry: Telemetry | None = None
        self._runtime_dir: str | None = None
        self._fleet = Fleet(max_workers=self.max_workers, prefork=self.prefork)
        self._calls: dict[str, CallState] = {}
        self._drivers: set[asyncio.Task[Outcome]] = set()
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{int(time.time()):x}"
        self._closed = asyncio.Event()
        # What close() releases, released by the collector (or at exit) if close() never runs.
        self._remains = Remains()
        self._images: ImageStore | None = None
        # The features (call_seam.py), in the order their hooks run.
        self._sessions = Sessions()
        self._network = NetworkProxy(
            self.config.sandbox, lambda proxy: self._remains.stoppers.append(proxy.stop)
        )
        self._runner = CallRunner(
            self._fleet,
            Features(()),
            self.config.calls,
            self._side,
            lambda: self.state is PoolState.OPEN and not self._fleet.template_lost,
            lambda: self._change_calls.store().root,
        )
        self._change_calls = ChangeCalls(
            self.config.workspace, self._hide, self._runner.internal, self._running_since
        )
        self._layers = LayerCalls(
            self.config,
            self._runner.internal,
            self._hide,
            lambda: self._fleet.containment,
            self.images,
        )
        self._runner.features = Features(
            (self._sessions, self._layers, self._change_calls, self._network)
        )
        #: Services (sandbx_pool.services): calls that run until stopped, by name.
        self._services = Services()
        self._finalizer = weakref.finalize(self, release, self._remains)

    def images(self) -> ImageStore:
        """The pool's image store (made on first use), out of every call's reach."""
        if self._images is None:
            self._images = ImageStore.from_config(self.config)
            if self._sandbox is not None:
                self._hide(self._images.root)
        return self._images

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        # First: a missing extra is a ConfigError before anything is made.
        self.telemetry = open_telemetry(self.config.telemetry)
        # Before anything is opened: libzmq aborts the process when it runs out (descriptors.py).
        inherited_nofile = descriptors.raise_soft_limit()
        self._runtime_dir = make_private_dir()
        self._remains.dirs.append(self._runtime_dir)
        self._network.runtime_dir = self._runtime_dir
        try:
            # Parent of each call's private TMPDIR (the worker makes and removes its own; what
            # a killed call leaves goes with this on close). Searchable by a run_as user, not
            # listable: one call cannot find another's.
            self._tmp_root = make_tmp_root()
            self._remains.dirs.append(self._tmp_root)
            os.chmod(self._tmp_root, 0o711 if self.config.sandbox.run_as else 0o700)
            self._lock_dir = make_lock_dir()
            self._remains.dirs.append(self._lock_dir)
            hidden = (os.path.dirname(self._runtime_dir), self._lock_dir)
            self._sandbox = msgspec.structs.replace(
                self.config.sandbox.for_workers(tmp_root=self._tmp_root, hidden=hidden),
                lock_dir=self._lock_dir,
            )
            self._layers.hide_store()
            journal_path = self._journal_path or self._fresh_default_journal()
            if self.config.journal.policy is not JournalPolicy.OFF or self._journal_path:
                self.journal = await Journal.open(journal_path, self.config.journal)
                # Its writer's own synchronous stop (it flushes what is queued, then closes).
                self._remains.stoppers.append(self.journal._writer.stop_at_exit)
                self._hide_journal(self.journal.path)
                self._sessions.restore(self.journal.sessions)
            self._runner.journal = self.journal
            self._change_calls.open(self._runtime_dir, self.journal)
            if self._journal_path is None and self.journal is not None:
                logger.info("journal: {}", self.journal.path)
            await self._fleet.start(
                f"ipc://{self._runtime_dir}/coordinator.sock",
                loop,
                self._remains,
                nofile=inherited_nofile,
                warm_up=self.config.pool.warm_up,
                user_namespaces=self.config.sandbox.user_namespaces,
            )
            if self.config.pool.warm_up:
                # Not for a pool that expects a call or two: building the rules once costs the
                # template a helper process before its first fork, what a worker saves.
                assert self._fleet.template is not None
                self._fleet.template.prebuild_file_rules(self.workspace, self._sandbox)
        except BaseException:
            await self._teardown()
            raise
        if self.state is not PoolState.NEW:  # close() was called while we were starting
            await self._teardown()
            raise PoolClosed("the pool was closed while it was starting")
        self.state = PoolState.OPEN
        self._fleet.open()
        problem = await self._workspace_problem()
        if problem is not None:
            await self._close()
            raise WorkspaceError(f"workspace {self.workspace}: {problem}")
        await self._remove_leftovers()
        await self._change_calls.finish_interrupted()

    def _hide_journal(self, path: str) -> None:
        """Out of every call's reach, wherever it lies: `run --journal run.jsonl` in the
        workspace is common, and a call must not read, truncate, forge or lock it. (Its real
        path: the workers compare resolved paths. The journal's directory was just opened.)"""
        assert self._sandbox is not None
        journal_file = os.path.realpath(path)
        hidden = (*self._sandbox.hidden, journal_file, journal_file + LOCK_SUFFIX)
        self._sandbox = msgspec.structs.replace(self._sandbox, hidden=hidden)

    def _hide(self, path: str) -> None:
        """The pool's own file or directory out of every call's reach (the journal's J.d, the
        layer and image stores): bash's mount namespace covers it, the file tools refuse it."""
        assert self._sandbox is not None
        hidden = (*self._sandbox.hidden, os.path.realpath(path))
        self._sandbox = msgspec.structs.replace(self._sandbox, hidden=hidden)

    def _fresh_default_journal(self) -> str:
        """A new journal path at the default location, its stale predecessors pruned first."""
        settings = self.config.journal
        prune_default_journals(
            default_journals_dir(),
            keep_days=settings.default_keep_days,
            keep_count=settings.default_keep_count,
        )
        return default_journal_path()

    async def _workspace_problem(self) -> str | None:
        """Why the workspace cannot be one (missing, not a directory), asked of a worker: the
        coordinator never touches the workspace's filesystem, where a hung mount would hang
        it. A worker that does not answer within WORKSPACE_CHECK_S (a mount that hangs) lets
        the pool start: its calls wait on the mount, killably, as they would anyway."""
        call = CallState(f"{self._id_prefix}-workspace", "_check_workspace", {}, WORKSPACE_CHECK_S)
        call.context = preflight.call_context(call, self.workspace, self._side())
        # Not journaled: it is the pool's own question, not a call.
        outcome = await self._runner.chore(call, journaled=False)
        if not outcome.ok or outcome.value is None:
            why = outcome.error or outcome.reason or outcome.status
            logger.warning("could not check the workspace {}: {}", self.workspace, why)
            return None
        problem: str | None = outcome.value["problem"]
        return problem

    async def _remove_leftovers(self) -> None:
        """Have a worker remove the temp files of writes and edits a crash interrupted, in
        this pool's workspace: another workspace's are only reported."""
        interrupted = self.journal.interrupted if self.journal is not None else []
        paths = journal_reader.unfinished_writes(interrupted, self.workspace)
        if not paths:
            return
        call = CallState(f"{self._id_prefix}-recovery", "_remove_temps", {"paths": paths}, 30.0)
        call.context = preflight.call_context(call, self.workspace, self._side())
        outcome = await self._runner.chore(call)
        if outcome.ok and outcome.value is not None:
            for path in outcome.value["removed"]:
                logger.info(
                    "removed {}, left by a write the previous coordinator did not finish", path
                )
        else:
            # The pool is open all the same: its calls will meet the same error, and say so.
            logger.warning("could not remove leftovers of in-doubt writes: {}", outcome.error)

    async def _close(self) -> None:
        if self.state is PoolState.NEW:
            self.state = PoolState.CLOSED
            return
        if self.state >= PoolState.CLOSING:
            await self._closed.wait()
            return
        self.state = PoolState.CLOSING
        self._fleet.workers.forking = False
        for call in self._calls.values():
            call.request_kill(KilledBy.SHUTDOWN, "pool closing")
        drivers = [task for task in self._drivers if not task.done()]
        if drivers:
            _, pending = await asyncio.wait(drivers, timeout=self.config.pool.close_timeout_s)
            for task in pending:
                logger.warning("call {} did not finish while closing", task.get_name())
                task.cancel()  # its driver settles it (cancelled, shutdown); see call_life
            if pending:
                # Bounded: what is left after cancellation is journaling the outcome.
                await asyncio.wait(pending, timeout=self.config.pool.close_timeout_s)
        try:
            await self._teardown()
        finally:
            self.state = PoolState.CLOSED
            self._closed.set()

    async def _teardown(self) -> None:
        await self._fleet.stop()
        self._runner.features.close()
        if self.journal is not None:
            await self.journal.close()
        if self.telemetry is not None:
            await self.telemetry.close()  # bounded: a dead collector does not hold close()
        self._fleet.stop_watching()
        self._finalizer()  # the directories, and anything the steps above left: once

    def _drive(self, call: CallState) -> asyncio.Task[Outcome]:
        """The call's driver task, in flight (close() kills it) until the caller is done."""
        run = self._runner.run
        driver = asyncio.create_task(call.drive(self.journal, lambda: run(call), self.telemetry))
        driver.set_name(call.call_id)
        self._drivers.add(driver)
        driver.add_done_callback(self._drivers.discard)
        self._calls[call.call_id] = call
        return driver

    def _launch(self, call: CallState) -> asyncio.Task[Outcome]:
        """Drive ``call`` as call() does, for a caller that keeps its task (a service): in
        flight until it ends, so close() kills it as any call. It takes no call's slot."""
        if self._services.take_slot():  # as Pool.admit(max_workers + 1)
            self.max_workers += 1
            self._fleet.widen(self.max_workers)
        driver = self._drive(call)
        driver.add_done_callback(lambda _: self._calls.pop(call.call_id, None))
        return driver

    def _running_since(self) -> float:
        return min((c.started_at for c in self._calls.values()), default=time.monotonic())

    def _side(self) -> preflight.PoolSide:
        proxy = self._network.socket
        return preflight.PoolSide(self.config, self.workspace, self._sandbox, self._gate, proxy)


__all__ = ["WORKSPACE_CHECK_S", "PoolParts", "PoolState"]
