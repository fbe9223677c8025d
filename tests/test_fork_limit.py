"""A fork bomb ends its own call only: [limits] processes, and a template that survives EAGAIN.

Every test here runs inside a pids cgroup of its own (``guard``), so that if the limit under
test failed, a fork bomb would fill the guard's GUARD_PIDS and not the machine. The guard is a
cgroup of the pids hierarchy the pool itself finds (workers.cgroups), and the pool makes its
cgroups inside it: the guard's pids.max bounds them all.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import pids_with, tagged_sleep, unique_tag, wait_until

from sandbx_pool import Pool, Status
from sandbx_pool.workers import cgroups
from sandbx_pool.workers.protocol import Limits

#: Room for this test process (its threads), the template, a few workers and a capped bomb.
GUARD_PIDS = 400

#: The per-call limit the bombs run under.
LIMIT = 64

BOMB = ":(){ :|:& };:"


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _exists(path: str) -> bool:
    # cgroupfs, never a hung mount: a blocking check in a coroutine is fine here.
    return os.path.exists(path)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@pytest.fixture
def guard() -> Iterator[str]:
    """Move this test process into a fresh pids cgroup capped at GUARD_PIDS; back out after."""
    reasons: list[str] = []
    hierarchy = cgroups.find_pids_hierarchy(reasons)
    if hierarchy is None or os.geteuid() != 0:
        pytest.skip(f"no writable pids controller here: {'; '.join(reasons) or 'not root'}")
    path = f"{hierarchy.base}/sandbx-guard-{os.getpid()}"
    os.mkdir(path)
    # v2: only a leaf may hold processes, and the pool is made beside our own cgroup (in its
    # parent): the guard is that parent, we go to a leaf of it.
    member = path
    if hierarchy.version == 2:
        _write(f"{path}/cgroup.subtree_control", "+pids")
        member = f"{path}/runner"
        os.mkdir(member)
    _write(f"{path}/pids.max", str(GUARD_PIDS))
    assert _read(f"{path}/pids.max") == str(GUARD_PIDS)
    _write(f"{member}/cgroup.procs", str(os.getpid()))
    try:
        assert f":{member.removeprefix(hierarchy.base)}" in _read("/proc/self/cgroup")
        yield path
    finally:
        _write(f"{hierarchy.origin}/cgroup.procs", str(os.getpid()))
        cgroups.kill_cgroup(path)
        assert cgroups.remove_cgroup(path, timeout_s=5)


@pytest.fixture
async def pool(
    guard: str, containment: str, workspace: Path, tmp_path: Path
) -> AsyncIterator[Pool]:
    config = marked_config(
        pool={"workers": 2, "prefork": 0},
        calls={"grace_s": 0.0},
        limits={"processes": LIMIT},
    )
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as p:
        assert p.fleet.template is not None
        if p.fleet.template.containment != containment:
            pytest.skip(f"{containment} containment is not available here")
        yield p


def _pool_cgroup(pool: Pool) -> str:
    assert pool.fleet.template is not None
    path = pool.fleet.template.pids_cgroup
    assert path is not None, pool.fleet.template.process_limit_why
    return path


async def test_a_fork_bomb_ends_its_own_call_only(pool: Pool, guard: str) -> None:
    pool_cgroup = _pool_cgroup(pool)
    assert pool_cgroup.startswith(guard + "/")  # so the guard bounds the bomb
    before = int(_read(f"{guard}/pids.current"))  # us, the template
    bomb_call = asyncio.create_task(
        pool.call("bash", {"command": f"{BOMB}; sleep 30"}, timeout=4.0)
    )
    await wait_until(
        lambda: int(_read(f"{guard}/pids.current")) >= LIMIT, within_s=10, what="the bomb at 64"
    )
    # While it rages at its limit, the template forks a worker for another call, which runs.
    during = await pool.call("bash", {"command": "echo ok"}, timeout=10.0)
    assert during.status is Status.OK, during
    assert during.value is not None
    assert during.value["stdout"] == "ok\n"
    bomb = await bomb_call
    assert bomb.status is Status.TIMEOUT, bomb
    # At most LIMIT for the bomb (its worker included), a few for the call made meanwhile and
    # for threads this process may start (asyncio's executor); without the limit the bomb
    # fills the guard (GUARD_PIDS).
    if _exists(f"{guard}/pids.peak"):  # Linux 6.1+
        peak = int(_read(f"{guard}/pids.peak"))
        assert peak <= before + LIMIT + 32, (peak, before)
    # One whose bash ends first: the worker kills what it left; the outcome names the limit.
    # Its sleep is forked before the bomb: forked after, it competes with the bomb for a free
    # pid and, on a loaded machine, lost for more than the call's 10 s (seen once). The bomb
    # starts in a background subshell of its own: run by this bash, its first `:|:&` forks
    # twice from here, and when the first child's bomb fills the limit before the second fork,
    # bash retries that fork for up to 15 s (seen twice in full runs).
    ends_first = f"sleep 1 & s=$!; ({BOMB}) & wait $s"
    bomb = await pool.call("bash", {"command": ends_first}, timeout=10.0)
    assert bomb.status is Status.OK, bomb
    assert bomb.limit == "processes"
    twenty = "for i in $(seq 20); do true & done; wait; echo ok"
    after = await pool.call("bash", {"command": twenty})
    assert after.status is Status.OK, after
    # Each worker's cgroup goes with it, and the pool's with the pool.
    await pool.close()
    assert not _exists(pool_cgroup)


#: Forks up to N children that sleep, until a fork fails; prints how many it started. Python,
#: not bash: bash retries a refused fork for up to 15 s before it gives up.
FORKER = """
import os, sys, time
started = 0
for _ in range(int(sys.argv[1])):
    try:
        pid = os.fork()
    except BlockingIOError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    started += 1
