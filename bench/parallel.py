"""Issue 40's throughput: bash ``true`` and a 1 KiB read with 8 calls in flight, against the
command executors doing the same 8 at a time.

sandbx-pool: ``Pool(workers=8)``, journal on, eight asyncio tasks each making one call after
another. The peers (``bench.executors``: a bare subprocess, bubblewrap per command) get eight
threads each running one command after another; the read is ``cat`` of the file with no shell.
Every contender's burst is bounded by a count and a time; there are ``ROUNDS`` rounds, the
order reversed in the second, so that a change of the machine's load falls on all alike, and a
row is its calls over its wall time summed over the rounds.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from loguru import logger

from bench.executors import Bare, Bwrap, Executor
from bench.percall import COMMANDS, READ, TRUE
from bench.stats import ratio
from bench.workspace import DATA_BYTES, BenchWorkspace
from sandbx_pool import Pool

PARALLEL = 8
ROUNDS = 2
OPERATIONS = (TRUE, READ)
POOL = "pool"
CALL_TIMEOUT_S = 30.0

NAMES = {
    POOL: f"sandbx-pool (workers={PARALLEL}, journal on)",
    Bare.key: "bare subprocess",
    Bwrap.key: "bubblewrap per command",
}


@dataclass
class ParallelResult:
    #: (contender, operation) -> (calls, wall ns), summed over the rounds
    totals: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)
    contenders: list[str] = field(default_factory=list)

    def add(self, contender: str, operation: str, calls: int, wall_ns: int) -> None:
        before = self.totals.get((contender, operation), (0, 0))
        self.totals[contender, operation] = (before[0] + calls, before[1] + wall_ns)

    def calls_per_s(self, contender: str, operation: str) -> float:
        calls, wall_ns = self.totals.get((contender, operation), (0, 0))
        return ratio(calls * 1e9, wall_ns)


async def _pool_burst(pool: Pool, operation: str, calls: int, max_s: float) -> tuple[int, int]:
    """``calls`` calls, 8 at a time, or as many as ``max_s`` allows: (calls made, wall ns)."""
    deadline = time.monotonic() + max_s
    done = 0

    async def one() -> None:
        if operation == READ:
            outcome = await pool.call("read", {"path": "data.txt"}, timeout=CALL_TIMEOUT_S)
            value = outcome.value if outcome.ok else None
            held = value is not None and len(value["content"]) == DATA_BYTES
        else:
            command = str(COMMANDS[operation])
            outcome = await pool.call("bash", {"command": command}, timeout=CALL_TIMEOUT_S)
            value = outcome.value if outcome.ok else None
            held = value is not None and value["exit_code"] == 0
        if not held:
            raise RuntimeError(f"{operation} through the pool: {outcome}")

    async def loop(quota: int) -> None:
        nonlocal done
        for _ in range(quota):
            if time.monotonic() > deadline:
                return
            await one()
            done += 1

    quotas = [calls // PARALLEL + (i < calls % PARALLEL) for i in range(PARALLEL)]
    start = time.perf_counter_ns()
    async with asyncio.TaskGroup() as group:
        for quota in quotas:
            group.create_task(loop(quota))
    return done, time.perf_counter_ns() - start


def _threads_burst(run: Callable[[], None], calls: int, max_s: float) -> tuple[int, int]:
    """The same for a blocking command: 8 threads, each one command after another."""
    deadline = time.monotonic() + max_s
    lock = threading.Lock()
    done = 0

    def loop(quota: int) -> None:
        nonlocal done
        for _ in range(quota):
            if time.monotonic() > deadline:
                return
            run()
            with lock:
                done += 1

    quotas = [calls // PARALLEL + (i < calls % PARALLEL) for i in range(PARALLEL)]
    start = time.perf_counter_ns()
    with ThreadPoolExecutor(PARALLEL) as threads:
        for future in [threads.submit(loop, quota) for quota in quotas]:
            future.result()  # raises what a command's check raised
    return done, time.perf_counter_ns() - start


def _checked(executor: Executor, operation: str) -> Callable[[], None]:
    command = COMMANDS[operation]

    def run() -> None:
        ran = executor.run(command)
        if ran.exit_code != 0 or (operation == READ and len(ran.output) != DATA_BYTES):
            raise RuntimeError(f"{operation} by {executor.name}: {ran}")

    return run


def run(ws: BenchWorkspace, *, calls: int = 600, max_s: float = 5.0) -> ParallelResult:
    return asyncio.run(_run(ws, calls, max_s))


async def _run(ws: BenchWorkspace, calls: int, max_s: float) -> ParallelResult:
    result = ParallelResult()
    directory = str(ws.workspace)
    executors: list[Executor] = [Bare(directory), Bwrap(directory)]
    per_round, round_s = max(PARALLEL, calls // ROUNDS), max_s / ROUNDS
    logger.info(
        "throughput: bash and read, {} in flight, against a bare subprocess and bubblewrap",
        PARALLEL,
    )
    async with Pool(
        ws.workspace, workers=PARALLEL, journal=ws.journal("parallel"), config=ws.config()
    ) as pool:
        for operation in OPERATIONS:  # warm-up
            await _pool_burst(pool, operation, 4 * PARALLEL, max_s)
            for executor in executors:
                await asyncio.to_thread(_threads_burst, _checked(executor, operation), 16, max_s)
        order = [POOL, *(e.key for e in executors)]
        result.contenders = order
        by_key = {e.key: e for e in executors}
        for number in range(ROUNDS):
            for operation in OPERATIONS:
                for key in order if number % 2 == 0 else order[::-1]:
                    if key == POOL:
                        made = await _pool_burst(pool, operation, per_round, round_s)
                    else:
                        burst = _checked(by_key[key], operation)
                        made = await asyncio.to_thread(_threads_burst, burst, per_round, round_s)
                    result.add(key, operation, *made)
    return result
