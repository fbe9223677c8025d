"""A journal as bars on lanes: what the timeline page draws, computed from the records alone.

    JournalScan (records in file order)
        |  attempts: each intent opens one, the next outcome of its call id closes it
        |  (an intent with no outcome: drawn to the last sign of life of its coordinator)
        v
    bars sorted by start --lowest free lane--> Bar(lane=...) --> Timeline

A lane is a worker slot: each worker is disposable (one call, then it exits), so its pid names
one call, never a slot. The lanes are rebuilt from the times instead: a call takes the lowest
lane free at its start, which is what ``parallel`` slots look like when they are kept busy,
and never more lanes than calls were ever in flight at once.

A bar runs from its intent's time to its outcome's. An attempt the journal never saw end (its
coordinator was killed) runs to the last record written before the journal shows that
coordinator gone: the call's next intent (a resumed run), its ``in_doubt`` record (the next
pool's open), or the journal's end. Such a bar is ``in_doubt`` when ``call_ledger`` says its
call is in doubt (an edit or bash that may have run), ``no_outcome`` otherwise (a read that can
simply run again). Only this module decides what a bar is; the page (page.py) draws it.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Final

import msgspec

from sandbx_pool.journal.costs import cpu_s
from sandbx_pool.journal.reader import JournalScan, call_ledger
from sandbx_pool.journal.records import InDoubtRecord, IntentRecord, OutcomeRecord, StartedRecord

#: The status of a bar whose call has no outcome and is in doubt (journal.reader.call_ledger).
IN_DOUBT: Final = "in_doubt"

#: The status of a bar whose call has no outcome but may simply run again.
NO_OUTCOME: Final = "no_outcome"

#: Longest reason or error kept for a bar's hover text (errors can be tracebacks).
TEXT_CHARS: Final = 300


class Bar(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt of a call. ``start``/``end`` are unix times; ``lane`` counts from 0."""

    call_id: str
    tool: str
    status: str
    start: float
    end: float
    lane: int = 0
    duration_s: float | None = None
    killed_by: str | None = None
    reason: str | None = None
    error: str | None = None
    worker_pid: int | None = None
    node: str | None = None
    exit_code: int | None = None
    quarantined: bool = False
    wchan: str | None = None
    limit: str | None = None
    #: What the call cost (OutcomeRecord.usage): CPU seconds, user and system, and its peak
    #: memory in bytes; None when its outcome has no figures.
    cpu_s: float | None = None
    max_rss_bytes: int | None = None


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    """Every bar of a journal, and how it was read (``torn_tail``: a killed run's last line)."""

    path: str
    bars: list[Bar]
    lanes: int
    start: float
    end: float
    torn_tail: bool = False
    corrupt_lines: int = 0

    def counts(self) -> dict[str, int]:
        """Bars by status."""
        found: dict[str, int] = {}
        for bar in self.bars:
            found[bar.status] = found.get(bar.status, 0) + 1
        return found


