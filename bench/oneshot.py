"""Section 6: a one-shot ``sandbx-pool call read`` against ``python -c pass``, as a ratio.

A user's first command is often a single call from a shell: interpreter start, imports, a
pool and its template started, one call, everything closed. Its wall time is measured as a
ratio to the bare interpreter's (``python -c pass``, the same interpreter), in alternating
rounds so that a shared machine's noise falls on both alike. The bar: within 5x (aim: 3x).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace

#: The bar: a one-shot call's p50 within this many times a bare interpreter's.
RATIO_BAR = 5.0


#: A command that takes longer has hung: the section fails rather than waits.
TIMEOUT_S = 60.0


def wall_ns(argv: list[str], timeout_s: float) -> int:
    """Nanoseconds from the start of ``argv`` to its exit, which a pidfd reports at once.

    Not ``subprocess.run(..., timeout=)``: with a timeout, ``Popen.wait`` polls with sleeps
    that double from 0.5 ms up to 50 ms, so it saw an exit only at 31.5, 63.5, 113.5, 163.5 ms
    and so on after the start. Every figure this section gave before was one of those steps
    (``python -c pass`` "32.1" or "64.7", a call "165" or "269"), and so was their ratio."""
    start = time.perf_counter_ns()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    pidfd = os.pidfd_open(proc.pid)
    try:
        exited, _, _ = select.select([pidfd], [], [], timeout_s)
        elapsed = time.perf_counter_ns() - start
    finally:
        os.close(pidfd)
    if not exited:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(argv, timeout_s)
    if proc.wait() != 0:  # reaps at once: it has exited
        raise subprocess.CalledProcessError(proc.returncode, argv)
    return elapsed


@dataclass
class OneShotResult:
    bare: Samples
    call: Samples

    @property
    def ratio(self) -> float:
        return self.call.percentile_ms(50) / self.bare.percentile_ms(50)


def run(ws: BenchWorkspace, *, runs: int) -> OneShotResult:
    bare, call = Samples(), Samples()
    path = os.path.join(ws.workspace, "oneshot.txt")
    with open(path, "w") as f:
        f.write("hello\n")
    commands = (
        (bare, [sys.executable, "-c", "pass"]),
        (
            call,
            [
                *(sys.executable, "-m", "sandbx_pool.cli", "call", "read", "path=oneshot.txt"),
                *("--workspace", ws.workspace, "--journal", ws.journal("oneshot")),
            ],
        ),
    )
    for round_number in range(runs):
        order = commands if round_number % 2 == 0 else commands[::-1]
        for samples, argv in order:
            samples.add(wall_ns(argv, TIMEOUT_S))
    logger.info("oneshot: {} calls and {} bare interpreters", call.count, bare.count)
    return OneShotResult(bare, call)
