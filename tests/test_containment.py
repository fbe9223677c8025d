"""Nothing a call starts outlives it; nothing the pool starts outlives the pool's owner.

Real processes throughout: commands that escape their process group (setsid, a double fork,
nohup + disown), a coordinator SIGKILLed in a subprocess, PDEATHSIG armed from a thread that
exits, cancels placed at each step of a worker's start, and a soak of mixed calls. Each
containment test runs under both mechanisms: a PID namespace per worker (the default where the
template may create one) and the subreaper fallback (forced with ``CONTAINMENT_ENV``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import MARKER, leftover_processes, marked_config
from helpers import alive, fifo_has_reader, pids_with, unique_tag, wait_until, wait_until_sync

from sandbx_pool import CancelToken, KilledBy, Pool, PoolClosed, Status
from sandbx_pool.workers.procfs import children
from sandbx_pool.workers.protocol import FromTemplate, Spawned

#: Ways a command leaves its process group. Each runs a sleep whose argv[0] is the tag.
ESCAPES = (
    "setsid bash -c 'exec -a {tag} sleep 1000' &",
    "( (exec -a {tag} sleep 1000 &) & )",
    "nohup bash -c 'exec -a {tag} sleep 1000' >/dev/null 2>&1 & disown",
)


def escaping(tag: str, then: str) -> str:
    """A bash script that starts every escape, then runs ``then``."""
    return "\n".join([*(escape.format(tag=tag) for escape in ESCAPES), then])


def uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


@pytest.fixture
async def pool(containment: str, workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 4}, calls={"grace_s": 0.1})
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as p:
        assert p._template is not None
        if p._template.containment != containment:
            pytest.skip(f"{containment} containment is not available here")
        yield p


async def assert_gone(tag: str, containment: str) -> None:
    if containment == "pidns":
        # The namespace died with its init, before the worker could be reaped and reported.
        assert pids_with(tag) == []
    else:
        # The template SIGKILLs the orphans before it reports the worker's exit; their deaths
        # are the kernel's to finish.
        await wait_until(lambda: pids_with(tag) == [])


# -- 1. escapees -------------------------------------------------------------------------------


async def test_escapees_die_when_the_call_finishes(
    pool: Pool, workspace: Path, containment: str
) -> None:
    tag = unique_tag()
    # The script ends once "go" exists, which the test creates when all the escapees are up.
    wait_for_go = "until [ -e go ]; do sleep 0.01; done"
    call = asyncio.create_task(pool.call("bash", {"command": escaping(tag, wait_for_go)}))
    await wait_until(lambda: len(pids_with(tag)) == len(ESCAPES))
    (workspace / "go").touch()
    outcome = await call
    assert outcome.status is Status.OK
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 0
    # Not eventually: the worker kills and reaps them before it answers.
    assert pids_with(tag) == []


@pytest.mark.parametrize("ending", ["cancel", "timeout"])
async def test_escapees_die_when_the_call_is_killed(
    pool: Pool, containment: str, ending: str
) -> None:
    tag = unique_tag()
    token = CancelToken()
    timeout = 2.0 if ending == "timeout" else None
    command = escaping(tag, "sleep 1000")
    call = asyncio.create_task(
        pool.call("bash", {"command": command}, timeout=timeout, cancel=token)
    )
    await wait_until(lambda: len(pids_with(tag)) == len(ESCAPES))
    if ending == "cancel":
        token.cancel("stop")
    outcome = await call
    assert outcome.status is (Status.CANCELLED if ending == "cancel" else Status.TIMEOUT)
    await assert_gone(tag, containment)


# -- 2. the coordinator dies -------------------------------------------------------------------

_COORDINATOR = """
import asyncio, json, sys
from sandbx_pool import Config, Pool

workspace, marker, commands = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])

async def main():
    config = Config().override(pool={"workers": 4}, journal={"policy": "off"}, env={"set": marker})
    async with Pool(workspace, config=config) as pool:
        calls = [pool.call("bash", {"command": command}) for command in commands]
        await asyncio.gather(*calls, pool.call("read", {"path": "fifo"}))

