"""What one call cost: the CPU, peak memory, storage bytes and processes of its whole tree.

Two places measure it, for the two ways a call ends:

    answered  the worker, once kill_descendants() has reaped all its call started (workers.
              runtime): ``Meter``, opened when the call comes (before the confinement, which
              may hide /proc/sys and cgroupfs), read before the Result is sent.
    killed    the template, when it reaps the worker (workers.template): ``from_wait4`` (the
              rusage wait4 gives, the worker's own and that of the descendants it reaped; the
              coordinator raises it to what /proc held for the whole tree at the kill:
              sandbx_pool.tree_usage), or ``from_cgroup`` where the worker had a cgroup with
              the figures (they hold what its members did, gone or not).

Sources. "cgroup" where the worker's cgroup is a v2 one with the memory controller (workers.
memory_cgroup): cpu.stat's user_usec and system_usec, memory.peak (what the tree held at once,
page cache it faulted in included), io.stat's rbytes and wbytes. Else "rusage": the kernel's
accounts of the worker and its reaped descendants, getrusage(RUSAGE_SELF) plus
RUSAGE_CHILDREN, where ``max_rss_bytes`` is the largest single process's peak (the worker's
own, a fork of the template, counts the template's pages it shares) and the byte counts are
the block I/O the task accounting charged (ru_inblock, ru_oublock: 512-byte units).

``processes``: in a PID namespace of its own, pids are handed out in order from 1 (the
worker), so the namespace's last pid when the call ends, less the one when it began, counts
every task the call started (a thread takes a pid too: rg's threads count). Without one, and
for a killed call, not known (None).

Cost, measured (bench.usage): a few syscalls and, with a cgroup, three preads of cgroupfs.
"""

from __future__ import annotations

import contextlib
import os
import resource

import msgspec

from sandbx_pool.workers import memory_cgroup
from sandbx_pool.workers.protocol import Call, Result, Usage

#: ru_inblock and ru_oublock count 512-byte units whatever the filesystem's block size.
BLOCK_BYTES = 512

_NS_LAST_PID = "/proc/sys/kernel/ns_last_pid"


def from_rusage(
    own: resource.struct_rusage | None,
    children: resource.struct_rusage,
    processes: int | None = None,
) -> Usage:
    """The figures of ``own`` (None: a rusage that already holds both, as wait4's does) and
    ``children`` added up; ru_maxrss is KiB and the larger of the two."""
    parts = [children] if own is None else [own, children]
    return Usage(
        cpu_user_s=round(sum(part.ru_utime for part in parts), 6),
        cpu_system_s=round(sum(part.ru_stime for part in parts), 6),
        max_rss_bytes=max(part.ru_maxrss for part in parts) * 1024,
        read_bytes=sum(part.ru_inblock for part in parts) * BLOCK_BYTES,
        write_bytes=sum(part.ru_oublock for part in parts) * BLOCK_BYTES,
        processes=processes,
        source="rusage",
    )


def from_wait4(rusage: resource.struct_rusage) -> Usage:
    """The template's figures for a worker it reaped, its tree included (see the docstring)."""
    return from_rusage(None, rusage)


def _cpu(text: str) -> tuple[float, float]:
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    return int(fields.get("user_usec", 0)) / 1e6, int(fields.get("system_usec", 0)) / 1e6


def _io(text: str) -> tuple[int, int]:
    read = written = 0
    for line in text.splitlines():
        for field in line.split()[1:]:
            name, _, value = field.partition("=")
            if name == "rbytes":
                read += int(value)
            elif name == "wbytes":
                written += int(value)
    return read, written


def _from_texts(
    cpu: str, peak: str, io: str | None, fallback: Usage, processes: int | None
) -> Usage:
    user, system = _cpu(cpu)
    read, written = _io(io) if io is not None else (fallback.read_bytes, fallback.write_bytes)
    return Usage(
        cpu_user_s=round(user, 6),
        cpu_system_s=round(system, 6),
        max_rss_bytes=int(peak),
        read_bytes=read,
        write_bytes=written,
        processes=processes,
        source="cgroup",
    )


def from_cgroup(path: str, fallback: Usage) -> Usage:
    """The figures of the v2 cgroup ``path`` (a reaped worker's), ``fallback`` where it lacks
    them (no memory.peak: before Linux 5.19; no io.stat: the io controller is not enabled)."""
    try:
        cpu, peak = _read(f"{path}/cpu.stat"), _read(f"{path}/memory.peak")
    except OSError:
        return fallback
    try:
        io: str | None = _read(f"{path}/io.stat")
    except OSError:
        io = None
    return _from_texts(cpu, peak, io, fallback, fallback.processes)


