"""Section ``sessions``: what a shell session costs a small bash call (``echo hi``).

Two rows, measured in alternating rounds on one pool so that a shared machine's noise falls on
both alike: a plain bash call (no session: the wrapper, the report's pipe and its parsing are
not there) and the same command in a session that carries a cwd and a few exports (the
wrapper, its exports listed by builtins at the shell's exit, the report read and confined in
the worker, the state settled in the coordinator and journaled). The difference is the
per-call overhead of a session.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool

ROUNDS = 10
COMMAND = "echo hi"


@dataclass
class SessionsResult:
    plain: Samples
    session: Samples

    @property
    def overhead_ms(self) -> tuple[float, float]:
        """The session row minus the plain one, at p50 and p95."""
        return (
            self.session.percentile_ms(50) - self.plain.percentile_ms(50),
            self.session.percentile_ms(95) - self.plain.percentile_ms(95),
        )


def run(ws: BenchWorkspace, *, calls: int) -> SessionsResult:
    return asyncio.run(_run(ws, calls))


async def _run(ws: BenchWorkspace, calls: int) -> SessionsResult:
    plain, session = Samples(), Samples()
    config = ws.config(pool={"workers": 2})
    per_round = max(1, calls // ROUNDS)
    async with Pool(ws.workspace, config=config, journal=ws.journal("sessions")) as pool:
        # A session with something to carry: a directory and a few variables.
        setup = "mkdir -p bench-session/sub && cd bench-session/sub && export A=1 B=two C=3"
        outcome = await pool.call("bash", {"command": setup}, session="bench")
        assert outcome.ok, outcome
        for _ in range(5):  # warm up both paths
            await pool.call("bash", {"command": COMMAND})
            await pool.call("bash", {"command": COMMAND}, session="bench")
        for round_number in range(ROUNDS):
            order = ((plain, None), (session, "bench"))
            for times, session_id in order if round_number % 2 == 0 else order[::-1]:
                for _ in range(per_round):
                    start = time.perf_counter_ns()
                    outcome = await pool.call("bash", {"command": COMMAND}, session=session_id)
                    times.add(time.perf_counter_ns() - start)
                    assert outcome.ok, outcome
        state = await pool.session("bench")
        assert state["env"] == {"A": "1", "B": "two", "C": "3"}, state
    logger.info("sessions: {} + {} bash calls", plain.count, session.count)
    return SessionsResult(plain, session)
