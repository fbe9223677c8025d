"""``sandbx-pool run`` and ``demo``: the batch file, the runner, progress, signals and resume."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import MARKER, marked_config
from helpers import wait_until_sync

from sandbx_pool import CancelToken, Outcome, Pool, Status
from sandbx_pool.batch.calls import (
    MAX_REPORTED,
    BatchFileError,
    CallSpec,
    canonical_json,
    derived_id,
    load_batch,
    parse_batch,
)
from sandbx_pool.batch.progress import Progress, format_summary
from sandbx_pool.batch.run import BatchReport, finished_call_ids, run_batch
from sandbx_pool.cli.main import build_parser
from sandbx_pool.journal.reader import interrupted, read_journal
from sandbx_pool.journal.records import IntentRecord, OutcomeRecord, encoder
from sandbx_pool.outcome import KilledBy

DEADLINE_S = 60.0
SIGNAL_BATCH = 2000
REPO = Path(__file__).resolve().parents[1]

#: A bash call that marks that it began, then waits for ``go`` in the workspace.
WAIT_FOR_GO = ": > up-{}; while [ ! -e go ]; do sleep 0.01; done"


# -- helpers -------------------------------------------------------------------------------


def write_lines(path: Path, items: list[Any]) -> Path:
    path.write_text("".join((i if isinstance(i, str) else json.dumps(i)) + "\n" for i in items))
    return path


def problems_of(tmp_path: Path, lines: list[str] | bytes) -> BatchFileError:
    path = tmp_path / "calls.jsonl"
    if isinstance(lines, bytes):
        path.write_bytes(lines)
    else:
        write_lines(path, list(lines))
    with pytest.raises(BatchFileError) as caught:
        load_batch(path)
    return caught.value


def make_workspace(root: Path, files: int = 20) -> Path:
    ws = root / "ws"
    ws.mkdir()
    for i in range(files):
        (ws / f"f{i}.txt").write_text(f"line one {i}\nneedle {i}\nline three\n")
    return ws


def mixed_calls(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """Mostly cheap reads, greps and ls, some writes, a few short sleeps. Ids are derived."""
    rng = random.Random(seed)
    calls: list[dict[str, Any]] = []
    for i in range(count):
        roll = rng.random()
        if roll < 0.50:
            calls.append({"tool": "read", "args": {"path": f"f{i % 20}.txt"}})
        elif roll < 0.70:
            calls.append({"tool": "grep", "args": {"pattern": "needle", "glob": "f1*.txt"}})
        elif roll < 0.85:
            calls.append({"tool": "ls", "args": {}})
        elif roll < 0.97:
            calls.append({"tool": "write", "args": {"path": f"out/w{i}.txt", "content": f"{i}\n"}})
        else:
            calls.append({"tool": "bash", "args": {"command": "sleep 0.05"}, "timeout": 10})
    return calls


def marked_toml(path: Path, extra: str = "") -> Path:
    """A config that marks bash's commands as this test session's (the leftover check)."""
    path.write_text(f'[env]\nset = {{ {MARKER} = "{os.environ[MARKER]}" }}\n{extra}')
    return path


def start_cli(argv: list[str], out: Path, cwd: Path | None = None) -> subprocess.Popen[bytes]:
    """``python -m sandbx_pool.cli ARGV`` with stdout and stderr in files (never a full pipe),
    run from ``cwd`` if given (the package imported is still this checkout's)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with open(out.with_suffix(".out"), "wb") as stdout, open(out.with_suffix(".err"), "wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "sandbx_pool.cli", *argv],
            stdout=stdout,
            stderr=err,
            cwd=cwd,
            env={**os.environ, "PYTHONPATH": path},
        )


def journal_command(*argv: str) -> str:
    """``sandbx-pool journal ARGV``'s output (it must succeed)."""
    return subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "journal", *argv],
        capture_output=True,
        text=True,
        check=True,
        timeout=DEADLINE_S,
    ).stdout


def printed_command(out: Path, prefix: str) -> list[str]:
    """The words of the one command printed after ``prefix`` in the file ``out``."""
    [line] = [line for line in out.read_text().splitlines() if prefix in line]
    return shlex.split(line.split(prefix, 1)[1])


def wait_until(predicate: Callable[[], bool], what: str, proc: subprocess.Popen[bytes]) -> None:
    """Until ``predicate`` holds, failing at once if the command ``proc`` exits first."""

    def holds() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"the command exited ({proc.returncode}) before {what}")
        return predicate()

    wait_until_sync(holds, DEADLINE_S, what)


def count_in(path: Path, needle: bytes) -> int:
    try:
        return path.read_bytes().count(needle)
    except FileNotFoundError:
        return 0


def run_command(argv: list[str]) -> int:
    """Run a batch command in this process, without configuring log sinks."""
    args: argparse.Namespace = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


