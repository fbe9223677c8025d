"""The bash tool: ``bash -c COMMAND`` in the call's cwd and (scrubbed) environment.

Data flow inside the worker::

    bash -c ... --stdout pipe--+                  +--> head and tail of each stream (_Kept)
         |     --stderr pipe--+--> selector --+--> OutputSink, when the caller streams
         +----- pidfd --------+        |       +--> kill past max_output_bytes (a flood)
                 SIGTERM (stopping) ---+
                                       +--> bash exited: wait() it, kill_descendants(), drain

Output is kept, never refused: each stream keeps its first and last keep_output_bytes / 2,
and the value says what was omitted between them (a marker line, ``omitted_bytes``). A
command that writes past max_output_bytes in all is a flood, killed as ``output_limit``; a
command stopped by the coordinator (timeout, cancel) answers with what it printed until then
(workers.stopping). With ``merge_stderr`` stderr shares stdout's pipe, so their order is kept.

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
import time
from typing import IO, Any

from sandbx_pool.workers import protected, stopping, streaming, users
from sandbx_pool.workers.containment import kill_descendants
from sandbx_pool.workers.errors import OutputLimitExceeded, ToolError
from sandbx_pool.workers.paths import resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import BashArgs
from sandbx_pool.workers.tools import shell_state

#: The key of a session call's ShellState in the value run_bash returns, which the runtime
#: takes out of it (Result.session): it is not the command's output.
SESSION_KEY = "_session"

#: Bytes asked of a pipe per read: the pipe's default capacity, so one read usually empties it.
_READ_BYTES = 64 * 1024

#: How far from the marker the kept head and tail look for a line end to cut at.
_LINE_REACH = 4096


class _Kept:
    """One stream's first and last bytes: about ``keep`` bytes held, however many pass."""

    def __init__(self, keep: int) -> None:
        self.head_cap = keep // 2
        self.tail_cap = keep - self.head_cap
        # The tail is trimmed once it is this much over its bound: trimming moves the whole
        # tail, and doing it on every read of a flood would cost more than the flood.
        self.slack = max(_READ_BYTES, self.tail_cap // 4)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > self.tail_cap + self.slack:
                del self.tail[: -self.tail_cap]

    def text(self) -> tuple[str, int]:
        """The stream as text, and how many bytes of it the marker line stands for."""
        head, tail = bytes(self.head), bytes(self.tail[-self.tail_cap :] if self.tail_cap else b"")
        omitted = self.total - len(head) - len(tail)
        if not omitted:
            return _decode(head + tail), 0
        # Whole lines on either side of the marker, where a line end is in reach (a very
        # long line is cut instead: dropping it whole could leave nothing to see).
        cut = head.rfind(b"\n", len(head) - _LINE_REACH) + 1
        if cut:
            omitted += len(head) - cut
            head = head[:cut]
        start = tail.find(b"\n", 0, _LINE_REACH) + 1
        if 0 < start < len(tail):
            omitted += start
            tail = tail[start:]
        newline = "" if not head or head.endswith(b"\n") else "\n"
        marker = f"{newline}[... {omitted} bytes omitted ...]\n"
        return _decode(head) + marker + _decode(tail), omitted


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


class _Output:
    """stdout and stderr as kept, and whether together they passed the flood limit."""

    def __init__(self, keep: int, limit: int) -> None:
        self.limit = limit
        self.streams = {"stdout": _Kept(keep), "stderr": _Kept(keep)}
        self.total = 0

    def add(self, stream: str, data: bytes) -> bool:
        """Keep ``data`` (head or tail); False once the total is over the limit."""
        self.streams[stream].add(data)
        self.total += len(data)
        return self.total <= self.limit


class _Stopped(Exception):
    """The coordinator asked the call to stop and the command's share of the grace is over."""


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


def _start(
    args: BashArgs, ctx: ExecutionContext
) -> tuple[subprocess.Popen[bytes], shell_state.Capture | None]:
    # The cwd is confined like any path: a cwd that is (or passes through) a symlink leading
    # out of the workspace is refused, not silently used.
    cwd = resolve(ctx, ".")
    shell = image_shell() if ctx.sandbox.image else "bash"
    argv = args.argv if args.argv is not None else [shell, "-c", args.command]
    ids: dict[str, Any] = {}
    env = ctx.env
    if args.user is not None:
        ids, env = _identity(args.user, env)
    capture, moved = None, None
    if ctx.session_env is not None:  # a shell session's call (workers.tools.shell_state)
        cwd, moved = shell_state.start_cwd(ctx, cwd)
        base, env = env, shell_state.session_env(ctx, env)
        if args.argv is None:  # an argv runs no shell: nothing to report
            capture = shell_state.Capture(ctx, base, cwd)
            capture.notes.extend([moved] if moved else [])
            argv = capture.argv(args.command, shell)
    has_input = args.stdin is not None or args.stdin_bytes is not None
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE if has_input else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if args.merge_stderr else subprocess.PIPE,
            pass_fds=(capture.write_fd,) if capture is not None else (),
            **ids,
        )
    except OSError as exc:
        if capture is not None:
            capture.close()
        if args.argv is not None and exc.filename in (None, argv[0]):
            raise _ExecFailed(exc, argv[0]) from exc
        raise ToolError(f"cannot start {argv[0]} in {cwd}: {exc.strerror or exc}") from exc
    if capture is not None:
        capture.started()
    return proc, capture


