"""A read stuck on a hung filesystem holds nobody: tested against a real FUSE mount.

The mount (``fusefs.HungFs``) answers lookups and listings but never a read until released, so a
reader sleeps in the kernel (state D) where even SIGKILL cannot end it. The pool must release
the caller anyway (after ``calls.kill_wait_s``), quarantine the worker and report where it is
stuck, keep serving other calls, reap the worker once the filesystem lets go, and close in
bounded time while it is still stuck. Without FUSE these tests skip, except under CI=true,
where they fail.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MARKER, marked_config
from fusefs import STALLED, HungFs, require_fuse
from helpers import wait_until

from sandbx_pool import CancelToken, KilledBy, Pool, Status
from sandbx_pool.workers.rules import FILE_RULES_TIMEOUT_S

#: After SIGKILL, how long the pool waits for a worker to die before it quarantines it.
KILL_WAIT_S = 0.2
#: How long past its deadline a caller may wait: kill_wait_s plus slack for a loaded machine.
#: A bound that says "released, not held by the kernel", not a performance bar.
RELEASE_BOUND_S = KILL_WAIT_S + 5.0
#: The same for close(): its own kill wait, and the template's bounded wait for stuck workers.
CLOSE_BOUND_S = 15.0
#: What docs/design.md promises close() with a worker stuck, and the slack a loaded machine
#: adds to it (far less than a second wait of that bound would).
CLOSE_DOCUMENTED_S = 2.0
CLOSE_SLACK_S = 0.5

CALLS: dict[str, tuple[str, dict[str, Any]]] = {
    "read": ("read", {"path": "hung/stuck-0.txt"}),
    "grep": ("grep", {"pattern": "needle", "path": "hung"}),
}


@pytest.fixture
def hung_fs(workspace: Path) -> Iterator[HungFs]:
    require_fuse()
    fs = HungFs(workspace / "hung")
    fs.start()
    try:
        yield fs
    finally:
        fs.stop()
    assert not fs.mounted()


def hung_config(**calls: object) -> Any:
    return marked_config(pool={"workers": 2}, calls={"kill_wait_s": KILL_WAIT_S, **calls})


@pytest.fixture
async def pool(hung_fs: HungFs, workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=hung_config()) as p:
        yield p


async def stuck_call(pool: Pool, fs: HungFs, name: str, token: CancelToken) -> asyncio.Task[Any]:
    """Start call ``name`` and return once its read is held by the filesystem."""
    tool, args = CALLS[name]
    seen = len(fs.reads)
    call = asyncio.create_task(pool.call(tool, args, cancel=token))
    await asyncio.to_thread(fs.wait_reads, seen + 1)
    return call


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# -- released on schedule, quarantined, reaped -------------------------------------------------


@pytest.mark.parametrize("name", CALLS)
@pytest.mark.parametrize("release", ["answer", "daemon dies"])
async def test_a_cancelled_call_on_a_hung_mount_is_released_then_reaped(
    pool: Pool, hung_fs: HungFs, name: str, release: str
) -> None:
    token = CancelToken()
    call = await stuck_call(pool, hung_fs, name, token)
    token.cancel("user pressed stop")
    outcome = await asyncio.wait_for(call, RELEASE_BOUND_S)
    assert outcome.status is Status.CANCELLED
    assert outcome.killed_by is KilledBy.TOKEN
    assert outcome.started
    assert outcome.quarantined
    assert outcome.wchan  # e.g. "request_wait_answer": where FUSE holds the reader
    (stuck,) = pool.stuck_workers()
    assert stuck["pid"] == outcome.worker_pid
    assert stuck["stuck_pid"] == outcome.stuck_pid
    assert stuck["wchan"] == outcome.wchan
    if name == "grep":
        # grep runs rg: the kernel holds one of rg's threads, and the worker waits for rg.
        assert outcome.stuck_pid != outcome.worker_pid
        assert outcome.wchan != "do_wait"
        comm = await asyncio.to_thread(Path(f"/proc/{outcome.stuck_pid}/comm").read_text)
        assert comm.strip() == "rg"
    else:
        assert outcome.stuck_pid == outcome.worker_pid
        assert stuck["state"].startswith("D")
    if release == "answer":
        hung_fs.release()
    else:
        hung_fs.kill()  # the kernel aborts the connection: the read fails, the kill lands
    await wait_until(lambda: pool.stuck_workers() == [], within_s=10)
    assert outcome.worker_pid is not None
    assert proc_state(outcome.worker_pid) is None


@pytest.mark.parametrize("name", CALLS)
async def test_a_call_on_a_hung_mount_times_out_on_schedule(
    pool: Pool, hung_fs: HungFs, name: str
) -> None:
    tool, args = CALLS[name]
    timeout = 2.0
    outcome = await asyncio.wait_for(
        pool.call(tool, args, timeout=timeout), timeout + RELEASE_BOUND_S
    )
    assert hung_fs.reads  # the deadline found the worker held by the filesystem
    assert outcome.status is Status.TIMEOUT
    assert outcome.killed_by is KilledBy.TIMEOUT
    assert outcome.quarantined
    assert outcome.wchan
    assert outcome.duration_s >= timeout
    assert [w["pid"] for w in pool.stuck_workers()] == [outcome.worker_pid]
    hung_fs.release()
    await wait_until(lambda: pool.stuck_workers() == [], within_s=10)


async def test_a_bash_command_on_a_hung_mount_is_released_then_reaped(
    pool: Pool, hung_fs: HungFs
) -> None:
    # Here the stuck process is bash's child, not the worker: the worker, its namespace's init,
    # cannot finish exiting while a process of its namespace is alive, so it is quarantined too.
    seen = len(hung_fs.reads)
    token = CancelToken()
    call = asyncio.create_task(pool.call("bash", {"command": "cat hung/stuck-1.txt"}, cancel=token))
    await asyncio.to_thread(hung_fs.wait_reads, seen + 1)
    token.cancel()
    outcome = await asyncio.wait_for(call, RELEASE_BOUND_S + 1.0)  # + bash's SIGTERM grace
    assert outcome.status is Status.CANCELLED
    assert outcome.started
    assert pool._template is not None
    if pool._template.containment == "pidns":
        assert outcome.quarantined
        # Reported is the process the kernel holds, cat, not the worker waiting for it.
        assert outcome.stuck_pid not in (None, outcome.worker_pid)
        assert outcome.wchan  # e.g. "request_wait_answer", not the worker's "do_wait"
        assert outcome.wchan != "do_wait"
        (stuck,) = pool.stuck_workers()
        assert (stuck["pid"], stuck["stuck_pid"]) == (outcome.worker_pid, outcome.stuck_pid)
        comm = await asyncio.to_thread(Path(f"/proc/{outcome.stuck_pid}/comm").read_text)
        assert comm.strip() == "cat"
    hung_fs.release()
    await wait_until(lambda: pool.stuck_workers() == [], within_s=10)


# -- other calls go on -------------------------------------------------------------------------


async def test_other_calls_keep_working_while_workers_are_stuck(
    pool: Pool, hung_fs: HungFs
) -> None:
    # As many stuck workers as the pool has slots: quarantined workers must not hold one.
    tokens = [CancelToken(), CancelToken()]
    calls = [await stuck_call(pool, hung_fs, n, t) for n, t in zip(CALLS, tokens, strict=True)]
    for token in tokens:
        token.cancel()
    stuck = await asyncio.wait_for(asyncio.gather(*calls), RELEASE_BOUND_S)
    assert all(o.quarantined for o in stuck)
    outcomes = await asyncio.gather(*(pool.call("read", {"path": "hello.txt"}) for _ in range(50)))
    assert [o.status for o in outcomes] == [Status.OK] * 50
    listing = await pool.call("ls", {"path": "hung"})  # the mount still answers what it can
    assert listing.status is Status.OK
    assert {w["pid"] for w in pool.stuck_workers()} == {o.worker_pid for o in stuck}
    hung_fs.release()
    await wait_until(lambda: pool.stuck_workers() == [], within_s=10)


# -- close -------------------------------------------------------------------------------------


async def test_close_is_bounded_while_workers_are_stuck(
    hung_fs: HungFs, workspace: Path, tmp_path: Path
) -> None:
    pool = Pool(workspace, journal=tmp_path / "j.jsonl", config=hung_config())
    await pool.start()
    token = CancelToken()
    first = await stuck_call(pool, hung_fs, "read", token)
    token.cancel()
    quarantined = await asyncio.wait_for(first, RELEASE_BOUND_S)
    in_flight = await stuck_call(pool, hung_fs, "grep", CancelToken())
    started = time.monotonic()
    await asyncio.wait_for(pool.close(), CLOSE_BOUND_S)
    closed_in = time.monotonic() - started
    stopped = await in_flight
    assert stopped.status is Status.CANCELLED
    assert stopped.killed_by is KilledBy.SHUTDOWN
    assert stopped.quarantined
    pids = [quarantined.worker_pid, stopped.worker_pid]
    # Closed while they were still stuck: the pool did not wait for the kernel.
    # (The grep's worker waits, in S, for rg, which the kernel holds.)
    assert [proc_state(pid) for pid in pids if pid is not None] == ["D", "S"], closed_in
    hung_fs.release()
    await wait_until(lambda: all(proc_state(p) is None for p in pids if p is not None), 10)


async def test_a_workspace_whose_lookup_hangs_holds_only_its_own_calls(
    hung_fs: HungFs, tmp_path: Path
) -> None:
    # The template has a helper open the workspace to build the file tools' rules once; the
    # helper hangs here, and the template must give up on it (workers then build their own
    # rules, and each call hangs, killably, until the mount answers) rather than fork nothing.
    workspace = hung_fs.mountpoint / STALLED
    config = hung_config()
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        started = time.monotonic()
        outcome = await pool.call("read", {"path": "x.txt"}, timeout=1.0)
        assert outcome.status is Status.TIMEOUT, outcome
        assert outcome.started
        assert time.monotonic() - started < FILE_RULES_TIMEOUT_S + 1.0 + RELEASE_BOUND_S
        hung_fs.release()
        outcome = await pool.call("read", {"path": "x.txt"}, timeout=30.0)
        assert outcome.status is Status.ERROR, outcome
        assert outcome.error == "x.txt not found", outcome


# -- a stop waits on nothing: no grace for what the kernel holds --------------------------------

#: A grace and a kill wait so long that a stop which waited out either shows plainly: the old
#: stop took grace_s + kill_wait_s for bash and grep, and kill_wait_s for the file tools.
SLOW_STOP = {"grace_s": 4.0, "kill_wait_s": 4.0}
#: How soon after the cancel or deadline the caller must be back: far under either wait above,
#: far over the 50 ms settle a stop on a hung mount now costs (slack for a loaded machine).
PROMPT_RELEASE_S = 1.5

#: Every tool that can be held by the mount, and the call that is. The file reads and bash's cat
#: are seen arriving at the daemon; the lookups of ``STALLED`` (ls, find) are not.
HELD: dict[str, tuple[str, dict[str, Any], bool]] = {
    "read": ("read", {"path": "hung/stuck-0.txt"}, True),
    "edit": ("edit", {"path": "hung/stuck-1.txt", "old_string": "a", "new_string": "b"}, True),
    "grep": ("grep", {"pattern": "needle", "path": "hung"}, True),
    "bash": ("bash", {"command": "cat hung/stuck-2.txt"}, True),
    # wc takes its SIGTERM; then only cat, in the kernel, is left for the grace to wait on.
    "bash pipeline": ("bash", {"command": "cat hung/stuck-3.txt | wc -c"}, True),
    "ls": ("ls", {"path": f"hung/{STALLED}"}, False),
    "find": ("find", {"pattern": "*", "path": f"hung/{STALLED}"}, False),
}


@pytest.fixture
async def slow_stop_pool(hung_fs: HungFs, workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 2}, calls=SLOW_STOP)
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as p:
        yield p


@pytest.mark.parametrize("name", [n for n, (_, _, seen) in HELD.items() if seen])
async def test_a_cancel_on_a_hung_mount_releases_at_once_whatever_the_tool(
    slow_stop_pool: Pool, hung_fs: HungFs, name: str
) -> None:
    tool, args, _ = HELD[name]
    seen = len(hung_fs.reads)
    token = CancelToken()
    call = asyncio.create_task(slow_stop_pool.call(tool, args, cancel=token))
    await asyncio.to_thread(hung_fs.wait_reads, seen + 1)
    if name == "bash pipeline":
        await wait_until(lambda: _processes_named("wc"), within_s=10)
    cancelled_at = time.monotonic()
    token.cancel("stop")
    outcome = await asyncio.wait_for(call, PROMPT_RELEASE_S + 10)
    held_for = time.monotonic() - cancelled_at
    assert outcome.status is Status.CANCELLED, outcome
    assert outcome.quarantined, outcome  # as before: the worker is kept apart until reaped
    assert outcome.wchan
    assert held_for < PROMPT_RELEASE_S, f"{name}: the caller was held {held_for:.2f} s"
    hung_fs.release()
    await wait_until(lambda: slow_stop_pool.stuck_workers() == [], within_s=10)


@pytest.mark.parametrize("name", list(HELD))
async def test_a_timeout_on_a_hung_mount_releases_at_its_deadline(
    slow_stop_pool: Pool, hung_fs: HungFs, name: str
) -> None:
    tool, args, _ = HELD[name]
    timeout = 1.0
    started = time.monotonic()
    outcome = await asyncio.wait_for(
        slow_stop_pool.call(tool, args, timeout=timeout), timeout + PROMPT_RELEASE_S + 10
    )
    late = time.monotonic() - started - timeout
    assert outcome.status is Status.TIMEOUT, outcome
    assert outcome.quarantined, outcome
    assert late < PROMPT_RELEASE_S, f"{name}: released {late:.2f} s after its deadline"
    hung_fs.release()
    await wait_until(lambda: slow_stop_pool.stuck_workers() == [], within_s=10)


async def test_a_command_that_takes_its_sigterm_still_gets_its_grace(
    slow_stop_pool: Pool, hung_fs: HungFs
) -> None:
    # The control: a command that is not held by the kernel is warned first, and its output
    # until the kill is kept, as before.
    token = CancelToken()
    command = "trap 'echo cleaned; exit 3' TERM; echo started; while :; do sleep 0.05; done"
    chunks: list[str] = []
    first = asyncio.Event()

    def on_output(chunk: Any) -> None:
        chunks.append(chunk.data)
        first.set()

    call = asyncio.create_task(
        slow_stop_pool.call("bash", {"command": command}, cancel=token, on_output=on_output)
    )
    await asyncio.wait_for(first.wait(), 30)
    token.cancel()
    outcome = await asyncio.wait_for(call, 30)
    assert outcome.status is Status.CANCELLED
    assert not outcome.quarantined
    assert outcome.value is not None, (outcome, outcome.duration_s)
    assert "cleaned" in outcome.value["stdout"], outcome.value


def _processes_named(comm: str) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() == comm:
                    return True
    return False


# -- the caller's descriptors -----------------------------------------------------------------


def test_a_piped_one_shot_call_ends_with_its_outcome_while_its_worker_is_stuck(
    hung_fs: HungFs, workspace: Path, tmp_path: Path
) -> None:
    # `sandbx-pool call ... | cat`: cat ends when the last holder of the pipe closes it. A
    # worker held in the kernel must not be one, nor may any process of the pool.
    config = tmp_path / "pool.toml"
    config.write_text(
        f'[calls]\nkill_wait_s = {KILL_WAIT_S}\n[env.set]\n{MARKER} = "{os.environ[MARKER]}"\n'
    )
    argv = [sys.executable, "-m", "sandbx_pool.cli", "call", "read", "path=hung/stuck-0.txt"]
    argv += ["--timeout", "1", "--workspace", str(workspace), "--config", str(config)]
    argv += ["--journal", str(tmp_path / "j.jsonl")]
    pipeline = f"{shlex.join(argv)} 2>&1 | cat"
    done = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, timeout=30)
    outcome = json.loads(done.stdout[done.stdout.index("{") :])
    assert outcome["status"] == "timeout", done.stdout
    assert outcome["quarantined"], done.stdout
    # Still held: the pipeline did not end because the filesystem let go.
    assert proc_state(outcome["worker_pid"]) == "D"
    assert hung_fs.reads == ["/stuck-0.txt"]


async def test_close_returns_within_its_documented_bound_with_a_worker_stuck(
    hung_fs: HungFs, workspace: Path, tmp_path: Path
) -> None:
    pool = Pool(workspace, journal=tmp_path / "j.jsonl", config=hung_config())
    await pool.start()
    token = CancelToken()
    call = await stuck_call(pool, hung_fs, "read", token)
    token.cancel()
    stuck = await asyncio.wait_for(call, RELEASE_BOUND_S)
    assert stuck.quarantined
    started = time.monotonic()
    await pool.close()
    closed_in = time.monotonic() - started
    assert stuck.worker_pid is not None
    assert proc_state(stuck.worker_pid) == "D"  # closed while it was still stuck
    # docs/design.md: close() does not wait for a stuck worker beyond a bounded 2 s.
    assert closed_in < CLOSE_DOCUMENTED_S + CLOSE_SLACK_S, closed_in
