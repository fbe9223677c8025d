"""Ray: the node's side, one ``NodePool`` actor per node owning that node's ``Pool``.

    RayPool (integrations.ray, the driver) or a rollout worker on the node
        |  node_pool(node_id) -> the actor "sandbx-pool:<node id>" (named, detached, pinned)
        v
    NodePool.call(tool, args, workspace=ABS, ticket=T) --> Pool.call(..., cancel=<T's token>)
    NodePool.cancel(T, reason) --> that token: the call ends ``cancelled`` and is returned

The actor journals nothing (its callers do: RayPool's journal, on the driver). Its Pool starts on
the first call and serves every workspace on the node; a lost template (TemplateLost) closes it,
and the next call opens a new one. ``ray`` is imported lazily (``pip install 'sandbx-pool[ray]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, Final

import msgspec

from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import Config, TelemetrySettings
from sandbx_pool.errors import TemplateLost
from sandbx_pool.outcome import Outcome
from sandbx_pool.pool import Pool

#: Ray namespace of the node actors: every driver of the cluster finds the same ones.
NAMESPACE: Final = "sandbx-pool"
ACTOR_PREFIX: Final = "sandbx-pool:"

#: Cancels that reached a node before their call did (kept so the call is refused on arrival).
EARLY_CANCELS_KEPT: Final = 4096


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError(
            "sandbx_pool.integrations.ray needs Ray: pip install 'sandbx-pool[ray]'"
        ) from exc
    return ray


class NodePool:
    """The actor that owns one node's Pool (made a Ray actor by ``node_pool``)."""

    def __init__(self, node_id: str, config: Config, workers: int | None) -> None:
        self.node_id = node_id
        # The node's pool journals nothing: its callers do (RayPool), or choose not to.
        # The driver journals and sends the spans (RayPool): the node's pool does neither.
        config = msgspec.structs.replace(config, telemetry=TelemetrySettings())
        self._config = config.override(journal={"policy": "off"})
        self._workers = workers
        self._pool: Pool | None = None
        self._starting = asyncio.Lock()
        self._tokens: dict[str, CancelToken] = {}
        self._early: dict[str, str | None] = {}

    async def _open_pool(self) -> Pool:
        async with self._starting:
            if self._pool is None:
                # Its own workspace is never used: every call names one (an absolute path).
                pool = Pool("/", workers=self._workers, config=self._config)
                await pool.start()
                self._pool = pool
            return self._pool

    async def layer(self, name: str, base: str | None = None, image: str | None = None) -> str:
        """Make or open the layer ``name`` on this node (Pool.layer), over ``base`` or over the
        image ``image`` names (pulled into this node's image store, once); its path, a
        workspace valid on this node only."""
        pool = await self._open_pool()
        return (await pool.layer(name, base=base, image=image)).path

    async def call(
        self,
        tool: str,
        args: dict[str, Any],
        *,
        workspace: str,
        timeout: float | None = None,  # noqa: ASYNC109 (Pool.call's name: a kill deadline)
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        ticket: str | None = None,
    ) -> Outcome:
        """Run one call on this node, confined to ``workspace`` (an absolute path here)."""
        pool = await self._open_pool()
        token = CancelToken()
        if ticket is not None:
            self._tokens[ticket] = token
            if ticket in self._early:
                token.cancel(self._early.pop(ticket))
        try:
            outcome = await pool.call(
                tool, args, workspace=workspace, timeout=timeout, cwd=cwd, env=env, cancel=token
            )
        except TemplateLost:
            # The node's pool is broken for good: the next call opens a new one.
            self._pool = None
            await pool.close()
            raise
        finally:
            if ticket is not None:
                self._tokens.pop(ticket, None)
        return msgspec.structs.replace(outcome, node=self.node_id)

    def cancel(self, ticket: str, reason: str | None = None) -> None:
        """Kill the call of ``ticket`` (its ``call`` then returns the cancelled outcome)."""
        token = self._tokens.get(ticket)
        if token is not None:
            token.cancel(reason)
            return
        if len(self._early) >= EARLY_CANCELS_KEPT:
            self._early.pop(next(iter(self._early)))
        self._early[ticket] = reason

    def info(self) -> dict[str, Any]:
        pool = self._pool
        return {
            "node": self.node_id,
            "pid": os.getpid(),
            "workers": pool.max_workers if pool is not None else None,
            "running": len(pool.running()) if pool is not None else 0,
        }

    async def close(self) -> None:
        """Close the node's pool (the actor stays; its next call opens a new one)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()


_actor_class: Any = None


def node_pool(
    node_id: str | None = None,
    *,
    workers_per_node: int | None = None,
    config: Config | None = None,
) -> Any:
    """The handle of ``node_id``'s pool actor (default: this node's), created if missing.

    The first caller's ``workers_per_node`` and ``config`` make the actor; later callers share
    it as it is. ``ray.get(handle.call.remote(tool, args, workspace=ABS, timeout=...))`` returns
    the Outcome; ``ray.cancel(ref)`` kills the call (its process group, on the node).
    """
    global _actor_class
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or ray.get_runtime_context().get_node_id()
    if _actor_class is None:
        _actor_class = ray.remote(NodePool)
    return _actor_class.options(
        name=ACTOR_PREFIX + node,
        namespace=NAMESPACE,
        lifetime="detached",  # long-lived: shared by every task and driver of the node
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
        num_cpus=0,  # a coordinator on the loop; the workers are its own processes
        max_restarts=0,
    ).remote(node, config if config is not None else Config(), workers_per_node)


def shutdown_node_pools() -> int:
    """Kill every node's pool actor of the cluster (their workers go with them). Returns how
    many were killed."""
    ray = import_ray()
    killed = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        with contextlib.suppress(ValueError):  # no actor on that node
            handle = ray.get_actor(ACTOR_PREFIX + node["NodeID"], namespace=NAMESPACE)
            ray.kill(handle, no_restart=True)
            killed += 1
    return killed


__all__ = [
    "ACTOR_PREFIX",
    "NAMESPACE",
    "NodePool",
    "import_ray",
    "node_pool",
    "shutdown_node_pools",
]
