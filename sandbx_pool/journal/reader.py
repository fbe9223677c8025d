"""Reading a journal: parse it, find the calls in doubt, count and time what happened.

Used by ``Journal.open`` (recovery, under the journal's lock) and by ``sandbx-pool journal``
and ``run --resume`` (read-only, possibly while a coordinator is still appending).

Two questions are asked of a journal's calls, and kept apart by name:

* **in doubt** (``call_ledger``, ``in_doubt_calls``): a call whose side effect may or may not
  have happened, so running it again could repeat it. An edit or bash call (not in
  ``IDEMPOTENT_TOOLS``) whose latest attempt has no outcome (its coordinator died), or was
  stopped after a worker took it (a shutdown cancel with ``started``, a loss with its Ray
  node), and that no later outcome settled. The one definition: ``journal in-doubt`` lists
  these, ``journal stats`` counts them and ``run --resume`` skips them (``--rerun-started``
  runs them). A call stopped before it started is not in doubt (it provably did not run), nor
  is a call of a tool that may simply run again (read, ls, grep, find, write), nor a
  transactional call (sandbx_pool.changes) whose change set was never applied: no
  ``applying`` record follows its latest intent, so the workspace is as it was before it.
* **interrupted** (``interrupted``): every intent, of any tool, that has no later outcome of
  its call id: what was in flight when a coordinator died. The pool reports these at open
  (``Pool.interrupted``, the ``in_doubt`` records) and removes their writes' temp files.

Parsing is forgiving by design: the journal is most needed right after something went wrong.
A last line without its newline is a write the coordinator never finished (a torn write): it
is ignored, and ``recover`` cuts it off so that the next record does not get glued to it. A
corrupt line elsewhere is skipped with a warning; the records around it still count.
"""

from __future__ import annotations

import enum
import math
import os
from collections import Counter, defaultdict
from typing import Any, Final

import msgspec

from sandbx_pool.journal.costs import CostTotals, totals
from sandbx_pool.journal.records import (
    IDEMPOTENT_TOOLS,
    JOURNAL_REFUSED,
    NODE_LOST,
    ApplyingRecord,
    InDoubtRecord,
    IntentRecord,
    JournalRecord,
    OutcomeRecord,
    decoder,
)
from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Status

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
    #: The calls in doubt (``in_doubt_calls``): as many as ``journal in-doubt`` lists.
    in_doubt: int
    by_status: dict[str, int]
    by_tool: dict[str, int]
    by_tool_status: dict[str, dict[str, int]]
    latency: Latency | None
    latency_by_tool: dict[str, Latency]
    torn_tail: bool
    corrupt_lines: int
    in_doubt_by_tool: dict[str, int] = msgspec.field(default_factory=dict)
    #: Intents of any tool with no later outcome of their call id (``interrupted``).
    no_outcome: int = 0
    #: What the calls cost (journal.costs); None: no outcome carries figures.
    usage: CostTotals | None = None


class Doubt(enum.StrEnum):
    """Why a call is in doubt: what its latest attempt left unknown."""

    NO_OUTCOME = "no outcome"  # its coordinator died (SIGKILL, a second SIGINT, a crash)
    STOPPED_AFTER_START = "stopped after it started"  # a shutdown cancel, once a worker had it
    NODE_LOST_AFTER_START = "lost with its node after it started"  # integrations.ray


class InDoubtCall(msgspec.Struct, frozen=True, kw_only=True):
    """A call whose side effect may or may not have happened. ``intent`` is its latest intent
    (arguments, cwd), None when the journal lost it (a corrupt line)."""

    call_id: str
    tool: str
    why: Doubt
    intent: IntentRecord | None = None


class CallLedger(msgspec.Struct, frozen=True, kw_only=True):
    """What a journal says about the call ids it holds (see ``call_ledger``).

    ``seen``: ids with an intent or an outcome. ``finished``: ids whose latest attempt that
    did anything ran to an end (``ran_to_an_end``). ``in_doubt``: in journal order.
    ``workspaces``: each id's workspace as its latest intent recorded it, ordered by those
    intents (the last one is the latest call made)."""

    seen: set[str]
    finished: set[str]
    in_doubt: list[InDoubtCall]
    workspaces: dict[str, str]


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


