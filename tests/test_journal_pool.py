"""The journal as the pool writes it: one outcome per intent, whatever ends the call, and an
in-doubt list after a coordinator is SIGKILLed that names only calls that were in flight."""

from __future__ import annotations

import asyncio
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from conftest import marked_config
from loguru import logger

from sandbx_pool import CancelToken, Config, Pool, Status
from sandbx_pool.journal.reader import read_journal
from sandbx_pool.journal.records import IntentRecord, OutcomeRecord
from sandbx_pool.journal.store import Journal


def _pairs(path: Path) -> tuple[Counter[str], Counter[str], dict[str, str]]:
    scan = read_journal(path)
    intents: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    status: dict[str, str] = {}
    for record in scan.records:
        if isinstance(record, IntentRecord):
            intents[record.call_id] += 1
        elif isinstance(record, OutcomeRecord):
            outcomes[record.call_id] += 1
            status[record.call_id] = str(record.status)
    return intents, outcomes, status


def _mixed_call(rng: random.Random, i: int) -> tuple[str, dict[str, object], float | None]:
    kind = rng.randrange(8)
    if kind == 0:
        return "write", {"path": f"out/{i % 7}.txt", "content": "x" * rng.randrange(10_000)}, None
    if kind == 1:
        return "bash", {"command": f"sleep {rng.choice([0, 0.01, 0.05, 2])}"}, 0.2
    if kind == 2:
        return "read", {"path": "../escape"}, None  # denied before a fork
    if kind == 3:
        return "read", {"path": 42}, None  # bad arguments
    if kind == 4:
        return "grep", {"pattern": "o"}, None
    if kind == 5:
        return "edit", {"path": "hello.txt", "old_string": "nope", "new_string": "x"}, None
    return "read", {"path": "hello.txt"}, None


async def test_every_intent_gets_exactly_one_outcome(workspace: Path, tmp_path: Path) -> None:
    rng = random.Random(20261129)
    journal = tmp_path / "journal.jsonl"
    returned: dict[str, Status] = {}

    async def one(pool: Pool, i: int) -> None:
        tool, args, timeout = _mixed_call(rng, i)
        token = CancelToken()
        if rng.random() < 0.3:
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.02), token.cancel, "random")
        outcome = await pool.call(tool, args, timeout=timeout, cancel=token)
        returned[outcome.call_id] = outcome.status

    async with Pool(workspace, journal=journal, config=marked_config(pool={"workers": 6})) as pool:
        await asyncio.gather(*(one(pool, i) for i in range(300)))
        # Closing with calls in flight also ends each with one outcome.
        closing = [asyncio.create_task(pool.call("bash", {"command": "sleep 5"})) for _ in range(4)]
        await asyncio.sleep(0)
    assert {o.status for o in await asyncio.gather(*closing)} == {Status.CANCELLED}
    intents, outcomes, status = _pairs(journal)
    assert len(intents) == 304
    assert set(intents) == set(outcomes)
    assert set(intents.values()) == {1}
    assert set(outcomes.values()) == {1}
    assert {cid: status[cid] for cid in returned} == {k: str(v) for k, v in returned.items()}
    seen = Counter(status.values())
    assert {"ok", "error", "denied", "cancelled", "timeout"} <= set(seen), seen


