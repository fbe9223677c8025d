"""Issue 40's per-call cost: a pool's bash and read calls against the command executors.

One pool (default workers, journal on) over a directory holding the 1 KiB file, and a layer over
that directory; the peers of ``bench.executors`` run the same commands in it. Each contender
makes three operations: bash ``true``, bash ``echo hi`` (its output checked) and a read of the
1 KiB file (the pool's read tool; ``cat`` for a command executor). They take turns: in each of
``rounds`` rounds every contender makes ``per_round`` calls of each operation, in an order
rotated from round to round, so that the load of a shared machine falls on all alike. The
figures that matter are the ratios inside one run.

The command executors run in a thread (the event loop stays free to do the pool's background
work, forking the next worker, as it would between an agent's calls) and read the clock there.
"""

from __future__ import annotations

import asyncio
import math
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from loguru import logger

from bench.executors import Bare, Bwrap, Executor, MiniSweLocal
from bench.stats import Samples, ratio
from bench.workspace import DATA_BYTES, BenchWorkspace
from sandbx_pool import Layer, LayerUnavailable, Pool

#: Operations, in the order each contender makes them within a round.
TRUE, ECHO, READ = "bash `true`", "bash `echo hi`", "read 1 KiB"
OPERATIONS = (TRUE, ECHO, READ)

#: Contenders' keys; the executors' are theirs (bench.executors).
PLAIN, LAYER = "pool-plain", "pool-layer"
BARE, BWRAP, MINI = Bare.key, Bwrap.key, MiniSweLocal.key

NAMES = {
    PLAIN: "sandbx-pool, plain workspace",
    LAYER: "sandbx-pool, in a layer",
    BARE: Bare.name,
    BWRAP: Bwrap.name,
    MINI: MiniSweLocal.name,
}

#: What a command executor runs for each operation (data.txt: bench.workspace's file); the
#: read is ``cat`` with no shell before it (mini-swe-agent's always has one).
COMMANDS: dict[str, str | list[str]] = {TRUE: "true", ECHO: "echo hi", READ: ["cat", "data.txt"]}

CALL_TIMEOUT_S = 30.0


@dataclass
class PerCallResult:
    #: (contender, operation) -> durations
    samples: dict[tuple[str, str], Samples] = field(default_factory=dict)
    contenders: list[str] = field(default_factory=list)
    rounds: int = 0
    #: why there is no layer row, when there is none
    layer_unavailable: str | None = None

    def p50(self, contender: str, operation: str) -> float:
        found = self.samples.get((contender, operation))
        return found.p50 if found else math.nan

    def p90(self, contender: str, operation: str) -> float:
        found = self.samples.get((contender, operation))
        return found.percentile_ms(90) if found else math.nan

    def ratio(self, contender: str, peer: str, operation: str, peer_operation: str = "") -> float:
        """The contender's p50 / the peer's (for ``peer_operation``, default the same)."""
        return ratio(self.p50(contender, operation), self.p50(peer, peer_operation or operation))

    def layer_extra_ms(self, operation: str) -> float:
        """A call in a layer minus the same call in the plain workspace, at p50."""
        return self.p50(LAYER, operation) - self.p50(PLAIN, operation)


Timed = Callable[[str], Awaitable[int]]


def _pool_caller(pool: Pool, where: Layer | None) -> Timed:
    async def timed(operation: str) -> int:
        if operation == READ:
            tool, args = "read", {"path": "data.txt"}
        else:
            tool, args = "bash", {"command": str(COMMANDS[operation])}
        start = time.perf_counter_ns()
        outcome = await pool.call(tool, args, workspace=where, timeout=CALL_TIMEOUT_S)
        elapsed = time.perf_counter_ns() - start
        value = outcome.value if outcome.ok else None
        if value is None:
            raise RuntimeError(f"{operation} through the pool: {outcome}")
        if operation == READ:
            _check(operation, len(value["content"]) == DATA_BYTES, value)
        else:
            _check(operation, value["exit_code"] == 0, value)
            _check(operation, operation != ECHO or value["stdout"] == "hi\n", value)
        return elapsed

    return timed


def _executor_caller(executor: Executor) -> Timed:
    async def timed(operation: str) -> int:
        ran = await asyncio.to_thread(executor.run, COMMANDS[operation])
        _check(operation, ran.exit_code == 0, ran)
        _check(operation, operation != ECHO or ran.output == "hi\n", ran)
        _check(operation, operation != READ or len(ran.output) == DATA_BYTES, ran)
        return ran.elapsed_ns

    return timed


def _check(operation: str, held: bool, what: object) -> None:
    if not held:
        raise RuntimeError(f"unexpected result of {operation}: {what}")


def run(ws: BenchWorkspace, *, rounds: int = 8, per_round: int = 10) -> PerCallResult:
    return asyncio.run(_run(ws, rounds, per_round))


async def _run(ws: BenchWorkspace, rounds: int, per_round: int) -> PerCallResult:
    result = PerCallResult(rounds=rounds)
    area = ws.root / "percall"
    base = area / "base"
    base.mkdir(parents=True)
    shutil.copyfile(ws.data, base / "data.txt")
    config = ws.config(workspace={"layers": str(area / "store")})
    async with Pool(base, config=config, journal=ws.journal("percall")) as pool:
        callers: dict[str, Timed] = {PLAIN: _pool_caller(pool, None)}
        layer: Layer | None = None
        try:
            layer = await pool.layer("percall", base=base)
            callers[LAYER] = _pool_caller(pool, layer)
        except LayerUnavailable as exc:
            result.layer_unavailable = str(exc)
        for executor in (Bare(str(base)), Bwrap(str(base)), MiniSweLocal(str(base))):
            callers[executor.key] = _executor_caller(executor)
        result.contenders = list(callers)
        logger.info(
            "latency: bash and read, {} against the command executors, {} rounds in turns",
            " and ".join(k for k in callers if k in (PLAIN, LAYER)),
            rounds,
        )
        for timed in callers.values():  # warm-up: caches, the layer's first mount, imports
            for operation in OPERATIONS:
                for _ in range(3):
                    await timed(operation)
        keys = list(callers)
        for number in range(rounds):
            shift = number % len(keys)
            for key in keys[shift:] + keys[:shift]:
                for operation in OPERATIONS:
                    samples = result.samples.setdefault((key, operation), Samples())
                    for _ in range(per_round):
                        samples.add(await callers[key](operation))
        if layer is not None:
            await layer.remove()
    await asyncio.to_thread(shutil.rmtree, area, True)
    return result
