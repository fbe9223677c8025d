"""A FUSE filesystem whose file reads never answer until released: a hung mount, for real.

    test --HungFs.start()--> python fusefs.py MOUNTPOINT   (the daemon: mfusepy over libfuse3)
         <--stdout "ready"--  once the kernel's INIT is answered (the mount is usable)
         <--stdout "read /stuck-0.txt"--  a read request arrived; the reader is now held
         --stdin "release"-->  every held read answers, and later ones at once
         --SIGTERM/SIGKILL-->  the daemon dies: the kernel aborts the connection, which fails
                               every pending request, and the mount is detached

Directory listings, lookups and opens answer at once: only ``read`` hangs, like an NFS server
that stops answering in the middle of a transfer. One exception: a lookup of the directory
``STALLED`` hangs too, until released (a mount that stops answering before the path is even
resolved). The kernel has already handed a held read to
the daemon, so the reader sleeps uninterruptibly (state D): SIGKILL does not end it until the
daemon answers or dies. That is the case the pool must survive.

The daemon runs in its own process so that the test can kill it: a daemon inside the test
process would hang the test on its own mount.
"""

from __future__ import annotations

import contextlib
import ctypes.util
import errno
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

#: The files the filesystem holds; every one of them hangs on read.
FILES = ("stuck-0.txt", "stuck-1.txt", "stuck-2.txt", "stuck-3.txt")
CONTENT = b"needle in a hung haystack\n"
#: A directory whose lookup (getattr) hangs until release, as its files' reads do.
STALLED = "stalled"

#: How long the daemon may take to mount (an interpreter plus libfuse's handshake).
START_TIMEOUT_S = 30.0
#: How long a stop waits for the daemon to unmount and exit before killing it.
STOP_TIMEOUT_S = 5.0


def missing_fuse() -> str | None:
    """Why FUSE cannot be used here, or None if it can."""
    if not os.path.exists("/dev/fuse"):
        return "/dev/fuse is missing"
    if shutil.which("fusermount3") is None:
        return "fusermount3 is missing (Debian package fuse3)"
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is missing (Debian package fuse3)"
    try:
        import mfusepy  # noqa: F401 (only whether it imports)
    except (ImportError, OSError) as exc:
        return f"mfusepy cannot be imported: {exc}"
    return None


def unmountable_here() -> str | None:
    """Why this process may not mount a FUSE filesystem though FUSE is installed, or None: the
    environment's own limit, not a missing package (an unprivileged user not allowed
    /dev/fuse; a container's root, whose bounding set leaves the set-uid fusermount3 no
    CAP_SYS_ADMIN to mount with)."""
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse: permission denied to this user"
    with open("/proc/self/status") as f:
        bounding = next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))
    if not bounding & (1 << 21):  # CAP_SYS_ADMIN
        return "no CAP_SYS_ADMIN in the bounding set: fusermount3 cannot mount (a container)"
    return None


def require_fuse() -> None:
    """Skip without FUSE, except under CI=true, where a missing FUSE is a failure (CI installs
    it); an environment that may not mount one (``unmountable_here``) skips even there."""
    reason = missing_fuse()
    if reason is not None and os.environ.get("CI") == "true":
        pytest.fail(f"FUSE is required under CI: {reason}")
    reason = reason or unmountable_here()
    if reason is not None:
        pytest.skip(f"FUSE unavailable: {reason}")


