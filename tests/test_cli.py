"""The command line's first minutes: exit codes, one-line usage errors, the journal's path,
a batch refused where it would repeat itself or land elsewhere, default-location journals
pruned, a closed pipe, ``journal show``'s table."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_batch import marked_toml

from sandbx_pool.journal.prune import prune_default_journals

#: Seconds a one-shot command may take on a loaded machine.
CHILD_S = 60


def cli(
    *argv: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", *argv],
        capture_output=True,
        text=True,
        timeout=CHILD_S,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("pairs", "status"),
    [
        (["path=hello.txt"], "ok"),
        (["path=missing.txt"], "error"),
        (["path=../outside.txt"], "denied"),
    ],
)
def test_call_exits_0_for_ok_and_1_for_any_other_status(
    workspace: Path, pairs: list[str], status: str
) -> None:
    result = cli("call", "read", *pairs, "--workspace", str(workspace), cwd=workspace)
    outcome = json.loads(result.stdout)
    assert outcome["status"] == status
    assert result.returncode == (0 if status == "ok" else 1)


def test_call_names_its_journal_in_the_outcome(workspace: Path, tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"
    result = cli(
        "call", "ls", "--workspace", str(workspace), "--journal", str(journal), cwd=tmp_path
    )
    outcome = json.loads(result.stdout)
    assert outcome["journal"] == str(journal)
    assert outcome["call_id"] in journal.read_text()


def test_usage_errors_exit_2_on_one_line_before_any_pool(workspace: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    bad_workspace = cli("call", "ls", "--workspace", str(missing), cwd=tmp_path)
    assert bad_workspace.returncode == 2
    assert one_line(bad_workspace) == f"sandbx-pool call: --workspace {missing}: no such directory"

    a_file = workspace / "hello.txt"
    not_a_dir = cli("call", "ls", "--workspace", str(a_file), cwd=tmp_path)
    assert not_a_dir.returncode == 2
    assert "not a directory" in one_line(not_a_dir)

    typo = cli("call", "read", "pth=hello.txt", "--workspace", str(workspace), cwd=tmp_path)
    assert typo.returncode == 2
    assert "pth" in one_line(typo)
    assert typo.stdout == ""

    no_equals = cli("call", "read", "hello.txt", "--workspace", str(workspace), cwd=tmp_path)
    assert no_equals.returncode == 2
    assert "key=value" in one_line(no_equals)

    calls = tmp_path / "calls.jsonl"
    calls.write_text('{"tool": "ls", "args": {}}\n')
    run = cli("run", str(calls), "--workspace", str(missing), cwd=tmp_path)
    assert run.returncode == 2
    assert one_line(run) == f"sandbx-pool run: --workspace {missing}: no such directory"


# -- run into a journal that already holds the batch -------------------------------------------


def calls_file(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_a_batch_run_again_into_its_journal_needs_resume_or_fresh(
    workspace: Path, tmp_path: Path
) -> None:
    appends = [
        {"tool": "bash", "args": {"command": "echo x >> log"}},
        {"tool": "ls"},
    ]  # ids derived
    calls = calls_file(tmp_path / "calls.jsonl", appends)
    journal = tmp_path / "j.jsonl"
    argv = ["--workspace", str(workspace), "--journal", str(journal)]
    argv += ["--config", str(marked_toml(tmp_path / "marked.toml"))]
    assert cli("run", str(calls), *argv, cwd=tmp_path).returncode == 0
    assert (workspace / "log").read_text() == "x\n"
    before = journal.read_bytes()

    # The same lines under another name are the same calls: their ids come from their content.
    copy = calls_file(tmp_path / "copy.jsonl", appends)
    for path in (calls, copy):
        again = cli("run", str(path), *argv, cwd=tmp_path)
        assert again.returncode == 2
        line = one_line(again)
        assert "--resume" in line
        assert "--fresh" in line
        assert str(journal) in line
        assert journal.read_bytes() == before, "the refused run journaled something"
        assert (workspace / "log").read_text() == "x\n", "the refused run ran something"

    both = cli("run", str(calls), *argv, "--fresh", "--resume", cwd=tmp_path)
    assert both.returncode == 2
    assert "--fresh" in one_line(both)

    fresh = cli("run", str(calls), *argv, "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert (workspace / "log").read_text() == "x\nx\n", "--fresh runs every call again"
    intents = [json.loads(line) for line in journal.read_text().splitlines()]
    assert sum(r["kind"] == "intent" for r in intents) == 4
    assert journal.read_bytes().startswith(before), "appended to the journal"

    # Other calls (another line is another id) are not in the journal: they just run.
    other = calls_file(tmp_path / "other.jsonl", [{"tool": "ls", "args": {"path": "src"}}])
    assert cli("run", str(other), *argv, cwd=tmp_path).returncode == 0


def test_resume_in_another_workspace_is_refused(workspace: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (workspace / "ep-1").mkdir()
    link = tmp_path / "link"
    link.symlink_to(workspace)
    # Lines of the pool's own workspace, and lines that carry theirs (a folder under it).
    for number, lines in enumerate([[{"tool": "ls"}], [{"tool": "ls", "workspace": "ep-1"}]]):
        calls = calls_file(tmp_path / "calls.jsonl", lines)
        journal = tmp_path / f"j{number}.jsonl"
        run = ["run", str(calls), "--journal", str(journal)]
        assert cli(*run, "--workspace", str(workspace), cwd=tmp_path).returncode == 0
        before = journal.read_bytes()

        elsewhere = cli(*run, "--workspace", str(other), "--resume", cwd=tmp_path)
        assert elsewhere.returncode == 2
        line = one_line(elsewhere)
        assert str(workspace) in line
        assert str(other) in line
        assert journal.read_bytes() == before

        # The same directory by another name is the same workspace (nothing is left to run).
        same = cli(*run, "--workspace", str(link), "--resume", cwd=tmp_path)
        assert same.returncode == 0, same.stderr
        assert journal.read_bytes() == before


def test_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    journal = tmp_path / "big.jsonl"
    record = {"kind": "intent", "call_id": "c", "time": 1.0, "tool": "read", "args": {}, "cwd": "."}
    with journal.open("w") as f:
        for n in range(20_000):  # far more than a pipe holds
            f.write(json.dumps({**record, "call_id": f"c{n}"}) + "\n")
    reader_gone = subprocess.run(
        f"{sys.executable} -m sandbx_pool.cli journal show {journal} | head -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=CHILD_S,
        cwd=tmp_path,
    )
    assert reader_gone.stdout.startswith("call")
    assert reader_gone.stderr == ""


# -- pruning the default location ----------------------------------------------------------------


def make_journal(directory: Path, name: str, age_days: float, *, now: float) -> Path:
    path = directory / f"{name}.jsonl"
    path.write_text("")
    (directory / f"{name}.jsonl.lock").write_text("")
    stamp = now - age_days * 86400
    os.utime(path, (stamp, stamp))
    return path


def test_prune_removes_old_journals_and_the_oldest_beyond_the_count(tmp_path: Path) -> None:
    now = time.time()
    fresh = [make_journal(tmp_path, f"fresh{n}", n / 10, now=now) for n in range(5)]
    old = make_journal(tmp_path, "old", 8, now=now)
    removed = prune_default_journals(str(tmp_path), keep_days=7, keep_count=3, now=now)
    assert sorted(removed) == sorted(str(p) for p in [old, fresh[3], fresh[4]])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        name for p in fresh[:3] for name in (p.name, p.name + ".lock")
    )


def test_prune_never_removes_a_journal_being_written(tmp_path: Path) -> None:
    now = time.time()
    live = make_journal(tmp_path, "live", 30, now=now)
    fd = os.open(f"{live}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a coordinator holds it
        assert prune_default_journals(str(tmp_path), keep_days=7, keep_count=1, now=now) == []
    finally:
        os.close(fd)
    assert live.exists()


def test_one_shot_calls_do_not_pile_up_journals(workspace: Path, tmp_path: Path) -> None:
    # A short runtime directory: the pool's socket path must fit in sockaddr_un.
    with tempfile.TemporaryDirectory(prefix="rt") as short:
        one_shot_calls(Path(short), workspace, tmp_path)


def one_shot_calls(runtime: Path, workspace: Path, tmp_path: Path) -> None:
    journals = runtime / "sandbx-pool" / "journals"
    journals.mkdir(parents=True, mode=0o700)
    os.chmod(runtime / "sandbx-pool", 0o700)
    now = time.time()
    stale = make_journal(journals, "stale", 10, now=now)
    config = tmp_path / "keep2.toml"
    config.write_text("[journal]\ndefault_keep_count = 2\n")
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    for _ in range(4):
        done = cli(
            "call",
            "ls",
            "--workspace",
            str(workspace),
            "--config",
            str(config),
            cwd=workspace,
            env=env,
        )
        assert done.returncode == 0, done.stderr
    left = sorted(p.name for p in journals.glob("*.jsonl"))
    assert not stale.exists()
    # Each run prunes before it makes its own: two kept, then the new one.
    assert len(left) == 3
    assert json.loads(done.stdout)["journal"] in {str(journals / name) for name in left}


# -- every documented error of every command: one line, its exit code -------------------------

#: Each command, with what it needs besides the argument under test ({ws}, {journal}, {config}
#: and {calls} are filled in by the test).
COMMANDS: dict[str, list[str]] = {
    "call": ["call", "ls", "--workspace", "{ws}", "--journal", "{journal}", "--config", "{config}"],
    "run": ["run", "{calls}", "--workspace", "{ws}", "--journal", "{journal}", "--config",
            "{config}"],
    "undo": ["undo", "c1", "--workspace", "{ws}", "--journal", "{journal}", "--config",
             "{config}"],
    "mcp": ["mcp", "--workspace", "{ws}", "--journal", "{journal}", "--config", "{config}"],
    "demo": ["demo", "--journal", "{journal}", "--config", "{config}"],
    "doctor": ["doctor", "--config", "{config}"],
}  # fmt: skip

#: Each error, what it sets, the commands it applies to, and a part of its one line.
ERRORS: dict[str, tuple[dict[str, str], list[str], str]] = {
    "workspace missing": ({"ws": "nowhere"}, ["call", "run", "undo", "mcp"], "no such directory"),
    "workspace a file": ({"ws": "ws/hello.txt"}, ["call", "run", "undo", "mcp"], "not a directory"),
    "config missing": ({"config": "nope.toml"}, list(COMMANDS), "no such config file"),
    "config bad": ({"config": "bad.toml"}, list(COMMANDS), "pool.workers"),
    "journal dir not a dir": (
        {"journal": "ws/hello.txt/j.jsonl"},
        ["call", "run", "mcp", "demo"],
        "cannot open journal",
    ),
    "journal dir read-only": (
        {"journal": "ro/j.jsonl"},
        ["call", "run", "mcp", "demo"],
        "Permission denied",
    ),
    "journal held": (
        {"journal": "held.jsonl"},
        ["call", "run", "undo", "mcp", "demo"],
        "being written by another coordinator",
    ),
    "journal missing (undo)": ({"journal": "nope.jsonl"}, ["undo"], "no such journal"),
}

CASES = [
    pytest.param(command, error, id=f"{command}-{error}")
    for error, (_, commands, _) in ERRORS.items()
    for command in commands
]


@pytest.mark.parametrize(("command", "error"), CASES)
def test_every_documented_error_is_one_line_and_exit_2(
    workspace: Path, tmp_path: Path, command: str, error: str
) -> None:
    changed, _, expected = ERRORS[error]
    if error == "journal dir read-only" and os.geteuid() == 0:
        pytest.skip("root writes a read-only directory: 'journal dir not a dir' stands for it")
    if command == "mcp":
        pytest.importorskip("mcp")
    (tmp_path / "ro").mkdir(mode=0o555)
    (tmp_path / "bad.toml").write_text('[pool]\nworkers = "x"\n')
    calls = calls_file(tmp_path / "calls.jsonl", [{"tool": "ls", "id": "c1"}])
    held = tmp_path / "held.jsonl"
    held.touch()
    values = {
        "ws": str(workspace),
        "journal": str(tmp_path / "j.jsonl"),
        "config": str(marked_toml(tmp_path / "marked.toml")),
        "calls": str(calls),
    }
    values.update({key: str(tmp_path / value) for key, value in changed.items()})
    argv = [word.format(**values) for word in COMMANDS[command]]
    lock = os.open(f"{held}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live coordinator holds it
        done = subprocess.run(
            [sys.executable, "-m", "sandbx_pool.cli", *argv],
            capture_output=True,
            text=True,
            timeout=CHILD_S,
            cwd=tmp_path,
            stdin=subprocess.DEVNULL,
        )
    finally:
        os.close(lock)
    line = one_line(done)
    assert line.startswith(f"sandbx-pool {command}: "), line
    assert expected in line, line
    assert done.returncode == 2, (done.returncode, line)
    if command != "demo":  # the demo says what it is about to run first
        assert done.stdout == ""


@pytest.mark.parametrize("subcommand", ["in-doubt", "stats", "show", "timeline"])
@pytest.mark.parametrize("error", ["missing", "a directory", "not a journal"])
def test_every_journal_command_error_is_one_line_and_exit_2(
    tmp_path: Path, subcommand: str, error: str
) -> None:
    if error == "not a journal" and subcommand != "timeline":
        pytest.skip("in-doubt, stats and show read what they can: corrupt lines are skipped")
    path = {"missing": tmp_path / "nope.jsonl", "a directory": tmp_path}.get(error)
    if path is None:
        path = tmp_path / "notes.txt"
        path.write_text("not a journal\n")
    argv = ["journal", subcommand, str(path)]
    if subcommand == "timeline":
        argv += ["-o", str(tmp_path / "t.html")]
    done = cli(*argv, cwd=tmp_path)
    assert one_line(done).startswith("sandbx-pool journal: ")
    assert done.returncode == 2