print(started)
"""


async def test_a_command_over_the_limit_is_refused_forks_and_named(pool: Pool) -> None:
    """The limit binds root: past it, fork fails with EAGAIN; the outcome names the limit."""
    command = f"python3 -c '{FORKER}' 100"
    over = await pool.call("bash", {"command": command}, limits=Limits(processes=20))
    assert over.status is Status.OK, over
    assert over.value is not None
    assert 10 <= int(over.value["stdout"]) < 20, over.value  # the worker and python hold 2-3
    assert over.limit == "processes"
    # The control: under the pool's limit (64), 30 children all start.
    under = await pool.call("bash", {"command": command.replace("100", "30")})
    assert under.value is not None
    assert int(under.value["stdout"]) == 30, under.value
    assert under.limit is None


def _joined_while_idle(pool_cgroup: str) -> list[str]:
    """The workers' own cgroups (w<n>) that hold a process: a worker that has joined one."""
    held = []
    with os.scandir(pool_cgroup) as entries:
        for entry in entries:
            if not entry.name.startswith("w"):
                continue
            try:
                if _read(f"{entry.path}/cgroup.procs"):
                    held.append(entry.name)
            except FileNotFoundError:
                pass  # a reaped worker's, removed by the template meanwhile
    return held


async def test_an_idle_worker_joins_its_cgroup_before_its_call_and_is_capped_there(
    guard: str, workspace: Path, tmp_path: Path
) -> None:
    """Past JOIN_WHEN_IDLE_MS without a call, a worker joins its own cgroup while nobody waits
    (a migration can wait out an RCU grace period: 5-15 ms a bash call used to pay); the
    call that comes later is capped in it as if it had joined then, and a file tool's worker
    that joined for nothing leaves no cgroup behind."""
    config = marked_config(
        pool={"workers": 1, "prefork": 1}, calls={"grace_s": 0.0}, limits={"processes": LIMIT}
    )
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as pool:
        pool_cgroup = _pool_cgroup(pool)
        await wait_until(
            lambda: len(_joined_while_idle(pool_cgroup)) == 1,
            within_s=10,
            what="the idle worker in a cgroup of its own",
        )
        command = f"python3 -c '{FORKER}' 100"
        over = await pool.call("bash", {"command": command}, limits=Limits(processes=20))
        assert over.status is Status.OK, over
        assert over.value is not None
        assert 10 <= int(over.value["stdout"]) < 20, over.value
        assert over.limit == "processes"
        await wait_until(
            lambda: len(_joined_while_idle(pool_cgroup)) == 1,
            within_s=10,
            what="the next idle worker in a cgroup of its own",
        )
        read = await pool.call("read", {"path": "."})
        assert read.started
    assert not _exists(pool_cgroup)


