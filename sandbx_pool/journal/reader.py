"""Reading a journal: parse it, find the calls in doubt, count and time what happened.

Used by ``Journal.open`` (recovery, under the journal's lock) and by ``sandbx-pool journal``
and ``run --resume`` (read-only, possibly while a coordinator is still appending).

Parsing is forgiving by design: the journal is most needed right after something went wrong.
A last line without its newline is a write the coordinator never finished (a torn write): it
is ignored, and ``recover`` cuts it off so that the next record does not get glued to it. A
corrupt line elsewhere is skipped with a warning; the records around it still count.
"""

from __future__ import annotations

import math
import os
from collections import Counter, defaultdict
from typing import Final

import msgspec

from sandbx_pool.journal.records import (
    InDoubtRecord,
    IntentRecord,
    JournalRecord,
    OutcomeRecord,
    decoder,
)
from sandbx_pool.logs import logger

#: Percentiles reported by ``stats``, as (name, q).
PERCENTILES: Final = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


class JournalScan(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed journal. ``valid_bytes`` is the length up to the last complete line."""

    path: str
    records: list[JournalRecord]
    torn_tail: bool = False
    corrupt_lines: list[int] = msgspec.field(default_factory=list)
    valid_bytes: int = 0


class Latency(msgspec.Struct, frozen=True, kw_only=True):
    """Nearest-rank percentiles of ``duration_s`` over ``count`` outcomes, in seconds."""

    count: int
    p50: float
    p90: float
    p99: float
    max: float


class JournalStats(msgspec.Struct, frozen=True, kw_only=True):
    intents: int
    outcomes: int
    in_doubt: int
    by_status: dict[str, int]
    by_tool: dict[str, int]
    by_tool_status: dict[str, dict[str, int]]
    latency: Latency | None
    latency_by_tool: dict[str, Latency]
    torn_tail: bool
    corrupt_lines: int


def parse_journal(data: bytes, path: str = "<journal>") -> JournalScan:
    """Parse a journal's bytes. Line numbers in ``corrupt_lines`` are 1-based."""
    end = data.rfind(b"\n") + 1  # 0 when there is no complete line at all
    torn_tail = end < len(data)
    records: list[JournalRecord] = []
    corrupt: list[int] = []
    for number, line in enumerate(data[:end].split(b"\n")[:-1], start=1):
        try:
            records.append(decoder.decode(line))
        except msgspec.DecodeError as exc:
            corrupt.append(number)
            logger.warning("journal {}: line {} skipped, not a record: {}", path, number, exc)
    if torn_tail:
        logger.warning(
            "journal {}: ignoring a torn last line ({} bytes, no newline)", path, len(data) - end
        )
    return JournalScan(
        path=path, records=records, torn_tail=torn_tail, corrupt_lines=corrupt, valid_bytes=end
    )


def read_journal(path: str | os.PathLike[str]) -> JournalScan:
    """Parse the journal at ``path`` without changing it. FileNotFoundError if it is missing."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        return parse_journal(f.read(), name)


def recover(fd: int, path: str) -> JournalScan:
    """Parse the journal open on ``fd`` and cut a torn tail off it. Call with the lock held.

    The cut is fsynced before anything is appended: otherwise a crash could bring the torn
    bytes back in front of records written after them.
    """
    size = os.fstat(fd).st_size
    chunks: list[bytes] = []
    offset = 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 1 << 24), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    scan = parse_journal(b"".join(chunks), path)
    if scan.torn_tail:
        os.ftruncate(fd, scan.valid_bytes)
        os.fsync(fd)
    return scan


def in_doubt(scan: JournalScan, *, include_reported: bool = True) -> list[IntentRecord]:
    """Intents not settled by a later outcome of the same call id, in journal order.

    An outcome settles every earlier intent of its call id: a resumed run that completes a call
    left in doubt by a crash settles the crashed attempt too (one call id is in flight once at
    a time; a second attempt exists only because the first one's coordinator is gone). With
    ``include_reported=False``, intents that an earlier reopening already reported (an
    ``in_doubt`` record) are left out: that is the list of calls in flight at the latest crash.
    """
    pending: dict[str, list[tuple[int, IntentRecord]]] = defaultdict(list)
    for position, record in enumerate(scan.records):
        if isinstance(record, IntentRecord):
            pending[record.call_id].append((position, record))
        elif isinstance(record, OutcomeRecord) or (
            isinstance(record, InDoubtRecord) and not include_reported
        ):
            pending.pop(record.call_id, None)
    left = sorted(item for items in pending.values() for item in items)
    return [record for _, record in left]


def unfinished_writes(records: list[IntentRecord], workspace: str) -> list[str]:
    """The paths (the workspace's cwd joined with the path) of the in-doubt writes and edits
    made in ``workspace``, whose temp files may have been left behind. Those of another
    workspace are only logged: a pool cleans its own workspace, nothing else."""
    paths = []
    for record in records:
        path = record.args.get("path")
        if record.tool not in ("write", "edit") or not isinstance(path, str):
            continue
        if record.workspace in (None, workspace):  # None: a journal from before it was kept
            paths.append(os.path.join(record.cwd, path))
        else:
            logger.warning(
                "in-doubt {} {} was in workspace {}, not this pool's: its temp file, if any,"
                " stays (open a pool there with this journal to remove it)",
                record.tool,
                record.call_id,
                record.workspace,
            )
    return paths


def percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending, non-empty list: a value that was observed."""
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def latency(durations: list[float]) -> Latency | None:
    if not durations:
        return None
    ordered = sorted(durations)
    p50, p90, p99 = (percentile(ordered, q) for _, q in PERCENTILES)
    return Latency(count=len(ordered), p50=p50, p90=p90, p99=p99, max=ordered[-1])


def stats(scan: JournalScan) -> JournalStats:
    """Counts by status, by tool and by both, and latency percentiles of the outcomes.

    ``by_tool`` counts intents (calls made); the status counts are over outcomes, so a tool's
    statuses plus its in-doubt calls add up to its row in ``by_tool``.
    """
    by_status: Counter[str] = Counter()
    by_tool: Counter[str] = Counter()
    by_tool_status: dict[str, Counter[str]] = defaultdict(Counter)
    durations: list[float] = []
    durations_by_tool: dict[str, list[float]] = defaultdict(list)
    intents = outcomes = 0
    for record in scan.records:
        if isinstance(record, IntentRecord):
            intents += 1
            by_tool[record.tool] += 1
        elif isinstance(record, OutcomeRecord):
            outcomes += 1
            by_status[record.status] += 1
            by_tool_status[record.tool][record.status] += 1
            durations.append(record.duration_s)
            durations_by_tool[record.tool].append(record.duration_s)
    by_tool_latency = {tool: latency(values) for tool, values in sorted(durations_by_tool.items())}
    return JournalStats(
        intents=intents,
        outcomes=outcomes,
        in_doubt=len(in_doubt(scan)),
        by_status=dict(by_status.most_common()),
        by_tool=dict(sorted(by_tool.items())),
        by_tool_status={tool: dict(c) for tool, c in sorted(by_tool_status.items())},
        latency=latency(durations),
        latency_by_tool={tool: value for tool, value in by_tool_latency.items() if value},
        torn_tail=scan.torn_tail,
        corrupt_lines=len(scan.corrupt_lines),
    )