asyncio.run(main())
"""


def test_everything_dies_with_a_sigkilled_coordinator(containment: str, workspace: Path) -> None:
    since = uptime() - 0.01
    tag = unique_tag()
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    commands = [f"{escape.format(tag=tag)}\nsleep 1000" for escape in ESCAPES]
    coordinator = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _COORDINATOR,
            str(workspace),
            json.dumps({MARKER: os.environ[MARKER]}),
            json.dumps(commands),
        ]
    )
    try:
        wait_until_sync(
            lambda: len(pids_with(tag)) == 3 and fifo_has_reader(fifo),
            30,
            "the coordinator's calls to start",
        )
        (template,) = children(coordinator.pid)
        workers = children(template)
        assert len(workers) >= 4  # the four calls, plus any idle pre-forked ones
    finally:
        coordinator.kill()
        coordinator.wait()

    def everything_gone() -> bool:
        return (
            not pids_with(tag)
            and not alive(template)
            and not any(alive(pid) for pid in workers)
            and not fifo_has_reader(fifo)
            and not leftover_processes(since)
        )

    wait_until_sync(
        everything_gone,
        1.0,
        f"everything gone after the coordinator died (now: tagged {pids_with(tag)}, template "
        f"alive {alive(template)}, workers alive {[p for p in workers if alive(p)]}, "
        f"leftovers {leftover_processes(since)})",
    )


_AFTER_FORK_HOOKS = """
import os, sys
from sandbx_pool.workers import bare_fork
read_end, write_end = os.pipe()
os.register_at_fork(after_in_child=lambda: os.write(write_end, b"hook"))
for fork in (os.fork, bare_fork.fork):
    pid = fork()
    if pid == 0:
        os._exit(7)
    _, status = os.waitpid(pid, 0)
    os.write(write_end, b"|%d;" % os.waitstatus_to_exitcode(status))
os.close(write_end)
print(os.read(read_end, 100).decode())
"""


def test_the_template_forks_without_pythons_after_fork_hooks() -> None:
    # os.fork (the control) runs the hooks in the child; bare_fork, the template's fork, must
    # not, and its child must still run and report its exit status.
    done = subprocess.run(
        [sys.executable, "-c", _AFTER_FORK_HOOKS], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hook|7;|7;"


# -- 3. the forking thread ---------------------------------------------------------------------

_ARMED_CHILD = """
from sandbx_pool.workers.containment import set_parent_death_signal
set_parent_death_signal()
print("armed", flush=True)
import time
time.sleep(1000)
"""


def test_pdeathsig_fires_when_the_forking_thread_exits() -> None:
    """The control: the hazard the template's long-lived thread exists to avoid is real."""
    forked: list[subprocess.Popen[str]] = []

    def fork_and_leave() -> None:
        child = subprocess.Popen(
            [sys.executable, "-c", _ARMED_CHILD], stdout=subprocess.PIPE, text=True
        )
        forked.append(child)
        assert child.stdout is not None
        child.stdout.readline()  # armed before this thread exits

    thread = threading.Thread(target=fork_and_leave, name="short-lived")
    thread.start()
    thread.join()
    (child,) = forked
    try:
        returncode = child.wait(timeout=10)
    finally:
        child.kill()
        child.wait()
        assert child.stdout is not None
        child.stdout.close()
    assert returncode == -signal.SIGKILL  # our process lives on; only the thread exited


def test_a_pool_started_from_a_short_lived_thread_keeps_serving(
    workspace: Path, tmp_path: Path
) -> None:
    pool = Pool(workspace, journal=tmp_path / "j.jsonl", config=marked_config(pool={"workers": 2}))
    loop = asyncio.new_event_loop()
    try:
        # start() runs on a thread that exits right after: whatever it forked with PDEATHSIG
        # armed would die now.
        starter = threading.Thread(
            target=loop.run_until_complete, args=(pool.start(),), name="short-lived"
        )
        starter.start()
        starter.join()
        assert pool._template is not None
        template = pool._template.pid
        assert template is not None

        async def serve() -> list[Any]:
            # Sequential, so that new workers are forked well after the starter is gone.
            return [await pool.call("bash", {"command": "echo alive"}) for _ in range(10)]

        outcomes = loop.run_until_complete(serve())
        assert [o.status for o in outcomes] == [Status.OK] * 10
        assert alive(template)
        assert pool._template.pid == template
    finally:
        loop.run_until_complete(pool.close())
        loop.close()


