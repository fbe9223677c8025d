"""The journal under faults: a full disk, a journal removed or replaced under the pool, a
coordinator stopped or killed mid-batch. Each fault is real (a small tmpfs filled to ENOSPC,
unlink(2) and rename(2) over it, SIGTERM and SIGKILL of a ``sandbx-pool run`` process); the
checks are on what ran and what the journal says afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import cli_argv
from helpers import wait_until as wait_for
from test_batch import count_in, marked_toml, start_cli, wait_until

from sandbx_pool import Pool, Status
from sandbx_pool.batch.calls import load_batch
from sandbx_pool.batch.run import resume_plan, run_batch
from sandbx_pool.errors import JournalLocked
from sandbx_pool.journal.reader import in_doubt_calls, interrupted, read_journal
from sandbx_pool.journal.records import (
    JOURNAL_REFUSED,
    NODE_LOST,
    IntentRecord,
    JournalRecord,
    OutcomeRecord,
    StartedRecord,
    encoder,
)
from sandbx_pool.journal.store import Journal

#: Room on the test's tmpfs: enough for the journal to open, small enough to fill in a moment.
TMPFS_SIZE = "1m"

#: Upper bound on the calls it takes for the journal's last page to fill up once the rest of
#: the tmpfs is taken (a record is ~250 bytes, a page 4 KiB).
CALLS_TO_FILL_A_PAGE = 100

DEADLINE_S = 60.0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for this test alone, unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def fill(directory: Path) -> Path:
    """Take every free block of ``directory``'s filesystem with one file; returns it."""
    filler = directory / "filler"
    chunk = b"\0" * 65536
    with open(filler, "wb", buffering=0) as f:
        for _ in range(1 << 16):  # bounded: 4 GiB at most
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        # Then the last partial chunk, byte runs at a time.
        for size in (4096, 512, 1):
            with contextlib.suppress(OSError):
                while True:
                    f.write(chunk[:size])
    return filler


def records(path: Path) -> list[JournalRecord]:
    scan = read_journal(path)
    assert (scan.torn_tail, scan.corrupt_lines) == (False, []), "a record was cut or glued"
    return list(scan.records)


@pytest.mark.parametrize("policy", ["side-effects", "batch", "always"])
async def test_a_full_disk_refuses_side_effects_and_recovers_once_freed(
    workspace: Path, small_fs: Path, policy: str
) -> None:
    journal = small_fs / "journal.jsonl"
    config = marked_config(journal={"policy": policy})
    async with Pool(workspace, journal=journal, config=config) as pool:
        assert (await pool.call("write", {"path": "before.txt", "content": "x"})).ok
        filler = fill(small_fs)
        # The journal's last page still has room for a few records: write until it does not.
        refused = None
        for i in range(CALLS_TO_FILL_A_PAGE):
            outcome = await pool.call("write", {"path": f"full-{i}.txt", "content": "x"})
            if not outcome.ok:
                refused = (i, outcome)
                break
        assert refused is not None, "the disk never filled"
        i, outcome = refused
        assert outcome.status is Status.ERROR
        assert not outcome.started
        assert outcome.error is not None
        assert "ENOSPC" in outcome.error
        assert str(journal) in outcome.error
        assert not (workspace / f"full-{i}.txt").exists(), "a side effect ran without its intent"

        # While full: every side effect is refused, read-only calls run.
        bash = await pool.call("bash", {"command": "echo ran > bash.txt"})
        assert (bash.status, bash.started) == (Status.ERROR, False)
        assert not (workspace / "bash.txt").exists()
        assert (await pool.call("read", {"path": "hello.txt"})).ok

        # Space is back: the same pool journals again, without being reopened.
        filler.unlink()
        after = await pool.call("write", {"path": "after.txt", "content": "x"})
        assert after.ok, after.error
        assert (workspace / "after.txt").read_text() == "x"
    journaled = records(journal)
    intents = {r.call_id for r in journaled if isinstance(r, IntentRecord)}
    outcomes = {r.call_id for r in journaled if isinstance(r, OutcomeRecord)}
    assert after.call_id in intents
    assert after.call_id in outcomes
    # Every side effect that ran has its intent on disk.
    written = {name for name in os.listdir(workspace) if name.startswith("full-")}
    ran = {
        r.args["path"]
        for r in journaled
        if isinstance(r, IntentRecord) and str(r.args.get("path", "")).startswith("full-")
    }
    assert written <= ran


