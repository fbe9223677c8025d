"""Section 1: the latency of one ``read`` of a 1 KiB file, calls made one after another.

sandbx-pool is measured twice, journal on (default policy) and journal off, in alternating
rounds of fresh pools (see ``_journal_rounds``), so that the noise of a shared machine falls on
both alike and their difference is the journal's cost. Two more
sandbx-pool rows help say where the time goes: one pauses before each call (as an agent does
while its model thinks), so that the background work of the previous call (reaping it, forking
the next worker) has finished; one makes calls the coordinator refuses before any worker is
involved (its own path, journal included).

The peers follow, one at a time, each warmed up first, then the fork floor three ways: from
this process, and from fresh interpreters with and without the template's imports (a fork's
cost grows with the process forked). The ratio column is how many times the row is faster
than pebble's disposable pool (one worker) at p50.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from functools import cached_property

from loguru import logger

from bench import procs
from bench.peers import BareFork, PebblePool, Peer, ProcessPoolDisposable, fork_floor_elsewhere
from bench.stats import Budget, Samples, paired_median_ratio_ci, ratio
from bench.workspace import DATA_BYTES, BenchWorkspace
from sandbx_pool import Pool

#: Row keys, used by the report to find the rows the bars are about.
JOURNAL_ON = "sandbx-journal-on"
JOURNAL_OFF = "sandbx-journal-off"
BASELINE = "pebble-disposable-1"
PEBBLE_DISPOSABLE_W = "pebble-disposable-w"
SPACED = "sandbx-spaced"
REFUSED = "sandbx-refused"

#: The pause before each call of the SPACED row.
GAP_S = 0.05

#: Rounds of the journal comparison; each opens a fresh pool of either kind.
ROUNDS = 8


@dataclass(frozen=True)
class LatencyRow:
    key: str
    name: str
    workers: int | None
    samples: Samples


@dataclass(frozen=True)
class LatencyResult:
    rows: list[LatencyRow]
    #: the journal comparison, round by round: (journal on, journal off) durations in ns
    rounds: list[tuple[list[int], list[int]]] = field(default_factory=list)

    def row(self, key: str) -> LatencyRow | None:
        return next((row for row in self.rows if row.key == key), None)

    def p50(self, key: str) -> float:
        row = self.row(key)
        return row.samples.p50 if row else math.nan

    def speedup(self, key: str) -> float:
        """How many times faster than pebble's disposable pool, at p50."""
        return ratio(self.p50(BASELINE), self.p50(key))

    @property
    def journal_overhead_pct(self) -> float:
        """The issue's definition: p50 with the journal on / p50 with it off - 1, in %."""
        return (ratio(self.p50(JOURNAL_ON), self.p50(JOURNAL_OFF)) - 1) * 100

    @cached_property
    def journal_overhead_ci_pct(self) -> tuple[float, float]:
        """95% bootstrap interval of the overhead, resampling whole rounds."""
        low, high = paired_median_ratio_ci(self.rounds)
        return (low - 1) * 100, (high - 1) * 100

    @property
    def journal_overhead_by_round_pct(self) -> list[float]:
        return [(ratio(Samples(on).p50, Samples(off).p50) - 1) * 100 for on, off in self.rounds]


#: A deadline on every call the bench makes, so that a broken pool fails a section, not hangs it.
CALL_TIMEOUT_S = 30.0


async def refused_once(pool: Pool) -> None:
    outcome = await pool.call("read", {"path": "../outside.txt"}, timeout=CALL_TIMEOUT_S)
    if outcome.status != "denied" or outcome.started:
        raise RuntimeError(f"unexpected outcome of a read outside the workspace: {outcome}")


async def read_once(pool: Pool) -> None:
    outcome = await pool.call("read", {"path": "data.txt"}, timeout=CALL_TIMEOUT_S)
    if not outcome.ok or outcome.value is None or len(outcome.value["content"]) != DATA_BYTES:
        raise RuntimeError(f"unexpected outcome of a read: {outcome}")


def _pool(ws: BenchWorkspace, journal: bool) -> Pool:
    if journal:
        return Pool(ws.workspace, journal=ws.journal("latency"), config=ws.config())
    return Pool(ws.workspace, config=ws.config(journal={"policy": "off"}))


async def _timed_reads(pool: Pool, count: int, samples: Samples) -> None:
    for _ in range(count):
        start = time.perf_counter_ns()
        await read_once(pool)
        samples.add(time.perf_counter_ns() - start)


