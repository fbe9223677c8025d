"""find's forked helper (workers.tools.helper_process) never outlives the process that forked it.

Real processes: a caller in a subprocess forks a helper that would sleep for ever, then the
caller is SIGKILLed (PDEATHSIG ends the helper), or its process group is killed (what a cancel
or a timeout does to a worker: the helper is in that group), or it kills the helper itself.
And through the pool: a find big enough to split answers as the sequential walk does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import alive, wait_until_sync

from sandbx_pool import Pool
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import parse_args
from sandbx_pool.workers.tools import TOOLS, find, helper_process

#: A caller that forks a helper sleeping for ever, prints its pid, and waits.
CALLER = """
import sys, time
from sandbx_pool.workers.tools.helper_process import start
helper = start(lambda: (time.sleep(1000), b"")[1], 100)
print(helper.pid, flush=True)
time.sleep(1000)
"""


def caller(processes: list[subprocess.Popen[bytes]]) -> tuple[subprocess.Popen[bytes], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CALLER], stdout=subprocess.PIPE, start_new_session=True
    )
    processes.append(proc)
    assert proc.stdout is not None
    with proc.stdout:
        pid = int(proc.stdout.readline())
    assert alive(pid)
    assert os.getpgid(pid) == proc.pid  # the caller's group (it leads its own session)
    return proc, pid


def test_the_helper_dies_with_its_caller(processes: list[subprocess.Popen[bytes]]) -> None:
    proc, helper = caller(processes)
    proc.kill()  # SIGKILL: nothing of the caller runs, PDEATHSIG does it
    proc.wait()
    wait_until_sync(lambda: not alive(helper), what="the helper to die with its caller")


def test_a_process_group_kill_takes_the_helper(processes: list[subprocess.Popen[bytes]]) -> None:
    """A cancel or a timeout kills the worker's process group."""
    proc, helper = caller(processes)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_until_sync(lambda: not alive(helper), what="the helper to die with its group")


def test_kill_ends_and_reaps_the_helper() -> None:
    helper = helper_process.start(lambda: (time.sleep(1000), b"")[1], 100)
    assert helper is not None
    pid = helper.pid
    assert alive(pid)
    helper.kill()
    assert not os.path.exists(f"/proc/{pid}")  # reaped: not even a zombie
    helper.kill()  # twice is harmless


def test_an_answer_comes_back_and_a_failure_is_none() -> None:
    ok = helper_process.start(lambda: b"x" * 200_000, 200_000)  # more than a pipe holds
    assert ok is not None
    assert ok.result() == b"x" * 200_000
    too_long = helper_process.start(lambda: b"x" * 101, 100)
    assert too_long is not None
    assert too_long.result() is None
    raised = helper_process.start(lambda: 1 // 0 and b"", 100)  # type: ignore[func-returns-value]
    assert raised is not None
    assert raised.result() is None


@pytest.mark.parametrize("pattern", ["**/*.py", "**"])
async def test_a_split_find_through_the_pool_answers_as_the_sequential_walk(
    tmp_path: Path, pattern: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tree past SPLIT_AFTER (so the worker forks its helper), truncated by the result cap
    for ``**``: the same answer as this process's walk with the split turned off."""
    ws = tmp_path / "ws"
    for i in range(find.SPLIT_AFTER * 6):
        path = ws / f"d{i % 16:02d}" / f"s{i % 7}" / f"f{i}.{'py' if i % 3 else 'txt'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    monkeypatch.setattr(find, "SPLIT_AFTER", 1 << 62)
    ctx = ExecutionContext(call_id="t", workspace=str(ws), cwd=str(ws), env={})
    expected = TOOLS["find"](parse_args("find", {"pattern": pattern}), ctx)
    async with Pool(ws, config=marked_config(pool={"workers": 1})) as pool:
        outcome = await pool.call("find", {"pattern": pattern}, timeout=60)
    assert outcome.status == "ok", outcome
    assert outcome.value == expected
