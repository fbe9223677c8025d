"""The Markdown report: one table per section, then the bars of issues 2, 3 and 5.

Printed on stdout (to paste into the README) and written to ``bench/results/latest.md`` and a
dated copy next to it; ``bench/results/`` is git-ignored.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from bench import cancel, executors_report, hung, latency, search, throughput
from bench.cancel import CancelResult
from bench.changes import BIG_MIB, FILES, ChangesResult
from bench.changes import MODES as CHANGE_MODES
from bench.cluster import LOCAL, RAY, ClusterResult
from bench.hung import HungResult
from bench.images import ImagesResult
from bench.images import render as images_table
from bench.images_layer import ImagesLayerResult
from bench.images_layer import render as render_images_layer
from bench.latency import LatencyResult
from bench.layers import BASE_FILES, CHANGED, LayersResult
from bench.network import INDEX_NAME, NetworkResult
from bench.network import MODES as NETWORK_MODES
from bench.oneshot import RATIO_BAR, OneShotResult
from bench.parallel import ParallelResult
from bench.percall import PerCallResult
from bench.procs import Leftovers
from bench.search import SearchResult
from bench.services import ServicesResult
from bench.services import table as services_table
from bench.sessions import COMMAND as SESSION_COMMAND
from bench.sessions import SessionsResult
from bench.soak import KINDS, SoakResult
from bench.stats import Samples
from bench.streaming import IDLE_GAP_S, StreamingResult
from bench.throughput import ConnectionCost, ThroughputResult
from bench.trajectory import TrajectoryResult
from bench.usage import UsageResult
from bench.usage import table as usage_table

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Report:
    started: datetime
    argv: list[str]
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float] = (math.nan, math.nan, math.nan)
    duration_s: float = math.nan
    latency: LatencyResult | None = None
    cancel: CancelResult | None = None
    hung: HungResult | None = None
    throughput: ThroughputResult | None = None
    soak: SoakResult | None = None
    streaming: StreamingResult | None = None
    search: SearchResult | None = None
    cluster: ClusterResult | None = None
    oneshot: OneShotResult | None = None
    changes: ChangesResult | None = None
    layers: LayersResult | None = None
    images: ImagesResult | None = None
    images_layer: ImagesLayerResult | None = None
    sessions: SessionsResult | None = None
    services: ServicesResult | None = None
    network: NetworkResult | None = None
    #: issue 40: per call and 8 in flight against the command executors, and the trajectory
    percall: PerCallResult | None = None
    parallel: ParallelResult | None = None
    trajectory: TrajectoryResult | None = None
    usage: UsageResult | None = None
    final_left: Leftovers | None = None
    #: per section: the share of the machine's CPU used by other processes, and stolen
    others_cpu: dict[str, tuple[float, float]] = field(default_factory=dict)
    #: sections that raised, with the error
    failed: dict[str, str] = field(default_factory=dict)


# -- formatting --------------------------------------------------------------------------------


def ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def times(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.1f}x" if value < 10 else f"{value:.0f}x"


def table(header: Iterable[str], rows: Iterable[Iterable[object]], align: str = "") -> str:
    """A Markdown table; ``align`` gives one letter per column, ``l`` or ``r`` (default r)."""
    head = list(header)
    marks = [
        ":---" if (align[i] if i < len(align) else "r") == "l" else "---:" for i in range(len(head))
    ]
    lines = [f"| {' | '.join(head)} |", f"| {' | '.join(marks)} |"]
    lines += [f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]
    return "\n".join(lines)


def _left(left: Leftovers | None) -> str:
    if left is None:
        return "n/a"
    if not left.at_once:
        return "0"
    live = [p for p in left.after_wait if p.state != "Z"]
    zombies = len(left.after_wait) - len(live)
    text = f"{len(left.at_once)} at once, {len(live)} after {left.waited_s:.1f} s"
    if zombies:
        text += f" (+{zombies} zombies)"
    shown = "; ".join(f"`{p}`" for p in (live or left.at_once)[:3])
    return f"{text}: {shown}"


def _revision() -> str:
    """The commit measured, and whether the working tree differed from it."""
    root = RESULTS.parent.parent

    def git(*args: str) -> str:
        try:
            done = subprocess.run(
                ["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return ""
        return done.stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    changed = [line for line in git("status", "--porcelain").splitlines() if line]
    return f"{commit} + {len(changed)} uncommitted changes" if changed else commit


# -- sections ----------------------------------------------------------------------------------


def _header(report: Report) -> str:
    cpus = os.cpu_count()
    usable = len(os.sched_getaffinity(0))
    load = " / ".join(f"{v:.2f}" for v in report.load_before)
    load_after = " / ".join(f"{v:.2f}" for v in report.load_after)
    containment = report.throughput.memory.containment if report.throughput else "n/a"
    others = ", ".join(
        f"{name} {share:.0%}" + (f" (+{steal:.0%} stolen)" if steal >= 0.005 else "")
        for name, (share, steal) in report.others_cpu.items()
    )
    return (
        f"# sandbx-pool benchmark, {report.started:%Y-%m-%d %H:%M %Z}\n\n"
        f"{cpus} CPUs ({usable} usable) · Python {platform.python_version()} · "
        f"{platform.system()} {platform.release()} · containment: {containment} · "
        f"revision {_revision()} · "
        f"`python -m bench {' '.join(report.argv)}`, {report.duration_s:.0f} s\n\n"
        f"The machine is shared, so figures are noisy. Load average (1/5/15 min) {load} at "
        f"start, {load_after} at end. Share of the machine's CPU time used by other processes "
        f"during each section: {others or 'n/a'}."
    )


def _latency(result: LatencyResult) -> str:
    rows = [
        (
            row.name,
            row.workers or "",
            row.samples.count,
            ms(row.samples.p50),
            ms(row.samples.p99),
            ms(row.samples.mean),
            times(result.speedup(row.key)),
        )
        for row in result.rows
    ]
    header = ("contender", "workers", "n", "p50 ms", "p99 ms", "mean ms", "vs pebble disposable")
    w_row = result.row(latency.PEBBLE_DISPOSABLE_W)
    on = result.row(latency.JOURNAL_ON)
    low, high = result.journal_overhead_ci_pct
    notes = [
        f"Journal overhead at p50 (on / off - 1): **{result.journal_overhead_pct:+.1f}%** "
        f"(95% bootstrap interval {low:+.0f}% to {high:+.0f}%); round by round: "
        + ", ".join(f"{v:+.0f}%" for v in result.journal_overhead_by_round_pct)
        + f". {len(result.rounds)} rounds, each opening a fresh pool of either kind in turn, "
        '`journal={"policy": "off"}` with no path being no journal at all.',
        "Start methods: pebble gets `fork` explicitly (Linux's default before Python 3.14). "
        "`ProcessPoolExecutor(max_tasks_per_child=1)` refuses `fork` (ValueError) and "
        "defaults to `spawn`; `forkserver` is its fastest legal option. Their workers import "
        "only `bench.tasks`, so the rows show the peers' own cost.",
        "Ratio: pebble disposable (1 worker) p50 / the row's p50. pebble with more workers is "
        "bimodal (a call either finds a fresh worker or waits for its 0.1 s manager tick), so "
        "compare means there",
    ]
    if w_row and on:
        notes[-1] += (
            f": pebble disposable ({w_row.workers} workers) mean / sandbx-pool mean = "
            f"{times(w_row.samples.mean / on.samples.mean)}."
        )
    else:
        notes[-1] += "."
    return (
        "## Per-call latency: `read` of a 1 KiB file, one call at a time\n\n"
        + table(header, rows, "l")
        + "\n\n"
        + "\n".join(f"- {note}" for note in notes)
    )


def _cancel(result: CancelResult) -> str:
    rows = []
    for row in result.rows:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(row.statuses.items()))
        rows.append(
            (
                row.name,
                row.kill,
                row.samples.count,
                ms(row.samples.p50),
                ms(row.samples.p95),
                ms(row.samples.p99),
                statuses,
            )
        )
    pebble = result.row(cancel.PEBBLE)
    notes = [
        "sandbx-pool: CancelToken.cancel() to `await pool.call(...)` returning, which happens "
        "once the worker's process group is gone. Each call settles "
        f"{cancel.SETTLE_S['read'] * 1000:.0f} ms (read) or {cancel.SETTLE_S['bash'] * 1000:.0f}"
        " ms (bash) before its cancel so that it is blocked; settling is not measured.",
    ]
    if pebble is not None and pebble.returned is not None:
        notes.append(
            "pebble: future.cancel() to the worker's exit (pidfd). cancel() itself returns in "
            f"{ms(pebble.returned.p50)} ms (p50), with the worker still blocked on the FIFO."
        )
    if result.ppe_cancel_returned is not None:
        notes.append(
            "ProcessPoolExecutor: cancel() of the running task returned "
            f"{result.ppe_cancel_returned}; the task ran on until the FIFO got a writer."
        )
    notes.append(
        f"Processes left after the cancels: {_left(result.left_pool_open)} with the pools "
        f"open and idle, {_left(result.left_after_close)} after closing them."
    )
    header = ("what", "kill", "n", "p50 ms", "p95 ms", "p99 ms", "outcomes")
    return (
        "## Cancel latency\n\n"
        + table(header, rows, "ll")
        + "\n\n"
        + "\n".join(f"- {note}" for note in notes)
    )


def _hung(result: HungResult) -> str:
    title = "## A stop on a hung filesystem\n\n"
    if result.skipped is not None:
        return title + f"Not measured: {result.skipped}."
    rows = []
    for row in result.rows:
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(row.statuses.items()))
        maximum = row.samples.percentile_ms(100)
        rows.append(
            (row.name, row.stop, row.samples.count, ms(row.samples.p50), ms(maximum), statuses)
        )
    header = ("call held by the mount", "stopped by", "n", "p50 ms", "max ms", "outcomes")
    notes = [
        "From the cancel (or the deadline) to `await pool.call(...)` returning, on a FUSE mount "
        "whose reads and lookups never answer: the reader sleeps in state D, where no signal "
        "reaches it, and is quarantined. Default `[calls]` (grace 1 s, kill wait 0.5 s); the bar "
        f"is {hung.BAR_S * 1000:.0f} ms.",
    ]
    return title + table(header, rows, "ll") + "\n\n" + "\n".join(f"- {n}" for n in notes)


def _kib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 1024:.1f} MiB"


def _throughput(result: ThroughputResult) -> str:
    rows = [
        (
            row.name,
            row.workers,
            row.calls,
            f"{row.wall_ns / 1e9:.2f}",
            f"{row.calls_per_s:.0f}",
            ms(row.samples.p50) if row.samples else "",
            ms(row.samples.p99) if row.samples else "",
            ms(row.caller_cpu_ms),
            ms(row.workers_cpu_ms),
        )
        for row in result.rows
    ]
    header = (
        "contender",
        "workers",
        "calls",
        "wall s",
        "calls/s",
        "p50 ms",
        "p99 ms",
        "CPU ms/call: caller",
        "CPU ms/call: workers",
    )
    memory = result.memory
    notes = [
        "The peers keep 16 tasks queued on 8 workers and stop submitting after "
        f"{throughput.PEER_MAX_S:g} s: their call counts are what fitted.",
        "CPU per call from getrusage: the caller over the timed run; the worker processes "
        "(template included) over the pool's life, warm-up calls included. With "
        f"{os.cpu_count()} cores, cores / (caller + workers) bounds calls/s.",
    ]
    if memory.coordinator is not None:
        notes.append(
            f"Coordinator (the bench process) after the sandbx-pool run: RSS "
            f"{_kib(memory.coordinator.rss_kib)}, peak {_kib(memory.coordinator.hwm_kib)}."
        )
    if memory.template is not None:
        notes.append(
            f"Template: RSS {_kib(memory.template.rss_kib)}, PSS {_kib(memory.template.pss_kib)}."
        )
    if memory.idle_workers:
        count = len(memory.idle_workers)
        rss = sum(m.rss_kib for m in memory.idle_workers) // count
        pss_values = [m.pss_kib for m in memory.idle_workers if m.pss_kib is not None]
        pss = sum(pss_values) // len(pss_values) if pss_values else None
        notes.append(
            f"Idle worker (mean of {count}): RSS {_kib(rss)}, PSS {_kib(pss)} "
            "(PSS shares pages with the template and its siblings)."
        )
    return (
        "## Throughput: `read`, 8 calls in flight\n\n"
        + table(header, rows, "l")
        + "\n\n"
        + "\n".join(f"- {note}" for note in notes)
        + _connection(result.connection)
    )


_CONNECTION_NAMES = {
    "zmtp": "ZMTP spoken by the worker (sandbx_pool.workers.zmtp), what the pool does",
    "libzmq": "a libzmq DEALER, with a context (two threads) per worker, as before",
}


def _connection(costs: list[ConnectionCost]) -> str:
    if not costs:
        return ""
    base = next((c for c in costs if c.mode == "libzmq"), None)
    rows = [
        (
            _CONNECTION_NAMES.get(cost.mode, cost.mode),
            cost.cpu.count,
            ms(cost.cpu.p50),
            ms(cost.cpu.percentile_ms(90)),
            f"{cost.faults_mean:.0f}",
            times(base.cpu.p50 / cost.cpu.p50) if base is not None and cost.cpu.p50 else "",
        )
        for cost in costs
    ]
    header = ("worker's connection", "workers", "CPU p50 ms", "CPU p90 ms", "faults", "vs libzmq")
    return (
        "\n\n### A worker's connection to the coordinator\n\n"
        + table(header, rows, "l")
        + "\n\n- Workers forked one after the other from an interpreter loaded like the "
        "template (pyzmq too, for the libzmq row), each serving one read from a libzmq ROUTER "
        "in the bench process; CPU time and page faults per worker from wait4. The rows run "
        "alternately, twice each (`bench/workerconn.py`)."
    )


def _soak(result: SoakResult) -> str:
    rows = []
    for kind in KINDS:
        counts = result.by_kind.get(kind.name)
        if not counts:
            continue
        seen = ", ".join(f"{k} {v}" for k, v in counts.most_common())
        rows.append((kind.name, sum(counts.values()), seen, " / ".join(sorted(kind.expected))))
    checks = [
        (
            "calls made / intents / outcomes",
            f"{result.calls} / {result.intents} / {result.outcomes}",
        ),
        ("intents without an outcome (in doubt)", result.missing),
        ("call ids with more than one outcome", result.duplicated),
        ("outcomes without an intent", result.unmatched),
        ("unexpected statuses", result.unexpected_count),
        ("quarantined workers", result.quarantined),
        ("processes left, pool open and idle", _left(result.left_pool_open)),
        ("processes left after close", _left(result.left_after_close)),
        ("coordinator open fds before / after", f"{result.fds_before} / {result.fds_after}"),
    ]
    text = (
        f"## Soak: {result.calls} calls, 8 in parallel, seed {result.seed}, "
        f"{result.wall_s:.1f} s\n\n"
        + table(("kind", "calls", "statuses", "expected"), rows, "lrll")
        + "\n\n"
        + table(("check", "value"), checks, "lr")
    )
    if result.unexpected:
        text += "\n\nUnexpected: " + "; ".join(f"`{u}`" for u in result.unexpected)
    if result.fds_changed:
        text += "\n\nFile descriptors changed: " + ", ".join(result.fds_changed)
    return text


def _search(result: SearchResult) -> str:
    rows = [
        (f"`{name}`", ms(ours), f"`{peer}`", ms(theirs), f"{ours / theirs:.2f}x")
        for name, (ours, peer, theirs) in result.rows.items()
    ]
    extra = "".join(f"\n\n{name}: {ms(value)} ms" for name, value in result.extra.items())
    return (
        f"## Search: {result.tree_files:,} files, {result.tree_mb:.0f} MB, warm\n\n"
        "Medians in ms; the pool's figure is the whole call (coordinator, worker, rg).\n\n"
        + table(("through the pool", "ms", "alone", "ms", "ratio"), rows, "lrlrr")
        + extra
        + _search_cold(result)
    )


def _search_cold(result: SearchResult) -> str:
    if result.cold_unavailable is not None:
        return f"\n\n### Cold cache\n\nNot measured: {result.cold_unavailable}."
    if not result.cold:
        return ""
    cold = result.cold

    def ratio(ours: str, theirs: str) -> str:
        if ours not in cold or theirs not in cold:
            return "n/a"
        return f"{cold[ours] / cold[theirs]:.2f}x"

    rows = [(f"`{name}`", ms(value)) for name, value in cold.items()]
    ratios = [
        ("grep through the pool / `rg -n`", ratio(search.COLD_GREP, search.COLD_RG)),
        ("`rg -n` / GNU `grep -rn`", ratio(search.COLD_RG, search.COLD_GNU)),
        ("grep through the pool / GNU `grep -rn`", ratio(search.COLD_GREP, search.COLD_GNU)),
        ("find through the pool / `rg --files`", ratio(search.COLD_FIND, search.COLD_RG_FILES)),
    ]
    return (
        f"\n\n### Cold cache\n\nThe page cache dropped before each run; medians of "
        f"{result.cold_runs} rounds, the tools taking turns.\n\n"
        + table(("tool", "ms"), rows, "lr")
        + "\n\n"
        + table(("cold", "ratio"), ratios, "lr")
    )


def _bars(report: Report) -> str:
    rows: list[tuple[str, str, str, str]] = []

    def bar(name: str, target: str, value: str, met: bool | None) -> None:
        rows.append(
            (name, target, value, "unresolved" if met is None else "yes" if met else "**no**")
        )

    lat = report.latency
    if lat is not None:
        p50 = lat.p50(latency.JOURNAL_ON)
        bar("read p50, journal on", "<= 3 ms (goal 1 ms)", ms(p50), p50 <= 3)
        speedup = lat.speedup(latency.JOURNAL_ON)
        bar("read p50 vs pebble disposable", ">= 25x", times(speedup), speedup >= 25)
        overhead = lat.journal_overhead_pct
        low, high = lat.journal_overhead_ci_pct
        value = f"{overhead:+.1f}% ({low:+.0f}% to {high:+.0f}%)"
        # Met, not met, or not resolved by this run: the interval straddles the bar.
        verdict = None if low <= 10 < high else overhead <= 10
        bar("journal overhead at p50 (95% interval)", "<= 10%", value, verdict)
    if report.cancel is not None:
        for row in report.cancel.rows:
            if row.key == cancel.PEBBLE:
                continue
            met = row.samples.p50 <= 5 and row.samples.p95 <= 25
            value = f"{ms(row.samples.p50)} / {ms(row.samples.p95)}"
            bar(f"cancel p50 / p95: {row.key}", "<= 5 / 25 ms", value, met)
        left = report.cancel.left_after_close
        bar("processes left after the cancels", "0", _left(left), left.count == 0)
    if report.hung is not None:
        for hung_row in report.hung.rows:
            worst = hung_row.samples.percentile_ms(100)
            value = f"{ms(hung_row.samples.p50)} / {ms(worst)} ms"
            bar(
                f"hung mount, {hung_row.name}: p50 / max",
                "<= 300 ms",
                value,
                worst <= hung.BAR_S * 1000,
            )
    if report.throughput is not None:
        sandbx = report.throughput.row(throughput.SANDBX)
        if sandbx is not None:
            rate = sandbx.calls_per_s
            bar("calls/s at 8 parallel", ">= 300 (goal 1500)", f"{rate:.0f}", rate >= 300)
    if report.soak is not None:
        soak = report.soak
        bar("soak: outcomes missing", "0", str(soak.missing), soak.missing == 0)
        left_open = soak.left_pool_open
        if left_open is not None:
            bar("soak: left, pool open", "0", _left(left_open), left_open.count == 0)
        left_closed = soak.left_after_close
        if left_closed is not None:
            bar("soak: left after close", "0", _left(left_closed), left_closed.count == 0)
        fds = f"{soak.fds_before} → {soak.fds_after}"
        bar("soak: coordinator fds", "back to start", fds, soak.fds_before == soak.fds_after)
    if report.search is not None:
        for name, (ours, peer, theirs) in report.search.rows.items():
            ratio = ours / theirs
            bar(f"{name} vs {peer}", "<= 1.5x (goal 1.2x)", f"{ratio:.2f}x", ratio <= 1.5)
    if report.oneshot is not None:
        ratio = report.oneshot.ratio
        bar(
            "one-shot call / python -c pass, p50",
            f"<= {RATIO_BAR:g}x",
            f"{ratio:.1f}x",
            ratio <= RATIO_BAR,
        )
    for name, target, value, met in executors_report.bars(report.percall):
        bar(name, target, value, met)
    if report.final_left is not None:
        final = report.final_left
        bar("processes left at the end of the run", "0", _left(final), final.count == 0)
    return "## Bars\n\n" + table(("bar", "target", "measured", "met"), rows, "lrrr")


def _streaming(result: StreamingResult) -> str:
    named = (
        ("bash, no callback", result.plain),
        ("bash, on_output", result.streamed),
        (f"bash, no callback, {IDLE_GAP_S:g} s idle before each call", result.idle),
    )
    rows = [
        (name, str(samples.count), ms(samples.percentile_ms(50)), ms(samples.percentile_ms(95)))
        for name, samples in named
    ]
    return (
        "## Streaming: `echo hi` with and without on_output\n\n"
        + table(("row", "calls", "p50", "p95"), rows, "lrrr")
        + f"\n\nA callback costs {result.cost_pct:+.1f}% at p50. Without one the worker sends"
        " no Output message; compare that row with an earlier commit's (bar: within 5%). The"
        " idle row is a call after the pool had nothing to do, as between an agent's turns."
    )


def _sessions(result: SessionsResult) -> str:
    named = (("bash, no session", result.plain), ("bash, in a session", result.session))
    rows = [
        (name, str(samples.count), ms(samples.percentile_ms(50)), ms(samples.percentile_ms(95)))
        for name, samples in named
    ]
    p50, p95 = result.overhead_ms
    return (
        f"## Sessions: `{SESSION_COMMAND}` with and without a shell session\n\n"
        + table(("row", "calls", "p50", "p95"), rows, "lrrr")
        + f"\n\nA session costs {p50:+.2f} ms at p50 and {p95:+.2f} ms at p95: the wrapper,"
        " the report of its exports at the shell's exit, read and confined in the worker, the state"
        " settled and journaled."
    )


def _cluster(result: ClusterResult) -> str:
    rows = [
        (
            name,
            f"{result.best_rate(name):.0f}",
            ms(result.sequential[name].percentile_ms(50)),
            ms(result.sequential[name].percentile_ms(95)),
        )
        for name in (LOCAL, RAY)
    ]
    nodes = ", ".join(f"{count}" for _, count in sorted(result.calls_per_node.items()))
    return (
        "## Ray: RayPool on a local 2-node cluster against a local Pool (`read`)\n\n"
        + table(
            ("row", f"calls/s at {8} in flight (best round)", "p50, one at a time", "p95"),
            rows,
            "lrrr",
        )
        + f"\n\nRay adds {ms(result.overhead_ms())} ms a call at p50 (the actor call and its result"
        f" object). RayPool's calls per node: {nodes}. Both nodes share this machine's 2 cores."
    )


def _oneshot(result: OneShotResult) -> str:
    named = (("python -c pass", result.bare), ("sandbx-pool call read", result.call))
    rows = [
        (name, str(samples.count), ms(samples.percentile_ms(50)), ms(samples.percentile_ms(95)))
        for name, samples in named
    ]
    return (
        "## One-shot: `sandbx-pool call read` against a bare interpreter\n\n"
        + table(("command", "runs", "p50", "p95"), rows, "lrrr")
        + f"\n\nRatio at p50: {result.ratio:.1f}x (bar: within {RATIO_BAR:g}x)."
    )


def _changes(result: ChangesResult) -> str:
    rows = [
        (
            f"bash `true`, {mode}",
            str(result.true_by_mode[mode].count),
            ms(result.true_by_mode[mode].percentile_ms(50)),
            ms(result.true_by_mode[mode].percentile_ms(95)),
            "" if mode == "direct" else f"{result.extra_ms(mode):+.2f} ms",
        )
        for mode in CHANGE_MODES
    ]
    rows += [
        (f"bash making {FILES:,} files, direct", "1", ms(result.many_direct_ms), "", ""),
        (
            f"bash making {FILES:,} files, tracked (scan + apply)",
            "1",
            ms(result.many_tracked_ms),
            "",
            f"{result.many_tracked_ms - result.many_direct_ms:+.0f} ms",
        ),
        (f"undo of those {FILES:,} files", "1", ms(result.undo_ms), "", ""),
        (f"one byte of a {BIG_MIB} MiB file, direct", "1", ms(result.big_direct_ms), "", ""),
        (
            f"one byte of a {BIG_MIB} MiB file, tracked (copy-up, pre-image, apply)",
            "1",
            ms(result.big_tracked_ms),
            "",
            f"{result.big_tracked_ms - result.big_direct_ms:+.0f} ms",
        ),
    ]
    return (
        "## Changes: what tracking a call's changes costs\n\n"
        + table(("row", "calls", "p50", "p95", "over direct"), rows, "lrrrr")
        + "\n\nTracked and transactional calls run on an overlay of the workspace and a"
        " second worker scans and applies its upper directory (docs/design.md, what a call"
        " changes); the goal for `true` was at most 1 ms over direct."
    )


def _layers(result: LayersResult) -> str:
    def row(name: str, samples: Samples) -> tuple[str, str, str, str]:
        return (
            name,
            str(samples.count),
            ms(samples.percentile_ms(50)),
            ms(samples.percentile_ms(95)),
        )

    rows = [
        row(f"make a layer over {BASE_FILES:,} files (`pool.layer`)", result.make),
        row(f"`cp -a` of the same {BASE_FILES:,} files", result.cp),
        row("`cp -a --reflink=auto` of them", result.cp_reflink),
        row("read, plain workspace", result.read_plain),
        row("read, in a layer", result.read_layer),
        row("bash `cat`, plain workspace", result.bash_plain),
        row("bash `cat`, in a layer", result.bash_layer),
        row(f"fork a layer ({CHANGED} files changed)", result.fork),
        row(f"reset a layer ({CHANGED} files changed)", result.reset),
    ]
    return (
        "## Layers: a sample's own copy-on-write workspace\n\n"
        + table(("row", "n", "p50", "p95"), rows, "lrrr")
        + "\n\nA layer is an overlay (lower = the base, read only) each call mounts in its own"
        " mount namespace (docs/design.md, layers); the goal for making one was at most 50 ms."
    )


def network_table(result: NetworkResult) -> str:
    rows = [
        (
            f"bash `true`, network = {mode}",
            str(result.true_by_mode[mode].count),
            ms(result.true_by_mode[mode].p50),
            ms(result.true_by_mode[mode].p95),
            "" if mode == "true" else f"{result.extra_ms(mode):+.2f} ms",
        )
        for mode in NETWORK_MODES
    ]
    proxied_extra = result.pip_proxied.p50 - result.pip_direct.p50
    rows += [
        (
            "`pip download` of a wheel, direct (network = true, by address)",
            str(result.pip_direct.count),
            ms(result.pip_direct.p50),
            ms(result.pip_direct.p95),
            "",
        ),
        (
            f"`pip download` of a wheel, through the proxy ({INDEX_NAME} allowed)",
            str(result.pip_proxied.count),
            ms(result.pip_proxied.p50),
            ms(result.pip_proxied.p95),
            f"{proxied_extra:+.1f} ms",
        ),
    ]
    return (
        "## Network: what the allow-list costs\n\n"
        + table(("row", "calls", "p50", "p95", "over network = true"), rows, "lrrrr")
        + "\n\nAn allow-listed bash call gets a network namespace of its own, loopback brought"
        " up, and a listening socket registered with the pool's proxy (docs/security.md); the"
        " index is a local one on the host's loopback, so the download rows compare the paths,"
        " not an internet connection."
    )


def render(report: Report) -> str:
    parts = [_header(report)]
    if report.percall is not None:
        parts.append(executors_report.percall_section(report.percall))
    if report.latency is not None:
        parts.append(_latency(report.latency))
    if report.cancel is not None:
        parts.append(_cancel(report.cancel))
    if report.hung is not None:
        parts.append(_hung(report.hung))
    if report.throughput is not None:
        parts.append(_throughput(report.throughput))
    if report.parallel is not None:
        parts.append(executors_report.parallel_section(report.parallel))
    if report.soak is not None:
        parts.append(_soak(report.soak))
    if report.streaming is not None:
        parts.append(_streaming(report.streaming))
    if report.search is not None:
        parts.append(_search(report.search))
    if report.cluster is not None:
        parts.append(_cluster(report.cluster))
    if report.oneshot is not None:
        parts.append(_oneshot(report.oneshot))
    if report.changes is not None:
        parts.append(_changes(report.changes))
    if report.layers is not None:
        parts.append(_layers(report.layers))
    if report.images_layer is not None:
        parts.append(render_images_layer(report.images_layer, table, ms))
    if report.sessions is not None:
        parts.append(_sessions(report.sessions))
    if report.network is not None:
        parts.append(network_table(report.network))
    if report.services is not None:
        parts.append(services_table(report.services))
    if report.trajectory is not None:
        parts.append(executors_report.trajectory_section(report.trajectory))
    if report.images is not None:
        parts.append(images_table(report.images))
    if report.usage is not None:
        parts.append(usage_table(report.usage))
    for section, error in report.failed.items():
        parts.append(f"## {section}: FAILED\n\n`{error}`")
    parts.append(_bars(report))
    return "\n\n".join(parts) + "\n"


def write(text: str, started: datetime) -> Path:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{started:%Y%m%d-%H%M%S}.md").write_text(text)
    latest = RESULTS / "latest.md"
    latest.write_text(text)
    return latest


def emit(report: Report) -> None:
    text = render(report)
    path = write(text, report.started)
    sys.stdout.write(text)
    sys.stdout.flush()
    print(f"(written to {path})", file=sys.stderr)
