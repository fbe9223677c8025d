"""Small helpers shared by the tests that drive real workers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from conftest import MARKER, is_marked

#: How often a predicate on the outside world is looked at again.
POLL_S = 0.005

#: Seconds one CLI command may take on a loaded machine.
CLI_S = 60


def cli_argv(*argv: str, python_options: tuple[str, ...] = ()) -> list[str]:
    """``sandbx-pool ARGV`` as this interpreter runs it (the installed package's CLI)."""
    return [sys.executable, *python_options, "-m", "sandbx_pool.cli", *argv]


def run_cli(
    *argv: str,
    cwd: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = CLI_S,
    check: bool = False,
    python_options: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``sandbx-pool ARGV`` to its end, its output captured as text; ``env`` adds to ours.
    The one way the tests run the CLI."""
    return subprocess.run(
        cli_argv(*argv, python_options=python_options),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        check=check,
    )


def _pauses(predicate: Callable[[], bool], within_s: float, what: str) -> Iterator[float]:
    """Yields the pause before each new look at ``predicate``; fails after ``within_s``."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within_s} s")
        yield POLL_S


async def wait_until(
    predicate: Callable[[], bool], within_s: float = 5.0, what: str = "the condition"
) -> None:
    """Poll ``predicate`` until it holds, for waiting on other processes (they send no event
    this test could await); fails the test after ``within_s``."""
    for pause in _pauses(predicate, within_s, what):
        await asyncio.sleep(pause)


def wait_until_sync(
    predicate: Callable[[], bool], within_s: float = 5.0, what: str = "the condition"
) -> None:
    """``wait_until`` for a test with no event loop."""
    for pause in _pauses(predicate, within_s, what):
        time.sleep(pause)


def fifo_has_reader(path: str | os.PathLike[str]) -> bool:
    """True while one of this test session's processes holds the FIFO ``path`` open, or is
    blocked opening a FIFO (which one is not exposed by the kernel; tests use one at a time)."""
    if os.fspath(path) in _held_writers or not procfs_shows_workers():
        return _reader_behind_our_writer(os.fspath(path))
    return bool(fifo_readers(path))


def fifo_readers(path: str | os.PathLike[str]) -> list[int]:
    """This test session's processes that hold the FIFO ``path`` open, or are blocked opening a
    FIFO (``fifo_has_reader``).

    Looked up in /proc rather than by opening the FIFO for writing: that open would complete
    a reader blocked in open(), which would then read EOF and finish instead of staying blocked.
    """
    fifo = os.stat(path)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not is_marked(entry):
            continue
        if _wchan(entry) == "wait_for_partner":
            found.append(int(entry))
            continue
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{entry}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{entry}/fd/{fd}")
                    if (st.st_dev, st.st_ino) == (fifo.st_dev, fifo.st_ino):
                        found.append(int(entry))
                        break
    return found


def procfs_shows_workers() -> bool:
    """Whether this process may read a worker's /proc/PID/fd and wchan. A worker is not
    dumpable (it holds its call's secret), so only a holder of CAP_SYS_PTRACE over it may: root
    on a host, not an unprivileged user nor a container's root (Docker's default set)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("CapEff:"))
    return bool(int(line.split()[1], 16) & (1 << 19))  # CAP_SYS_PTRACE


#: Where /proc hides the workers: the write end this test holds of each FIFO a reader opened.
_held_writers: dict[str, int] = {}


def _reader_behind_our_writer(path: str) -> bool:
    """``fifo_has_reader`` where /proc hides the reader. A non-blocking open for writing
    succeeds only while a reader has the FIFO open or is opening it; it completes that reader's
    open, and the reader then blocks in read(), not open(), for as long as this test holds the
    write end (it never writes, so the reader never reads EOF). Once held, the write end reports
    POLLERR when no reader is left."""
    fd = _held_writers.get(path)
    if fd is None:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # no reader yet
                return False
            raise
        _held_writers[path] = fd
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    if any(events & select.POLLERR for _, events in poller.poll(0)):
        del _held_writers[path]
        os.close(fd)
        return False
    return True


def release_held_fifos() -> None:
    """Close the write ends ``fifo_has_reader`` held (conftest does, after each test)."""
    while _held_writers:
        os.close(_held_writers.popitem()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wchan(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/wchan") as f:
            return f.read()
    except OSError:
        return ""


def unique_tag() -> str:
    """A string to put in a command line, so the test can find (or miss) its processes."""
    return f"sbxtest{uuid.uuid4().hex[:12]}"


def pids_with(tag: str) -> list[int]:
    """Live (non-zombie) processes whose argv[0] is ``tag`` (see ``tagged_sleep``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline.split(b"\0", 1)[0] == tag.encode() and state != "Z":
            found.append(int(entry))
    return found


def tagged_sleep(tag: str, seconds: int = 1000) -> str:
    """A bash snippet running ``sleep`` under an argv[0] that carries ``tag``."""
    return f"(exec -a {tag} sleep {seconds})"


def marked_pool_toml(directory: Path) -> str:
    """A pool config file for a test's Inspect task: every command carries the session marker,
    and no spare worker is forked (one left idle at the end of a test would look like a process
    the test left behind)."""
    path = directory / "pool.toml"
    path.write_text(f'[pool]\nprefork = 0\n\n[env.set]\n{MARKER} = "{os.environ[MARKER]}"\n')
    return str(path)


def journal_records(path: str) -> list[dict[str, Any]]:
    """Every record of the journal at ``path``, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


async def bash_value(pool: Any, command: str, *, ok: bool = True, **kwargs: Any) -> dict[str, Any]:
    """A bash call's value (30 s unless ``timeout`` says), its status asserted ``ok`` unless
    ``ok=False`` (a command expected to fail still leaves its output)."""
    outcome = await pool.call("bash", {"command": command}, **{"timeout": 30, **kwargs})
    if ok:
        assert outcome.status == "ok", outcome
    assert outcome.value is not None, outcome
    value: dict[str, Any] = outcome.value
    return value
