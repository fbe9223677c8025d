"""What a batch run shows: a progress line on stderr while it runs, a summary when it ends.

On a terminal the progress is one line redrawn in place (``\\r`` and erase-to-end), at most
``TTY_REFRESH_S`` apart. Anywhere else (CI logs, ``2> file``) redrawing would leave thousands
of fragments, so plain lines are printed instead: when ``PLAIN_EVERY_S`` have passed or another
tenth of the calls has finished since the last one, never closer than ``PLAIN_MIN_GAP_S``.

Counts and rates alone cannot say why a run stalls: while every lane waits on a long call the
rate sinks and nothing finishes. So the line also names the calls in flight and the longest
running one (``| 8 in flight, longest 0042 bash 73s``): ``started`` is run_batch's
``on_submit`` (the call is handed to the pool) and ``record`` ends it. A plain log gets a line
while nothing finishes too, so that it says which call holds the batch; at gaps that double from
``PLAIN_EVERY_S`` up to ``PLAIN_QUIET_MAX_S``, so an hour-long call costs a CI log some 60
lines, not 1,800.

On a terminal the line's text is shown with its control characters escaped (a call id is the
user's or a model's text: ``sandbx_pool.terminal``); its own ``\\r`` and erase-to-end are not.

The decisions (``due``) are synchronous and take the time as an argument, so they are tested
without a clock; ``run`` is the small loop that asks them periodically.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Final, TextIO

from sandbx_pool.batch.calls import CallSpec
from sandbx_pool.batch.run import BatchReport
from sandbx_pool.journal.costs import summary_line, totals
from sandbx_pool.journal.reader import percentile
from sandbx_pool.outcome import Outcome
from sandbx_pool.tables import status_order, text_table
from sandbx_pool.terminal import escape_controls, unguarded

#: A redraw costs a write to the terminal; ten a second looks live and costs nothing.
TTY_REFRESH_S: Final = 0.1
#: Plain lines: one every two seconds or every tenth of the calls, whichever comes first...
PLAIN_EVERY_S: Final = 2.0
PLAIN_STEP: Final = 0.1
#: ...but no closer than this, so a fast small batch does not print ten lines in a second.
PLAIN_MIN_GAP_S: Final = 0.5
#: While nothing finishes, plain lines come at doubling gaps, up to this one.
PLAIN_QUIET_MAX_S: Final = 60.0
BAR_WIDTH: Final = 24
#: Longest call id the line shows in full (ids are the batch file's, of any length).
SHOWN_ID_CHARS: Final = 24


def format_duration(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02}:{secs:02}" if hours else f"{minutes}:{secs:02}"


class Progress:
    """Counts outcomes as they come, follows the calls in flight, and draws them on ``stream``."""

    def __init__(
        self,
        total: int,
        stream: TextIO | None = None,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        width: int | None = None,
    ) -> None:
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.width = width  # None: the terminal's, asked at each redraw (it may be resized)
        self.done = 0
        self.counts: dict[str, int] = {}
        # Call id -> (spec, when it was handed to the pool), oldest first: dicts keep their
        # insertion order, so the longest-running call is the first one, at no cost.
        self.in_flight: dict[str, tuple[CallSpec, float]] = {}
        self.started_at = clock()
        # A terminal gets its bar at once; plain output waits for something worth a line.
        self._last_shown_at: float | None = None if self.tty else self.started_at
        self._last_shown_done = 0
        self._quiet_gap = PLAIN_EVERY_S  # plain: the gap before the next line if none finishes
        self._drawn = False

    def started(self, spec: CallSpec) -> None:
        """``spec`` was handed to the pool: it is in flight until ``record`` gets its outcome."""
        self.in_flight[spec.call_id] = (spec, self.clock())

    def record(self, outcome: Outcome) -> None:
        self.in_flight.pop(outcome.call_id, None)
        self.done += 1
        self.counts[outcome.status] = self.counts.get(outcome.status, 0) + 1
        if not self.tty:
            self.tick()  # a tenth may just have been crossed

    def due(self, now: float) -> bool:
        """Whether a line (or a redraw) is due at ``now``."""
        if self._last_shown_at is None:
            return True
        gap = now - self._last_shown_at
        if self.tty:
            return gap >= TTY_REFRESH_S
        if gap < PLAIN_MIN_GAP_S:
            return False
        if self.done == self._last_shown_done:
            # Nothing finished: a line only to say what holds the batch, at growing gaps.
            return bool(self.in_flight) and gap >= self._quiet_gap
        step = max(1, round(self.total * PLAIN_STEP))
        return gap >= PLAIN_EVERY_S or self.done - self._last_shown_done >= step

    def tick(self) -> None:
        now = self.clock()
        if self.due(now):
            self.show(now)

    def show(self, now: float) -> None:
        quiet = self._last_shown_at is not None and self.done == self._last_shown_done
        self._quiet_gap = min(2 * self._quiet_gap, PLAIN_QUIET_MAX_S) if quiet else PLAIN_EVERY_S
        self._last_shown_at = now
        self._last_shown_done = self.done
        if self.tty:
            # A line longer than the terminal wraps, and \r then redraws only its last row.
            width = self.width or shutil.get_terminal_size().columns - 1
            text = escape_controls(self.line(now))
            if len(text) > width:  # the bar goes first: the counts say as much, the rest more
                text = escape_controls(self.line(now, bar=False))
            unguarded(self.stream).write(f"\r{text[:width]}\x1b[K")
            self._drawn = True
        else:
            self.stream.write(self.line(now) + "\n")
        self.stream.flush()

    def finish(self) -> None:
        """The final state, then leave the terminal line for what follows."""
        # The batch has returned: nothing is in flight, though a call refused as the pool
        # closed (a stop, a lost template) was started and never got an outcome.
        self.in_flight.clear()
        self.show(self.clock())
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()

    def line(self, now: float, *, bar: bool = True) -> str:
        """The progress as one line of text; on a terminal, after a bar unless ``bar=False``."""
        elapsed = max(now - self.started_at, 1e-9)
        rate = self.done / elapsed
        percent = 100.0 * self.done / self.total if self.total else 100.0
        statuses = " ".join(f"{s} {self.counts[s]}" for s in status_order(set(self.counts)))
        if self.done >= self.total:
            eta = f"took {format_duration(elapsed)}"
        elif rate > 0:
            eta = f"ETA {format_duration((self.total - self.done) / rate)}"
        else:
            eta = "ETA --"
        head = " ".join(filter(None, [f"{self.done}/{self.total} ({percent:.0f}%)", statuses]))
        tail = f"{rate:.1f} calls/s, {eta}"
        if self.in_flight:
            tail += f" | {self._in_flight_text(now)}"
        if not self.tty:
            return f"progress: {head} | {tail}"
        if not bar:
            return f"{head} | {tail}"
        filled = int(BAR_WIDTH * self.done / self.total) if self.total else BAR_WIDTH
        return f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {head} | {tail}"

    def _in_flight_text(self, now: float) -> str:
        spec, since = next(iter(self.in_flight.values()))
        call_id = spec.call_id
        if len(call_id) > SHOWN_ID_CHARS:
            call_id = call_id[: SHOWN_ID_CHARS - 3] + "..."
        running = max(0.0, now - since)
        return f"{len(self.in_flight)} in flight, longest {call_id} {spec.tool} {running:.0f}s"

    async def run(self) -> None:
        """Redraw until cancelled: the ETA must move even while a long call runs."""
        period = TTY_REFRESH_S if self.tty else PLAIN_MIN_GAP_S
        while True:
            await asyncio.sleep(period)
            self.tick()


@contextlib.asynccontextmanager
async def showing(progress: Progress | None) -> AsyncIterator[None]:
    """Keep ``progress`` redrawn while the body runs; draw its final state after."""
    if progress is None:
        yield
        return
    progress.tick()  # a terminal shows its empty bar while the first calls run
    ticker = asyncio.create_task(progress.run(), name="batch-progress")
    try:
        yield
    finally:
        ticker.cancel()
        # wait(), not `await ticker`: the ticker's CancelledError is not ours to catch, and
        # ours (if the body was cancelled) still reaches the caller.
        await asyncio.wait([ticker])
        progress.finish()


def format_summary(report: BatchReport) -> list[str]:
    """The table printed when a run ends: counts by status and tool, latency, slowest calls.

    It names no command: what runs the rest depends on who ran the batch (``run`` prints the
    exact ``--resume`` or ``--rerun-started`` command after it; ``demo`` has neither)."""
    rate = len(report.results) / report.wall_s if report.wall_s > 0 else 0.0
    skipped = ""
    if report.in_doubt:
        finished = report.skipped - len(report.in_doubt)
        skipped = (
            f"; {report.skipped} skipped ({finished} finished by an earlier run,"
            f" {len(report.in_doubt)} in doubt)"
        )
    elif report.skipped:
        skipped = f"; {report.skipped} skipped, finished by an earlier run"
    lines = [
        f"{len(report.results)} call(s) run in {report.wall_s:.1f} s ({rate:.1f} calls/s)" + skipped
    ]
    if report.not_run:
        why = "stopped" if report.stopped else "not run"
        if report.held and not report.stopped:
            why = "not run: they come after a call in doubt"
        lines.append(f"{report.not_run} of {report.total} call(s) {why}")
    if report.failure:
        lines.append(f"failure: {report.failure}")
    if report.results:
        lines += ["", *_status_table(report.results)]
        if nodes := report.by_node():
            lines += ["", "calls per node:"]
            lines += [f"  {node}  {count}" for node, count in sorted(nodes.items())]
        durations = sorted(outcome.duration_s for _, outcome in report.results)
        p50, p99 = percentile(durations, 50.0), percentile(durations, 99.0)
        lines += ["", f"latency: p50 {p50:.3f} s, p99 {p99:.3f} s, max {durations[-1]:.3f} s"]
        started = [
            (spec.call_id, spec.tool, str(outcome.status), outcome.usage)
            for spec, outcome in report.results
            if outcome.started
        ]
        if started:
            lines.append(summary_line(totals(started)))
        lines += ["", f"slowest {min(len(report.results), 5)}:"]
        lines += [
            f"  {outcome.duration_s:8.3f} s  line {spec.line:<6} {spec.tool:<5} "
            f"{outcome.status:<9} {spec.call_id}"
            for spec, outcome in report.slowest()
        ]
    lines += ["", f"journal: {report.journal or '(none: journal policy is off)'}"]
    return lines


def _status_table(results: list[tuple[CallSpec, Outcome]]) -> list[str]:
    by_tool: dict[str, dict[str, int]] = {}
    for spec, outcome in results:
        row = by_tool.setdefault(spec.tool, {})
        row[outcome.status] = row.get(outcome.status, 0) + 1
    columns = status_order({status for row in by_tool.values() for status in row})
    rows = [
        [tool, str(sum(row.values())), *(str(row.get(c, 0)) for c in columns)]
        for tool, row in sorted(by_tool.items())
    ]
    totals = [sum(by_tool[t].get(c, 0) for t in by_tool) for c in columns]
    rows.append(["all", str(len(results)), *(str(n) for n in totals)])
    return text_table(["tool", "calls", *columns], rows)
