"""Per-call resource limits, end to end: each limit stops a real call and the outcome names it.

Limits come from the config's [limits] (every call) or from ``Pool.call(limits=...)`` (that call,
replacing the config's). A file tool runs inside the worker, so the worker meets the limit and
its outcome carries ``limit``; a command run by bash meets it itself and bash reports it (a
MemoryError, EMFILE, or death by SIGXCPU/SIGXFSZ, which also sets ``limit``).
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from conftest import MakePool, marked_config

from sandbx_pool import Pool, Status
from sandbx_pool.workers.protocol import Limits

MiB = 1024 * 1024


@pytest.fixture
async def pool(make_pool: MakePool) -> Pool:
    return await make_pool(pool={"workers": 2}, calls={"grace_s": 0.0})


@pytest.fixture
def big_file(workspace: Path) -> Path:
    """20 MB of text: more than a 16 MiB address space can read into memory."""
    path = workspace / "big.txt"
    path.write_text(("x" * 99 + "\n") * 200_000)
    return path


# -- memory (address space) ----------------------------------------------------------------------


async def test_a_command_over_the_memory_limit_gets_a_memory_error(pool: Pool) -> None:
    limits = Limits(address_space_bytes=200 * MiB)
    over = await pool.call(
        "bash", {"command": 'python3 -c "x = bytearray(500_000_000)"'}, limits=limits
    )
    assert over.status is Status.OK
    assert over.value is not None
    assert over.value["exit_code"] == 1
    assert "MemoryError" in over.value["stderr"]
    # The control: under the same limit, an allocation that fits succeeds.
    under = await pool.call(
        "bash", {"command": 'python3 -c "x = bytearray(50_000_000)"'}, limits=limits
    )
    assert under.value is not None
    assert under.value["exit_code"] == 0, under.value["stderr"]


async def test_a_read_over_a_tiny_memory_limit_names_the_limit(pool: Pool, big_file: Path) -> None:
    # Several at once: the worker must answer every time, not die in its own teardown under a
    # limit the tool exhausted (which once lost the Result: "crashed", status 127).
    limits = Limits(address_space_bytes=16 * MiB)
    outcomes = await asyncio.gather(
        *(pool.call("read", {"path": big_file.name}, limits=limits) for _ in range(4))
    )
    for outcome in outcomes:
        assert outcome.status is Status.ERROR, outcome
        assert outcome.limit == "memory"
        assert outcome.error is not None
        assert "memory limit exceeded" in outcome.error
        assert outcome.started


async def test_the_config_limits_apply_unless_the_call_gives_its_own(
    workspace: Path, tmp_path: Path, big_file: Path
) -> None:
    config = marked_config(limits={"address_space_mb": 16})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        limited = await pool.call("read", {"path": big_file.name})
        own = await pool.call("read", {"path": big_file.name}, limits=Limits())
    assert limited.limit == "memory"
    assert own.status is Status.OK, own


# -- CPU seconds ---------------------------------------------------------------------------------


async def test_a_runaway_grep_is_stopped_by_the_cpu_limit(pool: Pool, workspace: Path) -> None:
    # Catastrophic backtracking: (a+)+b against a line of a's with no b is exponential.
    # The look-ahead keeps rg (linear time, no backtracking) out: Python's re runs it.
    (workspace / "as.txt").write_text("a" * 40 + "\n")
    outcome = await pool.call(
        "grep", {"pattern": "(a+)+b(?=c)", "path": "as.txt"}, limits=Limits(cpu_seconds=1)
    )
    assert outcome.status is Status.CRASHED
    assert outcome.limit == "cpu"
    assert outcome.error is not None
    assert "CPU time limit exceeded (1 s)" in outcome.error
    assert outcome.killed_by is None  # the limit stopped it, not the pool


async def test_a_busy_bash_loop_gets_sigxcpu(workspace: Path, tmp_path: Path) -> None:
    config = marked_config(limits={"cpu_s": 1})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        outcome = await pool.call("bash", {"command": "while :; do :; done"})
    assert outcome.status is Status.OK
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 128 + signal.SIGXCPU  # 152
    assert outcome.value["signal"] == signal.SIGXCPU
    assert outcome.limit == "cpu"


# -- open files ----------------------------------------------------------------------------------


async def test_a_read_over_the_open_files_limit_names_the_limit(pool: Pool) -> None:
    # No descriptor above stdio: whichever numbers the worker has free, the read's open fails.
    outcome = await pool.call("read", {"path": "hello.txt"}, limits=Limits(open_files=3))
    assert outcome.status is Status.ERROR
    assert outcome.limit == "open_files"
    assert outcome.error is not None
    assert "too many open files" in outcome.error


async def test_a_command_over_the_open_files_limit_gets_emfile(pool: Pool) -> None:
    command = "python3 -c 'files = [open(\"/dev/null\") for _ in range(100)]'"
    outcome = await pool.call("bash", {"command": command}, limits=Limits(open_files=32))
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 1
    assert "Too many open files" in outcome.value["stderr"]
    fits = await pool.call(
        "bash",
        {"command": command.replace("100", "10")},
        limits=Limits(open_files=32),
    )
    assert fits.value is not None
    assert fits.value["exit_code"] == 0


# -- file size -----------------------------------------------------------------------------------


async def test_a_write_over_the_file_size_limit_names_the_limit(
    pool: Pool, workspace: Path
) -> None:
    limits = Limits(file_size_bytes=1 * MiB)
    outcome = await pool.call("write", {"path": "w.txt", "content": "x" * (2 * MiB)}, limits=limits)
    assert outcome.status is Status.ERROR
    assert outcome.limit == "file_size"
    assert outcome.error is not None
    assert "file size limit exceeded" in outcome.error
    # Atomic: neither the file nor its temp file is left.
    assert sorted(os.listdir(workspace)) == ["hello.txt", "src"]
    fits = await pool.call("write", {"path": "w.txt", "content": "x" * 1000}, limits=limits)
    assert fits.status is Status.OK


async def test_a_command_over_the_file_size_limit_gets_sigxfsz(pool: Pool, workspace: Path) -> None:
    limits = Limits(file_size_bytes=1 * MiB)
    child = await pool.call("bash", {"command": "head -c 5000000 /dev/zero > z.bin"}, limits=limits)
    assert child.value is not None
    assert child.value["exit_code"] == 128 + signal.SIGXFSZ  # 153, as bash reports its child
    assert (workspace / "z.bin").stat().st_size == 1 * MiB
    # When bash itself is killed (printf is a builtin), the outcome names the limit too.
    builtin = await pool.call("bash", {"command": "printf '%5000000s' x > y.bin"}, limits=limits)
    assert builtin.value is not None
    assert builtin.value["signal"] == signal.SIGXFSZ
    assert builtin.limit == "file_size"