# -- the batch file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"tool": "read", "args": {]', "bad JSON"),
        ('{"args": {"path": "a"}}', 'missing "tool"'),
        ('{"tool": "read", "args": ["a"]}', '"args" must be an object, got an array'),
        ('{"tool": "read", "args": "a"}', '"args" must be an object'),
        ('{"tool": "rm", "args": {}}', "unknown tool 'rm'"),
        ('{"tool": 3}', '"tool" must be a string'),
        ('["read", {}]', "expected a JSON object, got an array"),
        ('{"tool": "ls", "timeout": -1}', '"timeout" must be a positive number'),
        ('{"tool": "ls", "timeout": "5s"}', '"timeout" must be a number'),
        ('{"tool": "ls", "timout": 5}', "unknown key 'timout'"),
        ('{"tool": "ls", "id": ""}', '"id" must be a non-empty string'),
        ('{"tool": "ls", "id": "first"}', "id 'first' is already used by line 1"),
        ('{"tool": "ls", "after": ["later"]}', "'later' is not the id of an earlier line"),
        ('{"tool": "ls", "workspace": "../up"}', '"workspace" must be a folder under'),
        ('{"tool": "ls", "workspace": "/abs"}', '"workspace" must be a folder under'),
        ('{"tool": "ls", "workspace": 3}', '"workspace" must be a non-empty string'),
    ],
)
def test_a_bad_line_is_named_with_what_is_wrong(tmp_path: Path, line: str, message: str) -> None:
    error = problems_of(tmp_path, ['{"tool": "ls", "id": "first"}', "", line])
    assert [p.line for p in error.problems] == [3]  # blank lines count: editors number them
    assert message in error.problems[0].message
    assert f"calls.jsonl:3: {error.problems[0].message}" in str(error)


def test_meta_is_kept_out_of_the_way(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"tool": "ls", "meta": {"episode": 3, "step": 1}}])
    [spec] = load_batch(path).calls
    assert spec.call_id == parse_batch(['{"tool": "ls"}']).calls[0].call_id


async def test_a_line_runs_in_its_own_workspace_under_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "ep-1").mkdir(parents=True)
    (root / "a").write_text("the root's")
    lines = [
        {"id": "w", "tool": "write", "args": {"path": "a", "content": "x"}, "workspace": "ep-1"},
        {"id": "up", "tool": "read", "args": {"path": "../a"}, "workspace": "ep-1"},
    ]
    batch = load_batch(write_lines(tmp_path / "c.jsonl", lines))
    assert [spec.workspace for spec in batch.calls] == ["ep-1", "ep-1"]
    async with Pool(root, config=marked_config(pool={"workers": 2})) as pool:
        report = await run_batch(pool, batch.calls, parallel=1)
    assert (root / "ep-1" / "a").read_text() == "x"
    statuses = {spec.call_id: outcome.status for spec, outcome in report.results}
    assert statuses == {"w": Status.OK, "up": Status.DENIED}  # confined to ep-1, not the root


def test_session_lines_are_checked_ordered_and_part_of_derived_ids(tmp_path: Path) -> None:
    error = problems_of(
        tmp_path, ['{"tool": "bash", "args": {"command": "true"}, "session": "a/b"}']
    )
    assert '"session": bad session id' in error.problems[0].message
    lines = [
        {"id": "a1", "tool": "bash", "args": {"command": "cd src"}, "session": "a"},
        {"id": "b1", "tool": "bash", "args": {"command": "true"}, "session": "b"},
        {"id": "a2", "tool": "bash", "args": {"command": "pwd"}, "session": "a"},
        {"tool": "ls", "session": "a"},
    ]
    calls = load_batch(write_lines(tmp_path / "c.jsonl", lines)).calls
    assert [(c.session, c.after) for c in calls[:3]] == [("a", ()), ("b", ()), ("a", ("a1",))]
    assert calls[3].after == ("a2",)
    plain = parse_batch(['{"tool": "ls"}']).calls[0]
    assert calls[3].call_id != plain.call_id


async def test_session_lines_run_in_file_order_across_lanes(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path)
    (workspace / "src").mkdir()
    lines = [
        {"id": f"{name}{i}", "tool": "bash", "session": name,
         "args": {"command": f'export L="${{L-}}{i}"; echo "$L"'}}
        for i in range(4) for name in ("a", "b")
    ]  # fmt: skip
    batch = load_batch(write_lines(tmp_path / "c.jsonl", lines))
    async with Pool(workspace, config=marked_config(pool={"workers": 4})) as pool:
        report = await run_batch(pool, batch.calls, parallel=4)
        outputs = {spec.call_id: outcome.value["stdout"] for spec, outcome in report.results}
        assert await pool.session("a") == {"cwd": str(workspace), "env": {"L": "0123"}}
    assert outputs["a3"] == outputs["b3"] == "0123\n"


def test_resume_finds_each_session_as_the_journal_left_it(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path)
    (workspace / "src").mkdir()
    journal = tmp_path / "journal.jsonl"
    config = marked_toml(tmp_path / "marked.toml")
    first = [{"id": "1", "tool": "bash", "args": {"command": "cd src; export R=1"}, "session": "s"}]
    second = [
        *first,
        {"id": "2", "tool": "bash", "args": {"command": 'pwd > ../where; echo "$R" >> ../where'},
         "session": "s"},
    ]  # fmt: skip
    common = ["--workspace", str(workspace), "--journal", str(journal), "--config", str(config)]
    path = write_lines(tmp_path / "calls.jsonl", first)
    assert run_command(["run", str(path), *common]) == 0
    write_lines(path, second)
    assert run_command(["run", str(path), *common, "--resume"]) == 0
    assert (workspace / "where").read_text() == f"{workspace / 'src'}\n1\n"


def test_invalid_utf8_is_a_line_problem(tmp_path: Path) -> None:
    error = problems_of(tmp_path, b'{"tool": "ls"}\n{"tool": "read", "args": {"path": "\xff"}}\n')
    assert [(p.line, p.message) for p in error.problems] == [(2, "not UTF-8 (byte 36)")]


def test_every_bad_line_is_listed_up_to_a_bound(tmp_path: Path) -> None:
    error = problems_of(tmp_path, ['{"tool": "nope"}'] * (MAX_REPORTED + 5))
    assert len(error.problems) == MAX_REPORTED
    assert error.total == MAX_REPORTED + 5
    assert str(error).endswith("... and 5 more problem(s)")


