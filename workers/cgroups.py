"""A per-call process limit that holds for root: one pids cgroup per worker.

RLIMIT_NPROC does not bind root (the kernel exempts uid 0's user), so without this a fork bomb
in one call takes every free pid and the template's next fork fails. The pids controller binds
every process in its cgroup, root included, and counts threads as well as processes.

    <base>/sandbx-<pid>-<start>/           the pool, made by the template at start; named by the
                                           template's pid and start time (cleanup_stale's proof
                                           that its maker is dead)
    <base>/sandbx-<pid>-<start>/template   the template itself, a leaf
    <base>/sandbx-<pid>-<start>/idle       where every forked worker waits for its call
    <base>/sandbx-<pid>-<start>/w<n>       one per worker (n: its token's counter), made and
                                           joined by the worker once it has been idle a while
                                           (runtime.JOIN_WHEN_IDLE_MS) or when its call runs
                                           programs, whichever comes first; its pids.max is
                                           written when such a call comes (the call's
                                           Limits.processes); removed by the template once the
                                           worker is reaped

v1: <base> is our own pids cgroup. v2: a cgroup whose cgroup.subtree_control enables a
controller may hold no processes ("no internal processes", the root excepted), so our own
cgroup, which holds us, cannot give children a pids.max: <base> is its parent (which enabled
pids for us, as our cgroup.controllers shows), the pool our sibling, and the template moves to
a leaf of it. Nothing usable: find_pids_hierarchy returns None and says why in ``reasons``.

What keeps a root call in its cgroup, and its pids.max where it is: it cannot write to cgroupfs
(the workers' Landlock rules grant /sys read-only; with ``[sandbox] filesystem = "host"``
nothing stops a root call from raising its own limit). A leaf module: it imports nothing of
sandbx-pool.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

_POOL_NAME = re.compile(r"sandbx-(\d+)-(\d+)")


def _write(path: str, text: str) -> None:
    # One write(2) per value: cgroupfs acts on each write, and reports its error from it.
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _read(path: str) -> str:
    # Not open(): its text layer costs ~100 us more per file, in the template's loop.
    fd, data = os.open(path, os.O_RDONLY | os.O_CLOEXEC), b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    finally:
        os.close(fd)
    return data.decode()


#: For sibling modules (workers.memory_cgroup, workers.usage): one write(2) per value, and a
#: read without open()'s text layer.
write = _write
read = _read


def start_time(pid: int) -> int | None:
    """Field 22 of /proc/PID/stat (start time, clock ticks after boot); None if the process is
    gone or a zombie. A pid is recycled; a pid with its start time names one process per boot."""
    try:
        data = _read(f"/proc/{pid}/stat")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # comm (field 2) may hold spaces and ")": count from the last ")", after which is field 3.
    fields = data[data.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def kill_cgroup(path: str, deadline_s: float = 1.0) -> None:
    """SIGKILL every process in ``path`` and below it.

    v2 (5.14+): one write to cgroup.kill kills the subtree, and forks racing it fail. v1 has no
    equivalent, so: kill what cgroup.procs lists until it lists nothing. That ends, as a process
    with SIGKILL pending cannot fork and pids.max bounds each round.
    """
    # A worker that left nothing, the common case: pids.current is a counter, while v1's first
    # read of cgroup.procs builds a pid list (~150 us).
    with contextlib.suppress(FileNotFoundError):
        if _read(f"{path}/pids.current").strip() == "0":
            return
    with contextlib.suppress(FileNotFoundError):
        _write(f"{path}/cgroup.kill", "1")
        return
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        pids: list[int] = []
        for directory, _, _ in os.walk(path):
            with contextlib.suppress(FileNotFoundError):
                pids.extend(int(p) for p in _read(f"{directory}/cgroup.procs").split())
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def kill_others(path: str, deadline_s: float = 2.0) -> None:
    """SIGKILL every process in ``path`` but the caller: a worker without a PID namespace ending
    what its call left. A fork bomb's processes are not all its children yet, and walking them
    generation by generation loses the race; the cgroup lists them all, and a process with
    SIGKILL pending forks no more, so this ends (a zombie leaves cgroup.procs)."""
    me, end = os.getpid(), time.monotonic() + deadline_s
    while time.monotonic() < end:
        others = [pid for pid in map(int, _read(f"{path}/cgroup.procs").split()) if pid != me]
        if not others:
            return
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def remove_cgroup(path: str, timeout_s: float = 1.0) -> bool:
    """rmdir ``path``, and on EBUSY the cgroups below it; True once none is left.

    EBUSY also means a member is still exiting, so retry with a growing pause until
    ``timeout_s`` (0: one try, for the template's loop, which retries later itself)."""
    end, pause = time.monotonic() + timeout_s, 0.0002
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:
            if exc.errno != errno.EBUSY or time.monotonic() >= end:
                return False
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(path):
                if entry.is_dir(follow_symlinks=False):
                    remove_cgroup(entry.path, max(end - time.monotonic(), 0.0))
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


#: The leaf of a pool's cgroup where idle workers wait (PoolCgroup.idle_path).
IDLE = "idle"


@dataclass(frozen=True)
class PoolCgroup:
    """The template's pool of worker cgroups."""

    path: str
    origin: str  # the cgroup the template came from, and returns to in close()

    def worker_path(self, name: str) -> str:
        return f"{self.path}/{name}"

    @property
    def idle_path(self) -> str:
        """Where forked workers wait for their call: out of the template's cgroup (whose
        pids.max is the template's own), in one cgroup for all, joined with one write. A worker
        makes a cgroup of its own (``enter``) when its call runs programs, or before, while
        idle (workers.runtime.JOIN_WHEN_IDLE_MS)."""
        return f"{self.path}/{IDLE}"

    def end_worker(self, name: str) -> bool:
        """Once the worker is reaped: kill what it left, remove its cgroup (one try). False if
        it is still busy (a member exiting, or stuck in the kernel): retry later."""
        path = self.worker_path(name)
        kill_cgroup(path)
        return remove_cgroup(path, timeout_s=0)

    def close(self, timeout_s: float = 1.0) -> bool:
        """Template shutdown: kill every worker's cgroup, go back to ``origin``, remove the pool.
        False if something in it would not die in time (a later start's cleanup_stale
        removes it)."""
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                if entry.name.startswith("w"):
                    kill_cgroup(entry.path)
        with contextlib.suppress(OSError):
            _write(f"{self.origin}/cgroup.procs", "0")
        return remove_cgroup(self.path, timeout_s)


def join(path: str) -> None:
    """Move this process into the cgroup ``path``."""
    # "0" is the writer. cgroup.procs moves the whole thread group (v1's tasks, one thread).
    _write(f"{path}/cgroup.procs", "0")


def enter(path: str) -> None:
    """In a worker, while idle or for a call that runs programs, before it starts any: make
    ``path``, join it. Its pids.max stays "max" until cap()."""
    # It may exist: made by this worker while idle, whose join then failed. Nothing else makes
    # it: the name is the worker's own, and calls cannot write to cgroupfs.
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    join(path)


def cap(path: str, processes: int | None) -> None:
    """Set the call's limit on the worker's cgroup: processes and threads, the worker's own
    included. None: no limit."""
    _write(f"{path}/pids.max", "max" if processes is None else str(processes))


def limit_was_hit(path: str) -> bool:
    """Whether a fork in ``path`` was refused for its pids.max (pids.events' "max" counter)."""
    try:
        events = _read(f"{path}/pids.events").split()
    except OSError:
        return False
    return len(events) >= 2 and events[0] == "max" and events[1] != "0"


@dataclass(frozen=True)
class PidsHierarchy:
    version: int  # 1 or 2
    base: str  # where pools are made
    origin: str  # our own cgroup's directory

    def create_pool(self) -> PoolCgroup:
        """Make this process's pool and move this process (the template) into its leaf."""
        path = f"{self.base}/{_pool_name(os.getpid())}"
        os.mkdir(path)
        try:
            if self.version == 2:  # lets the w<n> children have pids.max; empty, so allowed
                _write(f"{path}/cgroup.subtree_control", "+pids")
            os.mkdir(f"{path}/template")
            _write(f"{path}/template/cgroup.procs", "0")
            os.mkdir(f"{path}/{IDLE}")
        except OSError:
            remove_cgroup(path)
            raise
        return PoolCgroup(path, self.origin)

    def cleanup_stale(self) -> list[str]:
        """Remove the pools of dead templates (pid gone, or recycled: another start time),
        killing what is left in them; never a live one's. Returns the paths removed. Names hold
        pids of their maker's PID namespace: pools sharing a <base> must share one."""
        removed: list[str] = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.base):
                match = _POOL_NAME.fullmatch(entry.name)
                if match is None or start_time(int(match[1])) == int(match[2]):
                    continue
                kill_cgroup(entry.path)
                if remove_cgroup(entry.path):
                    removed.append(entry.path)
        return removed


