"""``make soak``: the fault soak. One pool, 10,000 calls, and every fault a batch run meets.

    plan (seeded) --> 8 loops --> Pool.call ... --> Outcome per call
        while:  cancels (token, asyncio task), timeouts, worker SIGKILLs from outside,
                fork bombs (under [limits] processes), arguments that cannot be encoded,
                a full journal disk for a while (root: the journal is on a small tmpfs),
                descriptor pressure for a while (this process's descriptors taken up to
                a few dozen under its limit)
        sampled every 0.25 s: this process's open descriptors
    then, after close:
        outcomes lost          calls whose pool.call raised instead of returning an Outcome
                               (a task the soak cancelled itself excepted), and intents the
                               journal holds without an outcome
        duplicated outcomes    call ids with more than one outcome in the journal
        duplicated side effects appends (bash ``echo ID >> appends.log``) found twice
        appends lost           an ``ok`` append whose line is not in the file
        processes left         ours, pool open (idle) and after close
        temp files left        the pool's scratch and lock directories, write temp files
        descriptors            at start, at end, and the highest sample

Every count must be 0 and the descriptor count back where it started; ``main`` exits 1
otherwise. The figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import resource
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from bench import procs
from bench.procs import leftovers
from bench.workspace import MARKER, BenchWorkspace, bench_workspace
from sandbx_pool import CancelToken, Pool
from sandbx_pool.journal.reader import interrupted, read_journal
from sandbx_pool.journal.records import IntentRecord, OutcomeRecord
from sandbx_pool.workers.tools.atomic import TEMP_MARKER

PARALLEL = 8
#: The soak's own descriptor limit (soft and hard): low enough that the pressure window is real.
FD_LIMIT = 1024
#: Descriptors left free while the pressure window lasts.
FD_HEADROOM = 48
#: Size of the journal's tmpfs (root only), and what the filler leaves free.
JOURNAL_FS_MB = 64
FILLED_LEFT_BYTES = 4096

#: What each call is, by weight.
KINDS: dict[str, int] = {
    "read": 36,
    "write": 10,
    "append": 16,  # bash echo ID >> appends.log: the side effect a resume must not repeat
    "bash timeout": 8,
    "read fifo, token cancel": 8,
    "bash, token cancel": 6,
    "bash, worker SIGKILL": 6,
    "bash, task cancel": 4,
    "unencodable argument": 4,
    "fork bomb": 0,  # placed by hand: a few, spread over the run
}
FORK_BOMBS = 3


@dataclass
class FaultSoak:
    calls: int
    seed: int
    wall_s: float = 0.0
    statuses: dict[str, Counter[str]] = field(default_factory=dict)
    raised: list[str] = field(default_factory=list)  # outcomes lost
    appends_ok: set[int] = field(default_factory=set)
    journal_refusals: int = 0  # side effects refused while the journal's disk was full
    intents: int = 0
    without_outcome: int = 0  # intents with no outcome (interrupted)
    duplicated_outcomes: int = 0
    duplicated_appends: int = 0
    lost_appends: int = 0
    left_open: int = 0
    left_closed: int = 0
    temp_left: list[str] = field(default_factory=list)
    fds_start: int = 0
    fds_end: int = 0
    fds_peak: int = 0
    fd_samples: list[tuple[float, int]] = field(default_factory=list)
    disk_full: bool = False
    notes: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        checks = {
            "outcomes lost": len(self.raised) + self.without_outcome,
            "duplicated outcomes": self.duplicated_outcomes,
            "duplicated side effects": self.duplicated_appends,
            "appends lost": self.lost_appends,
            "processes left (pool open)": self.left_open,
            "processes left (closed)": self.left_closed,
            "temp files left": len(self.temp_left),
            "descriptors not back": self.fds_end - self.fds_start,
        }
        return [f"{name}: {value}" for name, value in checks.items() if value]


def plan(calls: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    kinds = [k for k in KINDS if KINDS[k]]
    chosen = rng.choices(kinds, weights=[KINDS[k] for k in kinds], k=calls)
    for n in range(FORK_BOMBS):
        chosen[(n + 1) * calls // (FORK_BOMBS + 1)] = "fork bomb"
    return chosen


async def _one(pool: Pool, index: int, kind: str, rng: random.Random, soak: FaultSoak) -> None:
    call_id = f"c{index}"
    token: CancelToken | None = None
    timeout = 30.0
    tool, args = "read", {"path": "data.txt"}
    if kind == "write":
        tool, args = "write", {"path": f"soak/{index % 97}.txt", "content": f"{index}\n" * 64}
    elif kind == "append":
        tool, args = "bash", {"command": f"echo {index} >> appends.log"}
    elif kind == "bash timeout":
        tool, args, timeout = "bash", {"command": "sleep 1000"}, rng.uniform(0.02, 0.2)
    elif kind == "read fifo, token cancel":
        tool, args, token = "read", {"path": "fifo"}, CancelToken()
    elif kind in ("bash, token cancel", "bash, worker SIGKILL", "bash, task cancel"):
        tool, args = "bash", {"command": "sleep 1000"}
        token = CancelToken() if kind == "bash, token cancel" else None
    elif kind == "unencodable argument":
        tool, args = "read", {"path": "bad\udcffname"}
    elif kind == "fork bomb":
        tool, args, timeout = "bash", {"command": ":(){ :|:& };:"}, 3.0
    task = asyncio.create_task(
        pool.call(tool, args, timeout=timeout, cancel=token, call_id=call_id)
    )
    if kind in ("read fifo, token cancel", "bash, token cancel", "bash, task cancel"):
        await asyncio.sleep(rng.uniform(0.0, 0.05))
        if token is not None:
            token.cancel("soak")
        else:
            task.cancel()
    elif kind == "bash, worker SIGKILL":
        await _kill_worker_of(pool, call_id, task)
    await asyncio.wait([task])
    if task.cancelled():
        status = "task cancelled" if kind == "bash, task cancel" else "LOST: cancelled"
        if kind != "bash, task cancel":
            soak.raised.append(f"{call_id} {kind}: cancelled")
    elif (error := task.exception()) is not None:
        status = "LOST: raised"
        soak.raised.append(f"{call_id} {kind}: {type(error).__name__}: {error}")
    else:
        outcome = task.result()
        status = str(outcome.status)
        if kind == "append" and status == "ok":
            soak.appends_ok.add(index)
        if outcome.error and "journal" in outcome.error and not outcome.started:
            soak.journal_refusals += 1
    soak.statuses.setdefault(kind, Counter())[status] += 1


async def _kill_worker_of(pool: Pool, call_id: str, task: asyncio.Task[object]) -> None:
    """SIGKILL the worker running ``call_id`` from outside, once it has one (bounded wait)."""
    deadline = time.monotonic() + 5.0
    while not task.done() and time.monotonic() < deadline:
        for running in pool.running():
            if running["call_id"] == call_id:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(running["pid"], signal.SIGKILL)
                return
        await asyncio.sleep(0.002)  # another process's state: nothing to await


@contextlib.contextmanager
def journal_disk(root: Path) -> object:
    """A small tmpfs for the journal (root only), so that it can be filled; else a directory."""
    directory = root / "journal-disk"
    directory.mkdir()
    mounted = False
    if os.geteuid() == 0:
        size = f"size={JOURNAL_FS_MB}m"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", size, "soak-journal", str(directory)],
            capture_output=True,
            check=False,
        )
        mounted = done.returncode == 0
    try:
        yield directory, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(directory)], check=False)


def _fill(directory: Path) -> Path:
    """Take all but FILLED_LEFT_BYTES of the journal's filesystem."""
    filler = directory / "filler"
    stats = os.statvfs(directory)
    free = stats.f_bavail * stats.f_frsize - FILLED_LEFT_BYTES
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        chunk = b"\0" * (1 << 20)
        while free > 0:
            free -= f.write(chunk[: max(1, min(len(chunk), free))])
    return filler