async def _journal_rounds(
    ws: BenchWorkspace, calls: int, warmup: int
) -> list[tuple[list[int], list[int]]]:
    """Journal on and off, one pool at a time, in alternating rounds of fresh pools.

    Two pools open side by side showed a bias that held for a whole run and changed sign from
    one run to the next (each pool's processes settle on a CPU, and the other agents on this
    machine load the two CPUs unevenly), so each round gets new pools, and the order of the
    two flips every round.
    """
    rounds: list[tuple[list[int], list[int]]] = []
    per_round = max(1, calls // ROUNDS)
    for number in range(ROUNDS):
        measured = {True: Samples(), False: Samples()}
        for journal in (True, False) if number % 2 == 0 else (False, True):
            async with _pool(ws, journal) as pool:
                await _timed_reads(pool, max(1, warmup // ROUNDS), Samples())
                await _timed_reads(pool, per_round, measured[journal])
        rounds.append((measured[True].values_ns, measured[False].values_ns))
    return rounds


async def _sandbx_more(
    ws: BenchWorkspace, calls: int, warmup: int, spaced: Budget
) -> tuple[Samples, Samples]:
    """Journal on: calls with the pool idle before each, then calls refused before dispatch."""
    gapped, refused = Samples(), Samples()
    async with _pool(ws, journal=True) as pool:
        await _timed_reads(pool, warmup, Samples())
        # An agent waits on its model between calls: with a pause, whatever the pool does in
        # the background after a call (forking the next worker, reaping) is not competing.
        spaced.started_ns = time.perf_counter_ns()
        while spaced.more(gapped.count):
            await asyncio.sleep(GAP_S)
            await _timed_reads(pool, 1, gapped)
        for i in range(warmup + calls):
            start = time.perf_counter_ns()
            await refused_once(pool)
            if i >= warmup:
                refused.add(time.perf_counter_ns() - start)
    return gapped, refused


def measure_peer(peer: Peer, budget: Budget, warmup: int) -> Samples:
    samples = Samples()
    with peer:
        for _ in range(warmup):
            peer.call()
        budget.started_ns = time.perf_counter_ns()
        while budget.more(samples.count):
            start = time.perf_counter_ns()
            peer.call()
            samples.add(time.perf_counter_ns() - start)
    return samples


def run(ws: BenchWorkspace, *, calls: int = 400, warmup: int = 50) -> LatencyResult:
    workers = ws.config().workers()
    path = str(ws.data)
    logger.info("latency: sandbx-pool, journal on and off, {} rounds of fresh pools", ROUNDS)
    rounds = asyncio.run(_journal_rounds(ws, calls, warmup))
    on = Samples([ns for values, _ in rounds for ns in values])
    off = Samples([ns for _, values in rounds for ns in values])
    spaced = Budget(calls // 2, max_s=6)
    gapped, refused = asyncio.run(_sandbx_more(ws, calls, warmup, spaced))
    rows = [
        LatencyRow(JOURNAL_ON, "sandbx-pool, journal on (default policy)", workers, on),
        LatencyRow(JOURNAL_OFF, 'sandbx-pool, journal policy "off"', workers, off),
        LatencyRow(
            SPACED,
            f"sandbx-pool, journal on, {GAP_S * 1000:.0f} ms idle before each call",
            workers,
            gapped,
        ),
        LatencyRow(
            REFUSED,
            "sandbx-pool, journal on, refused before dispatch (coordinator only, no worker)",
            workers,
            refused,
        ),
    ]
    slow = max(20, calls // 4)
    # (key, peer, budget, warm-up calls)
    peers: list[tuple[str, Peer, Budget, int]] = [
        (
            BASELINE,
            PebblePool(path, workers=1, disposable=True),
            Budget(slow, max_s=10),
            3,
        ),
        (
            PEBBLE_DISPOSABLE_W,
            PebblePool(path, workers=workers, disposable=True),
            Budget(calls, max_s=8),
            2 * workers,
        ),
        (
            "ppe-spawn",
            ProcessPoolDisposable(path, workers=workers),
            Budget(slow, max_s=6),
            workers,
        ),
        (
            "ppe-forkserver",
            ProcessPoolDisposable(path, workers=workers, method="forkserver"),
            Budget(slow, max_s=5),
            workers,
        ),
        (
            "pebble-warm",
            PebblePool(path, workers=1, disposable=False),
            Budget(calls, max_s=5),
            warmup,
        ),
        ("fork", BareFork(path), Budget(calls, max_s=5), warmup),
    ]
    for key, peer, budget, peer_warmup in peers:
        logger.info("latency: {}", peer.name)
        samples = measure_peer(peer, budget, peer_warmup)
        name = peer.name
        if key == "fork" and (memory := procs.memory()) is not None:
            name += f" (RSS {memory.rss_kib / 1024:.0f} MiB)"
        rows.append(LatencyRow(key, name, peer.workers, samples))
    for key, preload, bare, name in (
        (
            "fork-preloaded",
            True,
            False,
            "the same, from a fresh interpreter with the template's imports",
        ),
        (
            "fork-preloaded-bare",
            True,
            True,
            "the same, forked as the template does (libc's fork, no Python after-fork hooks)",
        ),
        ("fork-small", False, False, "the same, from a bare interpreter (small process)"),
    ):
        logger.info("latency: fork floor, {}", name)
        values = fork_floor_elsewhere(path, calls, preload=preload, bare_fork=bare)
        rows.append(LatencyRow(key, name, None, Samples(values)))
    return LatencyResult(rows, rounds)
