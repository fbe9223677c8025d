"""Starting the template's interpreter: a process that can be under way before its pool exists.

The template is an interpreter that imports the whole worker side (about 0.1 s) before it can
fork a worker. A pool that serves thousands of calls pays that once; a one-shot ``sandbx-pool
call`` pays it on every run, after its own imports. Nothing the template does until it forks
needs the pool: it learns where workers connect (``Attach``) in its first message. So the
command line launches it first thing (``prelaunch``), and the pool's ``TemplateHandle`` adopts
it (``take_prelaunched``): both interpreters then import at once, on two cores.

This module imports the standard library only, so that launching costs nothing the coordinator's
own imports would have to wait for.

PR_SET_PDEATHSIG fires when the *thread* that forked a process exits, not when its process
does. The template arms it (so it dies with us, even on SIGKILL), so it must be started from a
thread that lives exactly as long as the pool: an executor thread is retired after its idle
keep-alive and would take the template, and every worker, with it. ``TemplateLaunch`` owns such
a thread.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import socket
import subprocess
import threading

from sandbx_pool.interpreter import CHILD_CWD, python_command

#: How long a template that was told to stop may take to exit before it is killed.
EXIT_TIMEOUT_S = 5.0


class Launch:
    """The template process as its thread sees it: started, stopped, or failed to start."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.error: BaseException | None = None
        self.started = threading.Event()
        self.stop = threading.Event()


class TemplateLaunch:
    """The template's interpreter, its control socketpair and the thread it lives by.

    ``nofile``: the RLIMIT_NOFILE the template gets, the one this process had before a pool
    raised its own (sandbx_pool.descriptors). ``warm_up``: ``[pool] warm_up``."""

    def __init__(self, *, warm_up: bool, nofile: tuple[int, int] | None) -> None:
        self.warm_up = warm_up
        self.socket, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        #: What the thread shares with us; it holds nothing of ours, so that a pool dropped
        #: without close() can be collected (see remains.py).
        self.launch = Launch()
        command = python_command(
            "sandbx_pool.workers.template",
            f"--control-fd={child_sock.fileno()}",
            f"--parent-pid={os.getpid()}",
            f"--warm-up={'full' if warm_up else 'light'}",
        )
        self.thread = threading.Thread(
            target=_keep_template,
            args=(command, child_sock, self.launch, nofile),
            name="sandbx-template",
            daemon=True,
        )
        self.thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Have the thread reap the template (asked to exit, or killed: the caller's business)
        and end; a template that has not exited within EXIT_TIMEOUT_S is killed."""
        self.launch.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        self.socket.close()


def _keep_template(
    command: list[str],
    child_sock: socket.socket,
    launch: Launch,
    nofile: tuple[int, int] | None,
) -> None:
    """The template's thread: start it, then live as long as the pool (its PDEATHSIG is tied
    to this thread), then reap it. A function, not a method: a running thread is a root for
    the collector, and must not keep the pool alive.

    ``nofile`` is set from here, not by a preexec_fn (unsafe in a process with threads); it is
    in force before the template forks its first worker, which it does only when asked, after
    it is ready."""
    try:
        launch.process = subprocess.Popen(
            command,
            pass_fds=[child_sock.fileno()],
            # Never our stdout (a caller's `$(sandbx-pool call ...)` or pipe); our stderr for
            # what the template itself reports, and it exits when the pool closes. Its workers
            # hold neither (containment.release_standard_streams).
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=CHILD_CWD,
            # Own session: a Ctrl-C at our terminal reaches us, and we stop calls in order.
            start_new_session=True,
        )
        if nofile is not None:
            with contextlib.suppress(OSError):  # gone already: its start fails on its own
                resource.prlimit(launch.process.pid, resource.RLIMIT_NOFILE, nofile)
    except BaseException as exc:
        launch.error = exc
    finally:
        child_sock.close()
        launch.started.set()
    launch.stop.wait()
    if launch.process is not None:
        _reap(launch.process)


def _reap(process: subprocess.Popen[bytes]) -> None:
    """Wait for ``process`` to exit, EXIT_TIMEOUT_S at most, then kill it. On its pidfd: a
    template that exits at once is reaped at once (Popen.wait with a timeout polls, and its
    sleeps added tens of milliseconds to every pool's close)."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except OSError:  # reaped already (ESRCH cannot be: we have not), or no pidfd: poll
        pidfd = -1
    try:
        if pidfd >= 0:
            exited = bool(select.select([pidfd], [], [], EXIT_TIMEOUT_S)[0])
        else:
            exited = _wait_polling(process)
        if not exited:
            process.kill()
        process.wait()
    finally:
        if pidfd >= 0:
            os.close(pidfd)


def _wait_polling(process: subprocess.Popen[bytes]) -> bool:
    try:
        process.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return False
    return True


# -- launched before the pool (the one-shot command line) ---------------------------------------

_prelaunched: list[TemplateLaunch] = []
_prelaunch_lock = threading.Lock()


def prelaunch(*, warm_up: bool) -> None:
    """Start a template now, for the next pool this process starts with the same ``warm_up``.

    Its RLIMIT_NOFILE is this process's now: the limit a pool started later would hand it,
    before raising its own. One at a time: a second call while one waits does nothing."""
    with _prelaunch_lock:
        if not _prelaunched:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
            _prelaunched.append(TemplateLaunch(warm_up=warm_up, nofile=nofile))


def take_prelaunched(*, warm_up: bool) -> TemplateLaunch | None:
    """The template ``prelaunch`` started, if it was for these settings (then it is the
    caller's), else None."""
    with _prelaunch_lock:
        if _prelaunched and _prelaunched[0].warm_up == warm_up:
            return _prelaunched.pop()
    return None


def discard_prelaunched() -> None:
    """Stop a prelaunched template no pool took (the command failed before starting one)."""
    with _prelaunch_lock:
        waiting = _prelaunched.pop() if _prelaunched else None
    if waiting is not None:
        # No message from us yet, so a close of our end is its EOF: it exits on its own.
        # The kill covers one still importing (it reads the socket only once ready).
        waiting.launch.started.wait()
        process = waiting.launch.process
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        waiting.stop()