async def _faults(soak: FaultSoak, journal_dir: Path, mounted: bool, done: list[int]) -> None:
    """The timed faults, keyed to how far the run is: a full journal disk from 30% to 40% of
    the calls, descriptor pressure from 60% to 70%."""
    n = soak.calls
    filler: Path | None = None
    held: list[int] = []

    async def until(fraction: float) -> None:
        while done[0] < fraction * n:  # noqa: ASYNC110 (a count the loops bump, polled coarsely)
            await asyncio.sleep(0.05)

    await until(0.3)
    if mounted:
        filler = _fill(journal_dir)
        soak.disk_full = True
    await until(0.4)
    if filler is not None:
        filler.unlink()
    await until(0.6)
    with contextlib.suppress(OSError):
        while procs.fd_count() < FD_LIMIT - FD_HEADROOM:
            held.append(os.open("/dev/null", os.O_RDONLY))
    await until(0.7)
    for fd in held:
        os.close(fd)


async def _sample_fds(soak: FaultSoak, start: float) -> None:
    while True:
        soak.fd_samples.append((time.perf_counter() - start, procs.fd_count()))
        await asyncio.sleep(0.25)


def _pool_directories(pool: Pool) -> list[str]:
    """The scratch, lock and runtime directories this pool made (the machine is shared: other
    pools' come and go meanwhile, so only ours are checked)."""
    made = [pool.tmp_root, pool.lock_dir, pool.runtime_dir]
    return [path for path in made if path is not None]