# -- a journal removed or replaced under the pool --------------------------------------------

#: Calls of each round around a removal: a write, a read and a bash each.
ROUND = 3


async def a_round(pool: Pool, tag: str) -> list[str]:
    """Side effects and read-only calls, each ok; their call ids."""
    ids = []
    for i in range(ROUND):
        for tool, args in [
            ("write", {"path": f"{tag}-{i}.txt", "content": tag}),
            ("read", {"path": f"{tag}-{i}.txt"}),
            ("bash", {"command": f"echo {tag}-{i}"}),
        ]:
            outcome = await pool.call(tool, args)
            assert outcome.ok, outcome.error
            ids.append(outcome.call_id)
    return ids


def assert_whole(journal: Path, ran: list[str], refused: tuple[str, ...] = ()) -> None:
    """The journal at ``journal`` holds exactly these calls, each intent once and before its
    one outcome, nothing else: no call that ran is missing for the reader nor for ``run
    --resume``, which runs again only those the journal refused."""
    call_ids = [*ran, *refused]
    journaled = records(journal)
    assert not journal.is_symlink()
    intents = [r.call_id for r in journaled if isinstance(r, IntentRecord)]
    outcomes = [r.call_id for r in journaled if isinstance(r, OutcomeRecord)]
    assert sorted(intents) == sorted(call_ids), "a call's intent is missing, or repeated"
    assert sorted(outcomes) == sorted(call_ids), "a call's outcome is missing, or repeated"
    order = [(type(r).__name__, r.call_id) for r in journaled]
    for call_id in call_ids:
        assert order.index(("IntentRecord", call_id)) < order.index(("OutcomeRecord", call_id))
    scan = read_journal(journal)
    assert interrupted(scan) == []
    assert in_doubt_calls(scan) == []
    assert resume_plan(journal).finished == set(ran), "resume would repeat a call"
    temps = [n for n in os.listdir(journal.parent) if n.startswith(f".{journal.name}.sbx-keep")]
    assert temps == [], "a temp copy was left behind"


