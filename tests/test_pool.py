"""The core contract, end to end with real workers: tools, outcomes, cancellation, isolation."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import fifo_has_reader, pids_with, tagged_sleep, unique_tag, wait_until

from sandbx_pool import (
    CancelToken,
    KilledBy,
    Pool,
    PoolClosed,
    PoolNotStarted,
    PoolState,
    Status,
    WorkspaceError,
)

# -- each tool through a worker ---------------------------------------------------------------


async def test_read(pool: Pool) -> None:
    outcome = await pool.call("read", {"path": "hello.txt"})
    assert outcome.status is Status.OK
    assert outcome.value is not None
    assert outcome.value["content"] == "hello\nworld\n"
    assert outcome.started
    assert outcome.worker_pid is not None


async def test_read_window(pool: Pool) -> None:
    outcome = await pool.call("read", {"path": "hello.txt", "offset": 1, "limit": 1})
    assert outcome.value is not None
    assert outcome.value["content"] == "world\n"


async def test_write_then_read(pool: Pool, workspace: Path) -> None:
    outcome = await pool.call("write", {"path": "new/dir/f.txt", "content": "abc"})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["bytes"] == 3
    assert (workspace / "new/dir/f.txt").read_text() == "abc"


async def test_edit(pool: Pool, workspace: Path) -> None:
    outcome = await pool.call(
        "edit", {"path": "hello.txt", "old_string": "world", "new_string": "there"}
    )
    assert outcome.status is Status.OK, outcome
    assert outcome.value == {"replacements": 1}
    assert (workspace / "hello.txt").read_text() == "hello\nthere\n"


async def test_edit_missing_string_is_an_error(pool: Pool) -> None:
    outcome = await pool.call("edit", {"path": "hello.txt", "old_string": "nope", "new_string": ""})
    assert outcome.status is Status.ERROR
    assert outcome.error is not None
    assert "not found" in outcome.error


async def test_a_call_may_name_its_own_workspace(pool: Pool, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    wrote = await pool.call("write", {"path": "a.txt", "content": "x"}, workspace=str(other))
    assert wrote.ok, wrote
    assert (other / "a.txt").read_text() == "x"
    pwd = await pool.call("bash", {"command": "pwd"}, workspace=str(other))
    assert pwd.value is not None
    assert pwd.value["stdout"] == f"{other}\n"
    escaped = await pool.call("read", {"path": "../ws/hello.txt"}, workspace=str(other))
    assert escaped.status is Status.DENIED  # the call's workspace confines it, not the pool's
    with pytest.raises(ValueError, match="absolute"):
        await pool.call("ls", {}, workspace="relative")


async def test_ls(pool: Pool) -> None:
    outcome = await pool.call("ls", {})
    assert outcome.value is not None
    entries = {e["name"]: e["type"] for e in outcome.value["entries"]}
    assert entries == {"hello.txt": "file", "src": "dir"}


async def test_grep(pool: Pool) -> None:
    outcome = await pool.call("grep", {"pattern": "print"})
    assert outcome.value is not None
    assert outcome.value["matches"] == [{"path": "src/a.py", "line": 2, "text": "print('a')"}]


async def test_find(pool: Pool) -> None:
    outcome = await pool.call("find", {"pattern": "**/*.py"})
    assert outcome.value is not None
    assert outcome.value["paths"] == ["src/a.py"]


async def test_bash(pool: Pool) -> None:
    outcome = await pool.call("bash", {"command": "echo out; echo err >&2; exit 3"})
    assert outcome.status is Status.OK
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 3
    assert outcome.value["stdout"] == "out\n"
    assert outcome.value["stderr"] == "err\n"


async def test_read_missing_file_is_an_error(pool: Pool) -> None:
    outcome = await pool.call("read", {"path": "nope.txt"})
    assert outcome.status is Status.ERROR
    assert outcome.error is not None
    assert "nope.txt" in outcome.error


# -- bad input never crashes, and is refused before a fork ---------------------------------------


@pytest.mark.parametrize(
    ("tool", "args", "fragment"),
    [
        ("read", {}, "path"),
        ("read", {"path": 3}, "Expected `str`"),
        ("read", {"path": "x", "bogus": 1}, "bogus"),
        ("teleport", {}, "unknown tool"),
        ("bash", "ls", "must be an object"),
    ],
)
async def test_bad_arguments_are_an_error_outcome(
    pool: Pool, tool: str, args: object, fragment: str
) -> None:
    outcome = await pool.call(tool, args)  # type: ignore[arg-type]
    assert outcome.status is Status.ERROR
    assert outcome.error is not None
    assert fragment in outcome.error
    assert not outcome.started


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "src/../../x"])
async def test_paths_outside_are_denied_before_a_fork(pool: Pool, path: str) -> None:
    outcome = await pool.call("read", {"path": path})
    assert outcome.status is Status.DENIED
    assert not outcome.started


async def test_symlink_outside_is_denied_by_the_worker(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    (tmp_path / "secret.txt").write_text("s3cret")
    (workspace / "link").symlink_to(tmp_path / "secret.txt")
    outcome = await pool.call("read", {"path": "link"})
    assert outcome.status is Status.DENIED
    assert outcome.started  # only the worker may touch the filesystem to find out


async def test_cwd_outside_is_denied(pool: Pool) -> None:
    outcome = await pool.call("ls", {}, cwd="..")
    assert outcome.status is Status.DENIED


# -- cancellation -----------------------------------------------------------------------------


async def test_cancel_a_read_blocked_on_a_fifo(pool: Pool, workspace: Path) -> None:
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    token = CancelToken()
    call = asyncio.create_task(pool.call("read", {"path": "fifo"}, cancel=token))
    await wait_until(lambda: fifo_has_reader(fifo))
    token.cancel("user pressed stop")
    outcome = await call
    assert outcome.status is Status.CANCELLED
    assert outcome.killed_by is KilledBy.TOKEN
    assert outcome.reason == "user pressed stop"
    assert outcome.started
    assert not fifo_has_reader(fifo)  # the outcome comes once the reader is gone


async def test_pre_cancelled_token_refuses_without_side_effect(pool: Pool, workspace: Path) -> None:
    token = CancelToken()
    token.cancel("too late")
    outcome = await pool.call("write", {"path": "never.txt", "content": "x"}, cancel=token)
    assert outcome.status is Status.CANCELLED
    assert not outcome.started
    assert outcome.worker_pid is None
    assert not (workspace / "never.txt").exists()


async def test_one_token_cancels_every_call_it_guards(pool: Pool, workspace: Path) -> None:
    tag = unique_tag()
    token = CancelToken()
    calls = [
        asyncio.create_task(pool.call("bash", {"command": tagged_sleep(tag)}, cancel=token))
        for _ in range(3)
    ]
    await wait_until(lambda: len(pids_with(tag)) == 3)
    token.cancel("end of turn")
    outcomes = await asyncio.gather(*calls)
    assert [o.status for o in outcomes] == [Status.CANCELLED] * 3
    assert all(o.reason == "end of turn" for o in outcomes)
    assert pids_with(tag) == []


async def test_task_cancellation_kills_and_reraises_with_its_args(
    pool: Pool, workspace: Path
) -> None:
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    call = asyncio.create_task(pool.call("read", {"path": "fifo"}))
    await wait_until(lambda: fifo_has_reader(fifo))
    call.cancel("harness shutting down")
    with pytest.raises(asyncio.CancelledError) as caught:
        await call
    assert caught.value.args == ("harness shutting down",)
    assert not fifo_has_reader(fifo)
    assert pool.running() == []


async def test_bash_timeout_kills_the_whole_group(pool: Pool) -> None:
    tag = unique_tag()
    command = f"{tagged_sleep(tag)} & {tagged_sleep(tag)}"
    outcome = await pool.call("bash", {"command": command}, timeout=0.3)
    assert outcome.status is Status.TIMEOUT
    assert outcome.killed_by is KilledBy.TIMEOUT
    assert pids_with(tag) == []


async def test_command_ignoring_sigterm_is_killed_after_the_grace(
    workspace: Path, tmp_path: Path
) -> None:
    tag = unique_tag()
    config = marked_config(calls={"grace_s": 0.2})
    async with Pool(workspace, config=config, journal=tmp_path / "j.jsonl") as pool:
        command = f"trap '' TERM; {tagged_sleep(tag)}; trap '' TERM; {tagged_sleep(tag)}"
        outcome = await pool.call("bash", {"command": command}, timeout=0.2)
    assert outcome.status is Status.TIMEOUT
    assert pids_with(tag) == []


async def test_bash_gets_sigterm_first(pool: Pool, workspace: Path) -> None:
    marker = workspace / "cleaned-up"
    command = f"trap 'touch {marker}; exit 0' TERM; while true; do sleep 0.01; done"
    outcome = await pool.call("bash", {"command": command}, timeout=0.3)
    assert outcome.status is Status.TIMEOUT
    assert marker.exists()


async def test_output_cap_is_output_limit_not_timeout(workspace: Path, tmp_path: Path) -> None:
    config = marked_config(calls={"max_output_bytes": 64 * 1024})
    async with Pool(workspace, config=config, journal=tmp_path / "j.jsonl") as pool:
        outcome = await pool.call("bash", {"command": "yes"}, timeout=30)
    assert outcome.status is Status.OUTPUT_LIMIT
    assert outcome.killed_by is KilledBy.OUTPUT_LIMIT


async def test_a_worker_killed_by_a_signal_is_crashed(pool: Pool, workspace: Path) -> None:
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    call = asyncio.create_task(pool.call("read", {"path": "fifo"}))
    await wait_until(lambda: fifo_has_reader(fifo))
    (running,) = pool.running()
    # What the OOM killer does. (A worker is its PID namespace's init, which ignores other
    # signals from outside unless it handles them.)
    os.kill(running["pid"], signal.SIGKILL)
    outcome = await call
    assert outcome.status is Status.CRASHED
    assert outcome.killed_by is None  # nobody in the pool decided it
    assert outcome.signal == signal.SIGKILL
    assert outcome.error is not None
    assert "SIGKILL" in outcome.error


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def test_workers_that_cannot_start_fail_the_waiting_call_not_fork_forever(
    workspace: Path, tmp_path: Path
) -> None:
    # A real way for every new worker to fail before it connects: the coordinator's socket
    # is removed from under the pool, as a /tmp cleaner would. A worker connected before
    # that still serves; a call that needs a new one ends as an error, not a wait forever.
    journal = tmp_path / "j.jsonl"
    config = marked_config(pool={"workers": 1, "prefork": 1})
    async with Pool(workspace, config=config, journal=journal) as pool:
        assert (await pool.call("read", {"path": "hello.txt"})).status is Status.OK
        assert pool._runtime_dir is not None
        os.unlink(os.path.join(pool._runtime_dir, "coordinator.sock"))
        async with asyncio.timeout(60):  # without the bound, the second call never returns
            outcomes = [await pool.call("read", {"path": "hello.txt"}) for _ in range(3)]
        # With no call waiting, the template is left alone: no spare is forked to fail again.
        # (Absence has no event to await: a template forking in a loop burns a core, so half
        # a second shows it.)
        assert pool._template is not None
        spent = _cpu_seconds(pool._template.pid)
        await asyncio.sleep(0.5)
        assert _cpu_seconds(pool._template.pid) - spent < 0.1
    failed = [o for o in outcomes if o.status is not Status.OK]
    assert len(failed) >= 2  # at most one worker was ready before the socket went
    for outcome in failed:
        assert outcome.status is Status.ERROR
        assert not outcome.started
        assert outcome.error is not None
        assert "no worker could start: 5 in a row exited before connecting" in outcome.error
    recorded = [line for line in journal.read_text().splitlines() if '"outcome"' in line]
    assert len(recorded) == 4  # every call, the failed ones included, has its outcome


async def test_closing_the_pool_cancels_calls_in_flight(workspace: Path, tmp_path: Path) -> None:
    tag = unique_tag()
    pool = Pool(workspace, config=marked_config(), journal=tmp_path / "j.jsonl")
    await pool.start()
    call = asyncio.create_task(pool.call("bash", {"command": tagged_sleep(tag)}))
    await wait_until(lambda: len(pids_with(tag)) == 1)
    await pool.close()
    outcome = await call
    assert outcome.status is Status.CANCELLED
    assert outcome.killed_by is KilledBy.SHUTDOWN
    assert pids_with(tag) == []
    with pytest.raises(PoolClosed):
        await pool.call("ls", {})


async def test_calling_before_start_is_misuse(workspace: Path) -> None:
    with pytest.raises(PoolNotStarted):
        await Pool(workspace).call("ls", {})


# -- isolation ---------------------------------------------------------------------------------


async def test_parallel_calls_see_only_their_own_cwd_and_env(pool: Pool, workspace: Path) -> None:
    for name in ("a", "b", "c"):
        (workspace / name).mkdir()

    async def probe(name: str) -> str:
        outcome = await pool.call(
            "bash", {"command": 'sleep 0.05; echo "$(pwd) $WHO"'}, cwd=name, env={"WHO": name}
        )
        assert outcome.value is not None
        return str(outcome.value["stdout"]).strip()

    seen = await asyncio.gather(*(probe(n) for n in ("a", "b", "c")))
    assert seen == [f"{workspace / n} {n}" for n in ("a", "b", "c")]


async def test_bash_does_not_see_the_coordinator_environment(
    pool: Pool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_API_KEY", "sk-do-not-leak")
    outcome = await pool.call("bash", {"command": "env"})
    assert outcome.value is not None
    assert "sk-do-not-leak" not in outcome.value["stdout"]
    names = {line.split("=", 1)[0] for line in outcome.value["stdout"].splitlines()}
    assert {"PATH", "HOME"} <= names


async def test_each_call_gets_a_fresh_process(pool: Pool) -> None:
    first = await pool.call("bash", {"command": "true"})
    second = await pool.call("bash", {"command": "true"})
    assert first.worker_pid != second.worker_pid


async def test_more_calls_than_workers_queue_and_all_finish(pool: Pool) -> None:
    outcomes = await asyncio.gather(*(pool.call("read", {"path": "hello.txt"}) for _ in range(40)))
    assert all(o.ok for o in outcomes)
    assert len({o.worker_pid for o in outcomes}) == 40


async def test_repr_shows_the_lifecycle(pool: Pool) -> None:
    assert repr(pool).startswith("<Pool [OPEN | Calls: 0 active")


@pytest.mark.parametrize("kind", ["missing", "a file"])
async def test_a_workspace_that_is_not_a_directory_is_refused_at_start(
    tmp_path: Path, kind: str
) -> None:
    workspace = tmp_path / "nowhere"
    if kind == "a file":
        workspace.write_text("not a directory\n")
    pool = Pool(workspace, journal=tmp_path / "j.jsonl", config=marked_config())
    with pytest.raises(WorkspaceError) as refused:
        await pool.start()
    problem = "no such directory" if kind == "missing" else "not a directory"
    assert str(refused.value) == f"workspace {workspace}: {problem}"
    assert pool.state is PoolState.CLOSED  # its template and directories are gone with it
    with pytest.raises(PoolClosed):
        await pool.call("ls", {})


async def test_a_symlink_to_a_directory_is_a_workspace(workspace: Path, tmp_path: Path) -> None:
    link = tmp_path / "link"
    link.symlink_to(workspace)
    async with Pool(link, journal=tmp_path / "j.jsonl", config=marked_config()) as pool:
        assert (await pool.call("read", {"path": "hello.txt"})).ok