class HungFs:
    """The test's handle on one mounted hung filesystem (see the module docstring)."""

    def __init__(self, mountpoint: Path) -> None:
        self.mountpoint = mountpoint
        self._process: subprocess.Popen[str] | None = None
        self._reads: list[str] = []
        self._changed = threading.Condition()
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.mountpoint.mkdir(exist_ok=True)
        self._process = subprocess.Popen(
            [sys.executable, __file__, str(self.mountpoint)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], START_TIMEOUT_S)
        line = self._process.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self.stop()
            raise RuntimeError(f"the FUSE daemon did not mount {self.mountpoint}: {line!r}")
        self._reader = threading.Thread(target=self._read_events, name="fusefs-events")
        self._reader.start()

    def _read_events(self) -> None:
        assert self._process is not None
        assert self._process.stdout is not None
        for line in self._process.stdout:
            with self._changed:
                self._reads.append(line.split(" ", 1)[1].strip())
                self._changed.notify_all()

    @property
    def reads(self) -> list[str]:
        """Paths of the read requests the daemon has received (held until release)."""
        with self._changed:
            return list(self._reads)

    def wait_reads(self, count: int, within_s: float = 30.0) -> None:
        """Block until ``count`` read requests have reached the daemon (and are held there)."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._reads) >= count, within_s):
                raise AssertionError(f"{count} reads not seen within {within_s} s: {self._reads}")

    def release(self) -> None:
        """Answer every held read, and every later one at once."""
        if self._process is not None and self._process.poll() is None:
            assert self._process.stdin is not None
            try:
                self._process.stdin.write("release\n")
                self._process.stdin.flush()
            except BrokenPipeError:
                pass

    def kill(self) -> None:
        """Kill the daemon outright: the kernel fails whatever it held (ENOTCONN)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self) -> None:
        """Release, unmount and end the daemon, whatever state it is in; leaves no mount."""
        process = self._process
        if process is not None:
            self.release()
            if process.poll() is None:
                # libfuse's SIGTERM handler leaves its loop and unmounts.
                process.terminate()
                try:
                    process.wait(STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            if process.stdin is not None:
                process.stdin.close()
        if self._reader is not None:
            self._reader.join()
        if process is not None and process.stdout is not None:
            process.stdout.close()
        if self.mounted():
            # A daemon that died without unmounting leaves a dead mount ("Transport endpoint is
            # not connected"); detach it lazily so that nothing can trip on it later.
            subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], check=True)

    def mounted(self) -> bool:
        """Whether the mount table lists our mountpoint (os.path.ismount cannot stat a dead
        mount, and says False)."""
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f]
        # The table escapes spaces and the like as octal (\040).
        return any(p.encode().decode("unicode_escape") == str(self.mountpoint) for p in points)


# -- the daemon ---------------------------------------------------------------------------------


def _serve(mountpoint: str) -> None:
    from mfusepy import FUSE, FuseOSError, Operations

    released = threading.Event()
    print_lock = threading.Lock()

    def say(line: str) -> None:
        with print_lock:
            print(line, flush=True)

    class Hung(Operations):  # type: ignore[misc]
        use_ns = True

        def init(self, path: str) -> None:
            # The kernel sends INIT once the mount exists: from now on the mount answers.
            say("ready")

        def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
            now = time.time_ns()
            times = {"st_atime": now, "st_mtime": now, "st_ctime": now}
            if path == f"/{STALLED}":
                released.wait()
            if path in ("/", f"/{STALLED}"):
                return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, **times}
            if path.lstrip("/") in FILES:
                return {
                    "st_mode": stat.S_IFREG | 0o444,
                    "st_nlink": 1,
                    "st_size": len(CONTENT),
                    **times,
                }
            raise FuseOSError(errno.ENOENT)

        def readdir(self, path: str, fh: int) -> list[str]:
            return [".", "..", *FILES]

        def open(self, path: str, flags: int) -> int:
            return 0

        def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
            say(f"read {path}")
            released.wait()
            return CONTENT[offset : offset + size]

    def wait_for_release() -> None:
        # A line on stdin releases; so does EOF (the test died): never hold readers forever.
        for line in sys.stdin:
            if line.strip() == "release":
                break
        released.set()

    threading.Thread(target=wait_for_release, daemon=True).start()
    # direct_io: every read goes to the daemon, none is served (or queued) by the page cache.
    # Multithreaded (libfuse's default): a held read blocks one thread, lookups use the others.
    with contextlib.suppress(RuntimeError):  # fuse_main's status when SIGTERM ends it
        FUSE(Hung(), mountpoint, foreground=True, direct_io=True)


if __name__ == "__main__":
    # Die with the test even if it is SIGKILLed: a daemon left behind keeps a mount alive.
    from sandbx_pool.workers.containment import set_parent_death_signal

    set_parent_death_signal(signal.SIGTERM)
    _serve(sys.argv[1])
