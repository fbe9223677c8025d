"""The coordinator: runs each tool call in a disposable worker and journals it.

    caller --await pool.call(tool, args)--> Pool.call (misuse raises: preflight)
        |  driver task, one per call: CallLife.drive (call_life.py, shared with RayPool)
        |  journal intent (durable first when the call has side effects)
        |  checks before anything forks: cancelled token, arguments, lexical paths, gate,
        |  context, encoding (preflight.py)
        v
    takes an idle, pre-forked worker (WorkerSet) --> ROUTER.send(Call) (execution.py)
        |  waits for the first of: Result | kill request (token, task, timeout, shutdown)
        |  | the worker's exit (crash)
        |  on a kill: SIGTERM (bash, then SIGKILL after the grace) or SIGKILL to the worker's
        |  group (any other tool, or a command asleep in the kernel), then wait for its exit;
        |  if it does not die (state D on a hung mount), the caller is released anyway and the
        |  worker is quarantined until it is reaped
        v
    journal outcome (on disk first under policy "always") --> Outcome to the caller

Actors:

* ``TemplateHandle`` forks workers ahead of demand (``prefork``) and reports their exits.
* The ``Inbox`` (the ROUTER socket, read on the loop): ``Ready`` makes a worker idle,
  ``Result`` completes its call. A message from anyone but the worker a call was dispatched to
  is dropped: a Ready must come from the pid the template forked for its token, a Result must
  carry its call's secret, and anything undecodable or of another protocol version is logged
  and ignored.
* Each call runs in its own driver task, so that cancelling the caller's task only *requests*
  the kill: the driver finishes the cleanup (shielded) and the caller gets its CancelledError
  back afterwards (call_life.attend).
* The ``WorkerSet`` (worker_set.py) schedules: which call gets which worker, how many to fork,
  what each Ready and template message means. Its methods only decide: they update its state
  and return the actions to take (fork, assign, fail a call, watch a pid, signal a group, look
  again later; scheduling_actions.py), and ``Pool._act`` performs them, in order, at once.

No single call, argument or fault ends the pool: a call is encoded (and refused if it cannot
be) before a worker is taken (execution.encode_call); workers are forked only while the
coordinator's descriptors can pay for them (descriptors.py); connections from anything but a
worker are dropped (inbox.py); and what the pool holds outside memory is released by a
finalizer if close() never runs (remains.py), or by the next pool if its process was killed
(runtime_dir.py).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import os
import signal
import time
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import msgspec

from sandbx_pool import allow_list, descriptors, image_layer, preflight
from sandbx_pool.call_life import attend, token_subscription
from sandbx_pool.call_state import CallState
from sandbx_pool.cancel import CancelToken
from sandbx_pool.changes import ChangeSets, refuse_without_store, store_dir
from sandbx_pool.config import ChangeMode, Config, JournalPolicy, change_mode, load_config
from sandbx_pool.errors import (
    PoolClosed,
    PoolNotStarted,
    TemplateLost,
    WorkersFailToStart,
    WorkspaceError,
)
from sandbx_pool.execution import Unsendable, encode_call, execute
from sandbx_pool.gate import Approver, Gate
from sandbx_pool.images.image import Image
from sandbx_pool.images.refs import parse_ref
from sandbx_pool.images.store import ImageStore, Pin
from sandbx_pool.inbox import Inbox
from sandbx_pool.journal import reader as journal_reader
from sandbx_pool.journal.prune import LOCK_SUFFIX, prune_default_journals
from sandbx_pool.journal.records import IntentRecord
from sandbx_pool.journal.store import Journal
from sandbx_pool.layers import Layer, Layers, check_direct, mount_point, names_a_layer
from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.output import OutputCallback
from sandbx_pool.proxy_handle import ProxyHandle
from sandbx_pool.remains import Remains, release
from sandbx_pool.runtime_dir import (
    default_journal_path,
    default_journals_dir,
    make_lock_dir,
    make_private_dir,
    make_tmp_root,
    parent_pid,
)
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
from sandbx_pool.service_tools import ServiceTools, handles_service_tool
from sandbx_pool.services import Service, Services, start_service
from sandbx_pool.sessions import Sessions, check_id
from sandbx_pool.telemetry import Telemetry, open_telemetry
from sandbx_pool.template_handle import TemplateHandle
from sandbx_pool.worker_handle import Worker, WorkerState, describe_stuck, signal_worker
from sandbx_pool.worker_set import WorkerSet
from sandbx_pool.workers.protocol import (
    Exited,
    FromTemplate,
    Limits,
    Ready,
    Sandbox,
    Spawned,
    SpawnFailed,
)
from sandbx_pool.workers.schemas import SIDE_EFFECT_TOOLS

#: How long Pool.start waits for a worker to say whether the workspace is a directory.
WORKSPACE_CHECK_S = 2.0


class PoolState(enum.IntEnum):
    NEW = 0
    OPEN = 1
    CLOSING = 2
    CLOSED = 3


class Pool:
    """Run tool calls in disposable workers. Use as ``async with Pool(workspace) as pool``."""

    def __init__(
        self,
        workspace: str | os.PathLike[str],
        *,
        workers: int | None = None,
        journal: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | Config | None = None,
        approve: Approver | None = None,
        changes: str | None = None,
    ) -> None:
        self.config = config if isinstance(config, Config) else load_config(config)
        #: What calls may do to the workspace unless they say (sandbx_pool.changes).
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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runtime_dir: str | None = None
        self._template: TemplateHandle | None = None
        self._workers = WorkerSet(
            max_workers=self.max_workers, prefork=self.prefork, room=descriptors.Budget()
        )
        #: The WorkerSet's outstanding RetryAfter (_act).
        self._retry: asyncio.TimerHandle | None = None
        self._inbox = Inbox(self._workers.get, self._on_ready, self._is_worker)
        self._calls: dict[str, CallState] = {}
        self._drivers: set[asyncio.Task[Outcome]] = set()
        self._ids = itertools.count(1)
        self._id_prefix = f"{os.getpid():x}-{int(time.time()):x}"
        self._template_lost = False
        self._closed = asyncio.Event()
        # What close() releases, released by the collector (or at exit) if close() never runs.
        self._remains = Remains()
        self._remains.workers = self._workers.by_token
        self._change_sets: ChangeSets | None = None
        #: J.d did not exist when the pool opened its journal (undo then says it is missing).
        self._store_was_missing = False
        self._layers: Layers | None = None
        self._images: ImageStore | None = None
        #: The images of open layers, by ref: the store evicts none of them (images/store.py).
        self._pins: dict[str, Pin] = {}
        #: Shell sessions (sandbx_pool.sessions): restored from the journal at start.
        self._sessions = Sessions()
        #: Services (sandbx_pool.services): calls that run until stopped, by name.
        self._services = Services()
        #: bash's ``background`` and the service_* tools (sandbx_pool.service_tools).
        self._service_tools = ServiceTools(self._services, self.service, self._gate)
        #: The network proxy (sandbx_pool.proxy), started by the first allow-listed call.
        self._proxy: ProxyHandle | None = None
        self._finalizer = weakref.finalize(self, release, self._remains)

    def __repr__(self) -> str:
        return f"<Pool [{self.state.name} | {self._workers!r}]>"

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Pool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self.state is not PoolState.NEW:
            raise PoolClosed("a pool is started once")
        self._loop = asyncio.get_running_loop()
        # First: a missing extra is a ConfigError before anything is made.
        self.telemetry = open_telemetry(self.config.telemetry)
        # Before anything is opened: libzmq aborts the process when it runs out (descriptors.py).
        inherited_nofile = descriptors.raise_soft_limit()
        self._runtime_dir = make_private_dir()
        self._remains.dirs.append(self._runtime_dir)
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
            store = self.config.workspace.layers_dir()
            if os.path.isdir(store):  # noqa: ASYNC240 (the pool's own directory, as J.d is)
                self._hide(store)  # from the first call on, made by an earlier pool
            journal_path = self._journal_path or self._fresh_default_journal()
            if self.config.journal.policy is not JournalPolicy.OFF or self._journal_path:
                self.journal = await Journal.open(journal_path, self.config.journal)
                # Its writer's own synchronous stop (it flushes what is queued, then closes).
                self._remains.stoppers.append(self.journal._writer.stop_at_exit)
                self._hide_journal(self.journal.path)
                # J.d (change sets, pre-images) made and hidden before the first call, whatever
                # its mode: a call that reached it before the pool needed it (a direct bash
                # with the journal in the workspace) could forge what a later undo writes.
                self._store_was_missing = not self._store_exists()
                self._changes_store()
                self._sessions.restore(self.journal.sessions)
            if self._journal_path is None and self.journal is not None:
                logger.info("journal: {}", self.journal.path)
            endpoint = f"ipc://{self._runtime_dir}/coordinator.sock"
            self._inbox.bind(endpoint, self._loop)
            self._remains.zmq_context = self._inbox.context
            self._remains.zmq_sockets = self._inbox.sockets
            self._remains.loop = self._loop
            self._remains.reader_fds = self._inbox.watched_fds()
            self._template = TemplateHandle(
                endpoint,
                self._on_template,
                self._on_template_lost,
                nofile=inherited_nofile,
                warm_up=self.config.pool.warm_up,
                user_namespaces=self.config.sandbox.user_namespaces,
            )
            self._remains.launch = self._template.launch
            self._remains.sockets.append(self._template.socket)
            self._remains.reader_fds.append(self._template.socket.fileno())
            await self._template.start()
            if self.config.pool.warm_up:
                # Not for a pool that expects a call or two: building the rules once costs the
                # template a helper process before its first fork, what a worker saves.
                self._template.prebuild_file_rules(self.workspace, self._sandbox)
        except BaseException:
            await self._teardown()
            raise
        if self.state is not PoolState.NEW:  # close() was called while we were starting
            await self._teardown()
            raise PoolClosed("the pool was closed while it was starting")
        self.state = PoolState.OPEN
        self._workers.forking = True
        self._act(self._workers.replenish())
        problem = await self._workspace_problem()
        if problem is not None:
            await self.close()
            raise WorkspaceError(f"workspace {self.workspace}: {problem}")
        await self._remove_leftovers()
        if self.journal is not None and self.journal.unfinished_applies:
            await self._changes_store().finish_interrupted(self.journal, self._internal)

    def admit(self, calls: int) -> None:
        """Run at least ``calls`` calls at once from now on (``workers`` is only ever raised).

        For a caller whose own concurrency is known only once it runs (an Inspect eval's
        samples): its calls must not queue behind a pool sized for fewer."""
        self.max_workers = max(self.max_workers, calls)
        self._act(self._workers.widen(self.max_workers))

    def _hide_journal(self, path: str) -> None:
        """Out of every call's reach, wherever it lies: `run --journal run.jsonl` in the
        workspace is common, and a call must not read, truncate, forge or lock it. (Its real
        path: the workers compare resolved paths. The journal's directory was just opened.)"""
        assert self._sandbox is not None
        journal_file = os.path.realpath(path)
        hidden = (*self._sandbox.hidden, journal_file, journal_file + LOCK_SUFFIX)
        self._sandbox = msgspec.structs.replace(self._sandbox, hidden=hidden)

    def _hide(self, directory: str) -> None:
        """The pool's own directory out of every call's reach (the journal's J.d, the layer
        store): bash's mount namespace covers it, the file tools refuse it."""
        assert self._sandbox is not None
        hidden = (*self._sandbox.hidden, os.path.realpath(directory))
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
        try:
            payload = encode_call(call)
            worker = await self._acquire(call)
        except (WorkersFailToStart, Unsendable) as exc:
            logger.warning("could not check the workspace {}: {}", self.workspace, exc)
            return None
        if worker is None:
            return None
        # Not journaled: it is the pool's own question, not a call.
        outcome = await self._execute(call, worker, payload, journaled=False)
        if not outcome.ok or outcome.value is None:
            why = outcome.error or outcome.reason or outcome.status
            logger.warning("could not check the workspace {}: {}", self.workspace, why)
            return None
        problem: str | None = outcome.value["problem"]
        return problem

    async def _remove_leftovers(self) -> None:
        """Have a worker remove the temp files of writes and edits a crash interrupted, in
        this pool's workspace: another workspace's are only reported."""
        paths = journal_reader.unfinished_writes(self.interrupted, self.workspace)
        if not paths:
            return
        call = CallState(f"{self._id_prefix}-recovery", "_remove_temps", {"paths": paths}, 30.0)
        call.context = preflight.call_context(call, self.workspace, self._side())
        try:
            payload = encode_call(call)
            worker = await self._acquire(call)
        except (WorkersFailToStart, Unsendable) as exc:
            # The pool is open all the same: its calls will meet the same error, and say so.
            logger.warning("could not remove leftovers of in-doubt writes: {}", exc)
            return
        assert worker is not None
        outcome = await self._execute(call, worker, payload)
        if outcome.ok and outcome.value is not None:
            for path in outcome.value["removed"]:
                logger.info(
                    "removed {}, left by a write the previous coordinator did not finish", path
                )
        else:
            logger.warning("could not remove leftovers of in-doubt writes: {}", outcome.error)

    async def close(self) -> None:
        """Cancel what is in flight (killer ``shutdown``), kill every worker, clean up. Bounded."""
        if self.state is PoolState.NEW:
            self.state = PoolState.CLOSED
            return
        if self.state >= PoolState.CLOSING:
            await self._closed.wait()
            return
        self.state = PoolState.CLOSING
        self._workers.forking = False
        for call in self._calls.values():
            call.request_kill(KilledBy.SHUTDOWN, "pool closing")
        drivers = [task for task in self._drivers if not task.done()]
        if drivers:
            _, pending = await asyncio.wait(drivers, timeout=self.config.pool.close_timeout_s)
            for task in pending:
                logger.warning("call {} did not finish while closing", task.get_name())
                task.cancel()  # its driver settles it (cancelled, shutdown); see _drive
            if pending:
                # Bounded: what is left after cancellation is journaling the outcome.
                await asyncio.wait(pending, timeout=self.config.pool.close_timeout_s)
        try:
            await self._teardown()
        finally:
            self.state = PoolState.CLOSED
            self._closed.set()

    def kill_now(self) -> None:
        """SIGKILL every worker group at once, without waiting or journaling (last resort)."""
        for worker in list(self._workers.by_token.values()):
            worker.signal_group(signal.SIGKILL)
        if self._template is not None:
            self._template.kill()

    async def _teardown(self) -> None:
        self._workers.forking = False
        self._act(self._workers.stop_retrying())
        self._act(self._workers.kill_all())
        if self._template is not None:
            await self._template.close()
        self._inbox.close()
        if self._layers is not None:
            self._layers.close()
        for pin in self._pins.values():
            pin.unpin()
        if self._proxy is not None:
            self._proxy.stop()
        if self.journal is not None:
            await self.journal.close()
        if self.telemetry is not None:
            await self.telemetry.close()  # bounded: a dead collector does not hold close()
        for worker in self._workers.by_token.values():
            worker.stop_watching()
            if worker.state is WorkerState.QUARANTINED:
                logger.warning("closing with stuck worker {}", describe_stuck(worker))
        self._finalizer()  # the directories, and anything the steps above left: once

    # -- the public call -------------------------------------------------------------------

    async def call(
        self,
        tool: str,
        args: dict[str, Any],
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (the contract's name; it is a kill deadline)
        cancel: CancelToken | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        limits: Limits | None = None,
        call_id: str | None = None,
        on_output: OutputCallback | None = None,
        view: str | None = None,
        workspace: str | Layer | None = None,
        changes: str | None = None,
        layer_at: str | None = None,
        session: str | None = None,
        network: bool | list[str] | tuple[str, ...] | None = None,
    ) -> Outcome:
        """Run one tool call in a fresh worker and return how it ended.

        ``timeout`` counts from the moment a worker takes the call (time queued behind
        ``workers`` busy ones does not count). Cancelling the awaiting task kills the call;
        the CancelledError is re-raised once the worker is gone. ``on_output`` is called on
        the loop with each OutputChunk a bash command writes, while it runs (sandbx_pool.output).
        ``workspace`` (an absolute path) confines this call to another workspace than the
        pool's: one pool's workers then serve many workspaces (its file tools' Landlock rules
        are prebuilt for the pool's own only, so another costs each call a few ms more).

        ``view``: a directory inside the workspace that the call sees as its ``/``, as a
        container's (workers.view): the system read-only, the directories it holds read-write,
        nothing else of the host. ``cwd`` and the tool's paths are then paths in the view
        (relative ones to ``/``). Needs a root pool; elsewhere the call ends as ``error``.

        ``changes``: this call's change mode, ``"direct"``, ``"tracked"`` or
        ``"transactional"`` (default: the pool's); see sandbx_pool.changes. Outside direct
        mode the outcome's ``changes`` lists what the call did to the workspace.

        ``workspace`` may be a Layer (``pool.layer``), or a layer's ``path``: the call runs in
        it (its base plus the layer's changes; the base is never written), one call at a time
        per layer, direct into the layer (``changes`` other than direct: ValueError). With a
        ``view``, the layer is mounted at ``layer_at``, a directory of the view.
        ``session``: a shell session's id (sandbx_pool.sessions). A bash call starts in the
        cwd and with the exports the session's previous bash call left, and leaves its own
        for the next one (a call that does not end ``ok`` changes nothing); other tools run
        in the session's cwd. Calls of one session run one after another, in call order.
        Without it, every bash call starts in the workspace root (or ``cwd``) with the pool's
        environment. A bad id, or a session used before with another workspace or view, is a
        ValueError.
        ``network``: this call's network, replacing the pool's ``[sandbox] network``
        whole (default: the pool's): True, False (none, even for hosts the pool's list
        allows), or a list of host patterns (sandbx_pool.allow_list), its own list, not
        the pool's narrowed. A bad pattern is a ValueError naming it. An allow-listed
        call's outcome lists the hosts the proxy refused in ``value["network_denied"]``.
        """
        if self.state is PoolState.NEW:
            raise PoolNotStarted("use `async with Pool(...)` or `await pool.start()` first")
        if self.state is not PoolState.OPEN:
            raise PoolClosed("the pool is closed")
        if self._template_lost:
            raise TemplateLost("the worker template died; open a new pool")
        preflight.check_call_arguments(timeout, cwd, env, limits, call_id)
        if session is not None:
            check_id(session)
        if handles_service_tool(tool, args):
            return await self._service_tools.run(
                call_id or f"{self._id_prefix}-{next(self._ids)}",
                tool,
                args,
                journal=self.journal,
                session=session,
                cwd=cwd,
                env=env,
                network=network,
            )
        own_network = None if network is None else allow_list.parse_network(network)
        mode = change_mode(changes) if changes is not None else self.changes
        layer = await self._layer_of(workspace, changes)
        image = layer.image if layer is not None else None
        layer_mount: str | None
        if layer is not None and image is not None:
            # Over an image: the layer's root is the call's `/` (image_layer.py).
            if view is not None or layer_at is not None:
                raise ValueError(
                    f"layer {layer.name!r} lies over an image, which is the call's / already:"
                    " no view or layer_at"
                )
            view = workspace = layer_mount = layer.path
            mode = ChangeMode.DIRECT
        elif layer is not None:
            layer_mount = mount_point(layer, view, layer_at)
            workspace = layer.path if view is None else None
            mode = ChangeMode.DIRECT
        else:
            layer_mount = mount_point(layer, view, layer_at)
        if workspace is not None and not (isinstance(workspace, str) and os.path.isabs(workspace)):
            raise ValueError(f"workspace must be an absolute path or None, not {workspace!r}")
        if call_id is not None and call_id in self._calls:
            # Two calls under one id would share one journal entry and one slot in _calls:
            # the first to end would hide the other from close() for good.
            raise ValueError(f"call_id {call_id!r} is already in flight")
        call = CallState(
            call_id or f"{self._id_prefix}-{next(self._ids)}",
            tool,
            args,
            timeout if timeout is not None else self.config.calls.timeout_s,
            cwd,
            env,
            limits,
            view,
            workspace=_normalised(workspace) if workspace is not None else self.workspace,
        )
        call.on_output = on_output
        call.changes = mode
        if layer is not None:
            call.layer, call.layer_name = layer, layer.name
            call.layer_dir, call.layer_base = layer.directory, layer.base
            call.layer_mount = layer_mount
            call.image = image
            call.start_dir = image_layer.start_dir(image) if image is not None else None
            call.layer_image = image.layer_dirs if image is not None else None
        call.network = own_network
        call.join_network = self._services.network_of(session)
        run: Callable[[], Awaitable[Outcome]] = partial(self._run, call)
        release = None
        if session is not None:  # before the token: a refused reservation subscribes nothing
            run, release = self._sessions.reserve(session, call, run)
        unsubscribe = token_subscription(cancel, call)
        driver = asyncio.create_task(call.drive(self.journal, run, self.telemetry))
        if release is not None:  # the session's next call goes once this one is journaled
            driver.add_done_callback(lambda _: release())
        driver.set_name(call.call_id)
        self._drivers.add(driver)
        driver.add_done_callback(self._drivers.discard)
        self._calls[call.call_id] = call
        try:
            return await attend(driver, call)
        finally:
            self._calls.pop(call.call_id, None)
            if unsubscribe is not None:
                unsubscribe()

    async def session(self, session_id: str) -> dict[str, Any]:
        """A shell session's state, ``{"cwd": ..., "env": {...}}``, once the calls made in it
        so far have ended: the cwd as its calls see it (a path in the view, for a session in
        one), the variables it exports beyond the pool's environment. A session never used
        starts in the workspace root with none. A bad id is a ValueError."""
        return await self._sessions.state(session_id, self.workspace)

    def has_session(self, session_id: str) -> bool:
        """Whether the pool holds state for this session: used in it, or restored from the
        journal (a pool opened on the journal of an earlier one)."""
        return check_id(session_id) in self._sessions

    def end_session(self, session_id: str) -> bool:
        """Forget a session: its id's next call starts afresh (the journal keeps its history,
        and a pool opened on it later restores the state its last call left). False if the
        pool held no such session."""
        stopped = self._services.stop_session(check_id(session_id))
        return self._sessions.forget(session_id) or bool(stopped)

    # -- services (sandbx_pool.services) ---------------------------------------------------------

    async def service(
        self,
        name: str,
        command: str,
        *,
        session: str | None = None,
        workspace: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        tty: bool = False,
        network: bool | list[str] | tuple[str, ...] | None = None,
    ) -> Service:
        """Start ``command`` (bash -c) as the service ``name`` and return it once it runs
        (or has failed to: ``svc.outcome`` says why). Confined, limited and journaled as a
        bash call, with no timeout: it runs until it exits, ``await svc.stop()``, its
        session ends (``end_session``) or the pool closes. ``session``: it starts in the
        session's cwd with its exports and belongs to it; with ``network`` false the
        session's later calls join its network namespace (sandbx_pool.services). ``tty``: a
        pseudo-terminal for its stdin, stdout and stderr. ``network``: as a call's (an
        allow-list only without a session). A bad or running name is a ValueError."""
        if self.state is not PoolState.OPEN:
            raise PoolClosed("the pool is not open")
        service = await start_service(
            self,
            self._services,
            self._launch,
            self._inbox.send,
            name,
            command,
            call_id=f"{self._id_prefix}-{next(self._ids)}",
            session=session,
            workspace=workspace,
            cwd=cwd,
            env=env,
            tty=tty,
            network=network,
            session_state=self.session,
            shared_network=self.views and not self._template_in_user_namespaces(),
        )
        return service

    def _template_in_user_namespaces(self) -> bool:
        return self._template is not None and self._template.user_namespaces

    def services(self) -> list[Service]:
        """The pool's services, running and ended, in the order they were started."""
        return list(self._services)

    def _launch(self, call: CallState) -> asyncio.Task[Outcome]:
        """Drive ``call`` as call() does, for a caller that keeps its task (a service): in
        flight until it ends, so close() kills it as any call. It takes no call's slot."""
        if self._services.take_slot():
            self.admit(self.max_workers + 1)
        run = partial(self._run, call)
        driver = asyncio.create_task(call.drive(self.journal, run, self.telemetry))
        driver.set_name(call.call_id)
        self._drivers.add(driver)
        driver.add_done_callback(self._drivers.discard)
        self._calls[call.call_id] = call
        driver.add_done_callback(lambda _: self._calls.pop(call.call_id, None))
        return driver

    # -- one call on this machine (its life around it: call_life) -----------------------------

    async def _run(self, call: CallState) -> Outcome:
        if call.layer is None:
            return await self._run_here(call)
        # One call at a time in a layer, once the previous call's worker is gone (layers.py).
        layer = call.layer
        if not await layer.turn(call):
            return call.killed_outcome()
        try:
            if not layer.open:  # removed (or its pool closing) while the call waited
                return call.outcome(Status.ERROR, error=f"layer {layer.name!r} was removed")
            return await self._run_here(call)
        finally:
            layer.leave(call)

    async def _run_here(self, call: CallState) -> Outcome:
        # Checks that need no process, in order: nothing is forked for a refused call.
        if call.killer is not None:
            return call.killed_outcome()
        tracked = call.changes is not ChangeMode.DIRECT
        keeps_changes = tracked and call.tool in SIDE_EFFECT_TOOLS
        try:
            store = self._changes_store() if keeps_changes else None
        except OSError as exc:
            return call.outcome(Status.ERROR, error=f"cannot keep the call's changes: {exc}")
        try:
            self._start_proxy_for(call)
        except OSError as exc:
            return call.outcome(Status.ERROR, error=f"cannot start the network proxy: {exc}")
        payload = preflight.prepare(call, self._side())
        if isinstance(payload, Outcome):
            return payload
        if store is not None:
            try:
                payload = self._keep_changes_apart(call, store)
            except (OSError, Unsendable) as exc:
                return call.outcome(Status.ERROR, error=f"cannot keep the call's changes: {exc}")
        if self.state is not PoolState.OPEN or self._template_lost:
            call.request_kill(KilledBy.SHUTDOWN, "pool closing")
        try:
            worker = await self._acquire(call)
        except WorkersFailToStart as exc:
            return call.outcome(Status.ERROR, error=str(exc))
        if worker is None:
            return call.killed_outcome()
        outcome = await self._execute(call, worker, payload)
        if call.changes_dir is not None:
            return await self._settle_changes(call, outcome)
        return msgspec.structs.replace(outcome, changes=[]) if tracked else outcome

    # -- layers (sandbx_pool.layers) ------------------------------------------------------------

    async def layer(
        self,
        name: str,
        base: str | os.PathLike[str] | None = None,
        *,
        image: Image | str | None = None,
    ) -> Layer:
        """The layer ``name`` of the pool's layer store (``[workspace] layers``): made over
        ``base`` (a directory, never written: every call in the layer sees it plus the layer's
        own changes), or over ``image`` (an Image of the store, ``pool.image(ref)``: every
        call in the layer sees the image as its ``/``, plus the layer's changes; see
        sandbx_pool.image_layer; a reference is pulled first, as by ``pool.image``; an image
        of the pool's store stays pinned there, never evicted, until the pool closes), or,
        without either, opened as a pool made it before.
        ValueError for a name that is not plain, a base that is not a directory, lies in the
        store (or holds it) or is not the one recorded, an image that is not the recorded
        one; LayerUnavailable where no overlay mounts, or the image's layers do not."""
        if self.state is not PoolState.OPEN:
            raise PoolClosed("the pool is not open")
        path = os.fspath(base) if base is not None else None
        if isinstance(image, str):
            image = await self.image(image)
        if isinstance(image, Image):  # anything else: image_layer.check says what is wrong
            await asyncio.to_thread(self._pin, image)
        return await self._layer_set().open(name, path, image)

    def _pin(self, image: Image) -> None:
        """Hold ``image``'s layers in the pool's store until the pool closes (an Image of
        another store is that store's to keep)."""
        root = self.config.images.store_dir()  # not the store itself: it would be made
        if image.ref in self._pins or not all(
            d.startswith(root + os.sep) for d in image.layer_dirs
        ):
            return
        self._pins[image.ref] = self.images().pin(image)

    def _layer_set(self) -> Layers:
        if self._layers is None:
            self._layers = Layers(
                self.config.workspace.layers_dir(),
                self._internal,
                shared=bool(self.config.sandbox.run_as),
                unavailable=self._why_no_layers,
            )
            self._hide(self._layers.store)
        return self._layers

    def _why_no_layers(self) -> str | None:
        if self.views:
            return None
        containment = (self._template.containment if self._template else None) or "not started"
        return (
            "layers need a mount namespace per call (root with CAP_SYS_ADMIN, or user"
            f" namespaces allowed); this pool's workers have none ({containment}): see"
            " sandbx-pool doctor"
        )

    async def _layer_of(self, workspace: object, changes: str | None) -> Layer | None:
        """The layer a call's ``workspace`` names (a Layer, or a layer's root path), or None."""
        configured = self.config.workspace.layers_dir()
        if not names_a_layer(workspace, configured, self._layers):
            return None
        layer = await self._layer_set().named_by(workspace, configured)
        check_direct(layer, changes)
        return layer

    # -- images (sandbx_pool.images) ------------------------------------------------------------

    async def image(self, ref: str) -> Image:
        """The image ``ref`` names (``oci:DIR[:TAG]``, ``oci-archive:FILE[:TAG]``,
        ``docker-archive:FILE`` or ``[docker://]HOST[:PORT]/REPO[:TAG|@sha256:...]``), found in
        the pool's image store (``[images] store``) or pulled into it, off the event loop.
        ValueError for a malformed ``ref``, ImageError when it cannot be pulled."""
        if self.state is not PoolState.OPEN:
            raise PoolClosed("the pool is not open")
        parse_ref(ref)  # a malformed one is refused before the store is made
        return await asyncio.to_thread(self.images().image, ref)

    def images(self) -> ImageStore:
        """The pool's image store (made on first use), out of every call's reach."""
        if self._images is None:
            self._images = ImageStore.from_config(self.config)
            if self._sandbox is not None:
                self._hide(self._images.root)
        return self._images

    # -- change sets (sandbx_pool.changes) ----------------------------------------------------

    def _changes_store(self) -> ChangeSets:
        """The pool's change sets, beside its journal (in its runtime directory without one:
        gone with the pool), hidden from every call from the first one on."""
        if self._change_sets is None:
            assert self._runtime_dir is not None
            assert self._sandbox is not None
            root = (
                store_dir(self.journal.path)
                if self.journal is not None
                else os.path.join(self._runtime_dir, "changes")
            )
            os.makedirs(root, mode=0o700, exist_ok=True)
            settings = self.config.workspace
            self._change_sets = ChangeSets(
                root, max_paths=settings.max_change_paths, max_bytes=settings.max_change_bytes
            )
            hidden = (*self._sandbox.hidden, os.path.realpath(root))
            self._sandbox = msgspec.structs.replace(self._sandbox, hidden=hidden)
        return self._change_sets

    def _store_exists(self) -> bool:
        # The journal's own directory (J.d), never the workspace.
        return self.journal is not None and os.path.isdir(store_dir(self.journal.path))

    def _keep_changes_apart(self, call: CallState, store: ChangeSets) -> bytes:
        """Give the call its overlay's directory; the Call encoded again with it."""
        call.changes_dir = store.make_call_dir(call.call_id)
        assert call.context is not None
        call.context = msgspec.structs.replace(
            call.context,
            changes_dir=call.changes_dir,
            changes_scan=call.changes is ChangeMode.TRACKED,
        )
        return encode_call(call)

    async def _settle_changes(self, call: CallState, outcome: Outcome) -> Outcome:
        """Apply the call's change set or keep it aside (sandbx_pool.changes)."""
        return await self._changes_store().settle(
            call_id=call.call_id,
            mode=call.changes,
            started_at=call.started_at,
            outcome=outcome,
            workspace=call.view or call.workspace or self.workspace,
            journal=self.journal,
            run=self._internal,
            oldest_running=self._oldest_running(),
        )

    def _oldest_running(self) -> float:
        return min((c.started_at for c in self._calls.values()), default=time.monotonic())

    async def undo(self, call_id: str) -> list[str]:
        """Put back every path a tracked or transactional call changed as it was before the
        call (content, mode, deleted files back, created ones gone); journaled. Returns the
        paths. Raises UndoConflict, changing nothing, when one of them was changed since (the
        error names it and the later call), or when its kept pre-images are not what was
        journaled with its changes; ValueError when the call has nothing to undo (unknown,
        made in direct mode, its changes never applied, already undone, its pre-images
        gone)."""
        if self.state is not PoolState.OPEN:
            raise PoolClosed("the pool is not open")
        if self.journal is None:
            raise ValueError("undo needs the pool's journal: this pool has none")
        store = self._changes_store()
        if self._store_was_missing and not os.path.isdir(store.call_dir(call_id)):  # noqa: ASYNC240 (J.d, the pool's own)
            await self.journal.flush()
            refuse_without_store(self.journal.path, call_id)
        return await store.undo(
            call_id, self.journal, self._internal, oldest_running=self._oldest_running()
        )

    async def _internal(
        self,
        call_id: str,
        tool: str,
        args: dict[str, Any],
        workspace: str,
        layer: tuple[str, str | None] | None = None,
        read_only: tuple[str, ...] | None = None,
        image: tuple[str, ...] | None = None,
    ) -> Outcome:
        """Run one of the coordinator's own actions on a worker confined to ``workspace``,
        the change sets' directory writable besides; or, for a layer's (``layer``: its
        directory and base, mounted; ``read_only``: paths readable besides), nothing more."""
        call = CallState(call_id, tool, args, None, workspace=workspace)
        if layer is not None:
            call.layer_dir, call.layer_base = layer
            call.layer_image = image
        context = preflight.call_context(call, workspace, self._side())
        box = context.sandbox
        if read_only is None:
            box = msgspec.structs.replace(box, writable=(*box.writable, self._changes_store().root))
        else:
            box = msgspec.structs.replace(box, read_only=(*box.read_only, *read_only))
        call.context = msgspec.structs.replace(context, workspace=workspace, sandbox=box)
        try:
            payload = encode_call(call)
            worker = await self._acquire(call)
        except (WorkersFailToStart, Unsendable) as exc:
            return call.outcome(Status.ERROR, error=str(exc))
        if worker is None:
            return call.killed_outcome()
        return await self._execute(call, worker, payload)

    async def _execute(
        self, call: CallState, worker: Worker, payload: bytes, *, journaled: bool = True
    ) -> Outcome:
        send, settings = self._inbox.send, self.config.calls
        journal = self.journal if journaled else None
        try:
            return await execute(
                call, worker, payload, send=send, settings=settings, journal=journal
            )
        except BaseException:
            # Whatever broke (a coordinator bug, close() giving up on the call), the worker
            # may hold the call half-run: it is never handed another, so it must not outlive it.
            worker.signal_group(signal.SIGKILL)
            raise
        finally:
            self._act(self._workers.release(worker))

    # -- workers: scheduling (the WorkerSet decides, _act does) ---------------------------------

    async def _acquire(self, call: CallState) -> Worker | None:
        """Wait for an idle worker and a free slot; None if the call was killed meanwhile.
        Raises WorkersFailToStart when the workers forked for it kept failing."""
        if call.killer is not None:
            return None
        self._act(self._workers.enqueue(call))
        if not call.assigned.done():  # else an idle worker took it: no turn of the loop to wait
            either: set[asyncio.Future[Any]] = {call.assigned, call.kill_requested}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if call.killer is None:
            return call.assigned.result()
        assigned = call.assigned
        given = assigned.result() if assigned.done() and assigned.exception() is None else None
        self._act(self._workers.withdraw(call, given))
        return None

    def _act(self, actions: list[Action]) -> None:
        """Do what the WorkerSet decided, in its order (worker_set.py)."""
        for action in actions:
            match action:
                case Fork(count):
                    if self._template is not None:
                        self._template.spawn(count)
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
        self._act(self._workers.retry())

    # -- events from the workers and the template ----------------------------------------------

    def _on_ready(
        self, identity: bytes, message: Ready, known: Worker | None, peer_pid: int | None
    ) -> None:
        self._act(self._workers.on_ready(identity, message, known, peer_pid))

    def _is_worker(self, pid: int) -> bool:
        """Whether ``pid`` may stay connected to our socket: the template forked it."""
        template = self._template.pid if self._template is not None else None
        return template is not None and parent_pid(pid) == template

    def _on_template(self, message: FromTemplate) -> None:
        if isinstance(message, Spawned):
            self._act(self._workers.on_spawned(message))
        elif isinstance(message, Exited):
            self._act(self._workers.on_exited(message))
        elif isinstance(message, SpawnFailed):
            self._act(self._workers.on_spawn_failed(message))

    def _on_template_lost(self) -> None:
        self._template_lost = True
        for call in self._workers.waiting:
            call.request_kill(KilledBy.SHUTDOWN, "the worker template died")
        self._act(self._workers.on_template_lost())

    # -- helpers -----------------------------------------------------------------------------

    def _side(self) -> preflight.PoolSide:
        proxy = self._proxy.path if self._proxy is not None else None
        return preflight.PoolSide(self.config, self.workspace, self._sandbox, self._gate, proxy)

    def _start_proxy_for(self, call: CallState) -> None:
        """Start the network proxy if ``call`` is the first to need it (an allow-listed bash:
        preflight.with_network says why no other tool)."""
        network = call.network if call.network is not None else self.config.sandbox.network
        if isinstance(network, bool) or call.tool not in preflight.PROXIED_TOOLS:
            return
        if self._proxy is None:
            assert self._runtime_dir is not None
            self._proxy = ProxyHandle(self._runtime_dir, self.config.sandbox.network_hosts)
            self._remains.stoppers.append(self._proxy.stop)
        if not self._proxy.running:
            self._proxy.start()

    @property
    def interrupted(self) -> list[IntentRecord]:
        """Calls a previous coordinator journaled and never finished, of any tool (found when
        the journal was opened, each reported once): what was in flight when it died. Not the
        calls in doubt of ``sandbx-pool journal in-doubt`` (``journal.reader.call_ledger``),
        which are only edit and bash calls, and include those a shutdown stopped mid-way."""
        return self.journal.interrupted if self.journal is not None else []

    @property
    def in_doubt(self) -> list[IntentRecord]:
        """The older name of ``interrupted``, kept for callers that use it."""
        return self.interrupted

    @property
    def views(self) -> bool:
        """Whether a call may have a ``view``: its worker makes a mount namespace of its own,
        which is where it has a PID namespace too (root with CAP_SYS_ADMIN, or a user
        namespace per worker); not in the fallback (a container's root, user namespaces
        refused), where such a call ends as ``error``. False until the pool has started."""
        return self._template is not None and self._template.containment == "pidns"

    def running(self) -> list[dict[str, Any]]:
        """Calls a worker has taken and not finished: call id, tool, worker pid, seconds so far."""
        now = time.monotonic()
        return [
            {
                "call_id": call.call_id,
                "tool": call.tool,
                "pid": call.worker.pid,
                "elapsed_s": now - call.started_at,
            }
            for call in self._calls.values()
            if call.worker is not None and not call.result.done()
        ]

    def stuck_workers(self) -> list[dict[str, Any]]:
        """Workers that did not die after SIGKILL: the worker's pid and state, and the process
        the kernel holds (``stuck_pid``, the worker or a descendant) with where (``wchan``)."""
        return [worker.stuck_report() for worker in self._workers.quarantined()]


def _normalised(path: str) -> str:
    # Lexical only: the coordinator never touches the workspace's filesystem.
    return os.path.normpath(path)
