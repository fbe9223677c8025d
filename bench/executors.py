"""The command executors agent frameworks ship, the peers of a pool's bash and read calls.

Each runs one command in a directory and returns its exit code and output, blocking, as the
framework does: a string is a shell command line (``bash -c``), a list an argv run without a
shell where the executor can (``cat data.txt`` as one process, not bash and then cat). They
are timed from a thread (``asyncio.to_thread`` in the sections that interleave them with a
pool), the clock read inside the thread so that the hop is not counted:

* ``bare``: ``subprocess.run(["bash", "-c", command])``, no isolation at all; the floor.
* ``bwrap``: bubblewrap per command, the issue's line (every namespace, a fresh ``/proc`` and
  ``/dev``, the root read-only) and ``--chdir``; for a coding agent, which changes files, also
  a ``--bind`` of its directory. bubblewrap is C: its whole setup is a few dozen syscalls.
* ``mini-swe-agent``: its ``LocalEnvironment.execute``, a ``Popen(shell=True)`` in a session of
  its own with stderr merged, what its agents run every command with; no isolation either.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

#: The issue's bubblewrap line, before the directory binds and the command.
BWRAP_ARGV = (
    "bwrap",
    "--ro-bind",
    "/",
    "/",
    "--dev",
    "/dev",
    "--proc",
    "/proc",
    "--unshare-all",
    "--die-with-parent",
    "--new-session",
)

#: A command that outlives this is a broken peer: the section fails rather than hangs.
COMMAND_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Ran:
    exit_code: int
    output: str
    elapsed_ns: int
    errors: str = ""  # stderr, where the executor keeps it apart


class Executor(Protocol):
    key: str
    name: str

    def run(self, command: str | Sequence[str]) -> Ran: ...


def _argv(command: str | Sequence[str]) -> list[str]:
    return ["bash", "-c", command] if isinstance(command, str) else list(command)


class Bare:
    """``subprocess.run(["bash", "-c", command])`` with its output captured."""

    key = "bare"
    name = 'bare `subprocess.run(["bash", "-c", ...])`'

    def __init__(self, cwd: str) -> None:
        self.cwd = cwd

    def run(self, command: str | Sequence[str]) -> Ran:
        start = time.perf_counter_ns()
        done = subprocess.run(
            _argv(command),
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        return Ran(done.returncode, done.stdout, time.perf_counter_ns() - start, done.stderr)


class Bwrap:
    """bubblewrap per command, in ``cwd``; ``writable``: bind it read-write too (the issue's
    line, for the latency rows, has no bind: the whole root is read-only)."""

    key = "bwrap"
    name = "bubblewrap per command (`bwrap --unshare-all ...`)"

    def __init__(self, cwd: str, *, writable: bool = False) -> None:
        if shutil.which("bwrap") is None:
            raise RuntimeError("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")
        # A --bind after --ro-bind / / makes that one directory writable again.
        binds = ["--bind", cwd, cwd] if writable else []
        self.prefix = [*BWRAP_ARGV[:4], *binds, *BWRAP_ARGV[4:], "--chdir", cwd]

    def run(self, command: str | Sequence[str]) -> Ran:
        start = time.perf_counter_ns()
        done = subprocess.run(
            [*self.prefix, *_argv(command)],
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        return Ran(done.returncode, done.stdout, time.perf_counter_ns() - start, done.stderr)


class MiniSweLocal:
    """mini-swe-agent's ``LocalEnvironment`` (the package's own class, not a copy of it)."""

    key = "mini-swe-agent"
    name = "mini-swe-agent `LocalEnvironment` (a subprocess)"

    def __init__(self, cwd: str) -> None:
        # Its import prints a banner on stdout, where the report goes, unless told not to.
        os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
        from minisweagent.environments.local import LocalEnvironment

        self.environment = LocalEnvironment(cwd=cwd, timeout=int(COMMAND_TIMEOUT_S))

    def run(self, command: str | Sequence[str]) -> Ran:
        line = command if isinstance(command, str) else shlex.join(command)  # always a shell
        start = time.perf_counter_ns()
        done = self.environment.execute({"command": line})
        elapsed = time.perf_counter_ns() - start
        return Ran(int(done["returncode"]), str(done["output"]), elapsed)