# -- 4. the startup window ---------------------------------------------------------------------

STEPS = ("forking", "connecting", "handshaking")


def _stop_at(pool: Pool, step: str, stop: Callable[[], None]) -> Callable[[], None]:
    """Make ``stop`` happen at ``step`` of the first worker started once armed: installed
    before ``pool.start``, armed after it (start's own worker, the workspace check, passes).
    Returns the function that arms it.

    forking: Spawned has arrived but the pool has not seen it (its handling is deferred behind
    the kill); connecting: the pool knows the pid, the worker's Ready is not handled yet (held
    back if it came first); handshaking: the Ready that made the worker idle has just handed it
    to the call, whose driver has not resumed yet.
    """
    loop = asyncio.get_running_loop()
    on_template, on_message = pool._on_template, pool._inbox.deliver
    held: list[tuple[Any, ...]] = []
    state = {"armed": False, "spawned": False, "stopped": False}

    def fire() -> None:
        state["stopped"] = True
        stop()

    def at_template(message: FromTemplate) -> None:
        if not state["armed"] or state["stopped"] or not isinstance(message, Spawned):
            on_template(message)
            return
        state["spawned"] = True
        if step == "forking":
            fire()
            # A token's cancel is itself a call_soon on this loop: the kill is handled first.
            loop.call_soon(on_template, message)
            return
        on_template(message)
        if step == "connecting":
            fire()
            for args in held:
                loop.call_soon(on_message, *args)
        elif step == "handshaking" and pool._workers.busy:
            fire()

    def at_message(*args: Any) -> None:
        if not state["armed"]:
            on_message(*args)
            return
        # Before its call, the only message a worker sends is its Ready.
        if not state["stopped"] and step == "connecting" and not state["spawned"]:
            held.append(args)
            return
        on_message(*args)
        if not state["stopped"] and step == "handshaking" and pool._workers.busy:
            fire()

    pool._on_template = at_template  # type: ignore[method-assign]
    pool._inbox.deliver = at_message  # type: ignore[method-assign]
    return lambda: state.update(armed=True)


@pytest.mark.parametrize("step", STEPS)
async def test_a_cancel_in_the_startup_window_leaves_nothing(
    step: str, workspace: Path, tmp_path: Path
) -> None:
    config = marked_config(pool={"workers": 1, "prefork": 0})
    pool = Pool(workspace, journal=tmp_path / "j.jsonl", config=config)
    token = CancelToken()
    arm = _stop_at(pool, step, lambda: token.cancel(step))
    async with pool:
        arm()
        assert pool._template is not None
        template = pool._template.pid
        assert template is not None
        outcome = await pool.call("write", {"path": "never.txt", "content": "x"}, cancel=token)
        assert outcome.status is Status.CANCELLED
        assert outcome.killed_by is KilledBy.TOKEN
        assert outcome.reason == step
        assert not outcome.started
        assert outcome.worker_pid is None
        assert not (workspace / "never.txt").exists()
        assert len(children(template)) <= 1  # the one worker forked for it, kept for the next
        after = await pool.call("read", {"path": "hello.txt"})
        assert after.status is Status.OK
        # prefork=0: once the worker that served it is gone, nothing is left inside either.
        await wait_until(lambda: children(template) == [])


