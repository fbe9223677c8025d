"""Counting what is left: processes, file descriptors, memory, all read from /proc.

A process is *ours* when it descends from the bench process or carries the run's marker in its
environment (see ``bench.workspace``). Zombies are listed apart: they hold nothing but a pid,
and whoever parents them reaps them.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from dataclasses import dataclass

#: The command line of the template and of its workers (forked, never exec'd).
TEMPLATE_MODULE = "sandbx_pool.workers.template"

#: multiprocessing's own servers, started by the ProcessPoolExecutor peers and kept for the
#: life of the process: not left by anyone's call, so not counted (and named in the report).
MULTIPROCESSING_HELPERS = (
    "from multiprocessing.forkserver import main",
    "from multiprocessing.resource_tracker import main",
)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    state: str
    cmdline: str

    def __str__(self) -> str:
        return f"{self.pid} [{self.state}] {self.cmdline[:80]}"

    @property
    def is_template_or_worker(self) -> bool:
        return TEMPLATE_MODULE in self.cmdline

    @property
    def is_multiprocessing_helper(self) -> bool:
        return any(helper in self.cmdline for helper in MULTIPROCESSING_HELPERS)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _proc(pid: int) -> Proc | None:
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(b")", 1)[1].split()
    cmdline = (_read(f"/proc/{pid}/cmdline") or b"").replace(b"\0", b" ").strip()
    return Proc(pid, int(fields[1]), fields[0].decode(), cmdline.decode(errors="replace"))


def _all_procs() -> dict[int, Proc]:
    table: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := _proc(int(entry))) is not None:
            table[int(entry)] = proc
    return table


def _marked(pid: int, mark: bytes) -> bool:
    environ = _read(f"/proc/{pid}/environ")
    return environ is not None and mark in environ.split(b"\0")


def ours(marker_name: str, marker: str) -> list[Proc]:
    """Every live process of this run except the bench process itself, zombies included,
    and multiprocessing's helper servers."""
    me = os.getpid()
    mark = f"{marker_name}={marker}".encode()
    table = _all_procs()
    found: list[Proc] = []
    for pid, proc in table.items():
        if pid == me:
            continue
        ancestor, hops = proc.ppid, 0
        while ancestor not in (0, 1, me) and hops < 64:
            parent = table.get(ancestor)
            ancestor, hops = (parent.ppid if parent else 0), hops + 1
        if (ancestor == me or _marked(pid, mark)) and not proc.is_multiprocessing_helper:
            found.append(proc)
    return found


@dataclass(frozen=True)
class Leftovers:
    """Processes of ours found at once, and those still there after a bounded wait."""

    at_once: list[Proc]
    after_wait: list[Proc]
    waited_s: float

    @property
    def count(self) -> int:
        return len([p for p in self.after_wait if p.state != "Z"])


def leftovers(
    marker_name: str, marker: str, *, pool_open: bool = False, wait_s: float = 2.0
) -> Leftovers:
    """Our processes that should not exist now.

    With ``pool_open`` (nothing in flight, the pool still up) the template and its idle
    workers are expected and left out: what remains is something a call started and left
    running. Otherwise everything counts. If something is found, look again for up to
    ``wait_s`` (polling: these are other processes, being killed and reaped) and report both.
    """

    def scan() -> list[Proc]:
        found = ours(marker_name, marker)
        return [p for p in found if not (pool_open and p.is_template_or_worker)]

    first = scan()
    current = first
    started = time.monotonic()
    while any(p.state != "Z" for p in current) and time.monotonic() - started < wait_s:
        time.sleep(0.01)
        current = scan()
    return Leftovers(first, current, time.monotonic() - started if first else 0.0)


# -- file descriptors --------------------------------------------------------------------------


def open_fds() -> dict[int, str]:
    """This process's open file descriptors and what they point to."""
    fds: dict[int, str] = {}
    for entry in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fds[int(entry)] = os.readlink(f"/proc/self/fd/{entry}")
    return fds


def fd_count() -> int:
    """``len(os.listdir('/proc/self/fd'))``, the figure the soak compares before and after."""
    return len(os.listdir("/proc/self/fd"))


# -- memory ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    rss_kib: int
    pss_kib: int | None = None
    hwm_kib: int | None = None


def _kib_fields(text: bytes, names: tuple[str, ...]) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in text.decode(errors="replace").splitlines():
        key, _, rest = line.partition(":")
        if key in names and rest.split():
            values[key] = int(rest.split()[0])
    return values


def memory(pid: int | str = "self") -> Memory | None:
    """RSS (and its peak, for ourselves) from status; PSS from smaps_rollup where readable."""
    status = _read(f"/proc/{pid}/status")
    if status is None:
        return None
    fields = _kib_fields(status, ("VmRSS", "VmHWM"))
    rollup = _read(f"/proc/{pid}/smaps_rollup")
    pss = _kib_fields(rollup, ("Pss",)).get("Pss") if rollup else None
    return Memory(fields.get("VmRSS", 0), pss, fields.get("VmHWM"))


def children(pid: int) -> list[int]:
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            text = _read(f"/proc/{pid}/task/{tid}/children") or b""
            found.extend(int(p) for p in text.split())
    return found


def template_and_workers() -> tuple[int | None, list[int]]:
    """The pool's template (a child of ours running workers.template) and its live children."""
    for pid in children(os.getpid()):
        proc = _proc(pid)
        if proc is not None and proc.is_template_or_worker:
            return pid, [c for c in children(pid) if (p := _proc(c)) and p.state != "Z"]
    return None, []


def containment_of(worker: int) -> str:
    """``pidns`` when the worker has a PID namespace of its own, else ``subreaper``."""
    try:
        same = os.readlink(f"/proc/{worker}/ns/pid") == os.readlink("/proc/self/ns/pid")
    except OSError:
        return "unknown"
    return "subreaper" if same else "pidns"


# -- CPU time: ours, and the machine's -----------------------------------------------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class CpuSnapshot:
    """Cumulative CPU seconds: the machine's busy time, the hypervisor's steal, and ours."""

    busy_s: float
    steal_s: float
    ours_s: float
    at_s: float


def _ours_s() -> float:
    """CPU of this process, its reaped descendants, and its live children's subtrees so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for pid in children(os.getpid()):
        stat = _read(f"/proc/{pid}/stat")
        if stat is not None:
            fields = stat.rsplit(b")", 1)[1].split()
            total += sum(int(v) for v in fields[11:15]) / _CLK_TCK  # utime stime cutime cstime
    return total


def cpu_snapshot() -> CpuSnapshot:
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return CpuSnapshot(
        busy_s=(user + nice + system + irq + softirq) / _CLK_TCK,
        steal_s=steal / _CLK_TCK,
        ours_s=_ours_s(),
        at_s=time.monotonic(),
    )


def others_share(before: CpuSnapshot, after: CpuSnapshot) -> tuple[float, float]:
    """The share of the machine's CPU time used by others (and stolen) between two snapshots."""
    capacity = (after.at_s - before.at_s) * (os.cpu_count() or 1)
    if capacity <= 0:
        return 0.0, 0.0
    others = (after.busy_s - before.busy_s) - (after.ours_s - before.ours_s)
    return max(0.0, others / capacity), (after.steal_s - before.steal_s) / capacity
