"""Small helpers shared by the tests that drive real workers."""

from __future__ import annotations

import asyncio
import errno
import os
import time
import uuid
from collections.abc import Callable


async def wait_until(predicate: Callable[[], bool], within_s: float = 5.0) -> None:
    """Poll ``predicate`` until it holds; for waiting on other processes, which send no event."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {within_s} s")
        await asyncio.sleep(0.005)


def fifo_has_reader(path: str | os.PathLike[str]) -> bool:
    """True while some process holds ``path`` (a FIFO) open for reading."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:
            return False
        raise
    os.close(fd)
    return True


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
