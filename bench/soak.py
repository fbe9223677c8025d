"""Section 5: a soak of mixed calls, then an account of everything that should be gone.

Calls are drawn (seeded) from ``KINDS``: plain reads and writes, reads blocked on a FIFO and
bash ``sleep 1000`` stopped by a timeout, a CancelToken after a random delay, or a cancelled
asyncio task, and bash commands that try to escape their call (``setsid``, a double fork,
``nohup ... & disown``), finishing normally or stopped. Eight loops run them through
``Pool(workers=8)``. Then:

* processes left while the pool is still open and nothing is in flight (anything but the
  template and its idle workers was started by a call and outlived it), and after closing;
* the journal, read back after closing: every intent has exactly one outcome;
* this process's open file descriptors, before opening the pool and after closing it (a pool
  is opened and closed once first, so that what the first pool of a process allocates for good
  is not counted as a leak).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from bench import procs
from bench.latency import CALL_TIMEOUT_S, read_once
from bench.procs import Leftovers, leftovers
from bench.workspace import MARKER, BenchWorkspace
from sandbx_pool import CancelToken, Pool
from sandbx_pool.journal.reader import interrupted, read_journal
from sandbx_pool.journal.records import IntentRecord, OutcomeRecord

PARALLEL = 8
TASK_CANCELLED = "task cancelled"  # the awaiting asyncio task was cancelled: no outcome returned

Args = Callable[[int], dict[str, Any]]
_Range = tuple[float, float]


def _fixed(args: dict[str, Any]) -> Args:
    return lambda i: args


def _bash(command: str) -> Args:
    return _fixed({"command": command})


@dataclass(frozen=True)
class Kind:
    name: str
    weight: int
    tool: str
    args: Args
    expected: frozenset[str]
    timeout_s: _Range | None = None
    cancel_after_s: _Range | None = None
    task_cancel_after_s: _Range | None = None


_OK = frozenset({"ok"})
_TIMEOUT = frozenset({"timeout"})
_CANCELLED = frozenset({"cancelled"})
_SHORT = (0.02, 0.1)
_DELAY = (0.0, 0.05)
_READ = _fixed({"path": "data.txt"})
_FIFO = _fixed({"path": "fifo"})
_SLEEP = _bash("sleep 1000")

KINDS: tuple[Kind, ...] = (
    Kind("read", 35, "read", _READ, _OK),
    Kind("write", 8, "write", lambda i: {"path": f"soak/{i % 64}.txt", "content": f"{i}\n"}, _OK),
    Kind("read fifo, timeout", 7, "read", _FIFO, _TIMEOUT, timeout_s=_SHORT),
    Kind("bash sleep, timeout", 6, "bash", _SLEEP, _TIMEOUT, timeout_s=_SHORT),
    Kind("read fifo, token cancel", 8, "read", _FIFO, _CANCELLED, cancel_after_s=_DELAY),
    Kind("bash sleep, token cancel", 6, "bash", _SLEEP, _CANCELLED, cancel_after_s=_DELAY),
    Kind(
        "read, token cancel racing it",
        6,
        "read",
        _READ,
        _OK | _CANCELLED,
        cancel_after_s=(0.0, 0.004),
    ),
    Kind("escape: setsid sleep &", 4, "bash", _bash("setsid sleep 1000 &"), _OK),
    Kind("escape: ( (sleep &) & )", 4, "bash", _bash("( (sleep 1000 &) & )"), _OK),
    Kind(
        "escape: nohup sleep & disown",
        4,
        "bash",
        _bash("nohup sleep 1000 >/dev/null 2>&1 & disown"),
        _OK,
    ),
    Kind(
        "escape + token cancel",
        4,
        "bash",
        _bash("setsid sleep 1000 & sleep 1000"),
        _CANCELLED,
        cancel_after_s=_DELAY,
    ),
    Kind(
        "escape + timeout",
        4,
        "bash",
        _bash("( (sleep 1000 &) & ); sleep 1000"),
        _TIMEOUT,
        timeout_s=_SHORT,
    ),
    Kind(
        "bash sleep, asyncio task cancelled",
        4,
        "bash",
        _SLEEP,
        frozenset({TASK_CANCELLED}),
        task_cancel_after_s=(0.001, 0.05),
    ),
)


@dataclass(frozen=True)
class Planned:
    index: int
    kind: Kind
    timeout_s: float | None
    delay_s: float | None


@dataclass
class SoakResult:
    calls: int
    seed: int
    wall_s: float = 0.0
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)
    quarantined: int = 0
    intents: int = 0
    outcomes: int = 0
    missing: int = 0  # intents without an outcome
    duplicated: int = 0  # call ids with more than one outcome
    unmatched: int = 0  # outcomes without an intent
    fds_before: int = 0
    fds_after: int = 0
    fds_changed: list[str] = field(default_factory=list)
    left_pool_open: Leftovers | None = None
    left_after_close: Leftovers | None = None

    @property
    def unexpected_count(self) -> int:
        return sum(
            count
            for kind in KINDS
            for status, count in self.by_kind.get(kind.name, Counter()).items()
            if status not in kind.expected
        )


def plan(calls: int, seed: int) -> list[Planned]:
    rng = random.Random(seed)
    kinds = rng.choices(KINDS, weights=[k.weight for k in KINDS], k=calls)
    planned = []
    for index, kind in enumerate(kinds):
        timeout = rng.uniform(*kind.timeout_s) if kind.timeout_s else None
        delay_range = kind.cancel_after_s or kind.task_cancel_after_s
        delay = rng.uniform(*delay_range) if delay_range else None
        planned.append(Planned(index, kind, timeout, delay))
    return planned


async def _one(pool: Pool, call: Planned, result: SoakResult) -> None:
    kind = call.kind
    args = kind.args(call.index)
    token = CancelToken() if kind.cancel_after_s else None
    timeout = call.timeout_s or CALL_TIMEOUT_S
    task = asyncio.create_task(pool.call(kind.tool, args, timeout=timeout, cancel=token))
    if call.delay_s is not None:
        await asyncio.sleep(call.delay_s)
        if token is not None:
            token.cancel("soak")
        else:
            task.cancel()
    await asyncio.wait([task])
    if task.cancelled():
        status = TASK_CANCELLED
    else:
        outcome = task.result()
        status = str(outcome.status)
        result.quarantined += outcome.quarantined
        if status not in kind.expected and len(result.unexpected) < 10:
            result.unexpected.append(f"{kind.name}: {status}: {outcome.error}")
    result.by_kind.setdefault(kind.name, Counter())[status] += 1


def _check_journal(path: str, result: SoakResult) -> None:
    scan = read_journal(path)
    intents = [r for r in scan.records if isinstance(r, IntentRecord)]
    outcomes = Counter(r.call_id for r in scan.records if isinstance(r, OutcomeRecord))
    intent_ids = {r.call_id for r in intents}
    result.intents = len(intents)
    result.outcomes = sum(outcomes.values())
    result.missing = len(interrupted(scan))
    result.duplicated = sum(1 for count in outcomes.values() if count > 1)
    result.unmatched = sum(1 for call_id in outcomes if call_id not in intent_ids)


async def _soak(ws: BenchWorkspace, calls: int, seed: int) -> SoakResult:
    result = SoakResult(calls=calls, seed=seed)
    async with Pool(ws.workspace, config=ws.config(journal={"policy": "off"})) as warm:
        await read_once(warm)
    before = procs.open_fds()
    result.fds_before = procs.fd_count()
    journal = ws.journal("soak")
    todo = iter(plan(calls, seed))
    logger.info("soak: {} calls, {} in parallel, seed {}", calls, PARALLEL, seed)
    async with Pool(ws.workspace, workers=PARALLEL, journal=journal, config=ws.config()) as pool:

        async def loop() -> None:
            for call in todo:  # shared: each loop takes the next planned call
                await _one(pool, call, result)

        start = time.perf_counter()
        async with asyncio.TaskGroup() as group:
            for _ in range(PARALLEL):
                group.create_task(loop())
        result.wall_s = time.perf_counter() - start
        result.left_pool_open = leftovers(MARKER, ws.marker, pool_open=True)
    result.left_after_close = leftovers(MARKER, ws.marker)
    result.fds_after = procs.fd_count()
    after = procs.open_fds()
    result.fds_changed = [f"-{fd} {before[fd]}" for fd in before.keys() - after.keys()] + [
        f"+{fd} {after[fd]}" for fd in after.keys() - before.keys()
    ]
    _check_journal(str(journal), result)
    return result


def run(ws: BenchWorkspace, *, calls: int = 2000, seed: int = 1) -> SoakResult:
    return asyncio.run(_soak(ws, calls, seed))
