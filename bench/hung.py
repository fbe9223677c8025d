"""Section: a stop on a hung filesystem, from the cancel (or the deadline) to the caller's outcome.

The mount is the tests' real FUSE filesystem (``tests/fusefs.py``): its reads, and the lookup of
its ``stalled`` directory, never answer until released, so the reader sleeps in the kernel
(state D), where no signal reaches it. What is measured is how long the caller is held: the
worker is quarantined, not waited for. Per tool, ``count`` calls are each held by the mount and
then cancelled (reads, seen arriving at the daemon) or timed out (lookups, which the daemon does
not report); they stay stuck until the mount is released (every ``HELD_PER_MOUNT`` calls,
when the mount is made anew), then are reaped. (edit is left out: a held edit keeps its file's
lock, so the next edit of that file would wait on the lock, not the mount; tests/test_hung_fs.py
stops one.) The defaults of
``[calls]`` apply (grace 1 s, kill wait 0.5 s): the bar is 0.3 s.

The peers have nothing to compare: pebble's cancel() returns at once while its worker stays in
state D for as long as the mount does (its pool then waits on it at close), and
ProcessPoolExecutor cannot cancel a running task at all (the cancel section shows both live).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import CancelToken, Pool

#: A lookup's call is given this deadline; the figure is how far past it the caller returns.
LOOKUP_TIMEOUT_S = 0.3
#: A broken pool fails the section instead of hanging it.
CALL_BOUND_S = 30.0
BAR_S = 0.3

#: (row, tool, args, seen): ``seen`` when the daemon reports the held read (cancelled then).
CASES: tuple[tuple[str, str, dict[str, Any], bool], ...] = (
    ("read", "read", {"path": "hung/stuck-0.txt"}, True),
    ("grep", "grep", {"pattern": "needle", "path": "hung"}, True),
    ("bash `cat`", "bash", {"command": "cat hung/stuck-2.txt"}, True),
    ("bash `cat | wc -c`", "bash", {"command": "cat hung/stuck-3.txt | wc -c"}, True),
    ("ls (lookup)", "ls", {"path": "hung/stalled"}, False),
    ("find (lookup)", "find", {"pattern": "*", "path": "hung/stalled"}, False),
)


@dataclass
class HungRow:
    name: str
    stop: str  # "cancel" or "timeout"
    samples: Samples = field(default_factory=Samples)
    statuses: Counter[str] = field(default_factory=Counter)


@dataclass
class HungResult:
    rows: list[HungRow]
    skipped: str | None = None  # why the section could not run (no FUSE here)


async def _held_call(pool: Pool, fs: Any, tool: str, args: dict[str, Any], seen: bool) -> Any:
    """One call held by the mount, stopped; returns (outcome, seconds the caller was held)."""
    if not seen:
        started = time.perf_counter_ns()
        outcome = await asyncio.wait_for(
            pool.call(tool, args, timeout=LOOKUP_TIMEOUT_S), CALL_BOUND_S
        )
        late = time.perf_counter_ns() - started - int(LOOKUP_TIMEOUT_S * 1e9)
        return outcome, late
    token = CancelToken()
    before = len(fs.reads)
    task = asyncio.create_task(pool.call(tool, args, cancel=token))
    await asyncio.to_thread(fs.wait_reads, before + 1)
    if "|" in args.get("command", ""):
        await asyncio.sleep(0.05)  # let wc start too: the pipeline's other process
    started = time.perf_counter_ns()
    token.cancel("bench")
    outcome = await asyncio.wait_for(task, CALL_BOUND_S)
    return outcome, time.perf_counter_ns() - started


#: libfuse serves a held request on one of its threads, ten at most by default, and a grep holds
#: one per rg thread (two here): the mount is remade after this many held calls (released, the
#: workers reaped), so that every call is held by the mount, not by a daemon out of threads.
HELD_PER_MOUNT = 4


async def _row(
    ws: BenchWorkspace, name: str, tool: str, args: dict[str, Any], seen: bool, count: int
) -> HungRow:
    row = HungRow(name, "cancel" if seen else f"timeout {LOOKUP_TIMEOUT_S:g} s")
    journal = ws.journal(f"hung-{tool}")
    async with Pool(ws.workspace, journal=journal, config=ws.config()) as pool:
        done = 0
        while done < count:
            await _held_on_one_mount(
                pool, ws, row, tool, args, seen, min(HELD_PER_MOUNT, count - done)
            )
            done += HELD_PER_MOUNT
    return row


async def _held_on_one_mount(
    pool: Pool,
    ws: BenchWorkspace,
    row: HungRow,
    tool: str,
    args: dict[str, Any],
    seen: bool,
    count: int,
) -> None:
    from tests.fusefs import HungFs

    fs = HungFs(ws.workspace / "hung")
    fs.start()
    try:
        for _ in range(count):
            outcome, held_ns = await _held_call(pool, fs, tool, args, seen)
            row.statuses[f"{outcome.status}{' quarantined' if outcome.quarantined else ''}"] += 1
            row.samples.add(held_ns)
        fs.release()
        deadline = time.monotonic() + CALL_BOUND_S
        while pool.stuck_workers() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # the outside world: the kernel letting them go
    finally:
        fs.stop()


def run(ws: BenchWorkspace, *, count: int) -> HungResult:
    from tests.fusefs import missing_fuse

    reason = missing_fuse()
    if reason is not None:
        return HungResult(rows=[], skipped=reason)
    rows = []
    for name, tool, args, seen in CASES:
        logger.info("hung: {}, {} stops", name, count)
        rows.append(asyncio.run(_row(ws, name, tool, args, seen, count)))
    return HungResult(rows=rows)
