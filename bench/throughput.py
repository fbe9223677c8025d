"""Section 3: reads per second with 8 calls in flight, and what the coordinator weighs after.

sandbx-pool: ``Pool(workers=8)``, journal on (default policy), eight asyncio loops each making
one call after another until the count is reached. The peers get 8 workers and all their tasks
submitted at once (their queue keeps 8 in flight, with no gap between a task and the next);
the slow ones get fewer calls, stated in the table. Memory is read from /proc once the
sandbx-pool run is over, before its pool closes: the coordinator (this process) and the idle
workers waiting for the next call.

CPU per call, from getrusage: the caller's process over the timed run (for sandbx-pool, the
coordinator with its ZeroMQ I/O and journal threads), and the worker processes over the
pool's whole life (RUSAGE_CHILDREN once the pool is closed: the template, or pebble's and the
executor's workers, and whatever they reaped) divided by every call they served, warm-up
included. On a machine with C cores, C / (the sum) bounds the calls per second.
"""

from __future__ import annotations

import asyncio
import math
import resource
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from loguru import logger

from bench import procs, workerconn
from bench.latency import read_once
from bench.peers import PebblePool, ProcessPoolDisposable
from bench.stats import Samples, ratio
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool

PARALLEL = 8
SANDBX = "sandbx"

#: How long each peer gets (its queued tasks then finish).
PEER_MAX_S = 6.0


@dataclass(frozen=True)
class ThroughputRow:
    key: str
    name: str
    workers: int
    calls: int
    wall_ns: int
    samples: Samples | None = None  # per-call latency, when measured per call
    caller_cpu_ms: float = float("nan")  # per call, the calling process
    workers_cpu_ms: float = float("nan")  # per call, the worker processes (and template)

    @property
    def calls_per_s(self) -> float:
        return ratio(self.calls * 1e9, self.wall_ns)


@dataclass(frozen=True)
class MemoryReport:
    coordinator: procs.Memory | None
    template: procs.Memory | None
    idle_workers: list[procs.Memory]
    containment: str


@dataclass(frozen=True)
class ConnectionCost:
    """Forked workers serving one read each, by how they connect (bench.workerconn)."""

    mode: str
    cpu: Samples  # per worker, from wait4 (ns)
    faults_mean: float


@dataclass(frozen=True)
class ThroughputResult:
    rows: list[ThroughputRow]
    memory: MemoryReport
    connection: list[ConnectionCost]

    def row(self, key: str) -> ThroughputRow | None:
        return next((row for row in self.rows if row.key == key), None)


