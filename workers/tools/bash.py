"""The bash tool: ``bash -c COMMAND`` in the call's cwd and (scrubbed) environment.

Data flow inside the worker::

    bash -c ... --stdout pipe--+
         |     --stderr pipe--+--> selector --> chunks (capped at max_output_bytes)
         +----- pidfd --------+        |
                                       +--> bash exited: wait() it, kill_descendants(), drain

bash runs in the worker's own process group, not a new session: the coordinator cancels a call
by killing the worker's group, and that must reach bash and what it started.

Why the pidfd: bash's exit cannot be inferred from the pipes. ``sleep 1000 &`` inherits both
write ends, so EOF would only come when the sleep ends. The pidfd turns readable the moment bash
itself exits, without polling; then everything bash left behind is killed, which closes the
last write ends, and the pipes drain to EOF. Background jobs do not survive the call: that is
the product's contract ("nothing a call started may outlive it").

Killing leftovers relies on workers.containment: the worker is a child subreaper or the init of
its own PID namespace, so orphans of bash become its children and kill_descendants() finds them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import subprocess
from typing import Any

from sandbx_pool.workers import users
from sandbx_pool.workers.containment import kill_descendants
from sandbx_pool.workers.errors import OutputLimitExceeded, ToolError
from sandbx_pool.workers.paths import resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import BashArgs

#: Bytes asked of a pipe per read: the pipe's default capacity, so one read usually empties it.
_READ_BYTES = 64 * 1024


class _Output:
    """stdout and stderr as they arrive, and whether together they passed the cap."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.chunks: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self.total = 0

    def add(self, stream: str, data: bytes) -> bool:
        """Keep ``data``; False once the total is over the limit."""
        self.chunks[stream].append(data)
        self.total += len(data)
        return self.total <= self.limit

    def text(self, stream: str) -> str:
        return b"".join(self.chunks[stream]).decode("utf-8", errors="replace")


class _ExecFailed(Exception):
    """``argv[0]`` could not be executed: reported as a shell would (126 or 127), not raised."""

    def __init__(self, exc: OSError, program: str) -> None:
        super().__init__(f"{program}: {exc.strerror or exc}")
        self.code = errno.errorcode.get(exc.errno or 0, "EIO")
        self.exit_code = 127 if exc.errno == errno.ENOENT else 126


def _identity(name: str, env: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Popen's user/group/extra_groups for ``name`` (or a uid), and env as runuser sets it."""
    user = users.lookup(name)
    switched = {**env, "HOME": user.home, "USER": user.name, "LOGNAME": user.name}
    if (os.geteuid(), os.getegid()) == (user.uid, user.gid):
        return {}, switched  # the confinement switched the worker already (workers.sandbox)
    tmpdir = env.get("TMPDIR")
    if tmpdir and os.geteuid() == 0:
        # The call's private TMPDIR was made for the worker's user; hand it to the command's.
        with contextlib.suppress(OSError):
            os.chown(tmpdir, user.uid, user.gid)
    ids = {"user": user.uid, "group": user.gid, "extra_groups": user.groups}
    return ids, switched


def _start(args: BashArgs, ctx: ExecutionContext) -> subprocess.Popen[bytes]:
    # The cwd is confined like any path: a cwd that is (or passes through) a symlink leading
    # out of the workspace is refused, not silently used.
    cwd = resolve(ctx, ".")
    argv = args.argv if args.argv is not None else ["bash", "-c", args.command]
    ids: dict[str, Any] = {}
    env = ctx.env
    if args.user is not None:
        ids, env = _identity(args.user, env)
    has_input = args.stdin is not None or args.stdin_bytes is not None
    try:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if has_input else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            **ids,
        )
    except OSError as exc:
        if args.argv is not None and exc.filename in (None, argv[0]):
            raise _ExecFailed(exc, argv[0]) from exc
        raise ToolError(f"cannot start {argv[0]} in {cwd}: {exc.strerror or exc}") from exc