def _read(path: str) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 65536).decode()
    finally:
        os.close(fd)


def _pread(fd: int) -> str:
    return os.pread(fd, 65536, 0).decode()


class Meter:
    """One call's measurement in its worker: ``start`` when the call comes, ``finish`` once
    everything the call started is reaped. ``cgroup``: the worker's v2 cgroup with memory
    accounting, joined (None: rusage)."""

    def __init__(
        self, cgroup: str | None, oom_events: str | None = None, *, measure: bool = True
    ) -> None:
        self._fds: list[int] = []
        self._events_fd = self._open(oom_events) if oom_events is not None else None
        self._last_pid_fd: int | None = None
        self._first_pid = 0
        self._cpu_fd = self._peak_fd = self._io_fd = None
        if measure and os.getpid() == 1:  # a PID namespace of its own: see the docstring
            with contextlib.suppress(OSError):
                self._last_pid_fd = self._open(_NS_LAST_PID)
                self._first_pid = int(_pread(self._last_pid_fd))
        if cgroup is not None:
            try:
                self._cpu_fd = self._open(f"{cgroup}/cpu.stat")
                self._peak_fd = self._open(f"{cgroup}/memory.peak")
            except OSError:
                self._cpu_fd = self._peak_fd = None
            with contextlib.suppress(OSError):
                self._io_fd = self._open(f"{cgroup}/io.stat")

    def _open(self, path: str) -> int:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._fds.append(fd)
        return fd

    def close(self) -> None:
        """Close what ``__init__`` opened (the call's command must not inherit it: CLOEXEC
        sees to exec, this to the worker's own forks' leftovers)."""
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def oom_killed(self) -> bool:
        """Whether the memory cgroup's OOM killer ended a process of the call."""
        if self._events_fd is None:
            return False
        try:
            return memory_cgroup.oom_kills(_pread(self._events_fd)) > 0
        except OSError:
            return False

    def processes(self) -> int | None:
        if self._last_pid_fd is None:
            return None
        try:
            return 1 + int(_pread(self._last_pid_fd)) - self._first_pid
        except (OSError, ValueError):
            return None

    def finish(self) -> Usage:
        """The call's figures; the worker's own counted in (it is still running)."""
        fallback = from_rusage(
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
            self.processes(),
        )
        if self._cpu_fd is None or self._peak_fd is None:
            return fallback
        try:
            io = _pread(self._io_fd) if self._io_fd is not None else None
            texts = _pread(self._cpu_fd), _pread(self._peak_fd), io
        except OSError:
            return fallback
        return _from_texts(*texts, fallback, fallback.processes)


def begin(
    call: Call, memory: memory_cgroup.WorkerMemory | None, joined: bool, *, measure: bool = True
) -> tuple[Call, Meter]:
    """In the worker, before the confinement: bind the call's memory limit through the
    worker's memory cgroup where there is one (the call then carries no RLIMIT_DATA: see
    workers.runtime), and start measuring the call, from its v2 cgroup where the worker is in
    one (``joined``: its pids cgroup, which is its memory cgroup too; or joined here).
    Raises OSError."""
    memory_bytes = call.context.limits.memory_bytes
    events = None
    if memory is not None and memory_bytes is not None:
        events = memory_cgroup.events_file(memory.bind(memory_bytes, joined=joined), memory.version)
        limits = msgspec.structs.replace(call.context.limits, memory_bytes=None)
        context = msgspec.structs.replace(call.context, limits=limits)
        call = msgspec.structs.replace(call, context=context)
        joined = joined or memory.version == 2
    in_v2 = measure and memory is not None and memory.version == 2 and joined
    cgroup = memory.path if memory is not None and in_v2 else None
    return call, Meter(cgroup, events, measure=measure)


def with_usage(
    result: Result, meter: Meter, memory_bytes: int | None, *, measure: bool = True
) -> Result:
    """``result`` with what the call cost; ``crashed`` with limit "memory" if the memory
    cgroup's OOM killer ended a process of it (the command may have run on without it: bash
    reports the kill as an exit status, and the value keeps its output)."""
    try:
        # Not over an output flood the worker killed for first: the first killer names it.
        if result.status in ("ok", "error") and meter.oom_killed():
            result = msgspec.structs.replace(
                result,
                status="crashed",
                limit="memory",
                error=f"memory limit exceeded ({memory_bytes} bytes): the kernel killed a"
                " process of the call",
            )
        return msgspec.structs.replace(result, usage=meter.finish()) if measure else result
    finally:
        meter.close()
