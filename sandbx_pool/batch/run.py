"""Running a batch through one Pool: bounded lanes, ordering by ``after``, stop, resume.

    CallSpecs (file order) --shared iterator--> ``parallel`` lanes, each: take the next spec,
        wait for its ``after`` calls, await pool.call(...), record the Outcome --> BatchReport

A fixed set of lanes, not one task per line: a 20,000-line batch must not put 20,000 tasks
(and 20,000 journal intents) in front of ``workers`` busy workers. Lanes take specs in file
order, so every ``after`` dependency (always an earlier line) has been taken by some lane and
will finish: waiting on it cannot deadlock.

Stopping: when ``stop`` is set (the command's Stopper saw a signal and is closing the pool)
lanes take no more specs; the calls in flight end as ``cancelled`` with killer ``shutdown``
and are journaled like any outcome. A call refused because the pool closed under it
(PoolClosed) was never journaled and simply counts as not run.

Resume: ``finished_call_ids`` is what a resumed run skips. A call whose only outcomes are
``cancelled`` by ``shutdown`` is *not* finished: the user stopped the run, not the call, and
expects it to run on resume. Calls in doubt (an intent without an outcome: the coordinator was
SIGKILLed or a second SIGINT exited at once) are not finished either and run again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Collection, Mapping
from typing import Final

from sandbx_pool.batch.calls import CallSpec
from sandbx_pool.cancel import CancelToken
from sandbx_pool.errors import PoolClosed, SandbxPoolError
from sandbx_pool.journal.reader import read_journal
from sandbx_pool.journal.records import OutcomeRecord
from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.pool import Pool

#: How many of the slowest calls the report keeps.
SLOWEST: Final = 5

# What the callbacks return is ignored (a lambda may return a TimerHandle, a print None).
OutcomeCallback = Callable[[CallSpec, Outcome], object]
SubmitCallback = Callable[[CallSpec], object]


def is_shutdown_cancel(status: str, killed_by: str | None) -> bool:
    """An outcome that says the *run* was stopped, not that the call ran: resume re-runs it."""
    return status == Status.CANCELLED and killed_by == KilledBy.SHUTDOWN


def finished_call_ids(path: str | os.PathLike[str]) -> set[str]:
    """Call ids with an outcome other than a shutdown cancel: what ``run --resume`` skips."""
    return {
        record.call_id
        for record in read_journal(path).records
        if isinstance(record, OutcomeRecord)
        and not is_shutdown_cancel(record.status, record.killed_by)
    }


class BatchReport:
    """What a run did: every outcome, in the order they finished, and what did not run."""

    def __init__(self, total: int, skipped: int) -> None:
        self.total = total  # calls in the file
        self.skipped = skipped  # finished by an earlier run (--resume)
        self.results: list[tuple[CallSpec, Outcome]] = []
        self.started_at = time.monotonic()
        self.wall_s = 0.0
        self.stopped = False  # a stop request ended the run early
        self.failure: str | None = None  # infrastructure failure that ended the run early
        self.journal: str | None = None

    @property
    def to_run(self) -> int:
        return self.total - self.skipped

    @property
    def ran(self) -> int:
        """Calls that have an outcome which is not a shutdown cancel."""
        return sum(
            not is_shutdown_cancel(outcome.status, outcome.killed_by) for _, outcome in self.results
        )

    @property
    def not_run(self) -> int:
        return self.to_run - self.ran

    @property
    def complete(self) -> bool:
        """Every call of the file ran (now or in an earlier run), whatever its outcome."""
        return self.not_run == 0

    def by_status(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, outcome in self.results:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return counts

    def slowest(self, n: int = SLOWEST) -> list[tuple[CallSpec, Outcome]]:
        return sorted(self.results, key=lambda item: item[1].duration_s, reverse=True)[:n]

    def __repr__(self) -> str:
        return (
            f"<BatchReport [{len(self.results)} outcomes | {self.skipped} skipped | "
            f"{self.not_run} not run{' | stopped' if self.stopped else ''}]>"
        )


async def run_batch(
    pool: Pool,
    calls: list[CallSpec],
    *,
    parallel: int,
    skip: Collection[str] = frozenset(),
    stop: asyncio.Event | None = None,
    on_submit: SubmitCallback | None = None,
    on_outcome: OutcomeCallback | None = None,
    tokens: Mapping[str, CancelToken] | None = None,
) -> BatchReport:
    """Run ``calls`` (minus ``skip``) through ``pool``, at most ``parallel`` at a time.

    ``on_submit`` is called just before a call is handed to the pool, ``on_outcome`` when it
    ends; ``tokens`` gives some calls a CancelToken. Returns when every call has run, or when
    ``stop`` was set and the calls in flight have ended.
    """
    if parallel < 1:
        raise ValueError("parallel must be at least 1")
    todo = [spec for spec in calls if spec.call_id not in skip]
    report = BatchReport(total=len(calls), skipped=len(calls) - len(todo))
    report.journal = pool.journal.path if pool.journal is not None else None
    # Only the calls something waits for need an event; the rest stay cheap.
    awaited = {dependency for spec in todo for dependency in spec.after}
    finished = {spec.call_id: asyncio.Event() for spec in todo if spec.call_id in awaited}
    queue = iter(todo)
    halt = asyncio.Event()  # our own reason to stop: the pool failed under us

    def stopping() -> bool:
        return halt.is_set() or (stop is not None and stop.is_set())

    async def lane() -> None:
        for spec in queue:  # shared: each spec is taken by exactly one lane, in file order
            try:
                for dependency in spec.after:
                    event = finished.get(dependency)  # None: skipped, finished in a past run
                    if event is not None:
                        await event.wait()
                if stopping():
                    return
                if on_submit is not None:
                    on_submit(spec)
                try:
                    outcome = await pool.call(
                        spec.tool,
                        spec.args,
                        timeout=spec.timeout_s,
                        cwd=spec.cwd,
                        call_id=spec.call_id,
                        cancel=tokens.get(spec.call_id) if tokens else None,
                    )
                except PoolClosed:
                    return  # closed by a stop: this call was refused before its intent
                except SandbxPoolError as exc:  # template lost, journal failed: nothing more runs
                    if report.failure is None:
                        report.failure = f"{type(exc).__name__}: {exc}"
                        logger.error("batch stopped at line {}: {}", spec.line, report.failure)
                    halt.set()
                    return
                report.results.append((spec, outcome))
                if on_outcome is not None:
                    on_outcome(spec, outcome)
            finally:
                # Set whatever happened, so a call waiting on this one never waits forever.
                if (event := finished.get(spec.call_id)) is not None:
                    event.set()

    try:
        async with asyncio.TaskGroup() as lanes:
            for number in range(min(parallel, len(todo))):
                lanes.create_task(lane(), name=f"batch-lane-{number}")
    finally:
        report.wall_s = time.monotonic() - report.started_at
        report.stopped = stop is not None and stop.is_set()
    return report
