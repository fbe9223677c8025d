"""The coordinator's façade: runs each tool call in a disposable worker and journals it.

    caller --await pool.call(tool, args)--> Pool.call (misuse raises: preflight)
        |  the call's CallState built whole: its layer placed (layer_calls.py), its mode,
        |  session, network; features' accept (call_seam.py: a session's turn taken)
        |  driver task, one per call: CallLife.drive (call_life.py, shared with RayPool)
        |  journal intent (durable first when the call has side effects)
        v
    CallRunner.run (call_run.py), the features' hooks around and inside it (call_seam.py):
        |  around: a session's turn, a layer's          (sessions.py, layer_calls.py)
        |  prepare: what the call needs made             (change_calls.py, proxy_handle.py)
        |  checks before anything forks: cancelled token, arguments, lexical paths, gate,
        |  context, encoding (preflight.py)
        |  admit: the Call with its change set's directory (change_calls.py)
        v
    Fleet.acquire: an idle, pre-forked worker (fleet.py, worker_set.py)
        |  Fleet.execute --> ROUTER.send(Call) (call_on_worker.py): waits for the first of
        |  Result | kill request (token, task, timeout, shutdown) | the worker's exit (crash);
        |  on a kill: SIGTERM (bash, then SIGKILL after the grace) or SIGKILL to the worker's
        |  group, then wait for its exit; a worker that does not die (state D on a hung
        |  mount) releases the caller anyway and is quarantined until it is reaped
        |  settle: the change set applied or kept aside (change_calls.py)
        v
    journal outcome (on disk first under policy "always") --> Outcome to the caller

Actors:

* ``Pool`` (here): the public API. It checks misuse, builds each call's state whole and
  starts its driver; it names none of the features' internals. What it is made of, and how
  that is put together and taken apart (directories, journal, fleet, features): pool_parts.py.
* ``CallLife`` / ``CallState``: one call's journaled life. Each call runs in its own driver
  task, so that cancelling the caller's task only *requests* the kill: the driver finishes
  the cleanup (shielded) and the caller gets its CancelledError back afterwards (attend).
* The features (``call_seam.CallFeature``): change sets, layers and their images, sessions,
  the network proxy. Each is a module of its own and plugs into every call at one seam.
* ``CallRunner`` (call_run.py): a call's run here, and the pool's own actions on a worker.
* ``Fleet`` (fleet.py): the template that forks workers ahead of demand, the ``WorkerSet``
  that decides (which call gets which worker, how many to fork) and the ``Inbox`` (the ROUTER
  socket: a Ready from the pid forked for its token, a Result carrying its call's secret,
  anything else dropped); it does what the WorkerSet decides, in order, at once.
* Services (services.py, service_tools.py): calls that run until stopped, owned by a session.

No single call, argument or fault ends the pool: a call is encoded (and refused if it cannot
be) before a worker is taken (call_on_worker.encode_call); workers are forked only while the
coordinator's descriptors can pay for them (descriptors.py); connections from anything but a
worker are dropped (inbox.py); and what the pool holds outside memory is released by a
finalizer if close() never runs (pool_finalizer.py), or by the next pool if its process was killed
(runtime_dir.py).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from sandbx_pool import allow_list, preflight
from sandbx_pool.call_life import attend, token_subscription
from sandbx_pool.call_state import CallState
from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import ChangeMode, Config, change_mode
from sandbx_pool.errors import PoolClosed, PoolNotStarted, TemplateLost
from sandbx_pool.fleet import Fleet
from sandbx_pool.gate import Approver
from sandbx_pool.images.image import Image
from sandbx_pool.images.refs import parse_ref
from sandbx_pool.journal.records import IntentRecord
from sandbx_pool.layers import Layer
from sandbx_pool.outcome import Outcome
from sandbx_pool.output import OutputCallback
from sandbx_pool.pool_parts import PoolParts, PoolState
from sandbx_pool.service_tools import ServiceTools, handles_service_tool
from sandbx_pool.services import Service, start_service
from sandbx_pool.sessions import check_id
from sandbx_pool.workers.protocol import Limits


class Pool(PoolParts):
    """Run tool calls in disposable workers. Use as ``async with Pool(workspace) as pool``.

    Its parts (directories, journal, fleet, features) and how they are put together and taken
    apart: pool_parts.py."""

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
        super().__init__(
            workspace,
            workers=workers,
            journal=journal,
            config=config,
            approve=approve,
            changes=changes,
        )
        #: bash's ``background`` and the service_* tools (sandbx_pool.service_tools).
        self._service_tools = ServiceTools(self._services, self.service, self._gate)

    def __repr__(self) -> str:
        return f"<Pool [{self.state.name} | {self._fleet!r}]>"

    @property
    def fleet(self) -> Fleet:
        """The pool's workers and their template (fleet.py): for diagnosis and tests."""
        return self._fleet

    @property
    def runtime_dir(self) -> str | None:
        """The pool's private directory (its sockets), once started; gone after close."""
        return self._runtime_dir

    @property
    def tmp_root(self) -> str | None:
        """Where each call's private TMPDIR is made, once started; gone after close."""
        return self._tmp_root

    @property
    def lock_dir(self) -> str | None:
        """Where the pool's file tools keep their lock files, once started; gone after close."""
        return self._lock_dir

    # -- lifecycle -----------------------------------------------------------------------

    async def __aenter__(self) -> Pool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Make the pool's directories, open its journal, start its workers (pool_parts.py)."""
        if self.state is not PoolState.NEW:
            raise PoolClosed("a pool is started once")
        await self._open()

    def admit(self, calls: int) -> None:
        """Run at least ``calls`` calls at once from now on (``workers`` is only ever raised).

        For a caller whose own concurrency is known only once it runs (an Inspect eval's
        samples): its calls must not queue behind a pool sized for fewer."""
        self.max_workers = max(self.max_workers, calls)
        self._fleet.widen(self.max_workers)

    async def close(self) -> None:
        """Cancel what is in flight (killer ``shutdown``), kill every worker, clean up. Bounded."""
        await self._close()

    def kill_now(self) -> None:
        """SIGKILL every worker group at once, without waiting or journaling (last resort)."""
        self._fleet.kill_now()

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
        ``"transactional"`` (default: the pool's); see sandbx_pool.change_sets. Outside direct
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
        if self._fleet.template_lost:
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
        place = await self._layers.place(workspace, view, layer_at, changes)
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
            place.view,
            _normalised(place.workspace) if place.workspace is not None else self.workspace,
            changes=ChangeMode.DIRECT if place.layer is not None else mode,
            session=session,
            network=own_network,
            join_network=self._services.network_of(session),
            on_output=on_output,
            layer=place.layer,
            layer_mount=place.mount,
        )
        # Before the token: a call its features refuse (a session's) subscribes nothing.
        releases = self._runner.features.accept(call)
        unsubscribe = token_subscription(cancel, call)
        driver = self._drive(call)
        for done in releases:  # a session's next call goes once this one is journaled
            driver.add_done_callback(lambda _, done=done: done())  # type: ignore[misc]
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
            self._fleet.inbox.send,
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
            shared_network=self.views and not self._fleet.in_user_namespaces,
        )
        return service

    def services(self) -> list[Service]:
        """The pool's services, running and ended, in the order they were started."""
        return list(self._services)

    # -- layers (layer_calls.py), images (sandbx_pool.images), change sets (change_calls.py) --

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
        return await self._layers.open(name, path, image)

    async def image(self, ref: str) -> Image:
        """The image ``ref`` names (``oci:DIR[:TAG]``, ``oci-archive:FILE[:TAG]``,
        ``docker-archive:FILE`` or ``[docker://]HOST[:PORT]/REPO[:TAG|@sha256:...]``), found in
        the pool's image store (``[images] store``) or pulled into it, off the event loop.
        ValueError for a malformed ``ref``, ImageError when it cannot be pulled."""
        if self.state is not PoolState.OPEN:
            raise PoolClosed("the pool is not open")
        parse_ref(ref)  # a malformed one is refused before the store is made
        return await asyncio.to_thread(self.images().image, ref)

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
        return await self._change_calls.undo(call_id)

    # -- what the pool can tell -------------------------------------------------------------------

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
        return self._fleet.containment == "pidns"

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
        return self._fleet.stuck_workers()


def _normalised(path: str) -> str:
    # Lexical only: the coordinator never touches the workspace's filesystem.
    return os.path.normpath(path)


__all__ = ["Pool", "PoolState"]
