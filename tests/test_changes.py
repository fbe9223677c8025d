"""What a call changes in the workspace: tracked and transactional mode, on a real pool with a
real overlay (these tests run as root: the overlay needs a mount namespace)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from helpers import journal_records, marked_pool_toml
from test_cli import cli, one_line

from sandbx_pool import Config, ConfigError, KilledBy, Pool, Status, UndoConflict
from sandbx_pool.change_sets import APPLIED_ON_REOPEN
from sandbx_pool.config import load_config
from sandbx_pool.journal.prune import prune_default_journals
from sandbx_pool.journal.reader import in_doubt_calls, read_journal

#: A tracked or transactional call runs on an overlay in its mount namespace: where doctor says
#: none mounts (a container's root, user namespaces refused), the calls fall back or are refused,
#: which test_without_an_overlay_tracked_lists_and_transactional_is_refused checks as root.
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="an overlay needs a root pool"),
    pytest.mark.needs("overlayfs (tracked, transactional changes)"),
]


def _by_path(changes: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    assert changes is not None
    return {change["path"]: change for change in changes}


def _config(tmp_path: Path) -> Config:
    sync = tmp_path / "sync"
    sync.mkdir(exist_ok=True)
    return marked_config(pool={"workers": 4}, sandbox={"writable": [str(sync)]})


async def test_tracked_bash_lists_exactly_what_it_changed(workspace: Path, tmp_path: Path) -> None:
    (workspace / "b").write_text("b\n")
    (workspace / "c").write_text("c\n")
    (workspace / "m").write_text("m\n")
    (workspace / "same").write_text("same\n")
    (workspace / "gone").mkdir()
    (workspace / "gone" / "x").write_text("x\n")
    journal = tmp_path / "j.jsonl"
    command = (
        "echo a > a; echo more >> b; rm c; touch t; rm t; chmod 600 m; touch same;"
        " rm -r gone; mkdir -p new/dir; ln -s a link; mkfifo fifo"
    )
    async with Pool(
        workspace, journal=journal, config=_config(tmp_path), changes="tracked"
    ) as pool:
        outcome = await pool.call("bash", {"command": command})
    assert outcome.status is Status.OK, outcome.error
    changes = _by_path(outcome.changes)
    assert set(changes) == {"a", "b", "c", "m", "gone", "gone/x", "new", "new/dir", "link", "fifo"}
    # A FIFO is listed, never made in the workspace.
    fifo = changes.pop("fifo")
    assert fifo == {
        "path": "fifo",
        "kind": "created",
        "type": "other",
        "size": 0,
        "applied": False,
    }
    assert not (workspace / "fifo").exists()
    assert changes["a"] == {
        "path": "a",
        "kind": "created",
        "type": "file",
        "size": 2,
        "applied": True,
    }
    assert changes["b"]["kind"] == "modified"
    assert changes["b"]["size"] == 7
    assert changes["c"] == {
        "path": "c",
        "kind": "deleted",
        "type": "file",
        "size": None,
        "applied": True,
    }
    assert changes["m"]["kind"] == "modified"  # its mode alone
    assert changes["gone"]["kind"] == changes["gone/x"]["kind"] == "deleted"
    assert changes["gone"]["type"] == "dir"
    assert changes["new/dir"]["kind"] == "created"
    assert changes["new/dir"]["type"] == "dir"
    assert changes["link"]["type"] == "symlink"
    # tracked: every change is in the workspace
    assert (workspace / "a").read_text() == "a\n"
    assert (workspace / "b").read_text() == "b\nmore\n"
    assert not (workspace / "c").exists()
    assert not (workspace / "gone").exists()
    assert stat.S_IMODE((workspace / "m").stat().st_mode) == 0o600
    assert os.readlink(workspace / "link") == "a"
    assert (workspace / "new" / "dir").is_dir()
    outcome_record = next(r for r in journal_records(str(journal)) if r["kind"] == "outcome")
    assert _by_path(outcome_record["changes"]) == {**changes, "fifo": fifo}


async def test_tracked_file_tools_and_read_only_tools(workspace: Path, tmp_path: Path) -> None:
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=_config(tmp_path)) as pool:
        direct = await pool.call("write", {"path": "d.txt", "content": "d"})
        written = await pool.call("write", {"path": "w.txt", "content": "w"}, changes="tracked")
        edited = await pool.call(
            "edit",
            {"path": "hello.txt", "old_string": "world", "new_string": "there"},
            changes="tracked",
        )
        read = await pool.call("read", {"path": "w.txt"}, changes="tracked")
    assert direct.changes is None
    assert written.changes == [
        {"path": "w.txt", "kind": "created", "type": "file", "size": 1, "applied": True}
    ]
    assert edited.changes == [
        {"path": "hello.txt", "kind": "modified", "type": "file", "size": 12, "applied": True}
    ]
    assert (workspace / "hello.txt").read_text() == "hello\nthere\n"
    assert read.ok
    assert read.changes == []


async def test_transactional_timeout_leaves_the_workspace_as_it_was(
    workspace: Path, tmp_path: Path
) -> None:
    before = (workspace / "hello.txt").read_bytes()
    async with Pool(
        workspace, journal=tmp_path / "j.jsonl", config=_config(tmp_path), changes="transactional"
    ) as pool:
        outcome = await pool.call(
            "bash",
            {"command": "echo half > hello.txt; echo new > new.txt; rm -r src; sleep 100"},
            timeout=1.0,
        )
        kept = await pool.call("bash", {"command": "echo done > done.txt"})
    assert outcome.status is Status.TIMEOUT
    changes = _by_path(outcome.changes)
    assert set(changes) == {"hello.txt", "new.txt", "src", "src/a.py"}
    assert not any(change["applied"] for change in changes.values())
    assert (workspace / "hello.txt").read_bytes() == before
    assert not (workspace / "new.txt").exists()
    assert (workspace / "src" / "a.py").exists()
    # kept aside for inspection, beside the journal
    upper = tmp_path / "j.jsonl.d" / "changes" / outcome.call_id / "upper"
    assert (upper / "new.txt").read_text() == "new\n"
    assert kept.ok
    assert _by_path(kept.changes)["done.txt"]["applied"] is True
    assert (workspace / "done.txt").read_text() == "done\n"


async def _wait_for_fifo_reader(fifo: Path) -> int:
    """Open ``fifo`` for writing once a call has it open for reading (polling the outside
    world: the call's command)."""
    deadline = asyncio.get_running_loop().time() + 20
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.02)