def image_shell() -> str:
    """In a layer over an image (the call's ``/`` is the image's): its ``/bin/bash``, else its
    ``/bin/sh``, as ``docker exec ... sh -c`` users expect; never the host's."""
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


def _exit_status(returncode: int) -> tuple[int, int | None]:
    """Popen's returncode as a shell reports it: 128 + N when killed by signal N."""
    if returncode < 0:
        return 128 - returncode, -returncode
    return returncode, None


def _pump(
    proc: subprocess.Popen[bytes],
    output: _Output,
    stdin: bytes | None,
    *,
    grace_s: float,
    capture: shell_state.Capture | None = None,
) -> None:
    """Feed ``stdin`` and collect output until bash has exited and both pipes are at EOF.

    Raises OutputLimitExceeded as soon as the output passes the cap, and _Stopped once a stop
    request's deadline has passed; the caller kills.
    """
    assert proc.stdout is not None
    sink, stop = streaming.current, stopping.current
    pidfd = os.pidfd_open(proc.pid)
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout, selectors.EVENT_READ, "stdout")
            if proc.stderr is not None:  # None with merge_stderr
                selector.register(proc.stderr, selectors.EVENT_READ, "stderr")
            selector.register(pidfd, selectors.EVENT_READ, None)
            if stop is not None:
                selector.register(stop, selectors.EVENT_READ, "stop")
            if capture is not None:  # the session's report: never part of the output
                selector.register(capture.read_fd, selectors.EVENT_READ, "session")
            feeder = _Feeder(proc, stdin, selector) if proc.stdin is not None else None
            while any(key.data != "stop" for key in selector.get_map().values()):
                for key, _ in selector.select(_wait_s(sink, stop, grace_s)):
                    if key.data == "stop":
                        selector.unregister(key.fileobj)  # the deadline is set now
                        continue
                    if key.data == "stdin":
                        assert feeder is not None
                        feeder.feed()
                        continue
                    if key.data == "session":
                        assert capture is not None
                        fd = capture.read_fd
                        if not capture.read():
                            selector.unregister(fd)
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
                        continue
                    if sink is not None:
                        sink.add(key.data, data)
                    if not output.add(key.data, data):
                        raise OutputLimitExceeded(f"output exceeded {output.limit} bytes")
                if sink is not None and sink.due_in() == 0:
                    sink.flush()
                deadline = stop.deadline(grace_s) if stop is not None else None
                if deadline is not None and time.monotonic() >= deadline:
                    raise _Stopped
    finally:
        os.close(pidfd)


