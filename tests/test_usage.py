"""What each call cost (outcome.usage) and the per-call memory limit, end to end.

The figures are checked against what the command measures of itself: a CPU loop in a child of
bash reports its own CPU time, an allocation of 200 MiB in a grandchild its own peak RSS. The
call's figures cover the whole tree, so they may only exceed the command's own by what bash,
the interpreter's start and the worker add (within 10%). Every test here runs as root and as
an unprivileged user (.ci/environments): the source is then "rusage" and the memory limit
RLIMIT_DATA, which doctor reports, and the memory tests take the path doctor says.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import shlex
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from conftest import doctor_checks, marked_config

from sandbx_pool import CancelToken, Outcome, OutputChunk, Pool, Status
from sandbx_pool.workers.memory_cgroup import oom_kills
from sandbx_pool.workers.protocol import Limits
from sandbx_pool.workers.usage import from_cgroup, from_rusage

MiB = 1024 * 1024

#: The interpreter the commands run: this one, not whatever ``python3`` on PATH is (a version
#: manager's shim would add processes of its own to what is measured).
PYTHON = shlex.quote(sys.executable)

USAGE_FIELDS = {
    "cpu_user_s",
    "cpu_system_s",
    "max_rss_bytes",
    "read_bytes",
    "write_bytes",
    "processes",
    "source",
}

#: A child of bash burns CPU for ~1.5 s, then prints its own CPU time (user + system).
CPU_LOOP = f"""{PYTHON} -c '
import os, time
t = time.process_time()
while time.process_time() - t < 1.5:
    pass
times = os.times()
print(times.user + times.system)
'"""

#: A grandchild (bash -> python -> python) allocates and fills 200 MiB (a pattern repeated: a
#: zero-filled one would be pages never touched), then prints its own
#: peak RSS in bytes; the child in between passes it on.
GRANDCHILD_ALLOCATES = f"""{PYTHON} -c '
import subprocess, sys
code = "import resource; b = bytes(range(256)) * (200 << 12); "
code += "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
subprocess.run([sys.executable, "-c", code], check=True)
'"""


def memory_cgroup_here() -> bool:
    return doctor_checks()["per-call memory limit"].ok


