"""Section ``usage``: what measuring each call's cost (outcome.usage) adds to a call.

Two pools open side by side, one whose template measures (the default) and one started with
``SANDBX_POOL_USAGE=off`` (workers.template.USAGE_ENV: no Meter in the worker, no figures
from wait4 or the cgroup in the template). Calls alternate between them round by round, so a
shared machine's noise falls on both alike, for two calls: a ``read`` (the worker's own
rusage only) and a bash ``true`` (a child reaped, its namespace's pid count read). The
difference of the p50s is the cost, with a 95% interval from resampling whole rounds.

On a loaded machine that difference is noise a few times the bar (0.2 ms), so the section
also times the code that measuring adds, alone, in a loop of this process: in the worker
(the Meter: ns_last_pid opened and read twice, two getrusage, the Usage in the Result's
encoding), in the template (wait4's rusage made a Usage, in Exited's encoding) and in the
coordinator (the Result's decoding, the outcome's dict, the journal record's encoding). Its CPU
time per call is what the bar is judged on: it does not move with the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
from loguru import logger

from bench.stats import Samples, paired_median_ratio_ci
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool
from sandbx_pool.execution import usage_dict
from sandbx_pool.journal.records import OutcomeRecord
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.workers import usage
from sandbx_pool.workers.protocol import Exited, Result, encoder, worker_decoder
from sandbx_pool.workers.template import USAGE_ENV

ROUNDS = 10

#: The calls measured, by row name.
CALLS: dict[str, tuple[str, dict[str, object]]] = {
    "read": ("read", {"path": "data.txt"}),
    "bash true": ("bash", {"command": "true"}),
}

#: The issue's bar: measuring adds no more than this to a call, at p50.
BAR_MS = 0.2

#: Iterations of the timed loop of the measuring code alone.
LOOPS = 2000


@dataclass
class UsageResult:
    #: row name -> (with measuring, without)
    rows: dict[str, tuple[Samples, Samples]] = field(default_factory=dict)
    #: row name -> its rounds, (with, without) durations in ns
    rounds: dict[str, list[tuple[list[int], list[int]]]] = field(default_factory=dict)
    #: CPU ms per call of the code measuring adds, by where it runs
    code_ms: dict[str, float] = field(default_factory=dict)

    def cost_ms(self, name: str) -> float:
        measured, bare = self.rows[name]
        return measured.percentile_ms(50) - bare.percentile_ms(50)

    def cost_ci_ms(self, name: str) -> tuple[float, float]:
        """95% interval of the p50 difference, from the ratio's (whole rounds resampled)."""
        low, high = paired_median_ratio_ci(self.rounds[name])
        bare = self.rows[name][1].percentile_ms(50)
        return (low - 1) * bare, (high - 1) * bare

    @property
    def code_total_ms(self) -> float:
        return sum(self.code_ms.values())

    @property
    def met(self) -> bool:
        return self.code_total_ms <= BAR_MS


def _per_call_ms(work: Callable[[], object]) -> float:
    """CPU milliseconds per run of ``work``, over LOOPS runs (after a few to warm up)."""
    for _ in range(20):
        work()
    start = time.process_time_ns()
    for _ in range(LOOPS):
        work()
    return (time.process_time_ns() - start) / LOOPS / 1e6


