"""Section 10: what tracking a call's changes costs (sandbx_pool.change_sets).

Rows, all on one pool (its journal gives the change sets a home), so that a shared machine's
noise falls on every mode alike:

* ``bash true`` one call after another, in direct, tracked and transactional mode, in
  alternating rounds: what the overlay (a mount per call) and the apply worker (a second
  worker per call, scanning an empty upper directory) add to a call that changes nothing.
* a bash call that creates 1,000 small files, direct against tracked: the difference is the
  scan and the apply (1,000 pre-images of "absent", 1,000 temp + fsync + rename).
* the undo of that tracked call (1,000 paths checked against their post-image, then removed).
* a 100 MiB file modified in place (one byte, ``dd conv=notrunc``), direct against tracked:
  overlayfs copies the whole file up before the write, and the apply hashes both images, keeps
  the pre-image (100 MiB into J.d/objects) and writes the new file.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool

MODES = ("direct", "tracked", "transactional")
ROUNDS = 6
FILES = 1000
BIG_MIB = 100
MANY = f"mkdir -p many && cd many && for i in $(seq {FILES}); do echo $i > f$i; done"
IN_PLACE = "printf x | dd of=big.bin bs=1 seek=4096 conv=notrunc status=none"


@dataclass
class ChangesResult:
    true_by_mode: dict[str, Samples] = field(default_factory=lambda: {m: Samples() for m in MODES})
    many_direct_ms: float = 0.0
    many_tracked_ms: float = 0.0
    undo_ms: float = 0.0
    big_direct_ms: float = 0.0
    big_tracked_ms: float = 0.0

    def extra_ms(self, mode: str) -> float:
        return self.true_by_mode[mode].percentile_ms(50) - self.true_by_mode[
            "direct"
        ].percentile_ms(50)


def _make_big(path: str) -> None:
    """A file of real data (not sparse: a copy-up of holes would cost nothing)."""
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(BIG_MIB):
            f.write(chunk)


def run(ws: BenchWorkspace, *, calls: int) -> ChangesResult:
    return asyncio.run(_run(ws, calls))


async def _timed(pool: Pool, command: str, mode: str) -> float:
    start = time.perf_counter()
    outcome = await pool.call("bash", {"command": command}, changes=mode)
    elapsed = (time.perf_counter() - start) * 1000
    assert outcome.ok, outcome
    return elapsed


async def _run(ws: BenchWorkspace, calls: int) -> ChangesResult:
    result = ChangesResult()
    config = ws.config(pool={"workers": 2})
    area = ws.workspace / "changes-bench"
    area.mkdir(exist_ok=True)
    async with Pool(area, config=config, journal=ws.journal("changes")) as pool:
        for mode in MODES:  # warm up
            await _timed(pool, "true", mode)
        per_round = max(1, calls // ROUNDS)
        for round_number in range(ROUNDS):
            order = MODES if round_number % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                for _ in range(per_round):
                    start = time.perf_counter_ns()
                    outcome = await pool.call("bash", {"command": "true"}, changes=mode)
                    result.true_by_mode[mode].add(time.perf_counter_ns() - start)
                    assert outcome.ok, outcome
        result.many_direct_ms = await _timed(pool, MANY, "direct")
        await _timed(pool, "rm -r many", "direct")
        start = time.perf_counter()
        outcome = await pool.call("bash", {"command": MANY}, changes="tracked")
        result.many_tracked_ms = (time.perf_counter() - start) * 1000
        assert outcome.ok, outcome
        assert outcome.changes is not None
        assert len(outcome.changes) == FILES + 1
        start = time.perf_counter()
        await pool.undo(outcome.call_id)
        result.undo_ms = (time.perf_counter() - start) * 1000
        await asyncio.to_thread(_make_big, str(area / "big.bin"))
        result.big_direct_ms = await _timed(pool, IN_PLACE, "direct")
        result.big_tracked_ms = await _timed(pool, IN_PLACE, "tracked")
    logger.info("changes: {} bash calls a mode", result.true_by_mode["direct"].count)
    return result
