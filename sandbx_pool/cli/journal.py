"""``sandbx-pool journal``: inspect a journal (in doubt, stats, show, timeline) without changing it.

Read-only on purpose: a coordinator may still be appending, and only the coordinator holding
the lock may cut a torn tail off. A torn tail or corrupt lines are mentioned on stderr; stdout
stays machine-readable.

"In doubt" has one meaning here, ``journal.reader.call_ledger``'s, the one ``run --resume``
skips by: ``in-doubt`` lists those calls (with why), ``stats`` counts them, ``show --status
in_doubt`` selects them.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec

from sandbx_pool.journal.costs import format_costs
from sandbx_pool.journal.reader import (
    JournalScan,
    JournalStats,
    Latency,
    in_doubt_calls,
    read_journal,
    stats,
)
from sandbx_pool.journal.records import (
    IntentRecord,
    JournalRecord,
    OutcomeRecord,
    decoder,
    encoder,
    is_digest,
)
from sandbx_pool.tables import status_order, text_table

#: Exit code for a journal that cannot be read (argparse uses 2 for usage errors too).
EXIT_UNREADABLE: Final = 2

#: ``--status`` value selecting the calls in doubt (those ``in-doubt`` lists).
IN_DOUBT: Final = "in_doubt"

#: ``--status`` value (and status shown) of a call that has no outcome and is not in doubt:
#: a read-only or write call the coordinator never saw end (``run --resume`` runs it again).
NO_OUTCOME: Final = "no_outcome"

#: Longest argument value shown in full by ``in-doubt``.
ARG_PREVIEW_CHARS: Final = 60

#: Longest cell of ``show``'s args and detail columns (a terminal line stays readable).
SHOW_CELL_CHARS: Final = 80

Command = Callable[[argparse.Namespace], int]


def add_journal_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``journal in-doubt|stats|show`` to a command line."""
    journal = subparsers.add_parser("journal", help="inspect a journal")
    commands = journal.add_subparsers(dest="journal_command", required=True, metavar="COMMAND")

    doubt = commands.add_parser(
        "in-doubt",
        help="edit and bash calls that may or may not have run (no outcome, or stopped after"
        " they started): what run --resume skips",
    )
    doubt.add_argument("path", metavar="PATH")
    doubt.set_defaults(func=_reading(_cmd_in_doubt))

    counts = commands.add_parser("stats", help="counts by status and tool, latency percentiles")
    counts.add_argument("path", metavar="PATH")
    counts.add_argument("--json", action="store_true", help="machine-readable output")
    counts.set_defaults(func=_reading(_cmd_stats))

    show = commands.add_parser(
        "show", help="matching calls as a table, one a line (--json: their records)"
    )
    show.add_argument("path", metavar="PATH")
    show.add_argument(
        "--status",
        help=f"an outcome status, {IN_DOUBT} (the calls in-doubt lists) or {NO_OUTCOME}"
        " (the other calls without an outcome)",
    )
    show.add_argument("--tool", help="only calls of this tool")
    show.add_argument("--call", metavar="ID", help="only this call id")
    show.add_argument("--json", action="store_true", help="the records, as JSON Lines")
    show.set_defaults(func=_reading(_cmd_show))

    picture = commands.add_parser(
        "timeline",
        help="every call as a bar on its worker slot, coloured by status: one self-contained"
        " HTML page (-o), or a PNG of it through headless Chromium (--png)",
    )
    picture.add_argument("path", metavar="PATH")
    picture.add_argument("-o", "--output", metavar="FILE.html", help="write the page here")
    picture.add_argument(
        "--png", metavar="FILE.png", help="render the page to a PNG (needs chromium installed)"
    )
    picture.set_defaults(func=_reading(_cmd_timeline))


def _reading(command: Callable[[argparse.Namespace, JournalScan], int]) -> Command:
    """Read the journal named by ``args.path`` for ``command``; a journal missing is exit 2."""

    def run(args: argparse.Namespace) -> int:
        try:
            if args.journal_command == "timeline" and not _starts_like_journal(args.path):
                # Before parsing: a big file of something else would warn once a line.
                print(f"sandbx-pool journal: {args.path}: not a journal", file=sys.stderr)
                return EXIT_UNREADABLE
            scan = read_journal(args.path)
        except FileNotFoundError:
            print(f"sandbx-pool journal: {args.path}: no such journal", file=sys.stderr)
            return EXIT_UNREADABLE
        except OSError as exc:
            print(f"sandbx-pool journal: {args.path}: {exc.strerror or exc}", file=sys.stderr)
            return EXIT_UNREADABLE
        if args.journal_command == "timeline" and not looks_like_journal(scan):
            print(f"sandbx-pool journal: {args.path}: not a journal", file=sys.stderr)
            return EXIT_UNREADABLE
        _report_damage(scan)
        return command(args, scan)

    return run