async def test_a_journal_removed_under_the_pool_is_put_back_whole(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        ids = await a_round(pool, "before")
        # A call in flight while the file goes: its outcome must still follow its intent.
        slow = asyncio.ensure_future(
            pool.call("bash", {"command": "while [ ! -e go ]; do sleep 0.01; done"})
        )
        await wait_for(lambda: len(pool.running()) == 1, what="the slow call running")
        os.unlink(journal)
        os.unlink(f"{journal}.lock")  # the lock file too: a second coordinator must not get in
        ids += await a_round(pool, "after")
        assert pool.journal is not None
        await pool.journal.flush()
        # Already back while the pool runs, with what came before.
        assert set(ids) <= {r.call_id for r in records(journal) if isinstance(r, OutcomeRecord)}
        with pytest.raises(JournalLocked):
            await Journal.open(journal, pool.config.journal)
        (workspace / "go").touch()
        assert (await slow).ok
        ids.append(slow.result().call_id)
        ids += await a_round(pool, "last")
    assert_whole(journal, ids)
    # J.d (change sets) is made, and hidden from the calls, when the pool opens its journal.
    expected = ["journal.jsonl", "journal.jsonl.d", "journal.jsonl.lock", "ws"]
    assert sorted(os.listdir(tmp_path)) == expected


def foreign_journal(path: Path) -> bytes:
    """Another run's journal: records of calls that are not ours."""
    path.write_bytes(
        b"".join(
            encoder.encode(r) + b"\n"
            for r in [_intent("theirs", "bash"), _outcome("theirs", "bash", "ok", started=True)]
        )
    )
    return path.read_bytes()


def garbage(path: Path) -> bytes:
    path.write_bytes(b"\x00not a journal, no newline \xff")
    return path.read_bytes()


@pytest.mark.parametrize("content", [foreign_journal, garbage])
@pytest.mark.parametrize("how", ["renamed over it", "written after an unlink"])
async def test_a_journal_replaced_under_the_pool_is_put_back_whole_and_the_other_file_kept(
    workspace: Path, tmp_path: Path, how: str, content: Callable[[Path], bytes]
) -> None:
    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        ids = await a_round(pool, "before")
        if how == "renamed over it":
            theirs = content(tmp_path / "other.jsonl")
            os.rename(tmp_path / "other.jsonl", journal)
        else:
            os.unlink(journal)
            theirs = content(journal)
        ids += await a_round(pool, "after")
    assert_whole(journal, ids)  # their records are not merged into ours
    kept = [name for name in os.listdir(tmp_path) if name.startswith("journal.jsonl.replaced-")]
    assert len(kept) == 1, os.listdir(tmp_path)
    assert (tmp_path / kept[0]).read_bytes() == theirs, "what replaced the journal was changed"


@pytest.mark.parametrize("what", ["symlink", "directory"])
async def test_a_journal_replaced_by_a_symlink_or_a_directory_is_put_back_without_following(
    workspace: Path, tmp_path: Path, what: str
) -> None:
    journal = tmp_path / "journal.jsonl"
    victim = tmp_path / "victim"
    victim.write_text("not yours\n")
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        ids = await a_round(pool, "before")
        os.unlink(journal)
        if what == "symlink":
            journal.symlink_to(victim)
        else:
            journal.mkdir()
            (journal / "inside").write_text("kept")
        ids += await a_round(pool, "after")
    assert_whole(journal, ids)
    assert victim.read_text() == "not yours\n"
    [kept] = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith("journal.jsonl.repl")]
    if what == "symlink":
        assert os.readlink(kept) == str(victim)
    else:
        assert (kept / "inside").read_text() == "kept"


@pytest.mark.parametrize("how", ["removed", "moved"])
async def test_a_journal_whose_directory_went_refuses_side_effects(
    workspace: Path, tmp_path: Path, how: str
) -> None:
    directory = tmp_path / "logs"
    journal = directory / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        ids = await a_round(pool, "before")
        if how == "removed":
            shutil.rmtree(directory)
        else:
            directory.rename(tmp_path / "moved")
        refused = await pool.call("write", {"path": "refused.txt", "content": "x"})
        assert (refused.status, refused.started) == (Status.ERROR, False)
        assert refused.error is not None
        assert "directory was removed or moved" in refused.error
        assert not (workspace / "refused.txt").exists()
        read = await pool.call("read", {"path": "hello.txt"})  # read-only calls still run
        assert read.ok
        ids.append(read.call_id)
        assert not directory.exists(), "the journal's directory was made again"
        if how == "moved":
            # Back where it was: the same file is at the path again, and the journal goes on.
            (tmp_path / "moved").rename(directory)
            ids += await a_round(pool, "after")
    if how == "moved":
        assert_whole(journal, ids, refused=(refused.call_id,))


