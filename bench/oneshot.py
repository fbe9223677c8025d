"""Section 6: a one-shot ``sandbx-pool call read`` against ``python -c pass``, as a ratio.

A user's first command is often a single call from a shell: interpreter start, imports, a
pool and its template started, one call, everything closed. Its wall time is measured as a
ratio to the bare interpreter's (``python -c pass``, the same interpreter), in alternating
rounds so that a shared machine's noise falls on both alike. The bar: within 5x (aim: 3x).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace

#: The bar: a one-shot call's p50 within this many times a bare interpreter's.
RATIO_BAR = 5.0


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
            start = time.perf_counter_ns()
            subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, timeout=60)
            samples.add(time.perf_counter_ns() - start)
    logger.info("oneshot: {} calls and {} bare interpreters", call.count, bare.count)
    return OneShotResult(bare, call)