async def test_transactional_calls_see_no_uncommitted_change_and_conflict(
    workspace: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path)
    first, second = tmp_path / "sync" / "first", tmp_path / "sync" / "second"
    os.mkfifo(first)
    os.mkfifo(second)
    async with Pool(
        workspace, journal=tmp_path / "j.jsonl", config=config, changes="transactional"
    ) as pool:
        a = asyncio.create_task(
            pool.call("bash", {"command": f"echo A > shared; echo a > only_a; cat {first}"})
        )
        b = asyncio.create_task(pool.call("bash", {"command": f"echo B > shared; cat {second}"}))
        fd_a = await _wait_for_fifo_reader(first)
        fd_b = await _wait_for_fifo_reader(second)
        seen = await pool.call("bash", {"command": "cat shared only_a"})
        assert seen.value is not None
        assert seen.value["exit_code"] != 0  # neither exists yet
        assert not (workspace / "shared").exists()
        os.close(fd_a)
        outcome_a = await a
        os.close(fd_b)
        outcome_b = await b
    assert outcome_a.ok, outcome_a.error
    assert (workspace / "shared").read_text() == "A\n"
    assert outcome_b.status is Status.ERROR
    assert outcome_b.error_code == "CONFLICT"
    assert outcome_b.error is not None
    assert "shared" in outcome_b.error
    assert outcome_a.call_id in outcome_b.error
    assert _by_path(outcome_b.changes)["shared"]["applied"] is False