def _cpu_s(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def _memory() -> MemoryReport:
    template, workers = procs.template_and_workers()
    idle = [m for pid in workers if (m := procs.memory(pid)) is not None]
    return MemoryReport(
        coordinator=procs.memory(),
        template=procs.memory(template) if template else None,
        idle_workers=idle,
        containment=next(
            (c for pid in workers if (c := procs.containment_of(pid)) != "unknown"), "unknown"
        ),
    )


async def _sandbx(
    ws: BenchWorkspace, calls: int, warmup: int, max_s: float
) -> tuple[ThroughputRow, MemoryReport]:
    """``calls`` reads, 8 at a time, or as many as ``max_s`` allows."""
    samples = Samples()
    children_before = _cpu_s(resource.RUSAGE_CHILDREN)
    deadline = math.inf
    async with Pool(
        ws.workspace, workers=PARALLEL, journal=ws.journal("throughput"), config=ws.config()
    ) as pool:

        async def loop(quota: int, record: bool) -> None:
            for _ in range(quota):
                if time.monotonic() > deadline:
                    return
                start = time.perf_counter_ns()
                await read_once(pool)
                if record:
                    samples.add(time.perf_counter_ns() - start)

        async def burst(total: int, record: bool) -> None:
            quotas = [total // PARALLEL + (i < total % PARALLEL) for i in range(PARALLEL)]
            async with asyncio.TaskGroup() as group:
                for quota in quotas:
                    group.create_task(loop(quota, record))

        await burst(warmup, record=False)
        deadline = time.monotonic() + max_s
        caller_before = _cpu_s(resource.RUSAGE_SELF)
        start = time.perf_counter_ns()
        await burst(calls, record=True)
        wall = time.perf_counter_ns() - start
        caller = _cpu_s(resource.RUSAGE_SELF) - caller_before
        deadline = math.inf
        # Two more calls give the pool a moment to fork its idle workers back.
        await read_once(pool)
        await read_once(pool)
        memory = _memory()
    workers = _cpu_s(resource.RUSAGE_CHILDREN) - children_before
    done = samples.count
    row = ThroughputRow(
        SANDBX,
        f"sandbx-pool (workers={PARALLEL}, journal on)",
        PARALLEL,
        done,
        wall,
        samples,
        caller_cpu_ms=caller * 1000 / done,
        workers_cpu_ms=workers * 1000 / (warmup + done + 2),
    )
    return row, memory


def _peer(
    key: str, peer: PebblePool | ProcessPoolDisposable, calls: int, max_s: float
) -> ThroughputRow:
    """Keep 2 x PARALLEL tasks queued until ``calls`` are done or ``max_s`` has passed."""
    logger.info("throughput: {}, up to {} calls or {} s", peer.name, calls, max_s)
    children_before = _cpu_s(resource.RUSAGE_CHILDREN)
    with peer:
        warmup = 2 * PARALLEL
        wait([peer.submit() for _ in range(warmup)])
        caller_before = _cpu_s(resource.RUSAGE_SELF)
        start = time.perf_counter_ns()
        deadline = start + int(max_s * 1e9)
        pending: set[Future[object]] = set()
        submitted = done = 0
        while True:
            while (
                submitted < calls
                and len(pending) < 2 * PARALLEL
                and time.perf_counter_ns() < deadline
            ):
                pending.add(peer.submit())
                submitted += 1
            if not pending:
                break
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                future.result()  # raises if a task failed
            done += len(finished)
        wall = time.perf_counter_ns() - start
        caller = _cpu_s(resource.RUSAGE_SELF) - caller_before
    workers = _cpu_s(resource.RUSAGE_CHILDREN) - children_before
    return ThroughputRow(
        key,
        peer.name,
        PARALLEL,
        done,
        wall,
        caller_cpu_ms=caller * 1000 / done,
        workers_cpu_ms=workers * 1000 / (warmup + done),
    )


def run(
    ws: BenchWorkspace, *, calls: int = 2000, max_s: float = 25.0, peer_max_s: float = PEER_MAX_S
) -> ThroughputResult:
    logger.info("throughput: sandbx-pool, {} calls or {} s, {} in parallel", calls, max_s, PARALLEL)
    row, memory = asyncio.run(_sandbx(ws, calls, min(200, calls // 5), max_s))
    path = str(ws.data)
    pebble_disposable = PebblePool(path, workers=PARALLEL, disposable=True)
    ppe = ProcessPoolDisposable(path, workers=PARALLEL)
    pebble_warm = PebblePool(path, workers=PARALLEL, disposable=False)
    rows = [
        row,
        _peer("pebble-disposable", pebble_disposable, calls, peer_max_s),
        _peer("ppe", ppe, calls, peer_max_s),
        _peer("pebble-warm", pebble_warm, calls, peer_max_s),
    ]
    return ThroughputResult(rows, memory, _connection_costs(ws))


def _connection_costs(ws: BenchWorkspace) -> list[ConnectionCost]:
    logger.info("throughput: a worker's connection, ZMTP against a libzmq context")
    endpoint = f"ipc://{ws.root}/workerconn.sock"
    costs = workerconn.measure(endpoint, str(ws.workspace), ws.data.name, count=150, rounds=2)
    return [
        ConnectionCost(
            mode,
            Samples([cpu for cpu, _ in pairs]),
            sum(faults for _, faults in pairs) / len(pairs),
        )
        for mode, pairs in costs.items()
    ]
