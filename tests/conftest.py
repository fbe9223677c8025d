"""Shared fixtures. Every test is checked for processes it left behind."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from loguru import logger

from sandbx_pool import Pool

#: Command-line fragments of anything a test may start, directly or through a worker.
_OURS = ("workers.template", "sleep", "bash", "sandbx-pool", "sandbx_pool", "python")
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, start time in seconds since boot) of a process, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None  # a zombie holds nothing; its parent reaps it
    return int(fields[1]), int(fields[19]) / _CLK_TCK


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def leftover_processes(since: float) -> list[str]:
    """Processes started after ``since`` (uptime seconds) that are ours and still alive.

    Ours: descendants of this test process, or orphans (reparented to init) whose command line
    looks like something a test starts (a worker's escaped ``sleep``, a template).
    """
    me = os.getpid()
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _stat(int(entry))) is not None:
            table[int(entry)] = info
    found = []
    for pid, (ppid, started) in table.items():
        if pid == me or started < since:
            continue
        ancestor, hops = ppid, 0
        while ancestor not in (0, 1, me) and hops < 64:
            ancestor, hops = table.get(ancestor, (0, 0.0))[0], hops + 1
        cmd = _cmdline(pid)
        if ancestor == me or (ancestor in (0, 1) and any(tag in cmd for tag in _OURS)):
            found.append(f"{pid} {cmd}")
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    since = _uptime() - 0.01
    yield
    deadline = time.monotonic() + 5.0
    left = leftover_processes(since)
    while left and time.monotonic() < deadline:
        time.sleep(0.02)  # waiting on the outside world: processes being reaped
        left = leftover_processes(since)
    assert not left, f"the test left processes behind: {left}"


@pytest.fixture(autouse=True)
def _logs_visible() -> Iterator[None]:
    logger.enable("sandbx_pool")
    yield
    logger.disable("sandbx_pool")


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "hello.txt").write_text("hello\nworld\n")
    (ws / "src").mkdir()
    (ws / "src" / "a.py").write_text("import os\nprint('a')\n")
    return ws


@pytest.fixture
async def pool(workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    async with Pool(workspace, workers=4, journal=tmp_path / "journal.jsonl") as p:
        yield p