def time_measuring_code() -> dict[str, float]:
    """What measuring adds, where it runs, each part timed alone (see the docstring)."""
    result = Result(call_id="c", status="ok", value={"exit_code": 0, "stdout": "", "stderr": ""})

    def worker() -> None:
        fd = os.open("/proc/sys/kernel/ns_last_pid", os.O_RDONLY | os.O_CLOEXEC)
        os.pread(fd, 64, 0)
        meter = usage.Meter(None)
        os.pread(fd, 64, 0)
        os.close(fd)
        encoder.encode(usage.with_usage(result, meter, None))

    def worker_without() -> None:
        encoder.encode(result)

    measured = usage.with_usage(result, usage.Meter(None), None)

    def template() -> None:
        figures = usage.from_wait4(resource.getrusage(resource.RUSAGE_CHILDREN))
        encoder.encode(Exited(pid=1, returncode=0, usage=figures))

    def template_without() -> None:
        encoder.encode(Exited(pid=1, returncode=0))

    with_bytes, without_bytes = encoder.encode(measured), encoder.encode(result)
    json = msgspec.json.Encoder()

    def coordinator(payload: bytes) -> None:
        decoded = worker_decoder.decode(payload)
        assert isinstance(decoded, Result)
        outcome = Outcome(
            call_id="c", tool="bash", status=Status.OK, usage=usage_dict(decoded.usage)
        )
        json.encode(OutcomeRecord.from_outcome(outcome, time=0.0, limit=1024))

    return {
        "worker": _per_call_ms(worker) - _per_call_ms(worker_without),
        "template": _per_call_ms(template) - _per_call_ms(template_without),
        "coordinator": _per_call_ms(lambda: coordinator(with_bytes))
        - _per_call_ms(lambda: coordinator(without_bytes)),
    }


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``name=value`` in our environment while a template starts (it inherits it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def run(ws: BenchWorkspace, *, calls: int) -> UsageResult:
    return asyncio.run(_run(ws, calls))


async def _run(ws: BenchWorkspace, calls: int) -> UsageResult:
    result = UsageResult({name: (Samples(), Samples()) for name in CALLS})
    result.rounds = {name: [] for name in CALLS}
    config = ws.config(pool={"workers": 2})
    per_round = max(1, calls // ROUNDS)
    async with contextlib.AsyncExitStack() as stack:
        measuring = await stack.enter_async_context(
            Pool(ws.workspace, config=config, journal=ws.journal("usage-on"))
        )
        with _environment(USAGE_ENV, "off"):
            bare = await stack.enter_async_context(
                Pool(ws.workspace, config=config, journal=ws.journal("usage-off"))
            )
        for name, (tool, args) in CALLS.items():
            on, off = result.rows[name]
            for pool in (measuring, bare):  # warm up both
                for _ in range(5):
                    await pool.call(tool, args)
            for round_number in range(ROUNDS):
                block: tuple[list[int], list[int]] = ([], [])
                order = ((measuring, on, block[0]), (bare, off, block[1]))
                for pool, times, kept in order if round_number % 2 == 0 else order[::-1]:
                    for _ in range(per_round):
                        start = time.perf_counter_ns()
                        outcome = await pool.call(tool, args)
                        took = time.perf_counter_ns() - start
                        times.add(took)
                        kept.append(took)
                        assert outcome.ok, outcome
                        assert (outcome.usage is not None) == (pool is measuring), outcome
                result.rounds[name].append(block)
    for name in CALLS:
        logger.info("usage: {} {:+.3f} ms at p50", name, result.cost_ms(name))
    result.code_ms = time_measuring_code()
    logger.info("usage: the measuring code alone, {:.4f} ms of CPU a call", result.code_total_ms)
    return result


def table(result: UsageResult) -> str:
    """The report's section."""
    lines = [
        "## Usage: what measuring each call's cost adds to it",
        "",
        "| call | calls | p50 measured | p50 not measured | cost at p50 | 95% interval |",
        "|---|--:|--:|--:|--:|--:|",
    ]
    for name, (on, off) in result.rows.items():
        low, high = result.cost_ci_ms(name)
        lines.append(
            f"| {name} | {on.count} | {on.percentile_ms(50):.3f} ms |"
            f" {off.percentile_ms(50):.3f} ms | {result.cost_ms(name):+.3f} ms |"
            f" {low:+.3f} to {high:+.3f} ms |"
        )
    lines += [
        "",
        "The measuring code alone, CPU per call: "
        + ", ".join(f"{where} {ms:.4f} ms" for where, ms in result.code_ms.items())
        + f"; {result.code_total_ms:.4f} ms in all.",
    ]
    verdict = "met" if result.met else "NOT met"
    lines += [
        "",
        f"Bar: measuring adds no more than {BAR_MS} ms to a call (its code's CPU): {verdict}.",
    ]
    return "\n".join(lines)