def _exit_status(returncode: int) -> tuple[int, int | None]:
    """Popen's returncode as a shell reports it: 128 + N when killed by signal N."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


def _pump(proc: subprocess.Popen[bytes], output: _Output, stdin: bytes | None = None) -> None:
    """Feed ``stdin`` and collect output until bash has exited and both pipes are at EOF.

    Raises OutputLimitExceeded as soon as the output passes the cap; the caller kills.
    """
    assert proc.stdout is not None
    assert proc.stderr is not None
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
            selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
            selector.register(pidfd, selectors.EVENT_READ, None)
            feeder = _Feeder(proc, stdin, selector) if proc.stdin is not None else None
            while selector.get_map():
                for key, _ in selector.select():
                    if key.data == "stdin":
                        assert feeder is not None
                        feeder.feed()
                        continue
                    if key.data is None:
                        selector.unregister(pidfd)
                        # Readable pidfd: bash is a zombie now, so wait() returns at once.
                        # It must come before kill_descendants(), which reaps every child
                        # and would take bash's exit status with it.
                        proc.wait()
                        kill_descendants()
                        continue
                    # os.read, not the file object's read(): it returns what the pipe holds
                    # instead of blocking until _READ_BYTES have arrived.
                    data = os.read(key.fd, _READ_BYTES)
                    if not data:
                        selector.unregister(key.fileobj)
                    elif not output.add(key.data, data):
                        raise OutputLimitExceeded(f"output exceeded {output.limit} bytes")
    finally:
        os.close(pidfd)


class _Feeder:
    """Writes stdin as the pipe takes it, from the same loop that drains stdout and stderr:
    a command that writes before it has read all its input must not deadlock against us."""

    def __init__(
        self, proc: subprocess.Popen[bytes], data: bytes | None, selector: selectors.BaseSelector
    ) -> None:
        assert proc.stdin is not None
        self.pipe = proc.stdin
        self.view = memoryview(data or b"")
        self.selector = selector
        os.set_blocking(self.pipe.fileno(), False)
        if self.view:
            selector.register(self.pipe, selectors.EVENT_WRITE, "stdin")
        else:
            self.pipe.close()  # empty input: EOF at once

    def feed(self) -> None:
        try:
            written = os.write(self.pipe.fileno(), self.view[:_READ_BYTES])
        except BlockingIOError:
            return
        except BrokenPipeError:  # the command stopped reading: the rest is not wanted
            written = len(self.view)
        self.view = self.view[written:]
        if not self.view:
            self.selector.unregister(self.pipe)
            self.pipe.close()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill bash (if still running) and everything it started; reap all of it."""
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        # Reap bash through Popen, so it records the status instead of warning at
        # garbage collection that the child is still running.
        proc.wait()
    kill_descendants()


def run_bash(args: BashArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Run the command; any exit code is an ``ok`` result, carried in ``exit_code``.

    With ``argv``, a program that cannot be executed is an ``ok`` result too, as a shell
    reports it (126, or 127 when not found), with ``exec_error`` naming the errno.
    """
    try:
        proc = _start(args, ctx)
    except _ExecFailed as failed:
        return {
            "exit_code": failed.exit_code,
            "signal": None,
            "stdout": "",
            "stderr": f"{failed}\n",
            "exec_error": failed.code,
        }
    output = _Output(ctx.max_output_bytes)
    stdin = args.stdin.encode("utf-8") if args.stdin is not None else args.stdin_bytes
    try:
        _pump(proc, output, stdin)
    finally:
        # Normally a no-op by now (bash reaped, leftovers killed); after an error or the
        # output limit it is the kill. Either way nothing outlives the call.
        _stop(proc)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
    assert proc.returncode is not None
    exit_code, signal_number = _exit_status(proc.returncode)
    return {
        "exit_code": exit_code,
        "signal": signal_number,
        "stdout": output.text("stdout"),
        "stderr": output.text("stderr"),
    }