def test_arguments_the_tool_refuses_are_warnings_not_file_errors(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "c.jsonl", [{"tool": "ls"}, {"tool": "read", "args": {"p": 1}}])
    batch = load_batch(path)
    assert len(batch.calls) == 2
    assert [w.line for w in batch.warnings] == [2]
    assert "read" in batch.warnings[0].message


def test_a_bad_file_exits_2_naming_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "calls.jsonl", [{"tool": "ls"}, '{"tool": "read", "args": 5}'])
    assert run_command(["run", str(path), "--workspace", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: " in err
    assert '"args" must be an object' in err


def test_a_bad_config_file_exits_2_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "calls.jsonl", [{"tool": "ls"}])
    config = tmp_path / "bad.toml"
    config.write_text("[calls]\ntimeout_s = -1\n")
    argv = ["run", str(path), "--workspace", str(tmp_path), "--config", str(config)]
    assert run_command(argv) == 2
    assert f"{config}: calls.timeout_s: " in capsys.readouterr().err


def test_resume_without_a_journal_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_lines(tmp_path / "calls.jsonl", [{"tool": "ls"}])
    assert run_command(["run", str(path), "--workspace", str(tmp_path), "--resume"]) == 2
    assert "--resume needs --journal" in capsys.readouterr().err


def test_derived_ids_are_stable() -> None:
    def ids(*lines: str) -> list[str]:
        return [spec.call_id for spec in parse_batch(lines).calls]

    read_a = '{"tool": "read", "args": {"path": "a", "limit": 2}}'
    # Key order and spacing do not matter; the content does.
    assert ids(read_a) == ids('{"args":{"limit":2,"path":"a"},"tool":"read"}')
    assert ids(read_a) != ids('{"tool": "read", "args": {"path": "b", "limit": 2}}')
    # The position does not matter: ids survive lines added or removed around them.
    assert ids('{"tool": "ls"}', read_a)[1] == ids(read_a)[0]
    # Identical lines stay distinct calls, numbered by occurrence.
    first, second = ids(read_a, read_a)
    assert first != second
    assert (first.rsplit("-", 1)[1], second.rsplit("-", 1)[1]) == ("0", "1")
    # 5 and 5.0 seconds are the same timeout; 6 is not.
    assert ids('{"tool": "ls", "timeout": 5}') == ids('{"tool": "ls", "timeout": 5.0}')
    assert ids('{"tool": "ls", "timeout": 5}') != ids('{"tool": "ls", "timeout": 6}')
    # The same in any process, on any day: a pinned value.
    canonical = canonical_json("ls", {}, None, None)
    assert canonical == '{"args":{},"timeout":null,"tool":"ls"}'
    assert ids('{"tool": "ls"}') == [derived_id(canonical, 0)] == ["39674252ac2bb87a-0"]
    # Explicit ids are kept as given (integers as their text).
    assert ids('{"tool": "ls", "id": "x"}', '{"tool": "ls", "id": 7}') == ["x", "7"]


# -- the runner, in process ----------------------------------------------------------------


async def test_a_few_hundred_mixed_calls_are_all_accounted_for(tmp_path: Path) -> None:
    ws = make_workspace(tmp_path)
    items = mixed_calls(240)
    chains = 10
    for n in range(chains):  # write, then edit, then read the same file: ordered by `after`
        items += [
            {"id": f"w{n}", "tool": "write", "args": {"path": f"c{n}.txt", "content": "v=1\n"}},
            {
                "id": f"e{n}",
                "tool": "edit",
                "args": {"path": f"c{n}.txt", "old_string": "1", "new_string": "2"},
                "after": [f"w{n}"],
            },
            {"id": f"r{n}", "tool": "read", "args": {"path": f"c{n}.txt"}, "after": [f"e{n}"]},
        ]
    items += [
        {"id": "missing", "tool": "read", "args": {"path": "nope.txt"}},
        {"id": "outside", "tool": "read", "args": {"path": "../../etc/passwd"}},
        {"id": "slow", "tool": "bash", "args": {"command": "sleep 5"}, "timeout": 0.2},
        {"id": "bad-args", "tool": "read", "args": {"path": 3}},
    ]
    batch = load_batch(write_lines(tmp_path / "calls.jsonl", items))
    journal = tmp_path / "journal.jsonl"
    async with Pool(ws, journal=journal, config=marked_config(pool={"workers": 8})) as pool:
        report = await run_batch(pool, batch.calls, parallel=8)

    assert report.complete
    assert not report.stopped
    assert report.failure is None
    assert len(report.results) == len(batch.calls) == len(items)
    status = {spec.call_id: outcome for spec, outcome in report.results}
    assert status["missing"].status is Status.ERROR
    assert status["outside"].status is Status.DENIED
    assert status["slow"].status is Status.TIMEOUT
    assert status["bad-args"].status is Status.ERROR
    for n in range(chains):
        assert status[f"e{n}"].status is Status.OK
        value = status[f"r{n}"].value
        assert value is not None
        assert value["content"] == "v=2\n"

    scan = read_journal(journal)
    intents = Counter(r.call_id for r in scan.records if isinstance(r, IntentRecord))
    outcomes = Counter(r.call_id for r in scan.records if isinstance(r, OutcomeRecord))
    expected = {spec.call_id for spec in batch.calls}
    assert set(intents) == set(outcomes) == expected
    assert set(intents.values()) == set(outcomes.values()) == {1}
    # `after` means "finished before": each edit's intent follows its write's outcome.
    order = {
        (type(r).__name__, r.call_id): i
        for i, r in enumerate(scan.records)
        if isinstance(r, IntentRecord | OutcomeRecord)
    }
    for n in range(chains):
        assert order[("OutcomeRecord", f"w{n}")] < order[("IntentRecord", f"e{n}")]
        assert order[("OutcomeRecord", f"e{n}")] < order[("IntentRecord", f"r{n}")]


async def test_at_most_parallel_calls_in_flight_from_a_fixed_set_of_lanes(
    workspace: Path, tmp_path: Path
) -> None:
    calls = parse_batch([json.dumps({"tool": "ls", "id": str(i)}) for i in range(60)]).calls
    in_flight = peak = 0
    lanes_seen: set[int] = set()

    def on_submit(spec: CallSpec) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        lanes_seen.add(sum(t.get_name().startswith("batch-lane") for t in asyncio.all_tasks()))

    def on_outcome(spec: CallSpec, outcome: Outcome) -> None:
        nonlocal in_flight
        in_flight -= 1

    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config(pool={"workers": 8})) as pool:
        report = await run_batch(
            pool, calls, parallel=3, on_submit=on_submit, on_outcome=on_outcome
        )
    assert report.complete
    assert peak == 3
    assert max(lanes_seen) == 3  # not one task per line


