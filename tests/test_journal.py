"""The journal alone, on real files: records, durability, pairing, recovery, lock, CLI, crashes."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import hashlib
import json
import os
import random
import re
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from helpers import wait_until
from loguru import logger

from sandbx_pool.batch.run import resume_plan
from sandbx_pool.cli.journal import add_journal_parser
from sandbx_pool.config import JournalPolicy, JournalSettings
from sandbx_pool.errors import JournalError, JournalLocked
from sandbx_pool.journal.reader import (
    Doubt,
    in_doubt_calls,
    interrupted,
    read_journal,
)
from sandbx_pool.journal.records import (
    NODE_LOST,
    InDoubtRecord,
    IntentRecord,
    OutcomeRecord,
    StartedRecord,
    decoder,
    encoder,
    summarize,
    summarize_value,
)
from sandbx_pool.journal.store import Journal, JournalState
from sandbx_pool.journal.writer import JournalWriteError
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.workers.schemas import SIDE_EFFECT_TOOLS

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 10.0


def settings(
    policy: JournalPolicy = JournalPolicy.SIDE_EFFECTS, group_commit_ms: float = 5.0
) -> JournalSettings:
    return JournalSettings(policy=policy, group_commit_ms=group_commit_ms)


def outcome(call_id: str, tool: str = "read", **fields: Any) -> Outcome:
    fields.setdefault("status", Status.OK)
    return Outcome(call_id=call_id, tool=tool, **fields)


async def intent(journal: Journal, call_id: str, tool: str = "read", **args: Any) -> None:
    await journal.intent(call_id=call_id, tool=tool, args=args, cwd="/ws", timeout_s=None)


def contents(path: Path) -> bytes:
    # Reading a small local file in a test: blocking the loop for it is harmless.
    return path.read_bytes()


def lines(path: Path) -> list[bytes]:
    return contents(path).splitlines()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "journals" / "j.jsonl"


@pytest.fixture
async def opened(path: Path) -> AsyncIterator[Callable[..., Awaitable[Journal]]]:
    """Open journals that are closed at teardown whatever the test did."""
    journals: list[Journal] = []

    async def open_journal(**kwargs: Any) -> Journal:
        journal = await Journal.open(path, settings(**kwargs))
        journals.append(journal)
        return journal

    yield open_journal
    for journal in journals:
        await journal.close()


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count fdatasync calls (the writer thread's durability points)."""
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        real(fd)
        calls.append(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    return calls


@pytest.fixture
async def children() -> AsyncIterator[list[asyncio.subprocess.Process]]:
    """Subprocesses a test starts; any still running at teardown is killed, and reaped."""
    procs: list[asyncio.subprocess.Process] = []
    yield procs
    for proc in procs:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        await proc.wait()


async def spawn(children: list[asyncio.subprocess.Process], script: str, *args: str) -> Any:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        textwrap.dedent(script),
        *args,
        stdout=asyncio.subprocess.PIPE,
        env=env,
        start_new_session=True,  # our own SIGKILL is the only signal it should get
    )
    children.append(proc)
    return proc


# -- records -----------------------------------------------------------------------------------


def test_records_roundtrip() -> None:
    records = [
        IntentRecord(call_id="c1", time=1.5, tool="write", args={"path": "a"}, cwd="/w"),
        StartedRecord(call_id="c1", time=2.0, pid=42),
        OutcomeRecord(
            call_id="c1",
            time=3.0,
            tool="write",
            status="timeout",
            killed_by="timeout",
            duration_s=0.25,
            started=True,
            value_summary={"bytes": 3},
        ),
        InDoubtRecord(call_id="c2", time=4.0, tool="bash"),
    ]
    for record in records:
        line = encoder.encode(record)
        assert b"\n" not in line
        raw = json.loads(line)
        assert raw["kind"] in {"intent", "started", "outcome", "in_doubt"}
        assert raw["v"] == 1
        assert raw["call_id"] == record.call_id
        assert decoder.decode(line) == record


