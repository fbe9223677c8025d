"""Section 5: what streaming costs a small bash call (``echo hi``), calls one after another.

Two rows, measured in alternating rounds on one pool so that a shared machine's noise falls on
both alike: without an on_output callback (the worker sends no Output message: the path every
call without a watcher takes) and with one (one Output message, handed to the callback). The
bar is on the first: streaming must cost a call that does not ask for it nothing that shows
(compare this row with the same section on an earlier commit: within 5%).

A third row pauses ``IDLE_GAP_S`` before each call, as an agent does between turns: the pool
has nothing to do meanwhile, and what a call then costs is what the back-to-back rows hide (a
worker's pids cgroup join used to wait out an RCU grace period on the call's clock: see
``workers.runtime.JOIN_WHEN_IDLE_MS``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import OutputChunk, Pool

PLAIN = "bash-no-callback"
STREAMED = "bash-on-output"
ROUNDS = 10

#: The pause before each call of the idle row, and how many such calls (a fifth of the others'
#: count, at most 40: each costs the pause).
IDLE_GAP_S = 0.3
IDLE_CALLS_MAX = 40


@dataclass
class StreamingResult:
    plain: Samples
    streamed: Samples
    idle: Samples

    @property
    def cost_pct(self) -> float:
        return (self.streamed.percentile_ms(50) / self.plain.percentile_ms(50) - 1) * 100


def run(ws: BenchWorkspace, *, calls: int) -> StreamingResult:
    return asyncio.run(_run(ws, calls))


async def _run(ws: BenchWorkspace, calls: int) -> StreamingResult:
    plain, streamed = Samples(), Samples()
    seen: list[OutputChunk] = []
    config = ws.config(pool={"workers": 2})
    per_round = max(1, calls // ROUNDS)
    async with Pool(ws.workspace, config=config, journal=ws.journal("streaming")) as pool:
        for _ in range(5):  # warm up
            await pool.call("bash", {"command": "echo hi"}, on_output=seen.append)
        for round_number in range(ROUNDS):
            for times, callback in (
                ((plain, None), (streamed, seen.append))
                if round_number % 2 == 0
                else ((streamed, seen.append), (plain, None))
            ):
                for _ in range(per_round):
                    start = time.perf_counter_ns()
                    outcome = await pool.call("bash", {"command": "echo hi"}, on_output=callback)
                    times.add(time.perf_counter_ns() - start)
                    assert outcome.ok, outcome
        idle = Samples()
        for _ in range(min(IDLE_CALLS_MAX, max(1, calls // 5))):
            await asyncio.sleep(IDLE_GAP_S)
            start = time.perf_counter_ns()
            outcome = await pool.call("bash", {"command": "echo hi"})
            idle.add(time.perf_counter_ns() - start)
            assert outcome.ok, outcome
    logger.info("streaming: {} + {} + {} bash calls", plain.count, streamed.count, idle.count)
    return StreamingResult(plain, streamed, idle)