@pytest.mark.parametrize("step", STEPS)
async def test_a_close_in_the_startup_window_leaves_nothing(
    step: str, workspace: Path, tmp_path: Path
) -> None:
    config = marked_config(pool={"workers": 1, "prefork": 0})
    pool = Pool(workspace, journal=tmp_path / "j.jsonl", config=config)
    closing: list[asyncio.Task[None]] = []
    arm = _stop_at(pool, step, lambda: closing.append(asyncio.ensure_future(pool.close())))
    async with pool:
        arm()
        assert pool._template is not None
        template = pool._template.pid
        assert template is not None
        outcome = await pool.call("write", {"path": "never.txt", "content": "x"})
        await closing[0]
    assert outcome.status is Status.CANCELLED
    assert outcome.killed_by is KilledBy.SHUTDOWN
    assert not outcome.started
    assert not (workspace / "never.txt").exists()
    assert not alive(template)
    with pytest.raises(PoolClosed):
        await pool.call("ls", {})


# -- 7. soak -----------------------------------------------------------------------------------


#: Calls in flight at once in the soak: a harness running calls in parallel, four times the pool's
#: workers, so that calls also queue.
SOAK_IN_FLIGHT = 16


@pytest.mark.slow
async def test_soak_of_cancels_timeouts_and_escapes_leaves_nothing(
    containment: str, workspace: Path, tmp_path: Path
) -> None:
    rng = random.Random(7)
    tag = unique_tag()
    os.mkfifo(workspace / "fifo")
    journal = tmp_path / "j.jsonl"
    fds_before = sorted(os.listdir("/proc/self/fd"))
    config = marked_config(pool={"workers": 4}, calls={"grace_s": 0.05})
    loop = asyncio.get_running_loop()
    calls: list[tuple[str, dict[str, Any], float | None]] = [
        ("read", {"path": "hello.txt"}, None),
        ("grep", {"pattern": "print"}, None),
        ("bash", {"command": escaping(tag, "true")}, None),
        ("bash", {"command": escaping(tag, "sleep 1000")}, 0.2),
        ("bash", {"command": f"{ESCAPES[0].format(tag=tag)}\nsleep 1000"}, None),
        ("read", {"path": "fifo"}, 0.1),
        ("write", {"path": "out.txt", "content": "x" * 1000}, None),
    ]
    slots = asyncio.Semaphore(SOAK_IN_FLIGHT)

    async with Pool(workspace, journal=journal, config=config) as pool:
        assert pool._template is not None
        if pool._template.containment != containment:
            pytest.skip(f"{containment} containment is not available here")

        async def one(i: int) -> Any:
            tool, args, timeout = rng.choice(calls)
            token = CancelToken()
            async with slots:
                # Without a timeout or a cancel, the sleeper would never end.
                sleeper = tool == "bash" and "1000" in args["command"]
                if timeout is None and (sleeper or rng.random() < 0.3):
                    loop.call_later(rng.uniform(0, 0.1), token.cancel, "soak")
                return await pool.call(
                    tool, args, timeout=timeout, cancel=token, call_id=f"soak-{i}"
                )

        outcomes = await asyncio.gather(*(one(i) for i in range(300)))

    ids = sorted(f"soak-{i}" for i in range(300))
    assert sorted(o.call_id for o in outcomes) == ids
    seen = {o.status for o in outcomes}
    assert seen == {Status.OK, Status.CANCELLED, Status.TIMEOUT}, seen
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert sorted(r["call_id"] for r in records if r["kind"] == "outcome") == ids  # one each
    await assert_gone(tag, containment)
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


async def test_a_burst_of_queued_calls_keeps_the_template(workspace: Path, tmp_path: Path) -> None:
    config = marked_config(pool={"workers": 4}, journal={"policy": "off"})
    async with Pool(workspace, config=config) as pool:
        outcomes = await asyncio.gather(*(pool.call("ls", {}) for _ in range(300)))
    assert [o.status for o in outcomes] == [Status.OK] * 300


async def test_a_burst_wider_than_the_control_socket(workspace: Path, tmp_path: Path) -> None:
    # No spare workers and room for every call at once: 400 workers wanted in one loop turn.
    config = marked_config(pool={"workers": 400, "prefork": 0}, journal={"policy": "off"})
    async with Pool(workspace, config=config) as pool:
        outcomes = await asyncio.gather(*(pool.call("ls", {}) for _ in range(400)))
    assert [o.status for o in outcomes] == [Status.OK] * 400