async def test_a_stop_takes_no_more_calls_and_counts_the_rest(
    workspace: Path, tmp_path: Path
) -> None:
    calls = parse_batch([json.dumps({"tool": "ls", "id": str(i)}) for i in range(80)]).calls
    stop = asyncio.Event()

    def on_outcome(spec: CallSpec, outcome: Outcome) -> None:
        if spec.call_id == "20":
            stop.set()

    submitted: list[str] = []
    taken_after_stop: list[str] = []

    def on_submit(spec: CallSpec) -> None:
        submitted.append(spec.call_id)
        if stop.is_set():
            taken_after_stop.append(spec.call_id)

    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config(pool={"workers": 4})) as pool:
        report = await run_batch(
            pool, calls, parallel=4, stop=stop, on_outcome=on_outcome, on_submit=on_submit
        )
    assert report.stopped
    assert not report.complete
    assert taken_after_stop == []
    # Calls finish out of order, so how many ran depends on timing; which ran does not: every
    # call taken before the stop, each with its outcome, and nothing else.
    assert sorted(spec.call_id for spec, _ in report.results) == sorted(submitted)
    assert len(report.results) >= 21
    assert report.not_run == 80 - len(report.results)
    summary = "\n".join(format_summary(report))
    assert f"{report.not_run} of 80 call(s) stopped" in summary
    assert "--resume" not in summary  # the command that ran the batch names the next one


async def test_a_token_cancels_its_call(workspace: Path, tmp_path: Path) -> None:
    os.mkfifo(workspace / "fifo")
    calls = parse_batch(['{"id": "blocked", "tool": "read", "args": {"path": "fifo"}}']).calls
    token = CancelToken()
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=marked_config()) as pool:
        report = await run_batch(
            pool,
            calls,
            parallel=1,
            tokens={"blocked": token},
            on_submit=lambda _: asyncio.get_running_loop().call_later(0.2, token.cancel, "stop"),
        )
    [(_, outcome)] = report.results
    assert (outcome.status, outcome.killed_by, outcome.reason) == (
        Status.CANCELLED,
        KilledBy.TOKEN,
        "stop",
    )


def test_resume_reruns_calls_cancelled_by_shutdown_and_in_doubt(tmp_path: Path) -> None:
    def outcome(call_id: str, status: str, killed_by: str | None = None) -> OutcomeRecord:
        return OutcomeRecord(
            call_id=call_id, time=0.0, tool="read", status=status, killed_by=killed_by
        )

    def intent(call_id: str) -> IntentRecord:
        return IntentRecord(call_id=call_id, time=0.0, tool="read", args={}, cwd=".")

    records = [
        intent("ok"), outcome("ok", "ok"),
        intent("failed"), outcome("failed", "error"),
        intent("timed-out"), outcome("timed-out", "timeout", "timeout"),
        intent("by-token"), outcome("by-token", "cancelled", "token"),
        intent("by-shutdown"), outcome("by-shutdown", "cancelled", "shutdown"),
        intent("in-doubt"),
        intent("again"), outcome("again", "cancelled", "shutdown"),
        intent("again"), outcome("again", "ok"),
    ]  # fmt: skip
    path = tmp_path / "journal.jsonl"
    path.write_bytes(b"".join(encoder.encode(r) + b"\n" for r in records))
    assert finished_call_ids(path) == {"ok", "failed", "timed-out", "by-token", "again"}


# -- progress and summary ------------------------------------------------------------------


def fake_outcome(call_id: str, status: Status, duration_s: float = 0.01) -> Outcome:
    return Outcome(call_id=call_id, tool="read", status=status, duration_s=duration_s)


def test_plain_progress_prints_every_tenth_or_every_two_seconds() -> None:
    now = [100.0]
    out = io.StringIO()
    progress = Progress(1000, out, tty=False, clock=lambda: now[0])
    for i in range(250):  # fast: a line per tenth, at most one per 0.5 s
        now[0] += 0.01
        progress.record(fake_outcome(str(i), Status.OK if i % 10 else Status.ERROR))
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["100/1000", "200/1000"]
    assert lines[0] == "progress: 100/1000 (10%) ok 90 error 10 | 100.0 calls/s, ETA 0:09"
    now[0] += 2.5  # slow: a line every two seconds even with few calls done
    progress.record(fake_outcome("x", Status.OK))
    assert out.getvalue().splitlines()[-1].split()[1] == "251/1000"
    progress.tick()  # nothing new: no line
    assert len(out.getvalue().splitlines()) == 3
    progress.finish()
    assert "\r" not in out.getvalue()


