"""Section 6: the same reads through ``RayPool`` on a local two-node Ray cluster and through a
local ``Pool``: calls/s at 8 in flight, and the per-call overhead Ray adds (p50 of one call at
a time, RayPool minus Pool).

The cluster is ``ray.cluster_utils.Cluster``: a head and one more node on this machine, each
with its own raylet, 1 CPU and a small object store. Both sides get the same workers in all (4
per node against 8 locally) and journal nothing, so the difference is Ray's: the actor call
(driver -> node's actor -> result object) on top of the pool's own call. Rounds alternate so
that a shared machine's noise falls on both alike.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool

LOCAL = "Pool (one machine)"
RAY = "RayPool (2 nodes)"
IN_FLIGHT = 8
WORKSPACES = 4
ROUNDS = 4


@dataclass
class ClusterResult:
    sequential: dict[str, Samples] = field(default_factory=dict)
    rate: dict[str, list[float]] = field(default_factory=dict)
    calls_per_node: dict[str, int] = field(default_factory=dict)

    def overhead_ms(self) -> float:
        return self.sequential[RAY].percentile_ms(50) - self.sequential[LOCAL].percentile_ms(50)

    def best_rate(self, name: str) -> float:
        return max(self.rate[name])


def run(ws: BenchWorkspace, *, calls: int) -> ClusterResult:
    import ray
    from ray.cluster_utils import Cluster

    from sandbx_pool.integrations.ray import shutdown_node_pools

    # Ray's sessions (logs, sockets) in a directory of ours, removed at the end: short, for the
    # unix sockets' 107-byte path limit (the run's own directory is too deep).
    temp_dir = tempfile.mkdtemp(prefix="sbx-ray-")
    # Whatever temp_dir says, Ray writes the head's address to <tmp>/ray/ray_current_cluster,
    # and fails when that directory does not exist (a fresh machine): after the head started,
    # whose processes a Cluster that raised in its constructor would leave running.
    address_dir = os.path.join(tempfile.gettempdir(), "ray")
    made_address_dir = not os.path.isdir(address_dir)
    os.makedirs(address_dir, exist_ok=True)
    node = {"num_cpus": 1, "object_store_memory": 80_000_000, "temp_dir": temp_dir}
    cluster = Cluster()  # the head comes in the try: a failure there still shuts it down
    try:
        cluster.add_node(**node)
        cluster.connect()
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        return asyncio.run(_run(ws, calls))
    finally:
        if ray.is_initialized():
            shutdown_node_pools()
            ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if made_address_dir:
            shutil.rmtree(address_dir, ignore_errors=True)


async def _run(ws: BenchWorkspace, calls: int) -> ClusterResult:
    from sandbx_pool.integrations.ray import RayPool

    result = ClusterResult(sequential={LOCAL: Samples(), RAY: Samples()}, rate={LOCAL: [], RAY: []})
    names = [f"ray-{n}" for n in range(WORKSPACES)]
    for name in names:
        (ws.workspace / name).mkdir(exist_ok=True)
        (ws.workspace / name / "data.txt").write_bytes(ws.data.read_bytes())
    off = {"policy": "off"}
    local_config = ws.config(pool={"workers": 2 * 4}, journal=off)
    ray_config = ws.config(pool={"workers": 4}, journal=off)
    per_round = max(IN_FLIGHT, calls // ROUNDS)
    async with (
        Pool(ws.workspace, config=local_config) as local,
        RayPool(ws.workspace, config=ray_config) as cluster,
    ):

        async def one(name: str, n: int) -> None:
            workspace = names[n % WORKSPACES]
            if name == LOCAL:
                outcome = await local.call("read", {"path": f"{workspace}/data.txt"})
            else:
                outcome = await cluster.call("read", {"path": "data.txt"}, workspace=workspace)
                assert outcome.node is not None
                result.calls_per_node[outcome.node] = result.calls_per_node.get(outcome.node, 0) + 1
            assert outcome.ok, outcome

        for name in (LOCAL, RAY):  # warm up: every node's actor and pool started
            await asyncio.gather(*(one(name, n) for n in range(2 * IN_FLIGHT)))
        for round_number in range(ROUNDS):
            order = (LOCAL, RAY) if round_number % 2 == 0 else (RAY, LOCAL)
            for name in order:
                for n in range(per_round // 4):
                    start = time.perf_counter_ns()
                    await one(name, n)
                    result.sequential[name].add(time.perf_counter_ns() - start)
                queue = iter(range(per_round))  # shared by the lanes
                start_s = time.monotonic()
                await asyncio.gather(*(_lane(one, name, queue) for _ in range(IN_FLIGHT)))
                result.rate[name].append(per_round / (time.monotonic() - start_s))
    logger.info("cluster: {} calls each way", per_round * ROUNDS)
    return result


async def _lane(
    one: Callable[[str, int], Awaitable[None]], name: str, queue: Iterator[int]
) -> None:
    for n in queue:
        await one(name, n)
