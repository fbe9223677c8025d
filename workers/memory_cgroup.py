"""A per-call memory limit the kernel enforces on the whole tree: one memory cgroup per worker.

RLIMIT_AS and RLIMIT_DATA bound each process alone (a call's ten processes may hold ten times
the limit), a command may raise their soft value, and RLIMIT_AS misfires on runtimes that
reserve large virtual ranges (Go, the JVM, V8). A memory cgroup charges every page the call's
processes fault in, and its OOM killer ends one of them when the charge reaches the limit;
the cgroup's event counter (``oom_kill``) is how the call's outcome names the limit.

Where the pool's cgroup lives (workers.cgroups):

    v2  the pids pool itself, with "+memory" (and "+io", where enabled, for its byte counts)
        in its cgroup.subtree_control: each worker's w<n> holds its pids.max and its
        memory.max alike, and the template removes it as it does now.
    v1  the memory controller has a hierarchy of its own: a pool made for it in our own memory
        cgroup (v1 lets a cgroup hold processes and children both), <mem>/sandbx-<pid>-<start>;
        a worker whose call has a memory limit makes w<n> there, writes the limit, joins it;
        the template removes it once the worker is reaped (kill what is left, rmdir).

Neither: ``find`` returns None and why, and the limit is RLIMIT_DATA (workers.usage).
Swap: v2's memory.swap.max is set to 0 with the limit (where the file exists), so that the
limit is one of memory, not of memory plus swap. A leaf module: it imports nothing of
sandbx-pool but workers.cgroups.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from sandbx_pool.workers import cgroups


@dataclass(frozen=True)
class MemoryPool:
    """Where each worker's memory cgroup is made: ``path`` the pool, ``version`` 1 or 2."""

    path: str
    version: int

    @property
    def shared(self) -> bool:
        """v2: a worker's memory cgroup is its pids cgroup (the template makes and removes
        it); v1: a directory of its own in the memory hierarchy."""
        return self.version == 2

    def worker_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    def end_worker(self, name: str) -> bool:
        """v1, once the worker is reaped: kill what it left, remove its cgroup (one try);
        False if it is still busy. A worker that made none: True at once."""
        path = self.worker_path(name)
        if not os.path.isdir(path):
            return True
        cgroups.kill_cgroup(path)
        return cgroups.remove_cgroup(path, timeout_s=0)

    def close(self, timeout_s: float = 1.0) -> bool:
        """v1 template shutdown: kill and remove every worker's memory cgroup and the pool."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                if entry.is_dir(follow_symlinks=False):
                    cgroups.kill_cgroup(entry.path)
        return cgroups.remove_cgroup(self.path, timeout_s)


def limit(path: str, version: int, memory_bytes: int) -> None:
    """Set the limit on a worker's cgroup ``path`` (made, not yet necessarily joined)."""
    if version == 2:
        cgroups.write(f"{path}/memory.max", str(memory_bytes))
        with contextlib.suppress(FileNotFoundError):  # no swap accounting: nothing to bound
            cgroups.write(f"{path}/memory.swap.max", "0")
    else:
        cgroups.write(f"{path}/memory.limit_in_bytes", str(memory_bytes))


def events_file(path: str, version: int) -> str:
    """The file whose ``oom_kill N`` line counts the processes the limit's OOM killer ended."""
    return f"{path}/memory.events" if version == 2 else f"{path}/memory.oom_control"


def oom_kills(text: str) -> int:
    """The ``oom_kill`` count of an events file's text (0 when it has none: an old kernel)."""
    for line in text.splitlines():
        name, _, count = line.partition(" ")
        if name == "oom_kill":
            return int(count)
    return 0


def was_oom_killed(path: str, version: int) -> bool:
    try:
        return oom_kills(cgroups.read(events_file(path, version))) > 0
    except OSError:
        return False


def enter_v1(pool: MemoryPool, name: str, memory_bytes: int) -> str:
    """In a worker (v1), before its confinement: make its memory cgroup, limit it, join it.
    Raises OSError."""
    path = pool.worker_path(name)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    limit(path, 1, memory_bytes)
    cgroups.join(path)
    return path


def find(
    pids: cgroups.PoolCgroup | None, pids_version: int | None
) -> tuple[MemoryPool | None, str]:
    """The template's memory pool (made here for v1, after removing dead templates' pools);
    or None and why there is none. ``pids``: the template's pids pool, already made."""
    reasons: list[str] = []
    if pids is not None and pids_version == 2:
        try:
            if "memory" in cgroups.read(f"{pids.path}/cgroup.controllers").split():
                cgroups.write(f"{pids.path}/cgroup.subtree_control", "+memory")
                # The byte counts of io.stat, where the io controller is there to enable.
                if "io" in cgroups.read(f"{pids.path}/cgroup.controllers").split():
                    with contextlib.suppress(OSError):
                        cgroups.write(f"{pids.path}/cgroup.subtree_control", "+io")
                return MemoryPool(pids.path, 2), ""
            reasons.append(f"{pids.path}: the memory controller is not enabled for the pool")
        except OSError as exc:
            reasons.append(f"{pids.path}: cannot enable memory: {exc.strerror}")
    hierarchy = _v1_hierarchy(reasons)
    if hierarchy is not None:
        hierarchy.cleanup_stale()
        path = cgroups.pool_path(hierarchy.base, os.getpid())
        try:
            os.mkdir(path)
            if not os.path.exists(f"{path}/memory.limit_in_bytes"):
                os.rmdir(path)
                reasons.append(f"{path}: a new cgroup has no memory.limit_in_bytes")
            else:
                return MemoryPool(path, 1), ""
        except OSError as exc:
            reasons.append(f"cgroup v1 memory at {hierarchy.base}: {exc.strerror}")
    return None, "; ".join(reasons) or "no memory controller mounted"