def test_tty_progress_redraws_one_line() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = Progress(4, out, tty=True, clock=lambda: now[0], width=200)
    progress.tick()
    for i, status in enumerate([Status.OK, Status.OK, Status.TIMEOUT, Status.DENIED]):
        now[0] += 0.2
        progress.record(fake_outcome(str(i), status))
        progress.tick()
    progress.finish()
    text = out.getvalue()
    assert text.count("\n") == 1
    assert text.endswith("\n")
    frames = [frame.removesuffix("\x1b[K") for frame in text.rstrip("\n").split("\r")[1:]]
    assert frames[0].startswith("[........................] 0/4 (0%)")
    assert frames[2] == "[############............] 2/4 (50%) ok 2 | 5.0 calls/s, ETA 0:00"
    assert frames[-1] == (
        "[########################] 4/4 (100%) ok 2 denied 1 timeout 1 | 5.0 calls/s, took 0:01"
    )


def spec_of(call_id: str, tool: str = "bash", line: int = 1) -> CallSpec:
    return CallSpec(line=line, call_id=call_id, tool=tool, args={})


def test_progress_names_the_calls_in_flight_and_the_longest_running() -> None:
    now = [0.0]
    progress = Progress(10, io.StringIO(), tty=False, clock=lambda: now[0])
    progress.started(spec_of("0042"))
    now[0] += 10.0
    progress.started(spec_of("0043", "read"))
    now[0] += 63.4
    assert progress.line(now[0]).endswith("| 2 in flight, longest 0042 bash 73s")
    progress.record(fake_outcome("0042", Status.TIMEOUT))  # record ends it
    assert progress.line(now[0]).endswith("| 1 in flight, longest 0043 read 63s")
    progress.record(fake_outcome("0043", Status.OK))
    assert "in flight" not in progress.line(now[0])
    progress.started(spec_of("x" * 40))
    assert progress.line(now[0]).endswith(f"longest {'x' * 21}... bash 0s")


def test_plain_progress_says_what_holds_a_stalled_batch_at_doubling_gaps() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = Progress(2, out, tty=False, clock=lambda: now[0])
    progress.started(spec_of("slow"))
    shown_at = []
    while now[0] < 200.0:  # the ticker's pace; nothing finishes
        now[0] += 0.5
        before = len(out.getvalue())
        progress.tick()
        if len(out.getvalue()) > before:
            shown_at.append(now[0])
    assert shown_at == [2.0, 6.0, 14.0, 30.0, 62.0, 122.0, 182.0]  # capped at 60 s apart
    assert out.getvalue().splitlines()[0] == (
        "progress: 0/2 (0%) | 0.0 calls/s, ETA -- | 1 in flight, longest slow bash 2s"
    )
    progress.record(fake_outcome("slow", Status.OK))  # a line, and the gaps start again
    assert out.getvalue().splitlines()[-1].startswith("progress: 1/2 (50%) ok 1 |")
    progress.started(spec_of("slower"))
    now[0] += 2.0
    progress.tick()
    assert out.getvalue().splitlines()[-1].endswith("| 1 in flight, longest slower bash 2s")
    progress.finish()
    assert "in flight" not in out.getvalue().splitlines()[-1]


def test_tty_progress_escapes_the_ids_it_shows_and_drops_the_bar_when_narrow() -> None:
    now = [0.0]
    out = io.StringIO()
    progress = Progress(4, out, tty=True, clock=lambda: now[0], width=200)
    progress.started(spec_of("a\x1b]52;c;aGk=\x07\r\x9b"))
    now[0] += 5.0
    progress.tick()
    frame = out.getvalue()
    assert frame.startswith("\r[")
    assert frame.endswith("\x1b[K")
    assert frame[1:-3].endswith(r"longest a\x1b]52;c;aGk=\x07\x0d\x9b bash 5s")
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f]", frame[1:-3])
    narrow_out = io.StringIO()
    narrow = Progress(4, narrow_out, tty=True, clock=lambda: now[0], width=80)
    narrow.started(spec_of("0042"))
    now[0] += 7.0
    narrow.tick()  # with its bar the line is 94 characters: the bar goes, the call stays
    assert narrow_out.getvalue() == (
        "\r0/4 (0%) | 0.0 calls/s, ETA -- | 1 in flight, longest 0042 bash 7s\x1b[K"
    )


def test_summary_has_statuses_tools_latency_slowest_and_journal() -> None:
    report = BatchReport(total=12, skipped=2)
    report.wall_s = 2.0
    report.journal = "/tmp/j.jsonl"
    for i in range(10):
        spec = CallSpec(line=i + 1, call_id=f"c{i}", tool="bash" if i < 3 else "read", args={})
        status = Status.TIMEOUT if i == 0 else Status.OK
        report.results.append((spec, fake_outcome(f"c{i}", status, duration_s=0.1 * (i + 1))))
    text = "\n".join(format_summary(report))
    assert "10 call(s) run in 2.0 s (5.0 calls/s); 2 skipped" in text
    assert re.search(r"^bash\s+3\s+2\s+1$", text, re.MULTILINE)
    assert re.search(r"^read\s+7\s+7\s+0$", text, re.MULTILINE)
    assert re.search(r"^all\s+10\s+9\s+1$", text, re.MULTILINE)
    assert "latency: p50 0.500 s, p99 1.000 s" in text
    slowest = re.findall(r"line (\d+)", text)
    assert slowest == ["10", "9", "8", "7", "6"]
    assert text.endswith("journal: /tmp/j.jsonl")


