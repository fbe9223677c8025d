"""What a worker's tree cost, read from /proc just before the SIGKILL that ends it.

A call that answers measures itself once everything it started is reaped (workers.usage). A
worker SIGKILLed cannot, and the template's wait4 has only what the worker had reaped by then:
the processes killed with it are not the worker's to count any more. In a PID namespace, the
dying init's kernel side sets SIGCHLD to SIG_IGN before it kills the rest (zap_pid_ns_processes,
to speed the namespace's shutdown), and a child reaped that way is released without adding its
times to its parent's; in subreaper mode they are reparented to the template and swept there.
Measured here: a bash child that had burned 0.5 s of CPU was missing from 3 of 5 such outcomes.

Which of them is lost is a race: a child that dies before the init ignores SIGCHLD is reaped
into it and counted (measured: 2 of 5). So the coordinator reads what /proc holds for the
worker and each descendant at the moment of the kill (``snapshot``, called by
worker_handle.Worker.stop before its SIGKILL: the worker's own times, its reaped children's,
and every live descendant's), and the call's figure is the larger of that and the template's
(``merge``): never both added, the template's counting some of the same processes. What the
tree does between the read and the kill (microseconds) is not counted. Only the kill path
pays for this walk.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class TreeFigures(NamedTuple):
    cpu_user_s: float
    cpu_system_s: float
    max_rss_bytes: int
    read_bytes: int
    write_bytes: int


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _one(pid: int) -> TreeFigures | None:
    """A process's figures, its reaped children's included (stat's cutime and cstime)."""
    try:
        stat = _read(f"/proc/{pid}/stat")
        status = _read(f"/proc/{pid}/status")
    except OSError:
        return None
    # comm (field 2) may hold spaces and ")": count from the last ")", after which is field 3.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    peak = 0
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    read = written = 0
    with contextlib.suppress(OSError, ValueError):  # another user's: not ours to read
        for line in _read(f"/proc/{pid}/io").splitlines():
            name, _, value = line.partition(": ")
            if name == "read_bytes":
                read = int(value)
            elif name == "write_bytes":
                written = int(value)
    return TreeFigures((utime + cutime) * _TICK_S, (stime + cstime) * _TICK_S, peak, read, written)


def snapshot(pids: list[int]) -> TreeFigures:
    """The sum of ``pids``' figures (the largest peak of them), those already gone left out."""
    found = [figures for pid in pids if (figures := _one(pid)) is not None]
    return TreeFigures(
        sum(f.cpu_user_s for f in found),
        sum(f.cpu_system_s for f in found),
        max((f.max_rss_bytes for f in found), default=0),
        sum(f.read_bytes for f in found),
        sum(f.write_bytes for f in found),
    )


def merge(worker: dict[str, Any] | None, tree: TreeFigures | None) -> dict[str, Any] | None:
    """The template's figures of a SIGKILLed worker (Outcome.usage's form), each raised to the
    snapshot's of its whole tree where that is larger; None when the template gave none."""
    if worker is None or tree is None or worker.get("source") == "cgroup":
        return worker  # a cgroup's figures hold what its members did, gone or not
    return {
        **worker,
        "cpu_user_s": round(max(worker["cpu_user_s"], tree.cpu_user_s), 6),
        "cpu_system_s": round(max(worker["cpu_system_s"], tree.cpu_system_s), 6),
        "max_rss_bytes": max(worker["max_rss_bytes"], tree.max_rss_bytes),
        "read_bytes": max(worker["read_bytes"], tree.read_bytes),
        "write_bytes": max(worker["write_bytes"], tree.write_bytes),
    }