_COORDINATOR = """
import asyncio, random, sys
from sandbx_pool import Config, Pool

async def main(workspace, journal, seed):
    rng = random.Random(seed)
    config = Config().override(journal={"policy": "always"}, env={"set": {MARKER: VALUE}})
    async with Pool(workspace, journal=journal, config=config, workers=4) as pool:
        print("in-doubt", *[r.call_id for r in pool.interrupted], flush=True)

        async def lane(n):
            for i in range(10_000):
                call_id = f"{seed}-{n}-{i}"
                print("start", call_id, flush=True)
                if rng.random() < 0.5:
                    args = {"path": f"f{n}.txt", "content": "y" * rng.randrange(50_000)}
                    await pool.call("write", args, call_id=call_id)
                else:
                    await pool.call("bash", {"command": "sleep 0.01"}, call_id=call_id)
                print("end", call_id, flush=True)

        await asyncio.gather(*(lane(n) for n in range(4)))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def _run_until_killed(
    script: str, workspace: Path, journal: Path, seed: int
) -> dict[str, set[str]]:
    """Run a coordinator, SIGKILL it after a random number of calls; what it said it did."""
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(workspace), str(journal), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    said: dict[str, set[str]] = {"start": set(), "end": set(), "in-doubt": set()}
    kill_after = random.Random(seed).randrange(5, 60)
    deadline = time.monotonic() + 30
    try:
        while len(said["end"]) < kill_after:
            assert time.monotonic() < deadline, "the coordinator made no progress"
            if not select.select([proc.stdout], [], [], 1.0)[0]:
                continue
            word, *ids = proc.stdout.readline().split()
            said[word].update(ids)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # Everything it printed before it died, including lines not parsed yet.
        for line in proc.stdout.read().splitlines():
            word, *ids = line.split()
            said[word].update(ids)
        proc.stdout.close()
    return said


def test_coordinator_sigkilled_at_random_moments(workspace: Path, tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    # The marker lets the leftover-process check attribute the workers' children to us.
    script = _COORDINATOR.replace(
        "from sandbx_pool import Config, Pool",
        "from sandbx_pool import Config, Pool\n"
        f"MARKER, VALUE = 'SANDBX_TEST_SESSION', {os.environ['SANDBX_TEST_SESSION']!r}",
    )
    previous_in_flight: set[str] = set()
    for seed in range(8):
        said = _run_until_killed(script, workspace, journal, seed)
        scan = read_journal(journal)
        assert scan.corrupt_lines == [], scan.corrupt_lines  # a torn tail is the only damage
        intents, outcomes, _ = _pairs(journal)
        assert max(intents.values()) == 1
        assert max(outcomes.values()) == 1
        assert set(outcomes) <= set(intents)
        # Reopening reported exactly the calls the previous run left in flight (with an intent).
        assert said["in-doubt"] == previous_in_flight
        # This run's calls without an outcome were all in flight when it was killed...
        left_open = {c for c in set(intents) - set(outcomes) if c.startswith(f"{seed}-")}
        assert left_open <= said["start"] - said["end"]
        # ...and, under policy "always", every call that returned has its outcome on disk.
        assert said["end"] <= set(outcomes)
        previous_in_flight = left_open


async def test_reopening_removes_temps_of_writes_left_in_doubt(
    workspace: Path, tmp_path: Path
) -> None:
    journal_path = tmp_path / "journal.jsonl"
    # A coordinator that journaled a write's intent and died before its outcome...
    journal = await Journal.open(journal_path, Config().journal)
    await journal.intent(
        call_id="lost-1",
        tool="write",
        args={"path": "f.txt", "content": "x"},
        cwd="sub",
        timeout_s=None,
    )
    await journal.close()
    # ...and the worker it had, killed mid-write, left its temp file behind.
    (workspace / "sub").mkdir()
    leftover = workspace / "sub" / ".f.txt.sbx-tmp-dead1234"
    leftover.write_text("half")
    bystander = workspace / "sub" / "keep.txt"
    bystander.write_text("mine")
    async with Pool(workspace, journal=journal_path, config=marked_config()) as pool:
        assert [record.call_id for record in pool.interrupted] == ["lost-1"]
        assert pool.in_doubt == pool.interrupted  # its older name
    assert not leftover.exists()
    assert bystander.read_text() == "mine"


async def test_temps_of_writes_in_doubt_in_another_workspace_are_left_alone(
    workspace: Path, tmp_path: Path
) -> None:
    # A journal reused by a pool on another workspace: the write in doubt happened in the
    # other one, so its path here names another file, which must not be touched.
    journal_path = tmp_path / "journal.jsonl"
    journal = await Journal.open(journal_path, Config().journal)
    for call_id, cwd, where in (
        ("elsewhere-1", "sub", str(tmp_path / "other")),
        ("here-1", ".", str(workspace)),
    ):
        await journal.intent(
            call_id=call_id,
            tool="write",
            args={"path": f"{call_id}.txt", "content": "x"},
            cwd=cwd,
            timeout_s=None,
            workspace=where,
        )
    await journal.close()
    # (Recovery sweeps the directory of each write it owns: "sub" is only the other's.)
    (workspace / "sub").mkdir()
    not_ours = workspace / "sub" / ".elsewhere-1.txt.sbx-tmp-dead1234"
    not_ours.write_text("someone else's")
    ours = workspace / ".here-1.txt.sbx-tmp-dead5678"
    ours.write_text("half")
    warnings: list[str] = []
    sink = logger.add(lambda m: warnings.append(m.record["message"]), level="WARNING")
    try:
        async with Pool(workspace, journal=journal_path, config=marked_config()) as pool:
            assert {record.call_id for record in pool.interrupted} == {"elsewhere-1", "here-1"}
    finally:
        logger.remove(sink)
    assert not ours.exists()
    assert not_ours.read_text() == "someone else's"
    assert any("elsewhere-1" in w and str(tmp_path / "other") in w for w in warnings), warnings