def test_outcome_record_from_outcome() -> None:
    out = outcome(
        "c1",
        "bash",
        status=Status.CANCELLED,
        killed_by=KilledBy.TOKEN,
        reason="user pressed stop",
        started=True,
        worker_pid=7,
        value={"exit_code": -9, "stdout": "x" * 10_000},
        error="e" * 100_000,
    )
    record = OutcomeRecord.from_outcome(out, time=1.0, limit=4096)
    assert (record.status, record.killed_by, record.reason) == (
        "cancelled",
        "token",
        "user pressed stop",
    )
    assert record.worker_pid == 7
    assert record.started
    assert record.error is not None
    assert len(record.error) < 4200
    assert record.error.endswith("[100000 characters in all]")
    assert record.value_summary is not None
    assert record.value_summary["exit_code"] == -9
    assert record.value_summary["stdout"]["summary"] is True


def test_summarize_replaces_large_strings_recursively() -> None:
    big = "é" * 3000  # 6000 bytes in UTF-8 but only 3000 characters
    value = {"path": "a.txt", "content": big, "nested": {"list": ["small", big]}, "n": 3}
    summary = summarize(value, 4096)
    expected = {
        "summary": True,
        "bytes": 6000,
        "sha256": hashlib.sha256(big.encode()).hexdigest(),
    }
    assert summary == {
        "path": "a.txt",
        "content": expected,
        "nested": {"list": ["small", expected]},
        "n": 3,
    }
    assert summarize("x" * 4096, 4096) == "x" * 4096  # at the limit: kept


def test_summarize_value_is_bounded() -> None:
    value = {
        "exit_code": 0,
        "stdout": "o" * 300,
        "stderr": "",
        "matches": [{"path": "a", "line": 1}] * 50,
        "nested": {"deep": {"deeper": 1}, "ok": True},
        **{f"k{i}": i for i in range(100)},
    }
    summary = summarize_value(value)
    assert summary is not None
    assert summary["exit_code"] == 0
    assert summary["stderr"] == ""
    assert summary["stdout"]["bytes"] == 300
    assert summary["matches"] == {"items": 50}
    assert summary["nested"] == {"deep": {"keys": 1}, "ok": True}
    assert summary["omitted_keys"] == len(value) - 32
    assert len(encoder.encode(summary)) < 2000
    assert summarize_value(None) is None


async def test_large_content_is_summarised_never_copied(opened: Any, path: Path) -> None:
    journal = await opened()
    marker = "MARKER-" + "q" * 1_000_000
    await intent(journal, "w1", "write", path="big.txt", content=marker)
    journal.outcome(outcome("w1", "write", value={"bytes": len(marker), "echo": marker}))
    await journal.close()
    data = contents(path)
    assert b"MARKER" not in data
    assert len(data) < 2000
    scan = read_journal(path)
    first = scan.records[0]
    assert isinstance(first, IntentRecord)
    assert first.args["content"] == {
        "summary": True,
        "bytes": len(marker),
        "sha256": hashlib.sha256(marker.encode()).hexdigest(),
    }
    assert first.args["path"] == "big.txt"


async def test_unencodable_arguments_are_kept_as_text(opened: Any, path: Path) -> None:
    journal = await opened()
    await intent(journal, "a", path=Path("x/y"), weird=object())
    # A file name that is not UTF-8 (os.fsdecode's surrogates) cannot be written as JSON.
    await intent(journal, "b", path="caf\udce9.txt")
    await journal.close()
    records = read_journal(path).records
    assert isinstance(records[0], IntentRecord)
    assert records[0].args["path"] == "PosixPath('x/y')"
    assert isinstance(records[1], IntentRecord)
    assert "unencodable" in records[1].args


# -- durability --------------------------------------------------------------------------------


@pytest.mark.parametrize("tool", sorted(SIDE_EFFECT_TOOLS))
async def test_side_effect_intent_is_on_disk_when_intent_returns(
    opened: Any, path: Path, fsyncs: list[int], tool: str
) -> None:
    # A group-commit delay far longer than the test: only the intent's own demand can sync.
    journal = await opened(group_commit_ms=60_000)
    await intent(journal, "c1", tool, command="echo hi", path="a")
    assert len(fsyncs) == 1
    (line,) = lines(path)
    record = decoder.decode(line)
    assert isinstance(record, IntentRecord)
    assert (record.call_id, record.tool) == ("c1", tool)


