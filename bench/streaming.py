"""Section 5: what streaming costs a small bash call (``echo hi``), calls one after another.

Two rows, measured in alternating rounds on one pool so that a shared machine's noise falls on
both alike: without an on_output callback (the worker sends no Output message: the path every
call without a watcher takes) and with one (one Output message, handed to the callback). The
bar is on the first: streaming must cost a call that does not ask for it nothing that shows
(compare this row with the same section on an earlier commit: within 5%).
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


@dataclass
class StreamingResult:
    plain: Samples
    streamed: Samples

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
    logger.info("streaming: {} + {} bash calls", plain.count, streamed.count)
    return StreamingResult(plain, streamed)