def _pool_name(pid: int) -> str:
    return f"sandbx-{pid}-{start_time(pid)}"


def pool_path(base: str, pid: int) -> str:
    """Where template ``pid`` keeps its pool under ``base`` (for tests and diagnostics)."""
    return f"{base}/{_pool_name(pid)}"


def _mounts() -> list[tuple[int, str]]:
    """(version, mount point) of each cgroup2 mount and each v1 mount of the pids controller."""
    found: list[tuple[int, str]] = []
    for line in _read("/proc/self/mountinfo").splitlines():
        mine, _, theirs = line.partition(" - ")
        fstype, _, options = theirs.split()[:3]
        if fstype == "cgroup2":
            found.append((2, mine.split()[4]))
        elif fstype == "cgroup" and "pids" in options.split(","):
            found.append((1, mine.split()[4]))
    return sorted(found, reverse=True)  # v2 first: it has cgroup.kill


def find_pids_hierarchy(reasons: list[str] | None = None) -> PidsHierarchy | None:
    """Where this process may make pools with a working pids.max; None if nowhere (why: in
    ``reasons``). Probes by making, and removing, the pool directory it would use."""
    why = reasons if reasons is not None else []
    own: dict[str, str] = {}  # controller ("" for v2) -> our cgroup in that hierarchy
    for line in _read("/proc/self/cgroup").splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(","):
            own[controller] = path
    for version, mount in _mounts():
        relative = own.get("" if version == 2 else "pids")
        if relative is None:
            continue
        origin = os.path.normpath(f"{mount}/{relative}")
        base = origin
        try:
            if version == 2:
                if "pids" not in _read(f"{origin}/cgroup.controllers").split():
                    why.append(f"{origin}: pids not enabled here (bound to v1, or not delegated)")
                    continue
                if relative != "/":
                    base = os.path.dirname(origin)  # see the module's docstring
                elif "pids" not in _read(f"{origin}/cgroup.subtree_control").split():
                    # The real root may hold processes and enable controllers; a cgroup
                    # namespace's root may not (EBUSY): start the pool in a delegated subtree.
                    _write(f"{origin}/cgroup.subtree_control", "+pids")
            probe = f"{base}/{_pool_name(os.getpid())}"
            os.mkdir(probe)
            usable = os.path.exists(f"{probe}/pids.max")
            os.rmdir(probe)
        except OSError as exc:
            why.append(f"cgroup v{version} at {base}: {exc.strerror} ({exc.filename})")
            continue
        if usable:
            return PidsHierarchy(version, base, origin)
        why.append(f"cgroup v{version} at {base}: a new cgroup has no pids.max")
    if not why:
        why.append("no cgroup2 mount and no v1 pids mount")
    return None