async def test_a_lock_file_replaced_by_a_symlink_is_not_followed(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    victim = tmp_path / "victim"
    victim.write_text("not yours\n")
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        ids = await a_round(pool, "before")
        os.unlink(journal)
        os.unlink(f"{journal}.lock")
        os.symlink(victim, f"{journal}.lock")
        refused = await pool.call("write", {"path": "refused.txt", "content": "x"})
        assert (refused.status, refused.started) == (Status.ERROR, False)
        assert refused.error is not None
        assert "ELOOP" in refused.error
        assert victim.read_text() == "not yours\n", "the lock was taken through a symlink"
        os.unlink(f"{journal}.lock")
        ids += await a_round(pool, "after")
        with pytest.raises(JournalLocked):
            await Journal.open(journal, pool.config.journal)
    assert_whole(journal, ids, refused=(refused.call_id,))


async def test_a_journal_taken_by_another_coordinator_meanwhile_is_left_to_it(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        ids = await a_round(pool, "before")
        os.unlink(journal)
        os.unlink(f"{journal}.lock")
        other = await Journal.open(journal, pool.config.journal)  # gets in before us
        try:
            await other.intent(call_id="theirs", tool="bash", args={}, cwd=".", timeout_s=None)
            refused = await pool.call("write", {"path": "refused.txt", "content": "x"})
            assert (refused.status, refused.started) == (Status.ERROR, False)
            assert refused.error is not None
            assert "another coordinator" in refused.error
            assert not (workspace / "refused.txt").exists()
            assert [r.call_id for r in records(journal)] == ["theirs"], "their journal touched"
            theirs = journal.read_bytes()
        finally:
            await other.close()
        # Gone, and its lock with it: ours goes back to the path, theirs aside.
        ids += await a_round(pool, "after")
    assert_whole(journal, ids, refused=(refused.call_id,))
    [kept] = [tmp_path / n for n in os.listdir(tmp_path) if n.startswith("journal.jsonl.repl")]
    assert kept.read_bytes() == theirs


# -- stop or crash mid-batch, then resume ----------------------------------------------------

APPENDS = 12
PARALLEL = 4


def append_calls(path: Path) -> Path:
    """Calls that each append their number to ``log`` once, then wait until ``fast`` exists."""
    lines = [
        {
            "id": f"append-{i}",
            "tool": "bash",
            "args": {"command": f"echo {i} >> log; while [ ! -e fast ]; do sleep 0.01; done"},
            "timeout": DEADLINE_S,
        }
        for i in range(APPENDS)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def appended(ws: Path) -> Counter[str]:
    log = ws / "log"
    return Counter(log.read_text().split()) if log.exists() else Counter()


def append_batch(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A workspace, a journal, and ``sandbx-pool run`` arguments for the batch of appends."""
    ws = tmp_path / "ws"
    ws.mkdir()
    calls = append_calls(tmp_path / "calls.jsonl")
    journal = tmp_path / "journal.jsonl"
    config = marked_toml(tmp_path / "marked.toml")
    argv = ["run", str(calls), "--workspace", str(ws), "--parallel", str(PARALLEL)]
    argv += ["--journal", str(journal), "--config", str(config)]
    return ws, journal, argv


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
def test_resume_never_runs_an_append_twice(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], stop: signal.Signals
) -> None:
    ws, journal, argv = append_batch(tmp_path)

    first = start_cli(argv, tmp_path / "first")
    processes.append(first)
    # PARALLEL appends landed: those calls are in flight, the rest have not started.
    wait_until(lambda: sum(appended(ws).values()) >= PARALLEL, "the first appends", first)
    wait_until(lambda: count_in(journal, b'"kind":"started"') >= PARALLEL, "started", first)
    os.kill(first.pid, stop)
    first.wait(DEADLINE_S)
    in_flight = set(appended(ws))
    assert len(in_flight) == PARALLEL

    (ws / "fast").touch()
    second = start_cli([*argv, "--resume"], tmp_path / "second")
    processes.append(second)
    code = second.wait(DEADLINE_S)
    counts = appended(ws)
    assert counts == Counter(str(i) for i in range(APPENDS)), "an append ran twice, or never"
    assert code == 1, "calls were skipped in doubt: the run is not complete"
    out = (tmp_path / "second.out").read_text()
    assert f"skipped {PARALLEL} call(s) in doubt" in out
    for number in in_flight:
        assert f"append-{number}  bash" in out
    assert "--rerun-started" in out
    # `journal in-doubt` lists the calls the resume skipped, whether the stop gave them an
    # outcome (SIGTERM: cancelled by shutdown after they started) or none (SIGKILL).
    listed = subprocess.run(
        [*cli_argv(), "journal", "in-doubt", str(journal)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert sorted(line.split()[0] for line in listed) == sorted(f"append-{n}" for n in in_flight)
    why = "no outcome" if stop is signal.SIGKILL else "stopped after it started"
    assert all(why in line for line in listed), listed


def test_a_completing_resume_leaves_nothing_in_doubt(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ws, journal, argv = append_batch(tmp_path)
    first = start_cli(argv, tmp_path / "first")
    processes.append(first)
    wait_until(lambda: count_in(journal, b'"kind":"started"') >= PARALLEL, "started", first)
    os.kill(first.pid, signal.SIGKILL)
    first.wait(DEADLINE_S)
    assert in_doubt_calls(read_journal(journal)), "the crash left calls in doubt"

    (ws / "fast").touch()
    second = start_cli([*argv, "--resume", "--rerun-started"], tmp_path / "second")
    processes.append(second)
    assert second.wait(DEADLINE_S) == 0, (tmp_path / "second.err").read_text()[-2000:]
    scan = read_journal(journal)
    assert (in_doubt_calls(scan), interrupted(scan)) == ([], [])
    listed = subprocess.run(
        [*cli_argv(), "journal", "in-doubt", str(journal)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert listed.stdout == ""
    assert "no calls in doubt" in listed.stderr


# -- what settles a call, what resume skips ---------------------------------------------------


def _journal_of(path: Path, records: list[JournalRecord]) -> Path:
    path.write_bytes(b"".join(encoder.encode(r) + b"\n" for r in records))
    return path


def _intent(call_id: str, tool: str) -> IntentRecord:
    return IntentRecord(call_id=call_id, time=0.0, tool=tool, args={}, cwd=".")


def _outcome(
    call_id: str, tool: str, status: str, *, started: bool, killed_by: str | None = None
) -> OutcomeRecord:
    return OutcomeRecord(
        call_id=call_id, time=0.0, tool=tool, status=status, started=started, killed_by=killed_by
    )


def test_resume_reruns_calls_lost_with_their_ray_node(tmp_path: Path) -> None:
    def lost(call_id: str, tool: str) -> OutcomeRecord:
        return OutcomeRecord(
            call_id=call_id, time=0.0, tool=tool, status="crashed", started=True, reason=NODE_LOST
        )

    journal = _journal_of(
        tmp_path / "j.jsonl",
        [
            _intent("read-lost", "read"),
            lost("read-lost", "read"),
            _intent("bash-lost", "bash"),
            lost("bash-lost", "bash"),
            _intent("bash-crashed", "bash"),
            _outcome("bash-crashed", "bash", "crashed", started=True),
        ],
    )
    plan = resume_plan(journal)
    assert plan.finished == {"bash-crashed"}  # a worker's crash is an end; a node's loss not
    assert plan.in_doubt == {"bash-lost": "bash"}  # it may have run before the node went


def test_a_later_outcome_settles_an_attempt_a_crash_left_in_doubt(tmp_path: Path) -> None:
    journal = _journal_of(
        tmp_path / "j.jsonl",
        [
            _intent("crashed", "bash"),  # the coordinator died here
            _intent("crashed", "bash"),  # the resumed run's attempt...
            _outcome("crashed", "bash", "ok", started=True),  # ...ended
            _intent("still", "edit"),
        ],
    )
    scan = read_journal(journal)
    assert [call.call_id for call in in_doubt_calls(scan)] == ["still"]
    assert [r.call_id for r in interrupted(scan)] == ["still"]


def test_resume_skips_side_effects_that_may_have_happened(tmp_path: Path) -> None:
    shutdown = {"status": "cancelled", "killed_by": "shutdown"}
    journal = _journal_of(
        tmp_path / "j.jsonl",
        [
            _intent("bash-cut", "bash"),
            _outcome("bash-cut", "bash", **shutdown, started=True),
            _intent("bash-queued", "bash"),
            _outcome("bash-queued", "bash", **shutdown, started=False),
            _intent("edit-crashed", "edit"),
            StartedRecord(call_id="edit-crashed", time=0.0, pid=7),
            _intent("bash-crashed-unstarted", "bash"),  # no started record proves nothing
            _intent("write-crashed", "write"),
            StartedRecord(call_id="write-crashed", time=0.0, pid=8),
            _intent("read-cut", "read"),
            _outcome("read-cut", "read", **shutdown, started=True),
            _intent("refused", "bash"),
            OutcomeRecord(
                call_id="refused",
                time=0.0,
                tool="bash",
                status="error",
                reason=JOURNAL_REFUSED,
            ),
            _intent("done", "bash"),
            _outcome("done", "bash", "ok", started=True),
            _intent("rerun", "bash"),
            _outcome("rerun", "bash", **shutdown, started=True),
            _intent("rerun", "bash"),
            _outcome("rerun", "bash", "ok", started=True),
        ],
    )
    plan = resume_plan(journal)
    assert plan.finished == {"done", "rerun"}
    assert plan.in_doubt == {
        "bash-cut": "bash",
        "edit-crashed": "edit",
        "bash-crashed-unstarted": "bash",
    }
    assert plan.skip(rerun_started=False) == {"done", "rerun", *plan.in_doubt}
    assert plan.skip(rerun_started=True) == {"done", "rerun"}


async def test_a_journal_cut_short_under_the_pool_goes_on_after_a_whole_line(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        assert (await pool.call("write", {"path": "a.txt", "content": "a"})).ok
        slow = asyncio.ensure_future(
            pool.call("bash", {"command": "while [ ! -e go ]; do sleep 0.01; done"})
        )
        await wait_for(lambda: len(pool.running()) == 1, what="the slow call running")
        assert pool.journal is not None
        await pool.journal.flush()
        os.truncate(journal, 10)  # mid-way through the first line
        b = await pool.call("write", {"path": "b.txt", "content": "b"})
        assert b.ok, b.error
        (workspace / "go").touch()
        assert (await slow).ok
    scan = read_journal(journal)
    assert (scan.torn_tail, scan.corrupt_lines) == (False, [1]), "the cut line only is lost"
    assert interrupted(scan) == [], "every outcome after the cut follows its intent"
    assert {r.call_id for r in scan.records if isinstance(r, IntentRecord)} == {
        slow.result().call_id,
        b.call_id,
    }


async def test_calls_after_one_in_doubt_are_held_back(workspace: Path, tmp_path: Path) -> None:
    lines = [
        {"id": "doubtful", "tool": "bash", "args": {"command": "echo x >> log"}},
        {"id": "next", "tool": "bash", "args": {"command": "echo y >> log"}, "after": ["doubtful"]},
        {"id": "then", "tool": "read", "args": {"path": "log"}, "after": ["next"]},
        {"id": "free", "tool": "write", "args": {"path": "free.txt", "content": "f"}},
    ]
    path = tmp_path / "calls.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    calls = load_batch(path).calls
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=marked_config()) as pool:
        report = await run_batch(pool, calls, parallel=2, skip={"doubtful"}, in_doubt={"doubtful"})
    assert [spec.call_id for spec, _ in report.results] == ["free"]
    assert report.in_doubt == ["doubtful"]
    assert report.held == ["next", "then"]
    assert report.not_run == 2
    assert not report.complete
    assert not (workspace / "log").exists()