def _report_damage(scan: JournalScan) -> None:
    if scan.torn_tail:
        print(f"note: {scan.path}: torn last line ignored", file=sys.stderr)
    if scan.corrupt_lines:
        lines = ", ".join(str(n) for n in scan.corrupt_lines[:10])
        more = "..." if len(scan.corrupt_lines) > 10 else ""
        print(f"note: {scan.path}: corrupt lines skipped: {lines}{more}", file=sys.stderr)


#: How every journal record's line begins (records.py: the tag comes first).
RECORD_START: Final = b'{"kind":'

#: The first line is looked for this far (an intent's arguments are summarised: far less).
FIRST_LINE_BYTES: Final = 1 << 20


def _starts_like_journal(path: str) -> bool:
    """Empty, or its first line is a record (a lone torn line: begins like one). OSError as
    ``open`` raises it. Checked before parsing: a big file of something else would have the
    parser warn once a line."""
    with open(path, "rb") as f:
        head = f.read(FIRST_LINE_BYTES)
    first, newline, _ = head.partition(b"\n")
    if not newline:
        return first == RECORD_START[: len(first)] or first.startswith(RECORD_START)
    try:
        decoder.decode(first)
    except msgspec.DecodeError:
        return False
    return True


def looks_like_journal(scan: JournalScan) -> bool:
    """Not a file of something else: records in it, or no line that failed to parse."""
    return bool(scan.records) or not scan.corrupt_lines


# -- in-doubt --------------------------------------------------------------------------------


def _cmd_in_doubt(args: argparse.Namespace, scan: JournalScan) -> int:
    """One line a call in doubt: id, tool, why, its arguments summarised."""
    calls = in_doubt_calls(scan)
    if not calls:
        print(f"{scan.path}: no calls in doubt", file=sys.stderr)
        return 0
    id_width = max(len(c.call_id) for c in calls)
    tool_width = max(len(c.tool) for c in calls)
    why_width = max(len(c.why) for c in calls)
    for call in calls:
        arguments = describe_args(call.intent.args) if call.intent is not None else ""
        line = (
            f"{call.call_id:<{id_width}}  {call.tool:<{tool_width}}  {call.why:<{why_width}}"
            f"  {arguments}"
        )
        print(line.rstrip())
    return 0


def describe_args(args: dict[str, Any]) -> str:
    """``path='a.txt' content=<1048576 bytes sha256:3f2a...>``: one line, bounded."""
    return " ".join(f"{key}={_describe(value)}" for key, value in args.items())


def _describe(value: Any) -> str:
    if is_digest(value):
        return f"<{value['bytes']} bytes sha256:{str(value['sha256'])[:12]}>"
    if isinstance(value, str):
        text = value if len(value) <= ARG_PREVIEW_CHARS else value[:ARG_PREVIEW_CHARS] + "..."
        return repr(text)
    text = json.dumps(value, default=str)
    return text if len(text) <= ARG_PREVIEW_CHARS else text[:ARG_PREVIEW_CHARS] + "..."


# -- stats -----------------------------------------------------------------------------------


def _cmd_stats(args: argparse.Namespace, scan: JournalScan) -> int:
    summary = stats(scan)
    if args.json:
        print(json.dumps(msgspec.to_builtins(summary), indent=2))
    else:
        print("\n".join(format_stats(scan.path, summary)))
    return 0


def format_stats(path: str, summary: JournalStats) -> list[str]:
    lines = [
        f"journal {path}",
        f"{summary.intents} intents, {summary.outcomes} outcomes, {summary.in_doubt} in doubt",
        "",
    ]
    columns = status_order(summary.by_status)
    header = ["tool", "calls", *columns, IN_DOUBT]
    rows: list[list[str]] = []
    tools = sorted(set(summary.by_tool) | set(summary.by_tool_status))
    for tool in tools:
        statuses = summary.by_tool_status.get(tool, {})
        calls = summary.by_tool.get(tool, 0)
        doubt = summary.in_doubt_by_tool.get(tool, 0)
        rows.append([tool, str(calls), *(str(statuses.get(c, 0)) for c in columns), str(doubt)])
    total = [str(summary.by_status.get(c, 0)) for c in columns]
    rows.append(["all", str(summary.intents), *total, str(summary.in_doubt)])
    lines += text_table(header, rows)
    if summary.latency is not None:
        lines += ["", "latency (s)"]
        latency_rows = [["all", *_latency_cells(summary.latency)]]
        latency_rows += [
            [tool, *_latency_cells(value)] for tool, value in summary.latency_by_tool.items()
        ]
        lines += text_table(["tool", "n", "p50", "p90", "p99", "max"], latency_rows)
    if summary.usage is not None:
        lines += ["", *format_costs(summary.usage)]
    return lines


def _latency_cells(value: Latency) -> list[str]:
    seconds = [value.p50, value.p90, value.p99, value.max]
    return [str(value.count), *(f"{s:.4f}" for s in seconds)]


# -- timeline -------------------------------------------------------------------------------