def is_shutdown_cancel(status: str, killed_by: str | None) -> bool:
    """An outcome that says the *run* was stopped, not that the call ran: resume re-runs it."""
    return status == Status.CANCELLED and killed_by == KilledBy.SHUTDOWN


def is_node_lost(status: str, reason: str | None) -> bool:
    """An outcome that says the call's Ray node died under it: resume runs it again."""
    return status == Status.CRASHED and reason == NODE_LOST


#: A service's call (sandbx_pool.services): the pool's close is how its life ends, not a run
#: cut short; only one with no outcome at all (its coordinator died) is in doubt.
SERVICE_TOOL = "_service"


def ran_to_an_end(record: OutcomeRecord) -> bool:
    """An outcome after which the call needs no new run: not a shutdown cancel (the *run* was
    stopped, not the call), not a loss with its node, not a refusal by a journal that could
    not be written. Any other outcome (a timeout, a crash of its worker, a token's cancel)
    says what became of the call itself."""
    if is_shutdown_cancel(record.status, record.killed_by) and record.tool != SERVICE_TOOL:
        return False
    if is_node_lost(record.status, record.reason):
        return False
    return not (record.status == Status.ERROR and record.reason == JOURNAL_REFUSED)


def call_ledger(scan: JournalScan) -> CallLedger:
    """Which calls finished and which are in doubt, replaying the journal in order.

    Each attempt of a call (an intent, then its outcome if it got one) either says something
    or nothing. An outcome that ran to an end finishes the call. An edit or bash attempt that
    may have done its side effect without an outcome of its own puts the call in doubt: it
    has no outcome at all (another intent of the id follows, or the journal ends), or was
    stopped after it started. The latest attempt that says something decides; an attempt
    that provably did nothing (stopped before a worker took it, refused by the journal) or
    whose tool may run again leaves the call as it was. So a call in doubt stays so until an
    attempt of it ends (``--rerun-started``), and a call that finished, then was run again
    (``--fresh``) and cut after it started, is in doubt again.

    A missing ``started`` record proves nothing (it is written just after the call is sent
    to its worker): an intent without an outcome is in doubt either way.
    """
    seen: set[str] = set()
    finished: set[str] = set()
    doubt: dict[str, tuple[int, InDoubtCall]] = {}
    open_attempts: dict[str, tuple[int, IntentRecord]] = {}
    latest_intent: dict[str, IntentRecord] = {}
    workspaces: dict[str, str] = {}

    def doubted(position: int, call_id: str, tool: str, why: Doubt) -> None:
        finished.discard(call_id)
        intent = latest_intent.get(call_id)
        doubt[call_id] = (position, InDoubtCall(call_id=call_id, tool=tool, why=why, intent=intent))

    applying: set[str] = set()  # calls whose latest attempt began to apply its changes

    def kept_aside(call_id: str) -> bool:
        # A transactional attempt that never began to apply its change set left the
        # workspace as it was: running it again repeats nothing there.
        intent = latest_intent.get(call_id)
        transactional = intent is not None and intent.changes == "transactional"
        return transactional and call_id not in applying

    for position, record in enumerate(scan.records):
        call_id = record.call_id
        if isinstance(record, ApplyingRecord):
            applying.add(call_id)
            continue
        if isinstance(record, IntentRecord):
            seen.add(call_id)
            earlier = open_attempts.pop(call_id, None)
            if earlier is not None and may_not_repeat(earlier[1].tool) and not kept_aside(call_id):
                doubted(earlier[0], call_id, earlier[1].tool, Doubt.NO_OUTCOME)
            applying.discard(call_id)
            open_attempts[call_id] = (position, record)
            latest_intent[call_id] = record
            if record.workspace is not None:
                workspaces.pop(call_id, None)  # re-inserted last: the latest intent
                workspaces[call_id] = record.workspace
        elif isinstance(record, OutcomeRecord):
            seen.add(call_id)
            open_attempts.pop(call_id, None)
            if ran_to_an_end(record):
                finished.add(call_id)
                doubt.pop(call_id, None)
            elif record.started and may_not_repeat(record.tool) and not kept_aside(call_id):
                lost = is_node_lost(record.status, record.reason)
                why = Doubt.NODE_LOST_AFTER_START if lost else Doubt.STOPPED_AFTER_START
                doubted(position, call_id, record.tool, why)
    for call_id, (position, intent) in open_attempts.items():
        if may_not_repeat(intent.tool) and not kept_aside(call_id):
            doubted(position, call_id, intent.tool, Doubt.NO_OUTCOME)
    ordered = [call for _, call in sorted(doubt.values(), key=lambda item: item[0])]
    return CallLedger(seen=seen, finished=finished, in_doubt=ordered, workspaces=workspaces)