async def test_an_unknown_mode_is_refused_naming_the_three(workspace: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'direct', 'tracked', 'transactional'"):
        Pool(workspace, changes="snapshot")
    async with Pool(workspace, config=_config(tmp_path)) as pool:
        with pytest.raises(ValueError, match="'direct', 'tracked', 'transactional'"):
            await pool.call("read", {"path": "hello.txt"}, changes="rewind")
    toml = tmp_path / "bad.toml"
    toml.write_text('[workspace]\nchanges = "snapshot"\n')
    with pytest.raises(ConfigError, match=r"workspace\.changes: .*'transactional'"):
        load_config(toml)


async def test_undo_puts_back_what_the_call_changed(workspace: Path, tmp_path: Path) -> None:
    (workspace / "b").write_text("b\n")
    (workspace / "c").write_text("c\n")
    (workspace / "m").write_text("m\n")
    os.chmod(workspace / "m", 0o644)
    journal = tmp_path / "j.jsonl"
    command = "echo a > a; echo more >> b; rm c; chmod 600 m; rm -r src; mkdir -p n/d"
    async with Pool(
        workspace, journal=journal, config=_config(tmp_path), changes="tracked"
    ) as pool:
        outcome = await pool.call("bash", {"command": command})
        assert outcome.ok, outcome.error
        assert not (workspace / "src").exists()
        undone = await pool.undo(outcome.call_id)
        assert set(undone) == {"a", "b", "c", "m", "src", "src/a.py", "n", "n/d"}
        assert not (workspace / "a").exists()
        assert not (workspace / "n").exists()
        assert (workspace / "b").read_text() == "b\n"
        assert (workspace / "c").read_text() == "c\n"
        assert stat.S_IMODE((workspace / "m").stat().st_mode) == 0o644
        assert (workspace / "src" / "a.py").read_text() == "import os\nprint('a')\n"
        # Undone already: said so, not a conflict with its own undo.
        with pytest.raises(ValueError, match=f"call {outcome.call_id} was already undone"):
            await pool.undo(outcome.call_id)
    kinds = [record["kind"] for record in journal_records(str(journal))]
    assert kinds.count("undone") == 1


async def test_undo_refuses_a_path_a_later_call_changed(workspace: Path, tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"
    async with Pool(
        workspace, journal=journal, config=_config(tmp_path), changes="tracked"
    ) as pool:
        first = await pool.call("bash", {"command": "echo 1 > f; echo 1 > g"})
        later = await pool.call("write", {"path": "f", "content": "2\n"})
        with pytest.raises(UndoConflict, match=f"f was changed by call {later.call_id}") as exc:
            await pool.undo(first.call_id)
        assert exc.value.path == "f"
        # nothing changed, g included
        assert (workspace / "f").read_text() == "2\n"
        assert (workspace / "g").read_text() == "1\n"
        direct = await pool.call("write", {"path": "h", "content": "h"}, changes="direct")
        with pytest.raises(ValueError, match="direct mode"):
            await pool.undo(direct.call_id)
        with pytest.raises(ValueError, match="no call 'nope'"):
            await pool.undo("nope")
        os.unlink(tmp_path / "j.jsonl.d" / "changes" / later.call_id / "images.json")
        with pytest.raises(ValueError, match="pre-images are missing"):
            await pool.undo(later.call_id)
    assert (workspace / "f").read_text() == "2\n"
    # The whole J.d gone: refused, naming it (the pool makes it again, empty, hidden from its
    # calls from the start).
    shutil.rmtree(tmp_path / "j.jsonl.d")
    async with Pool(workspace, journal=journal, config=_config(tmp_path)) as pool:
        with pytest.raises(ValueError, match=r"j\.jsonl\.d is missing"):
            await pool.undo(first.call_id)
        with pytest.raises(ValueError, match="direct mode"):
            await pool.undo(direct.call_id)
    assert not os.listdir(tmp_path / "j.jsonl.d")


def test_the_undo_command(workspace: Path, tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"

    async def calls() -> tuple[str, str]:
        async with Pool(
            workspace, journal=journal, config=_config(tmp_path), changes="transactional"
        ) as pool:
            first = await pool.call("write", {"path": "hello.txt", "content": "new\n"})
            second = await pool.call("write", {"path": "other.txt", "content": "o\n"})
            return first.call_id, second.call_id

    first, second = asyncio.run(calls())
    base = ["undo", "--journal", str(journal), "--workspace", str(workspace)]
    unknown = cli(*base, "nope", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "no call 'nope'" in one_line(unknown)
    direct_journal = tmp_path / "direct.jsonl"
    done = cli(*base, first, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"call_id": first, "undone": ["hello.txt"]}
    assert (workspace / "hello.txt").read_text() == "hello\nworld\n"
    again = cli(*base, first, cwd=tmp_path)
    assert again.returncode == 2
    assert f"call {first} was already undone" in one_line(again)
    (workspace / "other.txt").write_text("changed by hand\n")
    conflict = cli(*base, second, cwd=tmp_path)
    assert conflict.returncode == 1
    assert "other.txt was changed outside the pool" in conflict.stderr
    assert (workspace / "other.txt").read_text() == "changed by hand\n"
    assert not direct_journal.exists()
    missing = cli(
        "undo",
        "--journal",
        str(direct_journal),
        "--workspace",
        str(workspace),
        second,
        cwd=tmp_path,
    )
    assert missing.returncode == 2
    assert "no such journal" in one_line(missing)


_COORDINATOR = """
import asyncio, sys
from sandbx_pool import Config, Pool

async def main(workspace, journal):
    config = Config().override(env={"set": {MARKER: VALUE}})
    async with Pool(workspace, journal=journal, config=config, workers=2) as pool:
        calls = [
            pool.call("bash", {"command": COMMAND}, changes="tracked", call_id="applied"),
            pool.call("bash", {"command": "echo x >> counter; sleep 100"},
                      changes="transactional", call_id="kept-aside"),
            pool.call("bash", {"command": "echo x >> counter; sleep 100"}, call_id="direct"),
        ]
        await asyncio.gather(*calls)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _kill_once_journaled(workspace: Path, journal: Path, wanted: set[str]) -> None:
    """Run the coordinator above; SIGKILL it once the journal holds every record ``wanted``
    ("kind call_id"), polling the outside world (the journal file) with a deadline."""
    command = "mkdir many; for i in $(seq 1500); do echo $i > many/$i; done"
    script = _COORDINATOR.replace("COMMAND", repr(command)).replace(
        "from sandbx_pool import Config, Pool",
        "from sandbx_pool import Config, Pool\n"
        f"MARKER, VALUE = 'SANDBX_TEST_SESSION', {os.environ['SANDBX_TEST_SESSION']!r}",
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(workspace), str(journal)])
    deadline = time.monotonic() + 60
    try:
        while True:
            assert proc.poll() is None, "the coordinator ended by itself"
            assert time.monotonic() < deadline, "the journal never held " + repr(wanted)
            seen = (
                {f"{r['kind']} {r['call_id']}" for r in journal_records(str(journal))}
                if journal.exists()
                else set()
            )
            # and the direct call's line is in the counter: "started" is journaled just after
            # its Call is sent, maybe before its command ran (and `>>` makes the file before
            # it writes the line)
            counter = workspace / "counter"
            if wanted <= seen and counter.exists() and counter.read_bytes().endswith(b"\n"):
                break
            time.sleep(0.005)  # polling a file another process writes
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


async def test_an_apply_cut_by_a_crash_is_finished_on_reopen_and_resume_has_no_doubt(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "j.jsonl"
    wanted = {"applying applied", "started kept-aside", "started direct"}
    await asyncio.to_thread(_kill_once_journaled, workspace, journal, wanted)
    records = journal_records(str(journal))
    assert not [r for r in records if r["kind"] == "outcome" and r["call_id"] == "applied"]
    # Only the direct call may have done something that a new run would repeat.
    assert [call.call_id for call in in_doubt_calls(read_journal(journal))] == [
        "applied",
        "direct",
    ]
    listed = cli("journal", "in-doubt", str(journal), cwd=tmp_path)
    assert "kept-aside" not in listed.stdout
    assert "direct" in listed.stdout
    # The counter holds the direct call's line only: the transactional one's never landed.
    assert (workspace / "counter").read_text() == "x\n"
    async with Pool(workspace, journal=journal, config=_config(tmp_path)) as pool:
        assert pool.journal is not None
    assert sorted(os.listdir(workspace / "many"), key=int) == [str(i) for i in range(1, 1501)]
    assert (workspace / "many" / "1500").read_text() == "1500\n"
    outcome = next(
        r
        for r in journal_records(str(journal))
        if r["kind"] == "outcome" and r["call_id"] == "applied"
    )
    assert outcome["reason"] == APPLIED_ON_REOPEN
    assert len(outcome["changes"]) == 1501
    assert all(change["applied"] for change in outcome["changes"])
    assert [call.call_id for call in in_doubt_calls(read_journal(journal))] == ["direct"]


def test_a_batch_resumes_a_transactional_call_without_rerun_started(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "run.jsonl"
    calls = tmp_path / "calls.jsonl"
    command = "echo x >> counter; [ -e go ] || sleep 100"
    calls.write_text(
        json.dumps({"tool": "bash", "args": {"command": command}, "id": "t"})
        + "\n"
        + json.dumps(
            {"tool": "write", "args": {"path": "d", "content": "d"}, "id": "d", "changes": "direct"}
        )
        + "\n"
    )
    base = ["run", str(calls), "--workspace", str(workspace), "--journal", str(journal)]
    base += ["--config", marked_pool_toml(tmp_path), "--changes", "transactional"]
    proc = subprocess.Popen([sys.executable, "-m", "sandbx_pool.cli", *base], cwd=tmp_path)
    deadline = time.monotonic() + 60
    try:
        while not journal.exists() or not any(
            r["kind"] == "started" and r["call_id"] == "t" for r in journal_records(str(journal))
        ):
            assert proc.poll() is None, "the run ended by itself"
            assert time.monotonic() < deadline, "call t never started"
            time.sleep(0.005)  # polling a file another process writes
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    intent = next(r for r in journal_records(str(journal)) if r["kind"] == "intent")
    assert intent["changes"] == "transactional"
    assert not (workspace / "counter").exists()
    (workspace / "go").write_text("")
    resumed = cli(*base, "--resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert (workspace / "counter").read_text() == "x\n"  # run once, at the resume
    assert in_doubt_calls(read_journal(journal)) == []


def test_a_batch_line_with_an_unknown_mode_is_refused(workspace: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    calls.write_text(json.dumps({"tool": "read", "args": {"path": "x"}, "changes": "undo"}))
    refused = cli("run", str(calls), "--workspace", str(workspace), cwd=tmp_path)
    assert refused.returncode == 2
    assert "'direct', 'tracked', 'transactional'" in refused.stderr


async def test_a_pruned_default_journal_takes_its_change_sets_with_it(tmp_path: Path) -> None:
    journals = tmp_path / "journals"
    journals.mkdir()
    old = journals / "old.jsonl"
    old.write_text("")
    (journals / "old.jsonl.d" / "changes" / "c1" / "upper").mkdir(parents=True)
    os.mknod(journals / "old.jsonl.d" / "changes" / "c1" / "upper" / "w", stat.S_IFCHR, 0)
    os.utime(old, (0, 0))
    assert prune_default_journals(str(journals), keep_days=1, keep_count=10) == [str(old)]
    assert os.listdir(journals) == []


_WITHOUT_OVERLAY = """
import asyncio, json, sys
from sandbx_pool import Pool

async def main(workspace, journal):
    async with Pool(workspace, journal=journal, workers=1) as pool:
        out = {}
        command = "echo a > a; echo more >> b; rm c; touch t; rm t; chmod 600 m"
        for mode in ("tracked", "transactional"):
            outcome = await pool.call("bash", {"command": command}, changes=mode)
            out[mode] = {"status": outcome.status, "error": outcome.error,
                         "changes": outcome.changes, "call_id": outcome.call_id}
        try:
            await pool.undo(out["tracked"]["call_id"])
        except ValueError as exc:
            out["undo"] = str(exc)
    print(json.dumps(out))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""

#: Root without CAP_SYS_ADMIN, as in a Docker container: no mount namespace, no overlay.
_CONTAINER_ROOT = [
    "setpriv",
    "--bounding-set=-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,"
    "+net_bind_service,+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap",
    "--inh-caps=-all",
]


def test_without_an_overlay_tracked_lists_and_transactional_is_refused(
    workspace: Path, tmp_path: Path
) -> None:
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    for name in "bcm":
        (workspace / name).write_text(f"{name}\n")
    done = subprocess.run(
        [
            *_CONTAINER_ROOT,
            sys.executable,
            "-c",
            _WITHOUT_OVERLAY,
            str(workspace),
            str(tmp_path / "j.jsonl"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    tracked = out["tracked"]
    assert tracked["status"] == "ok"
    assert {c["path"]: (c["kind"], c["applied"]) for c in tracked["changes"]} == {
        "a": ("created", True),
        "b": ("modified", True),
        "c": ("deleted", True),
        "m": ("modified", True),
    }
    assert (workspace / "b").read_text() == "b\nmore\n"
    refused = out["transactional"]
    assert refused["status"] == "error"
    assert "cannot be kept apart" in refused["error"]
    assert refused["changes"] == []  # it never ran
    assert "keeps no pre-images" in out["undo"]


async def test_a_transactional_call_over_its_output_limit_changes_nothing(
    workspace: Path, tmp_path: Path
) -> None:
    config = _config(tmp_path).override(
        calls={"max_output_bytes": 64 * 1024, "keep_output_bytes": 4096}
    )
    async with Pool(
        workspace, journal=tmp_path / "j.jsonl", config=config, changes="transactional"
    ) as pool:
        outcome = await pool.call(
            "bash", {"command": "echo x > flood.txt; rm hello.txt; yes | head -c 10000000"}
        )
    assert outcome.status is Status.OUTPUT_LIMIT
    assert {c["path"]: c["applied"] for c in outcome.changes or []} == {
        "flood.txt": False,
        "hello.txt": False,
    }
    assert not (workspace / "flood.txt").exists()
    assert (workspace / "hello.txt").read_text() == "hello\nworld\n"


async def test_a_transactional_call_a_shutdown_stopped_is_not_in_doubt(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "j.jsonl"
    config = _config(tmp_path).override(pool={"close_timeout_s": 10.0})
    modes = ("transactional", "direct")
    fifos = {mode: tmp_path / "sync" / mode for mode in modes}  # one each: no crosstalk
    for fifo in fifos.values():
        os.mkfifo(fifo)
    pool = Pool(workspace, journal=journal, config=config)
    await pool.start()
    try:
        calls = [
            asyncio.create_task(
                pool.call(
                    "bash",
                    {"command": f"echo x >> counter; echo > {fifos[mode]}; sleep 100"},
                    changes=mode,
                    call_id=mode,
                )
            )
            for mode in modes
        ]
        for fifo in fifos.values():  # both commands ran their first line
            await _read_what_a_command_writes(fifo)
    finally:
        await pool.close()
    outcomes = await asyncio.gather(*calls)
    assert {o.call_id: o.killed_by for o in outcomes} == {
        "transactional": KilledBy.SHUTDOWN,
        "direct": KilledBy.SHUTDOWN,
    }
    assert (workspace / "counter").read_text() == "x\n"  # the direct call's line only
    assert [call.call_id for call in in_doubt_calls(read_journal(journal))] == ["direct"]


async def _read_what_a_command_writes(fifo: Path) -> None:
    """Open ``fifo`` for reading once a command opened it for writing (a blocking open in a
    thread: the command's ``echo`` waits for us as we wait for it), and read until it closes
    its end. Closing ours first would end the command with SIGPIPE before its next line."""

    def read_to_eof() -> None:
        fd = os.open(fifo, os.O_RDONLY)
        try:
            while os.read(fd, 4096):
                pass
        finally:
            os.close(fd)

    await asyncio.to_thread(read_to_eof)