#: fork_with_backoff's tries and first pause: 1, 2, 4 ... 128 ms, 255 ms in all. Long enough
#: for a killed call's processes to be reaped (what frees a pid), short enough that a call
#: waiting for a worker hears "no" within a fraction of a second.
FORK_ATTEMPTS = 9
FORK_FIRST_DELAY_S = 0.001

#: The errors of a fork the kernel may grant later: a pids cgroup, pid_max or threads-max full
#: (EAGAIN), or memory short (ENOMEM).
RETRYABLE_FORK_ERRORS = (errno.EAGAIN, errno.ENOMEM)


def fork_with_backoff(
    fork: Callable[[], int],
    on_retry: Callable[[], None],
    attempts: int = FORK_ATTEMPTS,
    first_delay_s: float = FORK_FIRST_DELAY_S,
) -> int:
    """fork(), retried while the kernel answers EAGAIN or ENOMEM, rather than letting the
    template die: pauses 1, 2, 4 ... ms, calling ``on_retry`` first (the template's reaper: a
    pid is freed only when its zombie is reaped). Then the last OSError propagates."""
    delay = first_delay_s
    for attempt in range(attempts):
        try:
            return fork()
        except OSError as exc:
            if exc.errno not in RETRYABLE_FORK_ERRORS or attempt == attempts - 1:
                raise
        on_retry()
        time.sleep(delay)
        delay *= 2
    raise ValueError("attempts must be at least 1")