def may_not_repeat(tool: str) -> bool:
    """Whether running a call of ``tool`` again could repeat or undo what it did: edit, bash
    (and any tool this reader does not know, on the safe side)."""
    return tool not in IDEMPOTENT_TOOLS


def in_doubt_calls(scan: JournalScan) -> list[InDoubtCall]:
    """The calls in doubt (see ``call_ledger``), in journal order."""
    return call_ledger(scan).in_doubt


def sessions(scan: JournalScan) -> dict[str, dict[str, Any]]:
    """Each shell session's state as the latest outcome record carrying it left it
    (sandbx_pool.sessions restores them), by session id."""
    found: dict[str, dict[str, Any]] = {}
    for record in scan.records:
        if isinstance(record, OutcomeRecord) and isinstance(record.session, dict):
            session_id = record.session.get("id")
            if isinstance(session_id, str):
                found[session_id] = record.session
    return found


def interrupted(scan: JournalScan, *, include_reported: bool = True) -> list[IntentRecord]:
    """Intents not settled by a later outcome of the same call id, in journal order: the calls
    in flight when a coordinator died, of any tool (not the calls in doubt: ``call_ledger``).

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


def unfinished_applies(scan: JournalScan) -> list[ApplyingRecord]:
    """Change sets whose apply began (an ``applying`` record) and whose call has no later
    outcome but a shutdown's without ``changes``: a coordinator died while it applied them, or
    close() gave up on the call mid-apply. The next coordinator finishes them
    (sandbx_pool.changes). An apply that failed has an outcome saying so, and is not retried."""
    pending: dict[str, ApplyingRecord] = {}
    for record in scan.records:
        if isinstance(record, ApplyingRecord):
            pending[record.call_id] = record
        elif isinstance(record, OutcomeRecord) and not (
            record.changes is None and is_shutdown_cancel(record.status, record.killed_by)
        ):
            pending.pop(record.call_id, None)
    return list(pending.values())


def unfinished_writes(records: list[IntentRecord], workspace: str) -> list[str]:
    """The paths (the workspace's cwd joined with the path) of the interrupted writes and edits
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
                "interrupted {} {} was in workspace {}, not this pool's: its temp file, if any,"
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
    """Counts by status, by tool and by both, latency percentiles of the outcomes, and the
    calls in doubt (``in_doubt_calls``: the same calls ``journal in-doubt`` lists).

    ``by_tool`` counts intents (attempts made); the status counts are over outcomes, so a
    tool's statuses plus its intents without an outcome add up to its row in ``by_tool``.
    """
    by_status: Counter[str] = Counter()
    by_tool: Counter[str] = Counter()
    by_tool_status: dict[str, Counter[str]] = defaultdict(Counter)
    durations: list[float] = []
    durations_by_tool: dict[str, list[float]] = defaultdict(list)
    costs: list[tuple[str, str, str, dict[str, Any] | None]] = []
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
            if record.started:
                costs.append((record.call_id, record.tool, record.status, record.usage))
    by_tool_latency = {tool: latency(values) for tool, values in sorted(durations_by_tool.items())}
    doubtful = in_doubt_calls(scan)
    return JournalStats(
        intents=intents,
        outcomes=outcomes,
        in_doubt=len(doubtful),
        by_status=dict(by_status.most_common()),
        by_tool=dict(sorted(by_tool.items())),
        by_tool_status={tool: dict(c) for tool, c in sorted(by_tool_status.items())},
        latency=latency(durations),
        latency_by_tool={tool: value for tool, value in by_tool_latency.items() if value},
        torn_tail=scan.torn_tail,
        corrupt_lines=len(scan.corrupt_lines),
        in_doubt_by_tool=dict(sorted(Counter(call.tool for call in doubtful).items())),
        no_outcome=len(interrupted(scan)),
        usage=_costs(costs),
    )


def _costs(calls: list[tuple[str, str, str, dict[str, Any] | None]]) -> CostTotals | None:
    """Totals of the started calls, None when none has figures (an older journal)."""
    total = totals(calls)
    return total if total.measured else None
