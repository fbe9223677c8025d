"""Section ``usage``: what measuring each call's cost (outcome.usage) adds to a call.

Two pools open side by side, one whose template measures (the default) and one started with
``SANDBX_POOL_USAGE=off`` (workers.template.USAGE_ENV: no Meter in the worker, no figures
from wait4 or the cgroup in the template). Calls alternate between them round by round, so a
shared machine's noise falls on both alike, for two calls: a ``read`` (the worker's own
rusage only) and a bash ``true`` (a child reaped, its namespace's pid count read). The
difference of the p50s is the cost; the issue's bar is 0.2 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool
from sandbx_pool.workers.template import USAGE_ENV

ROUNDS = 10

#: The calls measured, by row name.
CALLS: dict[str, tuple[str, dict[str, object]]] = {
    "read": ("read", {"path": "data.txt"}),
    "bash true": ("bash", {"command": "true"}),
}

#: The issue's bar: measuring adds no more than this to a call, at p50.
BAR_MS = 0.2


@dataclass
class UsageResult:
    #: row name -> (with measuring, without)
    rows: dict[str, tuple[Samples, Samples]] = field(default_factory=dict)

    def cost_ms(self, name: str) -> float:
        measured, bare = self.rows[name]
        return measured.percentile_ms(50) - bare.percentile_ms(50)

    @property
    def met(self) -> bool:
        return all(self.cost_ms(name) <= BAR_MS for name in self.rows)


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``name=value`` in our environment while a template starts (it inherits it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def run(ws: BenchWorkspace, *, calls: int) -> UsageResult:
    return asyncio.run(_run(ws, calls))


async def _run(ws: BenchWorkspace, calls: int) -> UsageResult:
    result = UsageResult({name: (Samples(), Samples()) for name in CALLS})
    config = ws.config(pool={"workers": 2})
    per_round = max(1, calls // ROUNDS)
    async with contextlib.AsyncExitStack() as stack:
        measuring = await stack.enter_async_context(
            Pool(ws.workspace, config=config, journal=ws.journal("usage-on"))
        )
        with _environment(USAGE_ENV, "off"):
            bare = await stack.enter_async_context(
                Pool(ws.workspace, config=config, journal=ws.journal("usage-off"))
            )
        for name, (tool, args) in CALLS.items():
            on, off = result.rows[name]
            for pool in (measuring, bare):  # warm up both
                for _ in range(5):
                    await pool.call(tool, args)
            for round_number in range(ROUNDS):
                order = ((measuring, on), (bare, off))
                for pool, times in order if round_number % 2 == 0 else order[::-1]:
                    for _ in range(per_round):
                        start = time.perf_counter_ns()
                        outcome = await pool.call(tool, args)
                        times.add(time.perf_counter_ns() - start)
                        assert outcome.ok, outcome
                        assert (outcome.usage is not None) == (pool is measuring), outcome
    for name in CALLS:
        logger.info("usage: {} {:+.3f} ms at p50", name, result.cost_ms(name))
    return result


def table(result: UsageResult) -> str:
    """The report's section."""
    lines = [
        "## Usage: what measuring each call's cost adds to it",
        "",
        "| call | calls | p50 measured | p50 not measured | cost at p50 |",
        "|---|--:|--:|--:|--:|",
    ]
    for name, (on, off) in result.rows.items():
        lines.append(
            f"| {name} | {on.count} | {on.percentile_ms(50):.3f} ms |"
            f" {off.percentile_ms(50):.3f} ms | {result.cost_ms(name):+.3f} ms |"
        )
    verdict = "met" if result.met else "NOT met"
    lines += ["", f"Bar: measuring adds no more than {BAR_MS} ms to a call at p50: {verdict}."]
    return "\n".join(lines)