@pytest.fixture
async def pool(workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as p:
        yield p


def within(measured: float, figure: float, share: float = 0.10) -> bool:
    return abs(figure - measured) <= share * measured


async def test_a_cpu_loop_in_a_child_is_counted_within_ten_percent(pool: Pool) -> None:
    outcome = await pool.call("bash", {"command": CPU_LOOP})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 0, outcome.value["stderr"]
    measured = float(outcome.value["stdout"])
    usage = outcome.usage
    assert usage is not None
    assert set(usage) == USAGE_FIELDS
    cpu = usage["cpu_user_s"] + usage["cpu_system_s"]
    # Never less than the command's own: the whole tree is counted, the child included.
    assert cpu >= measured * 0.99, (cpu, measured, usage)
    assert within(measured, cpu), (cpu, measured, usage)


async def test_a_grandchild_allocating_200_mib_is_counted_within_ten_percent(pool: Pool) -> None:
    outcome = await pool.call("bash", {"command": GRANDCHILD_ALLOCATES})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 0, outcome.value["stderr"]
    measured = int(outcome.value["stdout"])
    assert measured >= 200 * MiB
    usage = outcome.usage
    assert usage is not None
    assert within(measured, usage["max_rss_bytes"]), (usage, measured)


async def test_a_read_is_measured_with_its_worker_alone(pool: Pool) -> None:
    outcome = await pool.call("read", {"path": "hello.txt"})
    assert outcome.ok
    usage = outcome.usage
    assert usage is not None
    assert usage["cpu_user_s"] + usage["cpu_system_s"] < 0.5
    assert usage["max_rss_bytes"] > 0
    if usage["processes"] is not None:  # known in a PID namespace of its own
        assert usage["processes"] == 1


async def test_processes_counts_what_the_command_started(pool: Pool) -> None:
    if not doctor_checks()["PID namespaces"].ok:
        pytest.skip("the process count needs a PID namespace per worker")
    # bash, then five children of it (a subshell each, forked and waited for).
    outcome = await pool.call("bash", {"command": "for i in 1 2 3 4 5; do (true); done"})
    assert outcome.usage is not None
    # The worker, bash and the five subshells.
    assert outcome.usage["processes"] == 7, outcome.usage


#: A child of bash burns ~0.5 s of CPU, prints its own CPU time, then waits to be stopped.
BURN_THEN_WAIT = f"""{PYTHON} -c '
import os, time
t = time.process_time()
while time.process_time() - t < 0.5:
    pass
times = os.times()
print(times.user + times.system, flush=True)
time.sleep(600)
'"""


@pytest.mark.parametrize("grace_s", [1.0, 0.0], ids=["answers-the-sigterm", "sigkilled"])
async def test_a_cancelled_call_has_the_figures_of_its_whole_tree(
    workspace: Path, tmp_path: Path, grace_s: float
) -> None:
    # With a grace, the worker survives the SIGTERM and measures itself; without one, it is
    # SIGKILLed, and the figures are the template's (wait4) raised to what /proc held for the
    # whole tree at the kill (sandbx_pool.tree_usage: the kernel does not always reap the
    # children into the dying worker).
    config = marked_config(pool={"workers": 1}, calls={"grace_s": grace_s})
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as pool:
        outcome, measured = await _burn_then_cancel(pool)
    assert outcome.status is Status.CANCELLED
    assert outcome.usage is not None
    # Stopped mid-call, the child included: its CPU is in the figures all the same.
    cpu = outcome.usage["cpu_user_s"] + outcome.usage["cpu_system_s"]
    assert cpu >= measured * 0.99, (cpu, measured, outcome.usage)
    assert within(measured, cpu, share=0.25), (cpu, measured, outcome.usage)
    if grace_s == 0:  # the template's figures: it cannot know what the namespace counted
        assert outcome.usage["processes"] is None


async def _burn_then_cancel(pool: Pool) -> tuple[Outcome, float]:
    """Run BURN_THEN_WAIT, cancel it once it has printed, return its outcome and what the
    child measured of itself."""
    token, burned = CancelToken(), asyncio.Event()
    printed: list[str] = []

    def on_output(chunk: OutputChunk) -> None:
        printed.append(chunk.data)
        if "\n" in "".join(printed):
            burned.set()

    call = asyncio.ensure_future(
        pool.call("bash", {"command": BURN_THEN_WAIT}, cancel=token, on_output=on_output)
    )
    await asyncio.wait_for(burned.wait(), 60)
    token.cancel("burned enough")
    return await call, float("".join(printed))


async def test_a_file_tool_killed_without_an_answer_has_the_templates_figures(
    pool: Pool, workspace: Path
) -> None:
    os.mkfifo(workspace / "fifo")  # a read of it blocks until a writer comes: none will
    outcome = await pool.call("read", {"path": "fifo"}, timeout=0.5)
    assert outcome.status is Status.TIMEOUT
    assert outcome.usage is not None, outcome
    assert outcome.usage["max_rss_bytes"] > 0


async def test_a_call_that_never_started_has_no_figures(pool: Pool) -> None:
    token = CancelToken()
    token.cancel("before it began")
    outcome = await pool.call("read", {"path": "hello.txt"}, cancel=token)
    assert not outcome.started
    assert outcome.usage is None


# -- the memory limit ------------------------------------------------------------------------


async def test_a_command_over_the_memory_limit_is_stopped(pool: Pool) -> None:
    command = f"{PYTHON} -c 'b = bytes(range(256)) * (300 << 12)'; echo status $?"
    outcome = await pool.call("bash", {"command": command}, limits=Limits(memory_bytes=100 * MiB))
    assert outcome.value is not None
    if memory_cgroup_here():
        # The kernel killed the allocating child; bash ran on and said so.
        assert outcome.status is Status.CRASHED, outcome
        assert outcome.limit == "memory"
        assert outcome.value["stdout"] == "status 137\n"
    else:
        # RLIMIT_DATA: the allocation fails, the interpreter says so and exits 1.
        assert outcome.status is Status.OK, outcome
        assert "MemoryError" in outcome.value["stderr"]
        assert outcome.value["stdout"] == "status 1\n"
    # The control: under the same limit, what fits runs.
    fits = await pool.call(
        "bash",
        {"command": f"{PYTHON} -c 'b = bytes(range(256)) * (20 << 12)'"},
        limits=Limits(memory_bytes=100 * MiB),
    )
    assert fits.status is Status.OK, fits
    assert fits.value is not None
    assert fits.value["exit_code"] == 0, fits.value


@pytest.mark.needs("per-call memory limit")
async def test_a_worker_killed_for_the_memory_limit_crashes_with_limit_memory(
    pool: Pool, workspace: Path
) -> None:
    # A file tool runs in the worker itself: an edit holds the file's text and the edited
    # text at once; past the limit, the kernel kills the worker, which cannot answer, and the
    # template's notice says why.
    (workspace / "big.txt").write_text(("x" * 99 + "\n") * 1_500_000)  # 150 MB
    args = {"path": "big.txt", "old_string": "x", "new_string": "y", "replace_all": True}
    outcome = await pool.call("edit", args, limits=Limits(memory_bytes=64 * MiB))
    assert outcome.status is Status.CRASHED, outcome
    assert outcome.limit == "memory"
    assert outcome.error is not None
    assert "memory limit exceeded" in outcome.error
    assert outcome.usage is not None


async def test_the_pools_memory_limit_applies_unless_the_call_gives_its_own(
    workspace: Path, tmp_path: Path
) -> None:
    config = marked_config(limits={"memory_mb": 64})
    command = f"{PYTHON} -c 'b = bytes(range(256)) * (150 << 12)'"
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        limited = await pool.call("bash", {"command": command})
        own = await pool.call("bash", {"command": command}, limits=Limits(memory_bytes=512 * MiB))
    assert limited.value is not None
    assert limited.value["exit_code"] != 0, limited
    assert own.status is Status.OK, own
    assert own.value is not None
    assert own.value["exit_code"] == 0, own.value["stderr"]


# -- where the figures go --------------------------------------------------------------------


def _cli(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout


async def test_the_journal_keeps_the_figures_and_stats_ranks_the_calls(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=journal, config=config) as pool:
        busy = await pool.call("bash", {"command": CPU_LOOP})
        big = await pool.call("bash", {"command": GRANDCHILD_ALLOCATES})
        reads = [await pool.call("read", {"path": "hello.txt"}) for _ in range(3)]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    outcomes = {r["call_id"]: r for r in records if r["kind"] == "outcome"}
    for outcome in (busy, big, *reads):
        assert outcomes[outcome.call_id]["usage"] == outcome.usage
    text = _cli("journal", "stats", str(journal))
    lines = text.splitlines()
    top_cpu = lines[lines.index("most CPU (5):") + 1]
    top_memory = lines[lines.index("largest peak memory (5):") + 1]
    assert busy.call_id in top_cpu, text
    assert big.call_id in top_memory, text
    assert "usage of 5 call(s)" in text
    figures = json.loads(_cli("journal", "stats", "--json", str(journal)))["usage"]
    assert figures["top_cpu"][0]["call_id"] == busy.call_id
    assert figures["measured"] == 5


# -- cgroup v2's files, as the kernel writes them --------------------------------------------


def test_a_v2_cgroups_figures_are_read_from_its_files(tmp_path: Path) -> None:
    # This machine's cgroup may be v1: the reading of v2's files is checked on their format
    # (Documentation/admin-guide/cgroup-v2.rst), which the kernel keeps stable.
    (tmp_path / "cpu.stat").write_text(
        "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n"
        "nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n"
    )
    (tmp_path / "memory.peak").write_text("209715200\n")
    (tmp_path / "io.stat").write_text(
        "8:16 rbytes=1459200 wbytes=314773504 rios=192 wios=353 dbytes=0 dios=0\n"
        "8:0 rbytes=100 wbytes=200 rios=1 wios=1 dbytes=0 dios=0\n"
    )
    fallback = from_rusage(
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
        processes=3,
    )
    figures = from_cgroup(str(tmp_path), fallback)
    assert figures.source == "cgroup"
    assert (figures.cpu_user_s, figures.cpu_system_s) == (2.0, 0.5)
    assert figures.max_rss_bytes == 200 * MiB
    assert (figures.read_bytes, figures.write_bytes) == (1459300, 314773704)
    assert figures.processes == 3
    # Without io.stat (the io controller not enabled) the bytes are the rusage's.
    (tmp_path / "io.stat").unlink()
    figures = from_cgroup(str(tmp_path), fallback)
    assert (figures.read_bytes, figures.write_bytes) == (fallback.read_bytes, fallback.write_bytes)
    # Without memory.peak (before Linux 5.19) the whole figure is the rusage's.
    (tmp_path / "memory.peak").unlink()
    assert from_cgroup(str(tmp_path), fallback) == fallback


def test_the_oom_kill_count_is_read_from_either_versions_events() -> None:
    v2 = "low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n"
    v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"
    assert oom_kills(v2) == 1
    assert oom_kills(v1) == 3
    assert oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0  # before Linux 4.13


def test_runs_summary_prints_the_cpu_and_peak_memory_totals(
    workspace: Path, tmp_path: Path
) -> None:
    calls = tmp_path / "calls.jsonl"
    lines = [
        {"tool": "bash", "args": {"command": CPU_LOOP}},
        {"tool": "read", "args": {"path": "hello.txt"}},
    ]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    text = _cli(
        "run", str(calls), "--workspace", str(workspace), "--journal", str(tmp_path / "j.jsonl")
    )
    summary = next(line for line in text.splitlines() if line.startswith("cpu "))
    # The loop's 1.5 s are in the total; the largest peak is a process's, never nothing.
    cpu = float(summary.split()[1])
    assert 1.5 <= cpu < 3.0, summary
    assert "peak memory: largest call" in summary
    assert "without figures" not in summary