def _v1_hierarchy(reasons: list[str]) -> cgroups.PidsHierarchy | None:
    """Our own cgroup of a v1 memory hierarchy, as a base for pools (its cleanup is the same
    as a pids base's: pools named by their template's pid and start time)."""
    relative = None
    for line in cgroups.read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            relative = path
    if relative is None:
        return None
    for line in cgroups.read("/proc/self/mountinfo").splitlines():
        mine, _, theirs = line.partition(" - ")
        fstype, _, options = theirs.split()[:3]
        if fstype == "cgroup" and "memory" in options.split(","):
            base = os.path.normpath(f"{mine.split()[4]}/{relative}")
            if os.access(base, os.W_OK):
                return cgroups.PidsHierarchy(1, base, base)
            reasons.append(f"cgroup v1 memory at {base}: not writable")
    return None


@dataclass(frozen=True)
class WorkerMemory:
    """What a worker knows of its memory cgroup: ``path`` (v2: its pids cgroup, w<n>; v1: its
    directory in the memory pool, made only for a call with a limit) and ``version``."""

    path: str
    version: int

    def bind(self, memory_bytes: int, *, joined: bool) -> str:
        """Before the confinement: put the worker in its memory cgroup (``joined``: v2, it is
        in its pids cgroup already) with the call's limit. Returns the cgroup's path, whose
        events tell after the call whether the limit killed. Raises OSError."""
        if self.version == 1:
            pool, name = os.path.split(self.path)
            return enter_v1(MemoryPool(pool, 1), name, memory_bytes)
        if not joined:
            cgroups.enter(self.path)
        limit(self.path, 2, memory_bytes)
        return self.path


def probe(pids: cgroups.PidsHierarchy | None) -> tuple[str | None, int | None, str]:
    """For ``sandbx-pool doctor``, without making anything: where a pool started here would
    bind memory limits (a directory, its cgroup version), or None and why not."""
    reasons: list[str] = []
    if pids is not None and pids.version == 2:
        try:
            if "memory" in cgroups.read(f"{pids.origin}/cgroup.controllers").split():
                return pids.base, 2, ""
            reasons.append(f"{pids.base}: the memory controller is not delegated")
        except OSError as exc:
            reasons.append(f"{pids.origin}: {exc.strerror}")
    hierarchy = _v1_hierarchy(reasons)
    if hierarchy is not None:
        return hierarchy.base, 1, ""
    return None, None, "; ".join(reasons) or "no memory controller mounted"


class WorkerMemories:
    """The template's side of its workers' memory cgroups: where each worker's call binds its
    limit, whether the limit killed in it once it is reaped, and (v1) removing its cgroup."""

    def __init__(self, pool: MemoryPool | None) -> None:
        self.pool = pool
        self._names: dict[int, str] = {}  # worker pid -> its v1 memory cgroup's name
        self.unremoved: set[str] = set()  # v1 memory cgroups of reaped workers

    @property
    def in_pids_cgroups(self) -> bool:
        """v2: each worker's memory cgroup is its pids cgroup."""
        return self.pool is not None and self.pool.shared

    def forked(self, pid: int, name: str) -> None:
        if self.pool is not None and not self.pool.shared:
            self._names[pid] = name

    def for_worker(self, name: str, pids_path: str | None) -> WorkerMemory | None:
        """Where worker ``name``'s call's memory limit binds: its pids cgroup ``pids_path``
        (v2), or a directory of its own in the v1 pool; None: RLIMIT_DATA."""
        if self.pool is None:
            return None
        if self.pool.shared:
            return None if pids_path is None else WorkerMemory(pids_path, 2)
        return WorkerMemory(self.pool.worker_path(name), 1)

    def reaped(self, pid: int, pids_path: str | None) -> bool:
        """Whether the memory limit's OOM killer ended a process of worker ``pid`` (reaped;
        ``pids_path``: its pids cgroup, if it made one)."""
        if self.pool is None:
            return False
        if self.pool.shared:
            return pids_path is not None and was_oom_killed(pids_path, 2)
        name = self._names.pop(pid, None)
        if name is None:
            return False
        self.unremoved.add(name)
        return was_oom_killed(self.pool.worker_path(name), 1)

    def remove(self) -> None:
        """v1: kill what is left in each reaped worker's memory cgroup and remove it; one try
        each, the rest on the template loop's next turn."""
        assert self.pool is not None or not self.unremoved
        for name in list(self.unremoved):
            if self.pool is not None and self.pool.end_worker(name):
                self.unremoved.discard(name)

    def close(self) -> None:
        if self.pool is not None and not self.pool.shared:
            self.pool.close()