async def test_with_no_process_limit_a_command_still_gets_a_cgroup_that_ends_what_it_left(
    guard: str, containment: str, workspace: Path, tmp_path: Path
) -> None:
    """``processes = 0`` (no limit): the call still joins a cgroup of its own, where, without
    a PID namespace, its daemons are found and killed. It used to join none, and its worker
    then died reading the missing cgroup's members: every bash call "crashed"."""
    config = marked_config(pool={"workers": 1, "prefork": 0}, limits={"processes": 0})
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as pool:
        assert pool.fleet.template is not None
        if pool.fleet.template.containment != containment:
            pytest.skip(f"{containment} containment is not available here")
        tag = unique_tag()
        daemon = f"setsid bash -c {shlex.quote(tagged_sleep(tag))} > /dev/null 2>&1 &"
        command = f"{daemon} echo started"
        outcome = await pool.call("bash", {"command": command}, timeout=10.0)
        assert outcome.status is Status.OK, outcome
        assert outcome.value is not None
        assert outcome.value["stdout"] == "started\n"
        await wait_until(lambda: not pids_with(tag), within_s=10, what="the daemon killed")


async def test_template_refused_a_fork_fails_the_call_and_keeps_serving(pool: Pool) -> None:
    template_cgroup = f"{_pool_cgroup(pool)}/template"
    first = await pool.call("read", {"path": "."})  # the template is warm, nothing is forking
    assert first.status is Status.ERROR  # a directory: what matters is that a worker ran it
    # The template's own cgroup full (it alone is in it, prefork = 0): its next fork gets EAGAIN
    # from the kernel, as under a fork bomb that took every pid.
    _write(f"{template_cgroup}/pids.max", _read(f"{template_cgroup}/pids.current"))
    try:
        refused = await pool.call("bash", {"command": "echo hi"}, timeout=10.0)
    finally:
        _write(f"{template_cgroup}/pids.max", "max")
    assert refused.status is Status.ERROR, refused
    assert not refused.started
    assert refused.error is not None
    assert "no worker could be forked" in refused.error
    assert "Resource temporarily unavailable" in refused.error
    # A slot is free again: the same template serves the next call.
    again = await pool.call("bash", {"command": "echo hi"}, timeout=10.0)
    assert again.status is Status.OK, again
    assert again.value is not None
    assert again.value["stdout"] == "hi\n"


async def test_stale_pool_cgroups_of_dead_templates_are_removed(
    guard: str, workspace: Path, tmp_path: Path
) -> None:
    """A template that died without its shutdown (SIGKILL) leaves its pool cgroup; the next
    template in the same place removes it, and kills what was left in it."""
    config = marked_config(pool={"workers": 1, "prefork": 1})
    async with Pool(workspace, journal=tmp_path / "j1.jsonl", config=config) as first:
        stale = _pool_cgroup(first)
        await first.call("bash", {"command": "true"})
        assert first.fleet.template is not None
        first.fleet.template.kill()
        await first.close()
    assert _exists(stale)  # SIGKILL: no shutdown ran
    async with Pool(workspace, journal=tmp_path / "j2.jsonl", config=config) as second:
        assert not _exists(stale)
        assert _exists(_pool_cgroup(second))


def test_doctor_says_why_the_limit_is_not_enforced_where_cgroupfs_is_read_only() -> None:
    """cgroupfs read-only in a private mount namespace (the host's mounts are left as they are):
    doctor reports the limit as not enforced, and why."""
    if (
        os.geteuid() != 0
        or shutil.which("unshare") is None
        or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0
    ):
        pytest.skip("needs root with CAP_SYS_ADMIN and unshare(1) for a private mount namespace")
    remounts = "; ".join(
        f"mount -o remount,bind,ro {mount}"
        for mount in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/unified", "/sys/fs/cgroup")
        if os.path.ismount(mount)
    )
    if not remounts:
        pytest.skip("no cgroup mount to make read-only")
    done = subprocess.run(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            f'{remounts} && "$0" -m sandbx_pool.cli doctor --json',
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    checks = {check["name"]: check for check in json.loads(done.stdout)}
    limit = checks["per-call process limit"]
    assert limit["ok"] is False
    assert "Read-only file system" in limit["fallback"], limit
