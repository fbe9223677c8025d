"""Ray: one pool per node of a cluster, and ``RayPool``, the Pool API across the cluster.

    driver: RayPool.call(tool, args, workspace="ep-7")
        |  journal intent (the driver's journal: in-doubt and resume work as on one machine)
        |  placement: workspace -> node (sticky; a new one goes to the least loaded live node)
        v
    NodePool actor "sandbx-pool:<node id>" (named, detached, pinned to its node, async)
        |  Pool.call(tool, args, workspace=ROOT/ep-7, cancel=<the ticket's token>)
        v  one Pool per node: its template and workers serve every workspace on the node
    Outcome (node=<node id>) --> driver journals the outcome --> caller

Actors:

* ``NodePool`` (integrations.ray_node, re-exported here with ``node_pool`` and
  ``shutdown_node_pools``): a long-lived actor per node that owns the node's ``Pool`` (started
  on its first call, journal off: whoever drives the calls journals them). ``node_pool()``
  returns the handle of this node's actor, creating it if missing, so every rollout worker or
  task on a node shares one pool. ``handle.call.remote(...)`` returns the ``Outcome``;
  ``ray.cancel`` of that ref raises CancelledError inside the actor's coroutine, which kills
  the call's process group on the node (Pool.call's task cancel).
* ``RayPool``: the driver's side. A cancel (token or task) is sent to the node as
  ``cancel(ticket)`` rather than ``ray.cancel``: the actor's ``call`` then *returns* the
  cancelled outcome (a ray.cancel'ed ref has none to give), which the driver journals.

Node loss: a call whose actor died (its node was removed, or the actor crashed) ends
``crashed`` with an error naming the node and reason ``NODE_LOST`` (``run --resume`` runs it
again); its workspaces are placed afresh on live nodes, so the workspace root must be on
storage every node sees.

``ray`` is imported lazily: the core never needs it (``pip install 'sandbx-pool[ray]'``).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import os
import time
import uuid
from collections import Counter
from functools import partial
from typing import Any, Final

import msgspec

from sandbx_pool.call_life import CallLife, attend, token_subscription
from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import Config, load_config
from sandbx_pool.errors import PoolClosed, PoolNotStarted
from sandbx_pool.integrations.ray_node import import_ray, node_pool, shutdown_node_pools
from sandbx_pool.journal.records import NODE_LOST
from sandbx_pool.journal.store import Journal
from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.preflight import check_call_arguments
from sandbx_pool.telemetry import Telemetry, open_telemetry

#: After a cancel is sent, how long the driver waits for the node's cancelled outcome before it
#: gives up on the node (ray.cancel, then a ``cancelled`` outcome of its own). The node answers
#: within the kill's own deadlines (grace_s, kill_wait_s: about 1 s); this bounds a node that
#: no longer answers at all.
CANCEL_ANSWER_S: Final = 5.0

#: How long a list of the cluster's live nodes is trusted when a new workspace is placed.
NODES_TTL_S: Final = 1.0

# -- the driver's side ---------------------------------------------------------------------


class RayPoolState(enum.IntEnum):
    NEW = 0
    OPEN = 1
    CLOSING = 2
    CLOSED = 3


class Placement:
    """Which node runs each workspace: sticky, and a new workspace goes to the live node with
    the fewest workspaces per CPU. Synchronous decisions; the caller supplies the live nodes."""

    def __init__(self) -> None:
        self.node_of: dict[str | None, str] = {}
        self.load: Counter[str] = Counter()

    def place(self, workspace: str | None, live: dict[str, float]) -> str:
        node = self.node_of.get(workspace)
        if node is not None and node in live:
            return node
        if node is not None:
            self.load[node] -= 1
        if not live:
            raise RuntimeError("the Ray cluster has no live node with a CPU")
        chosen = min(live, key=lambda n: ((self.load[n] + 1) / live[n], n))
        self.node_of[workspace] = chosen
        self.load[chosen] += 1
        return chosen

    def forget_node(self, node: str) -> None:
        for workspace in [w for w, n in self.node_of.items() if n == node]:
            del self.node_of[workspace]
        self.load.pop(node, None)


class _Flight(CallLife):
    """One call on its node: its life (call_life), and the node's pool that runs it. A kill is
    recorded here first, then sent to the node as a cancel of the call's ticket."""

    def __init__(
        self, handle: Any, ticket: str, node: str, call: tuple[Any, ...], call_id: str
    ) -> None:
        tool, args, path, timeout, cwd, _ = call
        super().__init__(call_id, tool, args, timeout, cwd, path)
        self.handle = handle
        self.ticket = ticket
        self.node = node
        self.call = call
        self.dispatched = False
        self.kill_sent = asyncio.Event()

    def request_kill(self, killer: KilledBy, reason: str | None = None) -> None:
        if self.killer is not None:
            return
        super().request_kill(killer, reason)
        self.handle.cancel.remote(self.ticket, reason)
        self.kill_sent.set()

    def shutdown_fields(self) -> dict[str, Any]:
        return {"started": self.dispatched, "node": self.node}