async def test_always_fsyncs_every_intent(opened: Any, path: Path, fsyncs: list[int]) -> None:
    journal = await opened(policy=JournalPolicy.ALWAYS, group_commit_ms=60_000)
    await intent(journal, "r1", "read", path="a")
    assert len(fsyncs) == 1
    assert len(lines(path)) == 1
    journal.outcome(outcome("r1"))
    await wait_until(lambda: len(fsyncs) == 2, DEADLINE_S, "the outcome's own fsync")


@pytest.fixture
def blocked_fsync(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """fdatasync waits until the test sets the event: a disk that takes its time."""
    release = threading.Event()
    real = os.fdatasync

    def slow(fd: int) -> None:
        release.wait(DEADLINE_S)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    yield release
    release.set()


async def test_only_durable_intents_wait_for_the_disk(
    opened: Any, path: Path, blocked_fsync: threading.Event
) -> None:
    journal = await opened(group_commit_ms=60_000)
    durable = asyncio.create_task(intent(journal, "w1", "write", path="a", content="x"))
    await wait_until(lambda: len(lines(path)) == 1, DEADLINE_S, "the write intent to be written")
    # The writer thread is stuck in fsync; the loop and non-durable records are not.
    await asyncio.wait_for(intent(journal, "r1", "read", path="a"), DEADLINE_S)
    journal.started("r1", 123)
    journal.outcome(outcome("r1"))
    assert not durable.done()
    blocked_fsync.set()
    await asyncio.wait_for(durable, DEADLINE_S)
    await journal.flush()
    kinds = [decoder.decode(line).call_id for line in lines(path)]
    assert kinds == ["w1", "r1", "r1", "r1"]


@pytest.mark.parametrize(
    ("policy", "tool"),
    [(JournalPolicy.BATCH, "read"), (JournalPolicy.OFF, "read"), (JournalPolicy.OFF, "bash")],
)
async def test_batch_and_off_never_wait_in_intent(
    opened: Any, path: Path, blocked_fsync: threading.Event, policy: JournalPolicy, tool: str
) -> None:
    journal = await opened(policy=policy, group_commit_ms=60_000)
    for i in range(5):
        await asyncio.wait_for(intent(journal, f"b{i}", tool, command="rm -rf x"), DEADLINE_S)
    blocked_fsync.set()
    await journal.flush()
    assert len(lines(path)) == 5


async def test_batch_holds_a_side_effect_until_its_group_commit(
    opened: Any, path: Path, fsyncs: list[int]
) -> None:
    # The contract under every policy that fsyncs: an intent is durable before its side
    # effect starts. BATCH does not fsync it at once, but releases it with its group commit.
    journal = await opened(policy=JournalPolicy.BATCH, group_commit_ms=200)
    started = time.monotonic()
    await asyncio.wait_for(intent(journal, "b1", "bash", command="echo x >> f"), DEADLINE_S)
    assert time.monotonic() - started >= 0.15, "released before its group commit"
    assert len(fsyncs) == 1
    assert len(lines(path)) == 1


async def test_off_never_fsyncs(opened: Any, path: Path, fsyncs: list[int]) -> None:
    journal = await opened(policy=JournalPolicy.OFF)
    await intent(journal, "w1", "write", path="a", content="x")
    journal.outcome(outcome("w1", "write"))
    await journal.flush()
    await journal.close()
    assert fsyncs == []
    assert len(lines(path)) == 2


async def test_outcomes_are_group_committed_without_flush(
    opened: Any, path: Path, fsyncs: list[int]
) -> None:
    journal = await opened(policy=JournalPolicy.BATCH, group_commit_ms=20)
    for i in range(50):
        await intent(journal, f"c{i}")
        journal.outcome(outcome(f"c{i}"))

    def committed() -> bool:
        return len(fsyncs) >= 1 and len(lines(path)) == 100

    await wait_until(committed, DEADLINE_S, "a group commit")
    # 100 records, a handful of fsyncs: they were batched.
    assert len(fsyncs) < 20


async def test_nothing_queued_before_close_is_lost(opened: Any, path: Path) -> None:
    journal = await opened(policy=JournalPolicy.BATCH, group_commit_ms=60_000)
    for i in range(2000):
        await intent(journal, f"c{i}")
        journal.started(f"c{i}", 1000 + i)
        journal.outcome(outcome(f"c{i}"))
    await journal.close()
    assert len(lines(path)) == 6000


async def test_write_failure_is_reported_not_hung(
    opened: Any, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = await opened()
    real = os.write

    def full_disk(fd: int, data: Any) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if target == str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(JournalWriteError, match=r"ENOSPC \(No space left") as raised:
        await intent(journal, "w1", "write", path="a", content="x")
    assert raised.value.errno == errno.ENOSPC
    assert str(path) in str(raised.value)
    assert journal.state is JournalState.FAILED
    journal.outcome(outcome("w1", "write"))  # tried, not raised: it runs in cleanup paths
    await intent(journal, "r1")  # a read's intent is not waited on
    with pytest.raises(JournalWriteError):
        await intent(journal, "w2", "write", path="a", content="x")
    monkeypatch.undo()
    # The disk works again: so does the journal, without being reopened.
    await intent(journal, "w3", "write", path="a", content="x")
    assert journal.state is JournalState.OPEN
    await journal.close()
    # What the full disk kept out is written once it has room, in order, before w3: nothing
    # is lost to the outage (the pool journals a refused call's outcome after its intent).
    records = [(r["call_id"], r["kind"]) for r in map(json.loads, lines(path))]
    assert records == [
        ("w1", "intent"),
        ("w1", "outcome"),
        ("r1", "intent"),
        ("w2", "intent"),
        ("w3", "intent"),
    ]
    again = await Journal.open(path, settings())  # the lock was released
    await again.close()


# -- pairing -----------------------------------------------------------------------------------


async def test_every_intent_gets_exactly_one_outcome(opened: Any, path: Path) -> None:
    journal = await opened(group_commit_ms=1)
    rng = random.Random(1234)
    tools = ["read", "write", "edit", "ls", "grep", "find", "bash"]
    statuses = list(Status)

    async def one_call(i: int) -> None:
        tool = rng.choice(tools)
        cid = f"call-{i}"
        await intent(journal, cid, tool, path=f"f{i}", content="c" * rng.choice([5, 9000]))
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)  # let other calls interleave
        started = rng.random() < 0.8
        if started:
            journal.started(cid, 10_000 + i)
        status = rng.choice(statuses)
        journal.outcome(outcome(cid, tool, status=status, started=started, duration_s=i / 1000))

    await asyncio.gather(*(one_call(i) for i in range(400)))
    await journal.close()

    scan = read_journal(path)
    assert not scan.torn_tail
    assert scan.corrupt_lines == []
    assert interrupted(scan) == []
    order: dict[str, list[str]] = {}
    for record in scan.records:
        order.setdefault(record.call_id, []).append(type(record).__name__)
    assert len(order) == 400
    for kinds in order.values():
        assert kinds in (
            ["IntentRecord", "OutcomeRecord"],
            ["IntentRecord", "StartedRecord", "OutcomeRecord"],
        )


# -- recovery ----------------------------------------------------------------------------------


def write_lines(path: Path, *records: Any, tail: bytes = b"") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = b"".join(encoder.encode(r) + b"\n" if not isinstance(r, bytes) else r for r in records)
    path.write_bytes(data + tail)


def an_intent(cid: str, tool: str = "write") -> IntentRecord:
    return IntentRecord(call_id=cid, time=1.0, tool=tool, args={"path": cid}, cwd="/ws")


def an_outcome(cid: str, tool: str = "write", status: str = "ok", duration: float = 0.1) -> Any:
    return OutcomeRecord(call_id=cid, time=2.0, tool=tool, status=status, duration_s=duration)


async def test_torn_tail_is_ignored_and_cut_off(opened: Any, path: Path) -> None:
    torn = encoder.encode(an_outcome("a"))[:25]
    write_lines(path, an_intent("a"), an_intent("b"), tail=torn)
    scan = read_journal(path)
    assert scan.torn_tail
    assert [r.call_id for r in interrupted(scan)] == ["a", "b"]

    journal = await opened()
    assert [r.call_id for r in journal.interrupted] == ["a", "b"]
    await intent(journal, "c", "write", path="c", content="new")
    await journal.close()
    raw = contents(path)
    assert raw.endswith(b"\n")
    assert torn not in raw
    scan = read_journal(path)
    assert not scan.torn_tail
    assert scan.corrupt_lines == []
    assert [type(r).__name__ for r in scan.records] == [
        "IntentRecord",
        "IntentRecord",
        "InDoubtRecord",
        "InDoubtRecord",
        "IntentRecord",
    ]


async def test_corrupt_middle_line_is_skipped(opened: Any, path: Path) -> None:
    write_lines(path, an_intent("a"), b"{not json at all\n", an_outcome("a"), an_intent("b"))
    scan = read_journal(path)
    assert scan.corrupt_lines == [2]
    assert not scan.torn_tail
    assert [r.call_id for r in interrupted(scan)] == ["b"]
    journal = await opened()
    assert [r.call_id for r in journal.interrupted] == ["b"]


async def test_in_doubt_is_reported_once(opened: Any, path: Path) -> None:
    write_lines(path, an_intent("a"), an_outcome("a"), an_intent("b"), an_intent("c", "read"))
    first = await opened()
    assert [r.call_id for r in first.interrupted] == ["b", "c"]
    await first.close()

    second = await opened()
    assert second.interrupted == []
    # Still interrupted for a person auditing the run: nobody saw b's write or c's read end.
    assert [r.call_id for r in interrupted(read_journal(path))] == ["b", "c"]
    assert interrupted(read_journal(path), include_reported=False) == []


async def test_open_logs_path_and_in_doubt_count(opened: Any, path: Path) -> None:
    write_lines(path, an_intent("a"), an_intent("b"))
    messages: list[str] = []
    logger.enable("sandbx_pool")  # conftest enables it too; disabling is left to conftest
    sink = logger.add(messages.append, level="INFO", format="{message}")
    try:
        journal = await opened()
    finally:
        logger.remove(sink)
    assert any(str(journal.path) in m and "2 call(s) interrupted" in m for m in messages)
    assert any("call a (write)" in m for m in messages)


# -- lock and lifecycle ------------------------------------------------------------------------


async def test_second_opener_in_process_gets_journal_locked(opened: Any, path: Path) -> None:
    journal = await opened()
    with pytest.raises(JournalLocked, match=re.escape(str(path))) as excinfo:
        await Journal.open(path, settings())
    assert f"pid {os.getpid()}" in str(excinfo.value)
    await journal.close()
    again = await opened()
    assert again.state is JournalState.OPEN


LOCK_PROBE = """
    import asyncio, sys
    from sandbx_pool.config import JournalSettings
    from sandbx_pool.errors import JournalLocked
    from sandbx_pool.journal.store import Journal

    async def main():
        try:
            journal = await Journal.open(sys.argv[1], JournalSettings())
        except JournalLocked as exc:
            print("locked:", exc, flush=True)
            return 3
        await journal.close()
        print("opened", flush=True)
        return 0

    sys.exit(asyncio.run(main()))
"""


async def test_second_opener_in_another_process_gets_journal_locked(
    opened: Any, path: Path, children: list[asyncio.subprocess.Process]
) -> None:
    journal = await opened()
    proc = await spawn(children, LOCK_PROBE, str(path))
    out, _ = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert proc.returncode == 3
    assert str(path) in out.decode()
    await journal.close()
    proc = await spawn(children, LOCK_PROBE, str(path))
    out, _ = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    assert (proc.returncode, out.decode().strip()) == (0, "opened")


async def test_close_is_idempotent(opened: Any, path: Path) -> None:
    journal = await opened()
    await intent(journal, "a")
    await asyncio.gather(journal.close(), journal.close())
    await journal.close()
    assert journal.state is JournalState.CLOSED
    assert "closed" in repr(journal)
    with pytest.raises(JournalError, match="closed"):
        await intent(journal, "b")
    with pytest.raises(JournalError, match="closed"):
        journal.outcome(outcome("a"))
    with pytest.raises(JournalError, match="closed"):
        await journal.flush()
    assert len(lines(path)) == 1


# -- command line ------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="sandbx-pool")
    add_journal_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code


@pytest.fixture
def sample(path: Path) -> Path:
    """100 reads with durations 0.01..1.00 s, two writes, and one bash left in doubt."""
    records: list[Any] = []
    for i in range(1, 101):
        records += [an_intent(f"r{i}", "read"), an_outcome(f"r{i}", "read", duration=i / 100)]
    big = IntentRecord(
        call_id="w-big",
        time=1.0,
        tool="write",
        args=summarize({"path": "out.txt", "content": "z" * 10_000}, 4096),
        cwd="/ws",
    )
    records += [big, an_outcome("w-big", "write", status="error", duration=2.0)]
    records += [an_intent("w2", "write"), an_outcome("w2", "write", status="timeout", duration=3)]
    records += [an_intent("b1", "bash")]
    write_lines(path, *records)
    return path


def test_cli_stats_json_percentiles(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["journal", "stats", str(sample), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["intents"] == 103
    assert data["outcomes"] == 102
    assert data["in_doubt"] == 1
    assert data["by_status"] == {"ok": 100, "error": 1, "timeout": 1}
    assert data["by_tool"] == {"bash": 1, "read": 100, "write": 2}
    assert data["by_tool_status"]["write"] == {"error": 1, "timeout": 1}
    read = data["latency_by_tool"]["read"]
    assert (read["p50"], read["p90"], read["p99"], read["max"]) == (0.5, 0.9, 0.99, 1.0)
    assert data["latency"]["max"] == 3.0
    assert data["latency"]["count"] == 102


def test_cli_stats_table(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["journal", "stats", str(sample)]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("tool") and "calls" in line)
    assert header.split() == ["tool", "calls", "ok", "error", "timeout", "in_doubt"]
    assert next(line for line in out if line.startswith("bash")).split() == [
        "bash",
        "1",
        "0",
        "0",
        "0",
        "1",
    ]
    assert next(line for line in out if line.startswith("all")).split()[:3] == ["all", "103", "100"]
    read_latency = [line.split() for line in out if line.startswith("read")][-1]
    assert read_latency == ["read", "100", "0.5000", "0.9000", "0.9900", "1.0000"]


def test_cli_in_doubt(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    big_edit = IntentRecord(
        call_id="e-big",
        time=1.0,
        tool="edit",
        args=summarize({"path": "o.txt", "old_string": "a", "new_string": "y" * 5000}, 4096),
        cwd="/ws",
    )
    # A write without its outcome is not in doubt: running it again sets the same content.
    write_lines(sample, *read_journal(sample).records, big_edit, an_intent("w-lost", "write"))
    assert main(["journal", "in-doubt", str(sample)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out] == [["b1", "bash"], ["e-big", "edit"]]
    assert all(" no outcome " in line for line in out)
    digest = hashlib.sha256(b"y" * 5000).hexdigest()[:12]
    assert out[1].endswith(f"new_string=<5000 bytes sha256:{digest}>")


def test_one_definition_of_in_doubt(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """in-doubt, stats and show name the same calls, and resume skips exactly those."""

    def ended(cid: str, tool: str, status: str, **fields: Any) -> OutcomeRecord:
        return OutcomeRecord(call_id=cid, time=2.0, tool=tool, status=status, **fields)

    shutdown = {"status": "cancelled", "killed_by": "shutdown"}
    write_lines(
        path,
        an_intent("cut", "bash"),
        ended("cut", "bash", **shutdown, started=True),  # may have run part of its effects
        an_intent("queued", "bash"),
        ended("queued", "bash", **shutdown, started=False),  # provably did not run
        an_intent("read-cut", "read"),
        ended("read-cut", "read", **shutdown, started=True),  # read-only: runs again
        an_intent("crashed", "edit"),  # no outcome: the coordinator died
        an_intent("write-crashed", "write"),  # idempotent: runs again
        an_intent("lost", "bash"),
        ended("lost", "bash", "crashed", reason=NODE_LOST, started=True),
        an_intent("timed-out", "bash"),
        ended("timed-out", "bash", "timeout", killed_by="timeout", started=True),  # an end
        an_intent("settled", "bash"),
        ended("settled", "bash", **shutdown, started=True),
        an_intent("settled", "bash"),  # --rerun-started...
        ended("settled", "bash", "ok", started=True),  # ...and it ran to an end
        an_intent("still", "bash"),
        ended("still", "bash", **shutdown, started=True),
        an_intent("still", "bash"),  # --rerun-started, stopped again before it started
        ended("still", "bash", **shutdown, started=False),
        an_intent("again", "bash"),
        ended("again", "bash", "ok", started=True),
        an_intent("again", "bash"),  # run again (--fresh) and cut mid-way
        ended("again", "bash", **shutdown, started=True),
    )
    doubtful = {"cut", "crashed", "lost", "still", "again"}
    calls = in_doubt_calls(read_journal(path))
    assert {call.call_id for call in calls} == doubtful
    assert {call.call_id: call.why for call in calls}["crashed"] is Doubt.NO_OUTCOME
    assert {call.call_id: call.why for call in calls}["lost"] is Doubt.NODE_LOST_AFTER_START

    assert main(["journal", "in-doubt", str(path)]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert {line.split()[0] for line in listed} == doubtful
    assert "stopped after it started" in next(line for line in listed if line.startswith("cut"))
    assert main(["journal", "stats", str(path), "--json"]) == 0
    counted = json.loads(capsys.readouterr().out)
    assert (counted["in_doubt"], counted["in_doubt_by_tool"]) == (5, {"bash": 4, "edit": 1})
    assert counted["no_outcome"] == 2  # the edit's and the write's intents, of any tool
    assert main(["journal", "show", str(path), "--status", "in_doubt", "--json"]) == 0
    shown = {json.loads(line)["call_id"] for line in capsys.readouterr().out.splitlines()}
    assert shown == doubtful
    plan = resume_plan(path)
    assert set(plan.in_doubt) == doubtful
    assert plan.finished == {"timed-out", "settled"}


def test_cli_show_filters(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["journal", "show", str(sample), "--status", "timeout", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kind"], r["call_id"]) for r in shown] == [("intent", "w2"), ("outcome", "w2")]

    assert (
        main(["journal", "show", str(sample), "--tool", "write", "--status", "error", "--json"])
        == 0
    )
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["call_id"] for r in shown] == ["w-big", "w-big"]
    assert shown[0]["args"]["content"]["bytes"] == 10_000

    assert main(["journal", "show", str(sample), "--call", "r7", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in shown] == ["intent", "outcome"]

    assert main(["journal", "show", str(sample), "--status", "in_doubt", "--json"]) == 0
    shown = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["call_id"] for r in shown] == ["b1"]


def test_cli_show_prints_a_table_one_call_a_line(
    sample: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["journal", "show", str(sample), "--tool", "write"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["call", "tool", "status", "seconds", "args", "detail"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {"w-big", "w2"}
    assert rows["w2"].split()[1:4] == ["write", "timeout", "3.000"]
    assert "content=<10000 bytes sha256:" in rows["w-big"]  # summarised, not copied
    assert all(len(line) < 250 for line in lines)

    assert main(["journal", "show", str(sample), "--status", "in_doubt"]) == 0
    (_, row) = capsys.readouterr().out.splitlines()
    assert row.split()[:3] == ["b1", "bash", "in_doubt"]
    assert "no outcome" in row

    assert main(["journal", "show", str(sample), "--call", "nobody"]) == 0
    assert capsys.readouterr().out == "(no matching calls)\n"


@pytest.mark.parametrize("command", ["in-doubt", "stats", "show"])
def test_cli_missing_journal_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    missing = tmp_path / "nope.jsonl"
    assert main(["journal", command, str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert str(missing) in captured.err
    assert "no such journal" in captured.err


def test_cli_mentions_torn_tail_on_stderr(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_lines(path, an_intent("a", "bash"), tail=b'{"kind":"outc')
    assert main(["journal", "in-doubt", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out.split()[:2] == ["a", "bash"]
    assert "torn" in captured.err


# -- crashes -----------------------------------------------------------------------------------

CRASHING_COORDINATOR = """
    import asyncio, random, sys
    from sandbx_pool.config import JournalSettings
    from sandbx_pool.journal.store import Journal
    from sandbx_pool.outcome import Outcome, Status

    WORKERS = 4

    async def main(path, seed):
        rng = random.Random(seed)
        journal = await Journal.open(path, JournalSettings(group_commit_ms=2))
        print("open", ",".join(r.call_id for r in journal.interrupted), flush=True)

        async def worker(w):
            n = 0
            while True:
                n += 1
                cid = f"{seed}-{w}-{n}"
                tool = rng.choice(["read", "write", "edit", "bash", "grep"])
                content = "x" * rng.choice([10, 10_000])
                await journal.intent(
                    call_id=cid, tool=tool, args={"path": cid, "content": content},
                    cwd="/ws", timeout_s=None,
                )
                print("I", cid, tool, flush=True)
                journal.started(cid, 4242)
                await asyncio.sleep(0)
                journal.outcome(Outcome(call_id=cid, tool=tool, status=Status.OK, started=True))
                await journal.flush()
                print("O", cid, flush=True)

        await asyncio.gather(*(worker(w) for w in range(WORKERS)))

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


async def test_sigkilled_coordinator_leaves_a_consistent_journal(
    path: Path, children: list[asyncio.subprocess.Process]
) -> None:
    rng = random.Random(20240607)
    started_at = time.monotonic()
    expected_in_doubt: set[str] = set()
    rounds_with_doubt = torn_rounds = 0
    for round_ in range(20):
        proc = await spawn(children, CRASHING_COORDINATOR, str(path), str(round_))
        assert proc.stdout is not None

        async def read_line(stdout: asyncio.StreamReader = proc.stdout) -> list[str]:
            line = (await asyncio.wait_for(stdout.readline(), DEADLINE_S)).decode().split()
            assert line, "the coordinator exited by itself"
            return line

        # What the coordinator reports at open is exactly what was in flight at the last crash.
        first = await read_line()
        assert first[0] == "open"
        assert set(",".join(first[1:]).split(",")) - {""} == expected_in_doubt

        # Kill it at a random point of its stream of calls.
        intents_done: set[str] = set()
        outcomes_done: set[str] = set()
        for _ in range(rng.randrange(60)):
            line = await read_line()
            if line[0] == "I" and line[2] in SIDE_EFFECT_TOOLS:
                intents_done.add(line[1])
            elif line[0] == "O":
                outcomes_done.add(line[1])
        proc.kill()
        await proc.wait()
        await proc.stdout.read()

        scan = read_journal(path)
        assert scan.corrupt_lines == [], f"round {round_}"
        outcomes = Counter(r.call_id for r in scan.records if isinstance(r, OutcomeRecord))
        assert max(outcomes.values(), default=1) == 1, "an intent got two outcomes"
        journaled = {r.call_id for r in scan.records if isinstance(r, IntentRecord)}
        assert set(outcomes) <= journaled
        assert intents_done <= journaled, "a durable intent is missing"
        assert outcomes_done <= set(outcomes), "a flushed outcome is missing"
        now_in_doubt = {r.call_id for r in interrupted(scan, include_reported=False)}
        # Only this round's calls, never a finished one, at most one per coordinator task.
        assert all(cid.startswith(f"{round_}-") for cid in now_in_doubt)
        assert not now_in_doubt & outcomes_done
        assert len(now_in_doubt) <= 4, "more calls in doubt than the coordinator had in flight"
        expected_in_doubt = now_in_doubt
        rounds_with_doubt += bool(now_in_doubt)
        if round_ % 5 == 4 and now_in_doubt:
            # A machine crash can also tear the last write: the next coordinator must ignore
            # the fragment (the call stays in doubt) and never glue a record onto it.
            fragment = encoder.encode(an_outcome(min(now_in_doubt)))
            with path.open("ab") as f:
                f.write(fragment[: len(fragment) // 2])
            assert read_journal(path).torn_tail
            torn_rounds += 1
        assert time.monotonic() - started_at < 120

    # The kills must have landed mid-call often enough for the checks above to mean something.
    assert rounds_with_doubt >= 5
    assert torn_rounds >= 1
    journal = await Journal.open(path, settings())
    try:
        assert {r.call_id for r in journal.interrupted} == expected_in_doubt
        await intent(journal, "after", "write", path="a", content="b")
        journal.outcome(outcome("after", "write"))
    finally:
        await journal.close()
    scan = read_journal(path)
    assert (scan.torn_tail, scan.corrupt_lines) == (False, [])
    assert interrupted(scan, include_reported=False) == []
    assert msgspec.json.decode(lines(path)[-1])["call_id"] == "after"