def build_timeline(scan: JournalScan) -> Timeline:
    """The bars of ``scan``, each on its lane (see the module's docstring)."""
    doubted = {call.call_id for call in call_ledger(scan).in_doubt}
    bars: list[Bar] = []
    # At most one open attempt per id: a new intent of an id means its earlier coordinator
    # is gone. ``unfinished``: each attempt left open, with the time it is drawn to.
    open_attempts: dict[str, IntentRecord] = {}
    unfinished: list[tuple[IntentRecord, float]] = []
    latest: dict[str, IntentRecord] = {}
    pids: dict[int, int] = {}  # id() of an open intent -> the worker its started record names
    last_time = 0.0
    for record in scan.records:
        call_id = record.call_id
        if not math.isfinite(record.time):
            continue  # a record no clock wrote (1e400 parses as inf): nowhere to draw it
        if isinstance(record, IntentRecord):
            earlier = open_attempts.pop(call_id, None)
            if earlier is not None:
                unfinished.append((earlier, last_time))
            open_attempts[call_id] = latest[call_id] = record
        elif isinstance(record, StartedRecord) and call_id in open_attempts:
            pids[id(open_attempts[call_id])] = record.pid
        elif isinstance(record, OutcomeRecord):
            bars.append(_finished(record, open_attempts.pop(call_id, None)))
        elif isinstance(record, InDoubtRecord):
            earlier = open_attempts.pop(call_id, None)
            if earlier is not None:
                unfinished.append((earlier, last_time))
        last_time = max(last_time, record.time)
    unfinished += [(intent, last_time) for intent in open_attempts.values()]
    for intent, until in unfinished:
        # Only the call's latest attempt can be what keeps it in doubt; an earlier one was
        # followed by another attempt, whose fate is the call's.
        doubt = intent is latest[intent.call_id] and intent.call_id in doubted
        bars.append(_unfinished(intent, until, in_doubt=doubt, pid=pids.get(id(intent))))
    bars.sort(key=lambda bar: (bar.start, bar.end))
    placed, lanes = assign_lanes(bars)
    start = min((bar.start for bar in placed), default=0.0)
    end = max((bar.end for bar in placed), default=start)
    return Timeline(
        path=scan.path,
        bars=placed,
        lanes=lanes,
        start=start,
        end=end,
        torn_tail=scan.torn_tail,
        corrupt_lines=len(scan.corrupt_lines),
    )


def assign_lanes(bars: list[Bar]) -> tuple[list[Bar], int]:
    """``bars`` (sorted by start) each on the lowest lane free at its start; the lane count.

    A bar ending exactly when another starts frees its lane for it: outcome, then the next
    intent, is how one slot is reused."""
    busy: list[tuple[float, int]] = []  # (end, lane) of the bars still running
    free: list[int] = []
    lanes = 0
    placed: list[Bar] = []
    for bar in bars:
        while busy and busy[0][0] <= bar.start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane = lanes
            lanes += 1
        heapq.heappush(busy, (bar.end, lane))
        placed.append(msgspec.structs.replace(bar, lane=lane))
    return placed, lanes


def _finished(outcome: OutcomeRecord, intent: IntentRecord | None) -> Bar:
    # Without its intent (a corrupt line), the outcome's duration says when the call began.
    took = outcome.duration_s if math.isfinite(outcome.duration_s) else 0.0
    start = intent.time if intent is not None else outcome.time - took
    return Bar(
        call_id=outcome.call_id,
        tool=outcome.tool,
        status=outcome.status,
        start=min(start, outcome.time),
        end=outcome.time,
        duration_s=outcome.duration_s if math.isfinite(outcome.duration_s) else None,
        killed_by=outcome.killed_by,
        reason=_clip(outcome.reason),
        error=_clip(outcome.error),
        worker_pid=outcome.worker_pid if outcome.worker_pid is not None else outcome.stuck_pid,
        node=outcome.node,
        exit_code=_exit_code(outcome.value_summary),
        quarantined=outcome.quarantined,
        wchan=outcome.wchan,
        limit=outcome.limit,
        cpu_s=None if outcome.usage is None else round(cpu_s(outcome.usage), 6),
        max_rss_bytes=None if outcome.usage is None else outcome.usage.get("max_rss_bytes"),
    )


def _unfinished(intent: IntentRecord, until: float, *, in_doubt: bool, pid: int | None) -> Bar:
    status = IN_DOUBT if in_doubt else NO_OUTCOME
    return Bar(
        call_id=intent.call_id,
        tool=intent.tool,
        status=status,
        start=intent.time,
        end=max(until, intent.time),
        reason="no outcome: the coordinator stopped before the call ended",
        worker_pid=pid,
    )


def _exit_code(summary: dict[str, Any] | None) -> int | None:
    code = summary.get("exit_code") if summary else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _clip(text: str | None) -> str | None:
    if text is None or len(text) <= TEXT_CHARS:
        return text
    return text[:TEXT_CHARS] + "..."
