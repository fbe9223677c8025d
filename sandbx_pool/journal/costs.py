"""What a batch of calls cost: totals of their ``usage``, and the calls that cost the most.

One summary for both ends: ``journal stats`` builds it from the outcome records of a
journal, ``run``'s summary from the outcomes it holds (the same field: Outcome.usage, copied
whole into OutcomeRecord.usage). Calls without figures (never started, quarantined, or
journaled before usage was recorded) are counted apart, never as zero.

Peak memory does not add up the way CPU does: two calls that each held 200 MiB, one after the
other, never held 400 MiB at once. The summary gives the largest call's peak, and the sum of
the peaks as an upper bound of what the batch could have held with every call in flight.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

#: How many calls each "top" list keeps.
TOP_CALLS = 5

MiB = 1024 * 1024


class CostlyCall(msgspec.Struct, frozen=True, kw_only=True):
    call_id: str
    tool: str
    status: str
    cpu_s: float
    max_rss_bytes: int


class CostTotals(msgspec.Struct, frozen=True, kw_only=True):
    """The sums over ``measured`` calls (``unmeasured``: outcomes without figures)."""

    measured: int
    unmeasured: int
    cpu_user_s: float
    cpu_system_s: float
    read_bytes: int
    write_bytes: int
    largest_rss_bytes: int
    sum_rss_bytes: int
    #: How many measured calls had each source ("cgroup", "rusage").
    sources: dict[str, int]
    top_cpu: list[CostlyCall]
    top_memory: list[CostlyCall]

    @property
    def cpu_s(self) -> float:
        return self.cpu_user_s + self.cpu_system_s


def cpu_s(usage: dict[str, Any]) -> float:
    """A call's CPU seconds, user and system."""
    return float(usage.get("cpu_user_s", 0.0)) + float(usage.get("cpu_system_s", 0.0))


def totals(calls: Iterable[tuple[str, str, str, dict[str, Any] | None]]) -> CostTotals:
    """The totals of ``calls``: (call_id, tool, status, usage) each."""
    measured: list[CostlyCall] = []
    unmeasured = 0
    user = system = 0.0
    read = written = 0
    sources: dict[str, int] = {}
    for call_id, tool, status, usage in calls:
        if not usage:
            unmeasured += 1
            continue
        user += float(usage.get("cpu_user_s", 0.0))
        system += float(usage.get("cpu_system_s", 0.0))
        read += int(usage.get("read_bytes", 0))
        written += int(usage.get("write_bytes", 0))
        source = str(usage.get("source", "rusage"))
        sources[source] = sources.get(source, 0) + 1
        measured.append(
            CostlyCall(
                call_id=call_id,
                tool=tool,
                status=status,
                cpu_s=round(cpu_s(usage), 6),
                max_rss_bytes=int(usage.get("max_rss_bytes", 0)),
            )
        )
    rss = [call.max_rss_bytes for call in measured]
    return CostTotals(
        measured=len(measured),
        unmeasured=unmeasured,
        cpu_user_s=round(user, 6),
        cpu_system_s=round(system, 6),
        read_bytes=read,
        write_bytes=written,
        largest_rss_bytes=max(rss, default=0),
        sum_rss_bytes=sum(rss),
        sources=dict(sorted(sources.items())),
        top_cpu=sorted(measured, key=lambda call: call.cpu_s, reverse=True)[:TOP_CALLS],
        top_memory=sorted(measured, key=lambda call: call.max_rss_bytes, reverse=True)[:TOP_CALLS],
    )


def mib(value: int) -> str:
    return f"{value / MiB:.1f} MiB"


def summary_line(total: CostTotals) -> str:
    """One line: CPU and peak-memory totals (``run``'s summary, ``journal stats``' header)."""
    line = (
        f"cpu {total.cpu_s:.3f} s (user {total.cpu_user_s:.3f}, system"
        f" {total.cpu_system_s:.3f}); peak memory: largest call {mib(total.largest_rss_bytes)},"
        f" sum of calls' peaks {mib(total.sum_rss_bytes)}"
    )
    if total.unmeasured:
        line += f"; {total.unmeasured} call(s) without figures"
    return line


def format_costs(total: CostTotals) -> list[str]:
    """``journal stats``' section: totals, then the calls with the most CPU and memory."""
    if not total.measured:
        return []
    sources = ", ".join(f"{count} {source}" for source, count in total.sources.items())
    lines = [
        f"usage of {total.measured} call(s) ({sources})",
        "  " + summary_line(total),
        f"  storage: read {mib(total.read_bytes)}, written {mib(total.write_bytes)}",
        "",
        f"most CPU ({len(total.top_cpu)}):",
    ]
    lines += [_row(call) for call in total.top_cpu]
    lines += ["", f"largest peak memory ({len(total.top_memory)}):"]
    lines += [_row(call) for call in total.top_memory]
    return lines


def _row(call: CostlyCall) -> str:
    return (
        f"  {call.cpu_s:9.3f} s  {mib(call.max_rss_bytes):>11}  {call.tool:<5} "
        f"{call.status:<9} {call.call_id}"
    )