async def _soak(ws: BenchWorkspace, calls: int, seed: int) -> FaultSoak:
    soak = FaultSoak(calls=calls, seed=seed)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT))
    config = ws.config(limits={"processes": 128})
    # A first pool, so that what the first pool of a process keeps for good is not a leak.
    async with Pool(ws.workspace, config=ws.config(journal={"policy": "off"})) as warm:
        await warm.call("read", {"path": "data.txt"}, timeout=30)
    soak.fds_start = procs.fd_count()
    rng = random.Random(seed + 1)
    todo = iter(enumerate(plan(calls, seed)))
    done = [0]
    with journal_disk(ws.root) as (journal_dir, mounted):
        journal = journal_dir / "soak.jsonl"
        if not mounted:
            soak.notes.append("not root: no full-disk window (the journal is on the work disk)")
        start = time.perf_counter()
        sampler = asyncio.create_task(_sample_fds(soak, start))
        async with Pool(ws.workspace, workers=PARALLEL, journal=journal, config=config) as pool:
            faults = asyncio.create_task(_faults(soak, journal_dir, mounted, done))

            async def loop() -> None:
                for index, kind in todo:  # shared: each loop takes the next planned call
                    await _one(pool, index, kind, rng, soak)
                    done[0] += 1

            async with asyncio.TaskGroup() as group:
                for _ in range(PARALLEL):
                    group.create_task(loop())
            await faults
            soak.wall_s = time.perf_counter() - start
            soak.left_open = leftovers(MARKER, ws.marker, pool_open=True).count
            directories = _pool_directories(pool)
        soak.left_closed = leftovers(MARKER, ws.marker).count
        sampler.cancel()
        await asyncio.wait([sampler])
        soak.fds_end = procs.fd_count()
        soak.fds_peak = max(count for _, count in soak.fd_samples)
        _account_journal(journal, soak)
    _account_appends(ws.workspace / "appends.log", soak)
    soak.temp_left = _left_behind(directories, ws.workspace)
    return soak


def _left_behind(directories: list[str], workspace: Path) -> list[str]:
    """Our pool's directories still there, and write temp files in the workspace."""
    left = [path for path in directories if os.path.exists(path)]
    return left + [str(p) for p in workspace.rglob(f"*{TEMP_MARKER}*")]


def _account_journal(path: Path, soak: FaultSoak) -> None:
    scan = read_journal(path)
    soak.intents = sum(isinstance(r, IntentRecord) for r in scan.records)
    outcomes = Counter(r.call_id for r in scan.records if isinstance(r, OutcomeRecord))
    soak.duplicated_outcomes = sum(1 for count in outcomes.values() if count > 1)
    soak.without_outcome = len(interrupted(scan))


def _account_appends(path: Path, soak: FaultSoak) -> None:
    lines = Counter(path.read_text().split()) if path.exists() else Counter()
    soak.duplicated_appends = sum(1 for count in lines.values() if count > 1)
    soak.lost_appends = sum(1 for index in soak.appends_ok if lines[str(index)] != 1)


def report(soak: FaultSoak) -> list[str]:
    lines = [
        f"## Fault soak: {soak.calls} calls, {PARALLEL} in parallel, seed {soak.seed}, "
        f"{soak.wall_s:.0f} s",
        "",
        "| call kind | outcomes |",
        "|---|---|",
    ]
    for kind, counts in sorted(soak.statuses.items()):
        lines.append(f"| {kind} | {', '.join(f'{s} {n}' for s, n in counts.most_common())} |")
    fds = [count for _, count in soak.fd_samples]
    lines += [
        "",
        "| check | value |",
        "|---|---|",
        f"| outcomes lost (raised, or intents without outcome) | {len(soak.raised)}, "
        f"{soak.without_outcome} |",
        f"| duplicated outcomes in the journal | {soak.duplicated_outcomes} |",
        f"| duplicated side effects (appends found twice) | {soak.duplicated_appends} |",
        f"| appends reported ok but missing | {soak.lost_appends} |",
        f"| side effects refused while the journal's disk was full | {soak.journal_refusals} |",
        f"| processes left: pool open / closed | {soak.left_open} / {soak.left_closed} |",
        f"| temp files left | {len(soak.temp_left)} |",
        f"| coordinator descriptors: start, end, peak (limit {FD_LIMIT}) | {soak.fds_start}, "
        f"{soak.fds_end}, {soak.fds_peak} |",
        f"| descriptors over time (min / median / max of {len(fds)} samples) | "
        f"{min(fds)} / {sorted(fds)[len(fds) // 2]} / {max(fds)} |",
    ]
    lines += [f"- {note}" for note in soak.notes]
    lines += [f"- lost: {entry}" for entry in soak.raised[:10]]
    lines += [f"- left: {entry}" for entry in soak.temp_left[:10]]
    failures = soak.failures()
    lines += [
        "",
        "All counts 0, descriptors back: "
        + ("**no**: " + "; ".join(failures) if failures else "yes"),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.faults", description=__doc__)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    with bench_workspace() as ws:
        soak = asyncio.run(_soak(ws, args.calls, args.seed))
    text = "\n".join(report(soak))
    print(text)
    out = Path(__file__).parent / "results" / "faults.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text + "\n")
    return 1 if soak.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