def _cmd_timeline(args: argparse.Namespace, scan: JournalScan) -> int:
    from sandbx_pool.timeline import ChromiumFailed, ChromiumMissing, write_timeline

    if args.output is None and args.png is None:
        print(
            "sandbx-pool journal timeline: give -o FILE.html, --png FILE.png or both",
            file=sys.stderr,
        )
        return EXIT_UNREADABLE
    try:
        timeline = write_timeline(scan, args.output, args.png)
    except (ChromiumMissing, ChromiumFailed) as exc:
        print(f"sandbx-pool journal timeline: --png: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    except ValueError as exc:
        print(f"sandbx-pool journal timeline: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    except OSError as exc:
        where = exc.filename or args.output or args.png
        print(f"sandbx-pool journal timeline: {where}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    written = " and ".join(name for name in (args.output, args.png) if name is not None)
    print(f"{len(timeline.bars)} calls on {timeline.lanes} slots: {written}", file=sys.stderr)
    return 0


# -- show ------------------------------------------------------------------------------------


def _cmd_show(args: argparse.Namespace, scan: JournalScan) -> int:
    doubts = {call.call_id: call.why for call in in_doubt_calls(scan)}
    records = select(scan, status=args.status, tool=args.tool, call_id=args.call, doubts=doubts)
    if args.json:
        for record in records:
            sys.stdout.write(encoder.encode(record).decode() + "\n")
    else:
        print("\n".join(format_calls(records, doubts)))
        if records:  # stderr: stdout stays the table
            print(
                f"see them all as a picture: sandbx-pool journal timeline {shlex.quote(scan.path)}"
                " -o timeline.html",
                file=sys.stderr,
            )
    return 0


def format_calls(
    records: list[JournalRecord], doubts: Mapping[str, str] | None = None
) -> list[str]:
    """One line a call: id, tool, status, seconds, its arguments, then why it ended so.

    ``doubts``: the calls in doubt and why (``in_doubt_calls``); their status shows as
    ``in_doubt``, their latest outcome (if any) in the detail."""
    doubts = doubts or {}
    calls: dict[str, list[JournalRecord]] = {}
    for record in records:
        calls.setdefault(record.call_id, []).append(record)
    rows = [["call", "tool", "status", "seconds", "args", "detail"]]
    for call_id, parts in calls.items():
        intent = next((r for r in parts if isinstance(r, IntentRecord)), None)
        outcome = _latest_outcome(parts)
        detail = _detail(outcome)
        if call_id in doubts:
            status = IN_DOUBT
            detail = f"in doubt, {doubts[call_id]}" + (f": {detail}" if outcome else "")
        else:
            status = outcome.status if outcome is not None else NO_OUTCOME
        rows.append(
            [
                call_id,
                _tool_of(parts) or "?",
                status,
                f"{outcome.duration_s:.3f}" if outcome is not None else "",
                _clip(describe_args(intent.args)) if intent is not None else "",
                _clip(detail),
            ]
        )
    if len(rows) == 1:
        return ["(no matching calls)"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]


def _detail(outcome: OutcomeRecord | None) -> str:
    if outcome is None:
        return "no outcome: the coordinator stopped before the call ended"
    text = outcome.error or outcome.reason or ""
    return " ".join(text.split())  # one line, however the message was written


def _clip(text: str, width: int = SHOW_CELL_CHARS) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def select(
    scan: JournalScan,
    *,
    status: str | None = None,
    tool: str | None = None,
    call_id: str | None = None,
    doubts: Mapping[str, str] | None = None,
) -> list[JournalRecord]:
    """Every record of the calls matching all the filters, grouped by call, in call order.

    ``status`` ``in_doubt`` matches the calls in doubt (``doubts``, computed when not given),
    ``no_outcome`` the calls without an outcome, any other the latest outcome's status."""
    if status == IN_DOUBT and doubts is None:
        doubts = {call.call_id: call.why for call in in_doubt_calls(scan)}
    calls: dict[str, list[JournalRecord]] = {}
    for record in scan.records:
        calls.setdefault(record.call_id, []).append(record)
    chosen: list[JournalRecord] = []
    for cid, records in calls.items():
        if call_id is not None and cid != call_id:
            continue
        if tool is not None and _tool_of(records) != tool:
            continue
        if status == IN_DOUBT:
            if cid not in (doubts or {}):
                continue
        elif status is not None and _status_of(records) != status:
            continue
        chosen.extend(records)
    return chosen


def _tool_of(records: list[JournalRecord]) -> str | None:
    for record in records:
        if isinstance(record, IntentRecord | OutcomeRecord):
            return record.tool
    return None


def _latest_outcome(records: list[JournalRecord]) -> OutcomeRecord | None:
    return next((r for r in reversed(records) if isinstance(r, OutcomeRecord)), None)


def _status_of(records: list[JournalRecord]) -> str:
    outcome = _latest_outcome(records)
    return outcome.status if outcome is not None else NO_OUTCOME
