"""The Markdown of issue 40's comparisons with the command executors, and their bars.

Three tables, each from one section of the run: per call in turns (``bench.percall``, in the
latency section), 8 in flight (``bench.parallel``, in the throughput section) and the 40-call
trajectory (``bench.trajectory``). Every ratio is between rows of the same run: on this shared
machine a figure moves from run to run, a ratio much less.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from bench import parallel, percall, trajectory
from bench.parallel import ParallelResult
from bench.percall import BARE, BWRAP, ECHO, LAYER, OPERATIONS, PLAIN, READ, TRUE, PerCallResult
from bench.trajectory import TrajectoryResult

#: (bar, target, measured, met): rows of the report's table of bars.
Bar = tuple[str, str, str, bool | None]

#: The contenders as the ratio rows name them.
SHORT = {PLAIN: "pool, plain", LAYER: "pool, in a layer", BARE: "bare subprocess", BWRAP: "bwrap"}


def _ms(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _times(value: float) -> str:
    return "n/a" if math.isnan(value) else f"{value:.2f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    marks = [":---", *["---:"] * (len(header) - 1)]
    lines = [f"| {' | '.join(header)} |", f"| {' | '.join(marks)} |"]
    return "\n".join([*lines, *(f"| {' | '.join(row)} |" for row in rows)])


def percall_section(result: PerCallResult) -> str:
    header = ["contender"]
    for operation in OPERATIONS:
        header += [f"{operation} p50 ms", "p90 ms"]
    rows = []
    for key in result.contenders:
        row = [percall.NAMES[key]]
        for operation in OPERATIONS:
            row += [_ms(result.p50(key, operation)), _ms(result.p90(key, operation))]
        rows.append(row)
    pools = [key for key in (PLAIN, LAYER) if key in result.contenders]
    ratios = []
    for pool in pools:
        for peer in (BWRAP, BARE):
            ratios.append(
                [f"{SHORT[pool]} / {SHORT[peer]}"]
                + [_times(result.ratio(pool, peer, op)) for op in OPERATIONS]
            )
    for pool in pools:
        value = _times(result.ratio(pool, BARE, READ, TRUE))
        ratios.append([f"{SHORT[pool]}: its read / bare bash `true`", "", "", value])
    if LAYER in pools:
        ratios.append(
            ["in a layer minus plain workspace, ms"]
            + [f"{result.layer_extra_ms(op):+.2f}" for op in OPERATIONS]
        )
    samples = next(iter(result.samples.values())).count if result.samples else 0
    text = (
        "## Per call: bash and read against the command executors (issue 40)\n\n"
        f"One call at a time, {result.rounds} rounds in turns, {samples} calls of each "
        "operation per contender. A command executor's read is `cat data.txt` (mini-swe-agent's "
        "through its shell); the bubblewrap line is the issue's: `bwrap --ro-bind / / --dev /dev "
        "--proc /proc --unshare-all --die-with-parent --new-session --chdir DIR bash -c ...`.\n\n"
        + _table(header, rows)
        + "\n\n"
        + _table(["p50 ratio", *OPERATIONS], ratios)
    )
    if result.layer_unavailable:
        text += f"\n\nNo layer row: {result.layer_unavailable}"
    return text


def parallel_section(result: ParallelResult) -> str:
    header = ["contender", *(f"{op} calls/s" for op in parallel.OPERATIONS)]
    rows = [
        [parallel.NAMES[key], *(f"{result.calls_per_s(key, op):.0f}" for op in parallel.OPERATIONS)]
        for key in result.contenders
    ]
    for peer in (BARE, BWRAP):
        rows.append(
            [f"sandbx-pool / {SHORT[peer]}"]
            + [
                _times(result.calls_per_s(parallel.POOL, op) / result.calls_per_s(peer, op))
                for op in parallel.OPERATIONS
            ]
        )
    calls = ", ".join(
        f"{parallel.NAMES[key]} {sum(result.totals[key, op][0] for op in parallel.OPERATIONS)}"
        for key in result.contenders
    )
    return (
        f"### {parallel.PARALLEL} in flight, against the command executors (issue 40)\n\n"
        f"{parallel.ROUNDS} rounds, the order reversed in the second; the peers run "
        f"{parallel.PARALLEL} threads of one command after another. Calls made: {calls}.\n\n"
        + _table(header, rows)
    )


def _ratio_and_range(result: TrajectoryResult, executor: str, peer: str) -> str:
    if executor == peer:
        return "1x"
    low, high = result.small_ratio_range(executor, peer)
    median = _times(result.small_ratio(executor, peer))
    return median if low == high else f"{median} ({_times(low)}-{_times(high)})"


def trajectory_section(result: TrajectoryResult) -> str:
    header = [
        "executor",
        "runs",
        "40 calls, s",
        f"{result.steps - 1} small calls, ms",
        "test run, ms",
        "small calls vs mini-swe-agent",
        "vs bubblewrap",
    ]
    rows = [
        [
            trajectory.NAMES[key],
            str(result.rounds(key)),
            f"{result.total_s(key):.2f}",
            _ms(result.small_ms(key)),
            _ms(result.tests_ms(key)),
            _ratio_and_range(result, key, trajectory.MINI),
            _ratio_and_range(result, key, trajectory.BWRAP),
        ]
        for key in result.executors
        if result.rounds(key)
    ]
    text = (
        f"## Trajectory: {result.steps} calls of a coding agent over {result.source}\n\n"
        "read, grep, find, edit and bash over the repository's source, ending with its own "
        f"tests (`{result.tests}`, in a venv of their own); each executor on a fresh copy, taking "
        "turns call by call; medians over the rounds, and in brackets the range of the small-call "
        "ratio between two runs of one round (`bench/trajectory.py`).\n\n" + _table(header, rows)
    )
    if result.layer_unavailable:
        text += f"\n\nNo layer row: {result.layer_unavailable}"
    return text


def bars(percall_result: PerCallResult | None) -> list[Bar]:
    """Issue 40's goals, where this run measured them (the trajectory has none: its table)."""
    found: list[Bar] = []

    def bar(name: str, target: str, value: float, show: Callable[[float], str], met: bool) -> None:
        found.append((name, target, show(value), None if math.isnan(value) else met))

    if percall_result is not None:
        r = percall_result
        for op in (TRUE, ECHO):
            value = r.ratio(PLAIN, BWRAP, op)
            bar(f"{op} p50 / bubblewrap's", "<= 0.8x", value, _times, value <= 0.8)
            value = r.ratio(PLAIN, BARE, op)
            bar(f"{op} p50 / a bare subprocess's", "<= 2x", value, _times, value <= 2)
        value = r.p50(PLAIN, READ)
        bar("read 1 KiB p50", "<= 1 ms (quiet machine)", value, _ms, value <= 1)
        value = r.ratio(PLAIN, BARE, READ, TRUE)
        bar("read 1 KiB p50 / bare bash `true`'s", "<= 0.6x", value, _times, value <= 0.6)
        if LAYER in r.contenders:
            for op in (TRUE, READ):
                value = r.layer_extra_ms(op)
                bar(f"{op} in a layer minus plain, p50", "<= 0.5 ms", value, _ms, value <= 0.5)
    return found