class RayPool:
    """The Pool API across a Ray cluster. Use as ``async with RayPool(root) as pool``.

    ``await pool.call(tool, args, workspace="ep-7")`` runs the call confined to
    ``workspace_root/ep-7`` on the node that runs every call of that workspace. ``address`` is
    given to ``ray.init`` when Ray is not initialised yet (None: a local Ray, or
    ``RAY_ADDRESS``). ``workers_per_node`` and ``config`` make the node actors this pool
    creates (an actor that exists already is shared as it is). ``journal`` is written here.
    """

    def __init__(
        self,
        workspace_root: str | os.PathLike[str],
        *,
        address: str | None = None,
        workers_per_node: int | None = None,
        journal: str | os.PathLike[str] | None = None,
        config: str | os.PathLike[str] | Config | None = None,
    ) -> None:
        self.config = config if isinstance(config, Config) else load_config(config)
        self.workspace_root = os.path.abspath(os.fspath(workspace_root))
        self.address = address
        self.workers_per_node = workers_per_node
        self.journal: Journal | None = None
        #: Spans of its calls, made here on the driver (the node pools send none).
        self.telemetry: Telemetry | None = None
        self._journal_path = os.fspath(journal) if journal is not None else None
        self.state = RayPoolState.NEW
        self.placement = Placement()
        self._handles: dict[str, Any] = {}
        self._live: dict[str, float] = {}
        self._live_at = -NODES_TTL_S
        self._flights: dict[str, _Flight] = {}
        #: Paths of the layers made through this pool (RayPool.layer), each placed on its node.
        self._layer_paths: set[str] = set()
        self._drivers: set[asyncio.Task[Outcome]] = set()
        self._ids = itertools.count(1)
        self._id_prefix = f"ray-{os.getpid():x}-{int(time.time()):x}"
        self._started_ray = False

    def __repr__(self) -> str:
        return (
            f"<RayPool [{self.state.name} | {len(self._live)} nodes | "
            f"{len(self.placement.node_of)} workspaces | {len(self._flights)} in flight]>"
        )

    async def __aenter__(self) -> RayPool:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self.state is not RayPoolState.NEW:
            raise PoolClosed("a pool is started once")
        self.telemetry = open_telemetry(self.config.telemetry)
        ray = import_ray()
        if not ray.is_initialized():
            ray.init(address=self.address, logging_level="WARNING", log_to_driver=False)
            self._started_ray = True
        if self._journal_path is not None:
            self.journal = await Journal.open(self._journal_path, self.config.journal)
        self._refresh_nodes(force=True)
        self.state = RayPoolState.OPEN

    async def close(self) -> None:
        """Cancel what is in flight (killer ``shutdown``), journal it, close the journal. The
        node actors stay (shared); ``shutdown_node_pools()`` ends them."""
        if self.state is not RayPoolState.OPEN:
            self.state = RayPoolState.CLOSED
            return
        self.state = RayPoolState.CLOSING
        for flight in self._flights.values():
            flight.request_kill(KilledBy.SHUTDOWN, "pool closing")
        drivers = [task for task in self._drivers if not task.done()]
        if drivers:
            await asyncio.wait(drivers, timeout=self.config.pool.close_timeout_s + CANCEL_ANSWER_S)
        if self.journal is not None:
            await self.journal.close()
        if self.telemetry is not None:
            await self.telemetry.close()
        if self._started_ray:
            import_ray().shutdown()
        self.state = RayPoolState.CLOSED

    def kill_now(self) -> None:
        """Send every call in flight its cancel at once, without waiting (last resort)."""
        for flight in self._flights.values():
            flight.request_kill(KilledBy.SHUTDOWN, "exiting now")

    # -- the public call -------------------------------------------------------------------

    async def call(
        self,
        tool: str,
        args: dict[str, Any],
        *,
        workspace: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (the contract's name; a kill deadline)
        cancel: CancelToken | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        call_id: str | None = None,
    ) -> Outcome:
        """Run one call on the node of ``workspace`` (a folder under the root; None: the root).

        Cancelling the awaiting task or ``cancel`` kills the call on its node; the task's
        CancelledError is re-raised once the node has answered (within about 1 s).
        """
        if self.state is RayPoolState.NEW:
            raise PoolNotStarted("use `async with RayPool(...)` or `await pool.start()` first")
        if self.state is not RayPoolState.OPEN:
            raise PoolClosed("the pool is closed")
        check_call_arguments(timeout, cwd, env, None, call_id)
        # A layer's path (RayPool.layer) runs where the layer is, as its own placement.
        in_layer = isinstance(workspace, str) and workspace in self._layer_paths
        path = workspace if in_layer else self.workspace_path(workspace)
        assert path is not None
        call_id = call_id or f"{self._id_prefix}-{next(self._ids)}"
        if call_id in self._flights:
            raise ValueError(f"call_id {call_id!r} is already in flight")
        node = self._place(workspace)
        call = (tool, args, path, timeout, cwd, env)
        flight = _Flight(self._handle(node), uuid.uuid4().hex, node, call, call_id)
        self._flights[call_id] = flight
        unsubscribe = token_subscription(cancel, flight)
        run = partial(self._run, flight)
        driver = asyncio.create_task(flight.drive(self.journal, run, self.telemetry))
        driver.set_name(call_id)
        self._drivers.add(driver)
        driver.add_done_callback(self._drivers.discard)
        try:
            return await attend(driver, flight)  # bounded by CANCEL_ANSWER_S
        finally:
            self._flights.pop(call_id, None)
            if unsubscribe is not None:
                unsubscribe()

    async def layer(
        self, name: str, base: str | os.PathLike[str] | None = None, *, image: str | None = None
    ) -> str:
        """Make or open the layer ``name`` (sandbx_pool.layers) on a node, placed as a
        workspace is (sticky; the least loaded live node for a new one): its path there, which
        ``call(workspace=...)`` then takes, and which runs on that node only. A layer lives in
        that node's layer store: after a node is lost, its layers are gone with it.
        ``image``: a reference (``Pool.image``'s), pulled into that node's image store once
        (later layers over it on the node find it there); the layer's ``/`` is the image."""
        if self.state is not RayPoolState.OPEN:
            raise PoolClosed("the pool is not open")
        if image is not None and not isinstance(image, str):
            # An Image names directories of the driver's store, not of the node's.
            raise TypeError(f"image must be a reference (a str), not {type(image).__name__}")
        key = f"layer:{name}"
        node = self._place(key)
        base_path = os.path.abspath(os.fspath(base)) if base is not None else None  # noqa: ASYNC240
        path: str = await self._handle(node).layer.remote(name, base_path, image)
        self._layer_paths.add(path)
        self.placement.node_of[path] = node
        return path

    def workspace_path(self, workspace: str | None) -> str:
        """The absolute path of a workspace name: lexical, and never outside the root."""
        if workspace is None:
            return self.workspace_root
        if not isinstance(workspace, str) or not workspace:
            raise TypeError(f"workspace must be a folder name under the root, not {workspace!r}")
        path = os.path.normpath(os.path.join(self.workspace_root, workspace))
        if os.path.isabs(workspace) or not (
            path == self.workspace_root or path.startswith(self.workspace_root + os.sep)
        ):
            raise ValueError(f"workspace {workspace!r} is not a folder under the root")
        return path

    def nodes(self) -> dict[str | None, str]:
        """Which node each workspace placed so far runs on."""
        return dict(self.placement.node_of)

    # -- one call's life ---------------------------------------------------------------------

    async def _run(self, flight: _Flight) -> Outcome:
        """The call on its node: the node's Pool gates, runs and kills it; the outcome's
        duration is the caller's, from its intent here."""
        outcome = await self._on_node(flight)
        return msgspec.structs.replace(outcome, duration_s=time.monotonic() - flight.started_at)

    async def _on_node(self, flight: _Flight) -> Outcome:
        ray = import_ray()
        call_id, node = flight.call_id, flight.node
        tool, args, path, timeout, cwd, env = flight.call
        ref = flight.handle.call.remote(
            tool, args, workspace=path, timeout=timeout, cwd=cwd, env=env, ticket=flight.ticket
        )
        flight.dispatched = True
        answer = asyncio.ensure_future(_settle(ref))
        killed = asyncio.ensure_future(flight.kill_sent.wait())
        try:
            await asyncio.wait({answer, killed}, return_when=asyncio.FIRST_COMPLETED)
            if not answer.done():
                # Killed: the node answers with the cancelled outcome within its kill's deadlines.
                done, _ = await asyncio.wait({answer}, timeout=CANCEL_ANSWER_S)
                if not done:
                    ray.cancel(ref)
                    answer.cancel()
                    return flight.outcome(
                        Status.CANCELLED,
                        killed_by=flight.killer,
                        reason=flight.reason,
                        started=True,
                        node=node,
                        error=f"node {node} did not answer the cancel within {CANCEL_ANSWER_S} s",
                    )
        finally:
            killed.cancel()
        value = answer.result()
        if isinstance(value, Outcome):
            fields: dict[str, Any] = {"call_id": call_id, "node": node}
            if flight.killer is not None and value.killed_by is KilledBy.TOKEN:
                # The node saw a token; who asked is known here (the caller's token or task).
                fields |= {"killed_by": flight.killer, "reason": flight.reason}
            return msgspec.structs.replace(value, **fields)
        return self._failed(call_id, tool, node, value)

    def _failed(self, call_id: str, tool: str, node: str, exc: BaseException) -> Outcome:
        ray = import_ray()
        if isinstance(exc, ray.exceptions.RayTaskError):
            # The node's Pool raised (misuse is checked here first; this is its infrastructure).
            return Outcome(
                call_id=call_id,
                tool=tool,
                status=Status.CRASHED,
                error=f"node {node}: {exc.cause!r}" if exc.cause else f"node {node}: {exc}",
                started=True,
                node=node,
            )
        # The actor is gone: its node died, or it did. Either way its calls are lost, and its
        # workspaces go to a live node from now on.
        self._handles.pop(node, None)
        self._refresh_nodes(force=True)
        lost = node not in self._live
        if lost:
            self.placement.forget_node(node)
        what = "was lost" if lost else "lost its sandbx-pool actor"
        logger.warning("node {} {} with call {} in flight", node, what, call_id)
        return Outcome(
            call_id=call_id,
            tool=tool,
            status=Status.CRASHED,
            error=f"node {node} {what} while the call ran ({type(exc).__name__})",
            reason=NODE_LOST,
            started=True,
            node=node,
        )

    # -- nodes ---------------------------------------------------------------------------------

    def _refresh_nodes(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._live_at < NODES_TTL_S:
            return
        live = {
            node["NodeID"]: float(node.get("Resources", {}).get("CPU", 0.0))
            for node in import_ray().nodes()
            if node.get("Alive") and node.get("Resources", {}).get("CPU", 0.0) > 0
        }
        for gone in set(self._live) - set(live):
            self.placement.forget_node(gone)
            self._handles.pop(gone, None)
        self._live, self._live_at = live, now

    def _place(self, workspace: str | None) -> str:
        node = self.placement.node_of.get(workspace)
        if node is None or node not in self._live:
            self._refresh_nodes()
        return self.placement.place(workspace, self._live)

    def _handle(self, node: str) -> Any:
        handle = self._handles.get(node)
        if handle is None:
            handle = node_pool(node, workers_per_node=self.workers_per_node, config=self.config)
            self._handles[node] = handle
        return handle


async def _settle(ref: Any) -> Outcome | BaseException:
    """The node's answer: its Outcome, or the Ray error that stands for it."""
    ray = import_ray()
    try:
        value = await ref
    except ray.exceptions.RayError as exc:
        error: BaseException = exc
        return error
    if not isinstance(value, Outcome):
        return TypeError(f"the node answered {type(value).__name__}, not an Outcome")
    return value


__all__ = ["Placement", "RayPool", "RayPoolState", "node_pool", "shutdown_node_pools"]