def _wait_s(
    sink: streaming.OutputSink | None, stop: stopping.StopRequest | None, grace_s: float
) -> float | None:
    """How long the selector may sleep: until the sink's next flush or the stop deadline."""
    waits = []
    if sink is not None and (due := sink.due_in()) is not None:
        waits.append(due)
    if stop is not None and (deadline := stop.deadline(grace_s)) is not None:
        waits.append(max(0.0, deadline - time.monotonic()))
    return min(waits) if waits else None


def _drain(proc: subprocess.Popen[bytes], output: _Output) -> None:
    """After the kill: what the pipes still hold belongs to the partial output. Non-blocking,
    so a writer that somehow survived cannot hold us here."""
    pipes: tuple[tuple[streaming.Stream, IO[bytes] | None], ...] = (
        ("stdout", proc.stdout),
        ("stderr", proc.stderr),
    )
    for stream, pipe in pipes:
        if pipe is None or pipe.closed:
            continue
        os.set_blocking(pipe.fileno(), False)
        with contextlib.suppress(BlockingIOError):
            for _ in range(output.limit // _READ_BYTES + 1):
                data = os.read(pipe.fileno(), _READ_BYTES)
                if not data:
                    break
                output.add(stream, data)
                if streaming.current is not None:
                    streaming.current.add(stream, data)


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
    reports it (126, or 127 when not found), with ``exec_error`` naming the errno. A flood
    raises OutputLimitExceeded carrying the output until the kill; a stop request returns the
    output so far (the runtime marks the Result ``stopped``).
    """
    # The protected paths as they are (those no read-only mount holds, in full): whatever the
    # command makes of them is undone once it and all it started are dead.
    guard = protected.snapshot(ctx.workspace, ctx.sandbox.protected)
    try:
        proc, capture = _start(args, ctx)
    except _ExecFailed as failed:
        message = f"{failed}\n"
        return {
            "exit_code": failed.exit_code,
            "signal": None,
            "stdout": message if args.merge_stderr else "",
            "stderr": "" if args.merge_stderr else message,
            "exec_error": failed.code,
            "omitted_bytes": 0,
        }
    output = _Output(ctx.keep_output_bytes, ctx.max_output_bytes)
    stdin = args.stdin.encode("utf-8") if args.stdin is not None else args.stdin_bytes
    try:
        _pump(proc, output, stdin, grace_s=ctx.grace_s, capture=capture)
    except OutputLimitExceeded as exc:
        _stop(proc)
        value = _value(proc, output, guard.restore())
        raise OutputLimitExceeded(str(exc), value=value) from None
    except _Stopped:
        pass  # killed below; the value is what came until then
    finally:
        # Normally a no-op by now (bash reaped, leftovers killed); after an error, the output
        # limit or a stop it is the kill. Either way nothing outlives the call, and then the
        # protected paths are put back (restore() does it once).
        _stop(proc)
        restored = guard.restore()
        _drain(proc, output)
        if streaming.current is not None:
            streaming.current.flush(final=True)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None and not pipe.closed:
                pipe.close()
        if capture is not None:
            capture.close()
    value = _value(proc, output, restored)
    if capture is not None:
        value[SESSION_KEY] = capture.state()  # the runtime moves it to Result.session
    return value


def _value(
    proc: subprocess.Popen[bytes], output: _Output, restored: dict[str, Any]
) -> dict[str, Any]:
    assert proc.returncode is not None
    exit_code, signal_number = _exit_status(proc.returncode)
    stdout, omitted_out = output.streams["stdout"].text()
    stderr, omitted_err = output.streams["stderr"].text()
    return {
        "exit_code": exit_code,
        "signal": signal_number,
        "stdout": stdout,
        "stderr": stderr,
        "omitted_bytes": omitted_out + omitted_err,
        # Only when there is something to say: protected paths the command made or changed,
        # set aside and restored (protected_set_aside), and what could not be guarded.
        **restored,
    }
