"""Section 11: layers, copy-on-write workspaces over a base (sandbx_pool.layers).

Rows, on one pool, over a base of 10,000 small files in 100 directories:

* making a layer over it (``pool.layer(name, base=...)``: a probe worker mounts it, then one
  rename; goal at most 50 ms at p50), against ``cp -a`` and ``cp -a --reflink=auto`` of the
  same tree, what a sample's own copy costs without layers;
* a read and a bash call in a layer against the same call in a plain workspace (the base
  itself): what the overlay's mount adds to every call, in alternating rounds;
* fork (a copy of the layer's upper directory: 100 changed files) and reset (the upper
  directory set aside and removed).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Layer, Pool

BASE_FILES = 10_000
DIRECTORIES = 100
CHANGED = 100
ROUNDS = 4


@dataclass
class LayersResult:
    make: Samples = field(default_factory=Samples)
    cp: Samples = field(default_factory=Samples)
    cp_reflink: Samples = field(default_factory=Samples)
    read_plain: Samples = field(default_factory=Samples)
    read_layer: Samples = field(default_factory=Samples)
    bash_plain: Samples = field(default_factory=Samples)
    bash_layer: Samples = field(default_factory=Samples)
    fork: Samples = field(default_factory=Samples)
    reset: Samples = field(default_factory=Samples)


def _make_base(base: str) -> None:
    for d in range(DIRECTORIES):
        directory = os.path.join(base, f"d{d:03}")
        os.makedirs(directory, exist_ok=True)
        for f in range(BASE_FILES // DIRECTORIES):
            with open(os.path.join(directory, f"f{f:03}.py"), "w") as out:
                out.write(f"# file {d}/{f}\nx = {f}\n")


def run(ws: BenchWorkspace, *, samples: int) -> LayersResult:
    return asyncio.run(_run(ws, samples))


def _copy(base: str, target: str, *flags: str) -> int:
    start = time.perf_counter_ns()
    subprocess.run(["cp", "-a", *flags, base, target], check=True)
    elapsed = time.perf_counter_ns() - start
    shutil.rmtree(target)
    return elapsed


async def _call_ns(pool: Pool, tool: str, args: dict[str, object], ws: Layer | None) -> int:
    start = time.perf_counter_ns()
    outcome = await pool.call(tool, args, workspace=ws)
    elapsed = time.perf_counter_ns() - start
    assert outcome.ok, outcome
    return elapsed


async def _run(ws: BenchWorkspace, samples: int) -> LayersResult:
    result = LayersResult()
    area = ws.workspace / "layers-bench"
    base = str(area / "base")
    await asyncio.to_thread(_make_base, base)
    config = ws.config(pool={"workers": 2}, workspace={"layers": str(area / "store")})
    async with Pool(base, config=config, journal=ws.journal("layers")) as pool:
        warm = await pool.layer("warm", base=base)
        await pool.call("read", {"path": "d000/f000.py"}, workspace=warm)
        for n in range(samples):
            start = time.perf_counter_ns()
            await pool.layer(f"s{n}", base=base)
            result.make.add(time.perf_counter_ns() - start)
        copies = max(3, samples // 10)  # a copy takes far longer: fewer of them
        for n in range(copies):
            target = str(area / f"copy{n}")
            result.cp.add(await asyncio.to_thread(_copy, base, target))
            result.cp_reflink.add(await asyncio.to_thread(_copy, base, target, "--reflink=auto"))
        read = {"path": "d050/f050.py"}
        bash = {"command": "cat d050/f050.py"}
        per_round = max(1, samples // ROUNDS)
        for round_number in range(ROUNDS):
            order = (None, warm) if round_number % 2 == 0 else (warm, None)
            for where in order:
                for _ in range(per_round):
                    taken = await _call_ns(pool, "read", read, where)
                    (result.read_layer if where else result.read_plain).add(taken)
                    taken = await _call_ns(pool, "bash", bash, where)
                    (result.bash_layer if where else result.bash_plain).add(taken)
        changes = f"for i in $(seq {CHANGED}); do echo $i >> d001/f$(printf %03d $i).py; done"
        await pool.call("bash", {"command": changes}, workspace=warm)
        for n in range(max(5, samples // 4)):
            start = time.perf_counter_ns()
            fork = await warm.fork(f"fork{n}")
            result.fork.add(time.perf_counter_ns() - start)
            await pool.call("bash", {"command": changes}, workspace=fork)
            start = time.perf_counter_ns()
            await fork.reset()
            result.reset.add(time.perf_counter_ns() - start)
            await fork.remove()
        for name in [f"s{n}" for n in range(samples)]:
            await (await pool.layer(name)).remove()
        await warm.remove()
    await asyncio.to_thread(shutil.rmtree, area)
    logger.info("layers: {} layers made over {:,} files", result.make.count, BASE_FILES)
    return result