# -- the command, in another process: signals, resume, demo ----------------------------------


def test_sigterm_stops_the_run_and_resume_runs_each_call_once(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ws = make_workspace(tmp_path)
    calls = write_lines(tmp_path / "calls.jsonl", mixed_calls(SIGNAL_BATCH))
    expected = [spec.call_id for spec in load_batch(calls).calls]
    journal = tmp_path / "journal.jsonl"
    config = marked_toml(tmp_path / "marked.toml")
    argv = ["run", str(calls), "--workspace", str(ws), "--parallel", "8"]
    argv += ["--journal", str(journal), "--config", str(config)]

    started = time.monotonic()
    first = start_cli(argv, tmp_path / "first")
    processes.append(first)
    wait_until(lambda: count_in(journal, b'"kind":"outcome"') >= 300, "300 outcomes", first)
    os.kill(first.pid, signal.SIGTERM)  # the runner's pid alone, not its group
    assert first.wait(DEADLINE_S) == 128 + signal.SIGTERM
    stopped_after = time.monotonic() - started

    scan = read_journal(journal)
    assert (scan.torn_tail, scan.corrupt_lines) == (False, [])
    assert interrupted(scan) == [], "an intent without its outcome"
    intents = Counter(r.call_id for r in scan.records if isinstance(r, IntentRecord))
    outcomes = [r for r in scan.records if isinstance(r, OutcomeRecord)]
    assert set(intents.values()) == {1}
    assert Counter(r.call_id for r in outcomes) == intents
    assert 300 <= len(outcomes) < SIGNAL_BATCH, "the stop must land half-way"
    shutdown = [r for r in outcomes if r.killed_by == KilledBy.SHUTDOWN]
    assert shutdown, "the calls in flight are cancelled by the shutdown"
    assert {r.status for r in shutdown} == {"cancelled"}
    assert "SIGTERM" in (tmp_path / "first.err").read_text()
    assert "resume with: " in (tmp_path / "first.out").read_text()

    # Cut after a worker took them, an edit or bash may have done its side effect: resume
    # skips those (in doubt) and runs the rest again.
    doubtful = {r.call_id for r in shutdown if r.started and r.tool in ("edit", "bash")}
    started = time.monotonic()
    second = start_cli([*argv, "--resume"], tmp_path / "second")
    processes.append(second)
    code = second.wait(DEADLINE_S)
    assert code == (1 if doubtful else 0), (tmp_path / "second.err").read_text()[-2000:]
    resumed_in = time.monotonic() - started

    scan = read_journal(journal)
    assert interrupted(scan) == []
    ran = Counter(
        r.call_id
        for r in scan.records
        if isinstance(r, OutcomeRecord) and r.killed_by != KilledBy.SHUTDOWN
    )
    assert set(ran) == set(expected) - doubtful, "every line ran but those in doubt"
    assert set(ran.values()) == {1}, "a call ran twice"
    rerun = {r.call_id for r in shutdown} - doubtful
    assert rerun <= set(ran), "shutdown-cancelled calls ran on resume"
    summary = (tmp_path / "second.out").read_text()
    finished_first = len(outcomes) - len(shutdown)
    assert f"{SIGNAL_BATCH - finished_first - len(doubtful)} call(s) run" in summary
    assert f"{finished_first + len(doubtful)} skipped" in summary
    if doubtful:
        assert f"skipped {len(doubtful)} call(s) in doubt" in summary
    print(f"stopped after {stopped_after:.1f} s; resumed {resumed_in:.1f} s")


def test_a_plain_progress_line_names_the_call_that_holds_the_run(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ws = make_workspace(tmp_path, files=1)
    slow = [{"id": "slow-one", "tool": "bash", "args": {"command": "sleep 3"}}]
    calls = write_lines(tmp_path / "calls.jsonl", slow)
    config = marked_toml(tmp_path / "marked.toml")
    argv = ["run", str(calls), "--workspace", str(ws), "--journal", str(tmp_path / "j.jsonl")]
    proc = start_cli([*argv, "--config", str(config)], tmp_path / "r")  # stderr: a file
    processes.append(proc)
    assert proc.wait(DEADLINE_S) == 0, (tmp_path / "r.err").read_text()[-2000:]
    err = (tmp_path / "r.err").read_text()
    # Nothing finished for 3 s: a line said which call the run was waiting on, and for how long.
    assert re.search(
        r"^progress: 0/1 \(0%\) .*\| 1 in flight, longest slow-one bash [23]s$", err, re.M
    ), err


def test_the_printed_resume_command_works_verbatim_from_anywhere(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    home = tmp_path / "batch folder"  # spaces everywhere: the command must be quoted
    home.mkdir()
    ws = home / "my ws"
    ws.mkdir()
    lines: list[Any] = [{"id": "wait", "tool": "bash", "args": {"command": WAIT_FOR_GO.format(0)}}]
    lines += [
        {"id": f"w{i}", "tool": "write", "args": {"path": f"out{i}.txt", "content": f"{i}"}}
        for i in range(4)
    ]
    write_lines(home / "calls.jsonl", lines)
    marked_toml(home / "marked config.toml")
    # Typed in the batch's folder, with relative paths.
    argv = ["run", "calls.jsonl", "--workspace", "my ws", "--journal", "j dir/run.jsonl"]
    argv += ["--parallel", "1", "--config", "marked config.toml"]
    first = start_cli(argv, tmp_path / "first", cwd=home)
    processes.append(first)
    wait_until(lambda: (ws / "up-0").exists(), "the first call running", first)
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(DEADLINE_S) == 128 + signal.SIGTERM

    words = printed_command(tmp_path / "first.out", "resume with: ")
    assert words[:2] == ["sandbx-pool", "run"]
    given = build_parser().parse_args(words[1:])
    assert (given.calls, given.workspace, given.journal, given.config) == (
        str(home / "calls.jsonl"),
        str(ws),
        str(home / "j dir" / "run.jsonl"),
        str(home / "marked config.toml"),
    )
    assert (given.parallel, given.resume) == (1, True)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = start_cli(words[1:], tmp_path / "second", cwd=elsewhere)
    processes.append(second)
    # The bash call was cut after it started: in doubt, skipped. The writes ran, in ws.
    assert second.wait(DEADLINE_S) == 1, (tmp_path / "second.err").read_text()[-2000:]
    assert sorted(p.name for p in ws.glob("out*.txt")) == [f"out{i}.txt" for i in range(4)]
    assert list(elsewhere.iterdir()) == []

    # Only --rerun-started runs the rest: a --resume would run nothing more, and is not
    # suggested. The call was journaled cancelled, so the run did see it end.
    resumed = (tmp_path / "second.out").read_text()
    assert [line for line in resumed.splitlines() if "--resume" in line] == [
        line for line in resumed.splitlines() if "--rerun-started" in line
    ], resumed
    assert "  wait  bash  (line 1): cancelled by a stop after it had started" in resumed
    assert "never saw" not in resumed
    (ws / "go").touch()
    words = printed_command(tmp_path / "second.out", "run them again with: ")
    assert words[-2:] == ["--resume", "--rerun-started"]
    third = start_cli(words[1:], tmp_path / "third", cwd=tmp_path)
    processes.append(third)
    assert third.wait(DEADLINE_S) == 0, (tmp_path / "third.err").read_text()[-2000:]
    outcomes = [
        r
        for r in read_journal(home / "j dir" / "run.jsonl").records
        if isinstance(r, OutcomeRecord) and r.call_id == "wait"
    ]
    assert [r.status for r in outcomes] == ["cancelled", "ok"]


def test_after_a_sigterm_the_calls_in_doubt_are_the_same_everywhere(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ws = make_workspace(tmp_path, files=1)
    sleeps = [f"s{i}" for i in range(8)]
    lines: list[Any] = [
        {"id": "w", "tool": "write", "args": {"path": "w.txt", "content": "w"}},
        {"id": "r", "tool": "read", "args": {"path": "f0.txt"}},
    ]
    lines += [
        {"id": f"s{i}", "tool": "bash", "args": {"command": WAIT_FOR_GO.format(i)}}
        for i in range(len(sleeps))
    ]
    lines.append({"id": "last", "tool": "read", "args": {"path": "f0.txt"}})
    calls = write_lines(tmp_path / "calls.jsonl", lines)
    journal = tmp_path / "journal.jsonl"
    argv = ["run", str(calls), "--workspace", str(ws), "--parallel", "3"]
    argv += ["--journal", str(journal), "--config", str(marked_toml(tmp_path / "marked.toml"))]
    first = start_cli(argv, tmp_path / "first")
    processes.append(first)
    # Three lanes, each held by a bash call that has begun: nothing else can start.
    wait_until(lambda: len(list(ws.glob("up-*"))) == 3, "three bash calls running", first)
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(DEADLINE_S) == 128 + signal.SIGTERM
    began = {f"s{path.name.removeprefix('up-')}" for path in ws.glob("up-*")}
    assert len(began) == 3
    stopped_at = len(read_journal(journal).records)

    listed = journal_command("in-doubt", str(journal)).splitlines()
    assert {line.split()[0] for line in listed} == began
    assert all("stopped after it started" in line for line in listed), listed
    counted = json.loads(journal_command("stats", str(journal), "--json"))
    assert (counted["in_doubt"], counted["in_doubt_by_tool"]) == (len(listed), {"bash": 3})

    (ws / "go").touch()
    second = start_cli([*argv, "--resume"], tmp_path / "second")
    processes.append(second)
    assert second.wait(DEADLINE_S) == 1, (tmp_path / "second.err").read_text()[-2000:]
    skipped = re.findall(
        r"^  (\S+)  bash  \(line \d+\): cancelled by a stop after it had started$",
        (tmp_path / "second.out").read_text(),
        re.M,
    )
    assert set(skipped) == began
    resumed = read_journal(journal).records[stopped_at:]
    rerun = {r.call_id for r in resumed if isinstance(r, IntentRecord)}
    assert rerun == set(sleeps) - began | {"last"}, "resume ran what did not run, and only that"
    assert all(r.status == "ok" for r in resumed if isinstance(r, OutcomeRecord))
    # Skipped, not settled: still in doubt, in both views.
    assert {
        line.split()[0] for line in journal_command("in-doubt", str(journal)).splitlines()
    } == began
    assert json.loads(journal_command("stats", str(journal), "--json"))["in_doubt"] == 3


def test_a_second_sigint_exits_at_once_and_kills_the_workers(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    ws = make_workspace(tmp_path, files=1)
    # Commands that ignore SIGTERM and a long grace: the first INT's orderly stop would wait.
    stubborn = [
        {"id": f"s{i}", "tool": "bash", "args": {"command": f"trap '' TERM; : >up{i}; sleep 60"}}
        for i in range(3)
    ]
    calls = write_lines(tmp_path / "calls.jsonl", stubborn)
    config = marked_toml(
        tmp_path / "marked.toml", "[calls]\ngrace_s = 60\n[pool]\nclose_timeout_s = 30\n"
    )
    journal = tmp_path / "journal.jsonl"
    argv = ["run", str(calls), "--workspace", str(ws), "--parallel", "3"]
    proc = start_cli([*argv, "--journal", str(journal), "--config", str(config)], tmp_path / "r")
    processes.append(proc)
    wait_until(lambda: all((ws / f"up{i}").exists() for i in range(3)), "commands up", proc)

    os.kill(proc.pid, signal.SIGINT)
    err = tmp_path / "r.err"
    wait_until(lambda: b"SIGINT: stopping" in err.read_bytes(), "the first SIGINT", proc)
    assert proc.poll() is None, "the orderly stop is waiting out the grace period"
    os.kill(proc.pid, signal.SIGINT)
    sent = time.monotonic()
    assert proc.wait(DEADLINE_S) == 128 + signal.SIGINT
    assert time.monotonic() - sent < 2.0
    # No outcome was journaled: the calls are in doubt (a resume skips them, or with
    # --rerun-started runs them again).
    assert {r.call_id for r in interrupted(read_journal(journal))} == {"s0", "s1", "s2"}
    # The autouse fixture checks that no worker, bash or sleep is left.


def test_demo_shows_every_kind_of_ending(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    journal = tmp_path / "demo.jsonl"
    config = marked_toml(tmp_path / "marked.toml")
    proc = start_cli(["demo", "--journal", str(journal), "--config", str(config)], tmp_path / "d")
    processes.append(proc)
    assert proc.wait(DEADLINE_S) == 0, (tmp_path / "d.err").read_text()[-2000:]
    out = (tmp_path / "d.out").read_text()
    shown = set(re.findall(r"^  (\w+) ", out, re.MULTILINE))
    assert {"ok", "cancelled", "timeout", "denied"} <= shown
    assert re.search(r"^  cancelled\s+read\s+read-fifo .*killed by token", out, re.MULTILINE)
    assert re.search(r"^  ok\s+read\s+read-config .*9000", out, re.MULTILINE)
    assert f"journal: {journal}" in out
    records = read_journal(journal).records
    statuses = Counter(r.status for r in records if isinstance(r, OutcomeRecord))
    assert statuses.keys() >= {"ok", "error", "cancelled", "timeout", "denied"}


#: A bash command that ends ok once FILE exists in the workspace, or fails after 10 s: the
#: line that makes FILE must run while this one is in flight.
WAIT_FOR = "for i in $(seq 100); do [ -e {file} ] && exit 0; sleep 0.1; done; exit 1"


@pytest.mark.parametrize("waiting_on", ["after", "session"])
async def test_a_line_waiting_for_its_turn_holds_no_lane(tmp_path: Path, waiting_on: str) -> None:
    # a1 runs until d2 has run; a2 waits for a1 (its `after`, or its session's order). At
    # --parallel 2, a2 must not take the second lane: b1 and then d2 need it.
    workspace = make_workspace(tmp_path)
    if waiting_on == "after":
        lines = [
            {"id": "a1", "tool": "bash", "args": {"command": WAIT_FOR.format(file="d2-ran")}},
            {"id": "a2", "tool": "bash", "after": ["a1"], "args": {"command": "true"}},
        ]
    else:
        lines = [
            {"id": "a1", "tool": "bash", "session": "a",
             "args": {"command": f"export N=1; {WAIT_FOR.format(file='d2-ran')}"}},
            {"id": "a2", "tool": "bash", "session": "a", "args": {"command": 'echo "$N"'}},
        ]  # fmt: skip
    lines += [
        {"id": "b1", "tool": "bash", "args": {"command": "true"}},
        {"id": "d2", "tool": "bash", "args": {"command": "touch d2-ran"}},
    ]
    batch = load_batch(write_lines(tmp_path / "c.jsonl", lines))
    async with Pool(workspace, config=marked_config(pool={"workers": 4})) as pool:
        report = await run_batch(pool, batch.calls, parallel=2)
    ended = [spec.call_id for spec, _ in report.results]
    codes = {
        spec.call_id: (outcome.value or {}).get("exit_code") for spec, outcome in report.results
    }
    assert codes == dict.fromkeys(["a1", "a2", "b1", "d2"], 0), report.results
    assert ended.index("a1") < ended.index("a2")  # order kept
    if waiting_on == "session":
        assert report.results[ended.index("a2")][1].value["stdout"] == "1\n"


def test_a_stopped_demo_never_suggests_resume(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    # `demo` has no --resume (its workspace is gone once it ends): its summary says what was
    # stopped, and nothing about resuming.
    journal = tmp_path / "demo.jsonl"
    config = marked_toml(tmp_path / "marked.toml")
    proc = start_cli(["demo", "--journal", str(journal), "--config", str(config)], tmp_path / "d")
    processes.append(proc)
    wait_until(lambda: count_in(journal, b'"kind":"intent"') >= 1, "the demo's first call", proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(DEADLINE_S) == 128 + signal.SIGTERM
    out = (tmp_path / "d.out").read_text()
    assert re.search(r"^\d+ of 15 call\(s\) stopped$", out, re.M), out
    assert "resume" not in out + (tmp_path / "d.err").read_text()
