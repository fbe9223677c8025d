"""Shared fixtures. Every test is checked for processes it left behind.

``@pytest.mark.needs("mount namespaces", ...)``: the test asserts a protection ``sandbx-pool
doctor`` names, and is skipped, with doctor's reason, where doctor reports it absent (a pool
not run as root where user namespaces are refused, a container without CAP_SYS_ADMIN...).
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from loguru import logger

from sandbx_pool import Config, Pool

if TYPE_CHECKING:
    from sandbx_pool.cli.doctor import Check

#: Marks every process this test session starts: the template and workers inherit it from our
#: environment, and tools' commands get it through the pool's env (see ``marked_config``).
#: Orphans carrying it are ours; orphans without it belong to someone else on this machine.
MARKER = "SANDBX_TEST_SESSION"
os.environ.setdefault(MARKER, f"{os.getpid()}-{time.time_ns()}")
_MARK = f"{MARKER}={os.environ[MARKER]}".encode()
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def marked_config(**sections: dict[str, object]) -> Config:
    """The default config plus whatever is given, with the test marker in every call's env."""
    config = Config().override(env={"set": {MARKER: os.environ[MARKER]}})
    return config.override(**sections) if sections else config


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


def is_marked(pid: int | str) -> bool:
    """Whether process ``pid`` is ours: it carries this test session's marker, or, where its
    environment is hidden (a worker is not dumpable, and only CAP_SYS_PTRACE reads it), it
    descends from this test process."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return _MARK in f.read().split(b"\0")
    except PermissionError:
        return _descends_from_us(int(pid))
    except OSError:
        return False


def _descends_from_us(pid: int) -> bool:
    me, hops = os.getpid(), 0
    while pid not in (0, 1, me) and hops < 64:
        info = _stat(pid)
        if info is None:
            return False
        pid, hops = info[0], hops + 1
    return pid == me


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

    Ours: descendants of this test process, or orphans (reparented to init) that carry this
    session's marker in their environment (a worker's escaped ``sleep``, a template).
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
        if ancestor == me or (ancestor in (0, 1) and is_marked(pid)):
            found.append(f"{pid} {_cmdline(pid)}")
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    since = _uptime() - 0.01
    yield
    from helpers import release_held_fifos  # helpers imports this module

    release_held_fifos()
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


#: ``await make_pool(where=..., journal=..., **sections)``: a started pool (see ``make_pool``).
MakePool = Callable[..., Awaitable[Pool]]


@pytest.fixture
async def make_pool(workspace: Path, tmp_path: Path) -> AsyncIterator[MakePool]:
    """Start pools for the test, each closed after it: the one way a fixture makes a pool.
    ``where``: its workspace (the ``workspace`` fixture's by default); ``journal``: a file name
    in tmp_path (None: the default location); the rest are ``marked_config``'s sections."""
    async with contextlib.AsyncExitStack() as stack:

        async def make(
            where: Path | None = None,
            *,
            journal: str | None = "journal.jsonl",
            **sections: dict[str, object],
        ) -> Pool:
            path = tmp_path / journal if journal is not None else None
            made = Pool(where or workspace, journal=path, config=marked_config(**sections))
            return await stack.enter_async_context(made)

        yield make


@pytest.fixture
async def pool(make_pool: MakePool) -> Pool:
    return await make_pool(pool={"workers": 4})


@pytest.fixture(params=["pidns", "subreaper"])
def containment(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of ending what a worker leaves: its PID namespace, or (subreaper) the template
    sweeping orphans and killing what is left in the worker's cgroup."""
    from sandbx_pool.workers.template import CONTAINMENT_ENV

    mode: str = request.param
    if mode == "subreaper":
        monkeypatch.setenv(CONTAINMENT_ENV, "subreaper")
    else:
        monkeypatch.delenv(CONTAINMENT_ENV, raising=False)
    return mode


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Command-line processes a test starts; killed and reaped at its end, whatever happened."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


@functools.cache
def doctor_checks() -> dict[str, Check]:
    """What ``sandbx-pool doctor`` reports here, by check name: probed once per session."""
    from sandbx_pool.cli.doctor import diagnose

    return {check.name: check for check in diagnose()}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "needs(*checks): skip unless sandbx-pool doctor says yes to each check"
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    for marker in item.iter_markers("needs"):
        for name in marker.args:
            check = doctor_checks()[name]  # a KeyError: a check doctor does not have
            if not check.ok:
                pytest.skip(f"doctor: no {name} -> {check.fallback}")
