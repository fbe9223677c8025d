"""A service: ``bash -c COMMAND`` that lives until it ends or is stopped (sandbx_pool.services).

Data flow inside the worker::

    coordinator --ServiceInput / ServiceResize (DEALER, after the Call)--+
                                                                        v
    bash -c ... <--stdin pipe (or the pty's slave)-- pending input <-- selector
         |  --stdout+stderr, one pipe (or the pty's master)-------------> OutputSink --> Output
         +-- pidfd: bash exited --> wait(); SIGCHLD: orphans reaped (_Children)
                 nothing it started left, output at its end --> Result(bash's exit_code)
                 SIGTERM (stopping): the command's grace, then kill ----^

It is bash's tool (workers.tools.bash) with three differences. Nothing is kept for the
Result: the output goes to the coordinator as it comes (the streaming sink paces and bounds
it; the coordinator keeps its head and tail, sandbx_pool.services), so a server that logs for
hours is never an output flood. The worker reads its connection while the command runs, for
the bytes the caller writes (``svc.write``) and a terminal's new size. And with ``tty`` the
command's stdin, stdout and stderr are the slave of a pseudo-terminal, so programs that ask
``isatty`` (a REPL, an installer's prompt, ``stty``) behave as in a terminal.

The pty is not made the command's controlling terminal: that needs a session of its own
(setsid), which would take the command out of the worker's process group, the group the
coordinator kills. So ^C written to it is a byte, not a SIGINT, and a resize sends no SIGWINCH;
``stty size`` and TIOCGWINSZ read the new size all the same.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pty
import selectors
import signal
import struct
import subprocess
import termios
import time
from typing import Any

import msgspec

from sandbx_pool.workers import stopping, streaming, zmtp
from sandbx_pool.workers.containment import kill_descendants
from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.paths import resolve
from sandbx_pool.workers.protocol import (
    ExecutionContext,
    ServiceInput,
    ServiceResize,
    service_decoder,
)
from sandbx_pool.workers.schemas import ServiceArgs

#: This worker's connection to the coordinator, set by the runtime for a ``_service`` call:
#: where ServiceInput and ServiceResize come from while the command runs.
connection: zmtp.Dealer | None = None

#: A ``tty`` service's pseudo-terminal (master, slave), opened by ``open_terminal`` before the
#: worker confines itself: once confined, /dev/ptmx is out of its reach (Landlock grants no
#: device but the harmless ones), and the command needs no path to it, only the descriptor.
terminal: tuple[int, int] | None = None

#: Bytes asked of the output per read (a pipe's default capacity).
_READ_BYTES = 64 * 1024

#: Most input held for a command that does not read it: past this, more is dropped (counted
#: in the Result's ``input_dropped``) rather than growing the worker without bound.
MAX_PENDING_INPUT = 1024 * 1024

#: How long a frame the coordinator began may take to arrive whole.
_FRAME_TIMEOUT_S = 5.0


def open_terminal(args: dict[str, Any]) -> None:
    """For a ``tty`` service (its raw args, before they are parsed): its pseudo-terminal, now,
    while the worker is not yet confined. A failure is left for run_service to report."""
    global terminal
    if args.get("tty") is True:
        with contextlib.suppress(OSError):
            terminal = pty.openpty()


def _set_size(fd: int, cols: int, rows: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class _Command:
    """The running command, its output end, and the input waiting for it."""

    def __init__(self, args: ServiceArgs, ctx: ExecutionContext) -> None:
        cwd = resolve(ctx, ".")
        env = dict(ctx.env)
        self.tty = args.tty
        if args.tty:
            env.setdefault("TERM", "xterm-256color")
            try:
                master, slave = terminal if terminal is not None else pty.openpty()
            except OSError as exc:
                raise ToolError(f"cannot open a pseudo-terminal: {exc.strerror or exc}") from exc
            _set_size(slave, args.cols, args.rows)
            stdin: int = slave
            stdout: int = slave
            stderr: int = slave
        else:
            master = slave = -1
            stdin, stdout, stderr = subprocess.PIPE, subprocess.PIPE, subprocess.STDOUT
        try:
            self.proc = subprocess.Popen(
                ["bash", "-c", args.command],
                cwd=cwd,
                env=env,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
            )
        except OSError as exc:
            if args.tty:
                os.close(master)
                os.close(slave)
            raise ToolError(f"cannot start bash in {cwd}: {exc.strerror or exc}") from exc
        if args.tty:
            os.close(slave)  # the command's now: EIO on the master once all of it is gone
            # A second descriptor for input: a selector takes each descriptor once, and the
            # master is registered for reading already.
            self.output_fd, self.input_fd = master, os.dup(master)
        else:
            assert self.proc.stdout is not None
            assert self.proc.stdin is not None
            self.output_fd, self.input_fd = self.proc.stdout.fileno(), self.proc.stdin.fileno()
        os.set_blocking(self.input_fd, False)
        self.pending = bytearray()
        self.close_input = False
        self.input_dropped = 0

    def queue(self, data: bytes, eof: bool) -> None:
        room = MAX_PENDING_INPUT - len(self.pending)
        self.pending += data[: max(room, 0)]
        self.input_dropped += max(len(data) - max(room, 0), 0)
        self.close_input = self.close_input or eof

    def feed(self) -> bool:
        """Write what the input end takes now; True while something is left to write."""
        if self.input_fd < 0:
            self.pending.clear()
            return False
        if self.pending:
            try:
                written = os.write(self.input_fd, self.pending[:_READ_BYTES])
            except BlockingIOError:
                return True
            except OSError:  # the command closed its end: nothing more is wanted
                written = len(self.pending)
            del self.pending[:written]
        if not self.pending and self.close_input:
            self._close_input()
        return bool(self.pending)

    def _close_input(self) -> None:
        if self.tty:
            # A terminal has no end-of-file to close: ^D at the start of a line is one.
            with contextlib.suppress(OSError):
                os.write(self.input_fd, b"\x04")
            self.close_input = False
            return
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.input_fd = -1

    def resize(self, cols: int, rows: int) -> None:
        if self.tty and 0 < cols < 65536 and 0 < rows < 65536:
            with contextlib.suppress(OSError):
                _set_size(self.output_fd, cols, rows)

    def read(self, size: int) -> bytes:
        """What the command wrote; b"" at the end (a pty's master says EIO then)."""
        try:
            return os.read(self.output_fd, size)
        except OSError as exc:
            if exc.errno == errno.EIO:
                return b""
            raise

    def stop(self) -> None:
        """Kill bash (if still running) and all it started; reap all of it."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
        kill_descendants()

    def close(self) -> None:
        if self.tty:
            for fd in (self.output_fd, self.input_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            self.input_fd = -1
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()


def _receive(command: _Command, channel: zmtp.Dealer) -> bool:
    """One message from the coordinator; False when it hung up (the worker is then orphaned:
    the command is stopped)."""
    try:
        payload = channel.recv(timeout_s=_FRAME_TIMEOUT_S)
    except (ConnectionError, TimeoutError):
        return False
    if payload is None:
        return True
    try:
        message = service_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return True  # not ours to act on; the coordinator only sends what it checked
    if isinstance(message, ServiceInput):
        command.queue(message.data, message.eof)
    elif isinstance(message, ServiceResize):
        command.resize(message.cols, message.rows)
    return True


class _Children:
    """SIGCHLD as a readable descriptor, and the worker's children reaped but bash.

    A service ends when nothing it started is left, not when bash exits: ``pg_ctl start``,
    ``redis-server --daemonize yes`` and ``cmd &`` leave the real service running after the
    launcher is gone. The worker is their subreaper (or their PID namespace's init), so every
    orphan becomes its child: no child left means nothing of the service is left.
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._previous = signal.signal(signal.SIGCHLD, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._write_fd, b"\0")

    def fileno(self) -> int:
        return self._read_fd

    def reap(self, keep: int | None) -> bool:
        """Reap the children that exited, but ``keep`` (bash: Popen takes its status); True
        while any child is left."""
        with contextlib.suppress(BlockingIOError):
            os.read(self._read_fd, 4096)
        while True:
            try:
                flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
                exited = os.waitid(os.P_ALL, 0, flags)
            except ChildProcessError:
                return False
            if exited is None or exited.si_pid == keep:
                return True
            with contextlib.suppress(ChildProcessError):
                os.waitpid(exited.si_pid, 0)

    def close(self) -> None:
        signal.signal(signal.SIGCHLD, self._previous)
        os.close(self._read_fd)
        os.close(self._write_fd)


def run_service(args: ServiceArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Run the command until it and all it started have ended, or the coordinator stops it;
    its output goes out as it comes (``Call.stream_output``). The value: bash's exit code and
    signal, as bash's tool reports them."""
    children = _Children()
    try:
        command = _Command(args, ctx)
    except BaseException:
        children.close()
        raise
    sink, stop, channel = streaming.current, stopping.current, connection
    pidfd = os.pidfd_open(command.proc.pid)
    if sink is not None:
        sink.mark_started()
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(pidfd, selectors.EVENT_READ, "exit")
            selector.register(children, selectors.EVENT_READ, "child")
            if stop is not None:
                selector.register(stop, selectors.EVENT_READ, "stop")
            if channel is not None:
                selector.register(channel, selectors.EVENT_READ, "input")
            running, output_open, reading, left = True, True, False, True
            writing: int | None = None  # the input end, while input waits for it
            # Until bash has exited and the output is at its end: a server that sends its
            # output to a file closes our pipe long before it ends.
            while running or output_open or left:
                # Read only what the sink can send: a command that writes faster than its
                # output is paced waits on a full pipe, as on a slow terminal, and nothing
                # is dropped (so the last lines it wrote are the transcript's tail).
                room = _READ_BYTES if sink is None or sink.broken else sink.room("stdout")
                if output_open and bool(room) != reading:
                    if reading:
                        selector.unregister(command.output_fd)
                    else:
                        selector.register(command.output_fd, selectors.EVENT_READ, "output")
                    reading = not reading
                for key, _ in selector.select(_wait_s(sink, stop, ctx.grace_s)):
                    if key.data == "stop":
                        selector.unregister(key.fileobj)
                    elif key.data == "exit":
                        selector.unregister(pidfd)
                        command.proc.wait()  # before reap() may take its status
                        running = False
                        left = children.reap(None)
                    elif key.data == "child":
                        left = children.reap(command.proc.pid if running else None)
                    elif key.data == "input":
                        assert channel is not None
                        if not _receive(command, channel):
                            selector.unregister(channel)
                            command.stop()
                    elif key.data == "output":
                        data = command.read(room)
                        if not data:
                            selector.unregister(command.output_fd)
                            output_open = reading = False
                        elif sink is not None:
                            sink.add("stdout", data)
                if writing is not None:  # out of the selector before feed() may close it
                    selector.unregister(writing)
                    writing = None
                if command.feed():
                    writing = command.input_fd
                    selector.register(writing, selectors.EVENT_WRITE, "write")
                if sink is not None and sink.due_in() == 0:
                    sink.flush()
                deadline = stop.deadline(ctx.grace_s) if stop is not None else None
                if deadline is not None and time.monotonic() >= deadline:
                    command.stop()  # the grace is over: the pty or pipe reads EOF next
    finally:
        os.close(pidfd)
        command.stop()
        children.close()
        if sink is not None:
            sink.flush(final=True)
        command.close()
    assert command.proc.returncode is not None
    code = command.proc.returncode
    value: dict[str, Any] = {
        "exit_code": 128 - code if code < 0 else code,
        "signal": -code if code < 0 else None,
    }
    if command.input_dropped:
        value["input_dropped"] = command.input_dropped
    return value


def _wait_s(
    sink: streaming.OutputSink | None, stop: stopping.StopRequest | None, grace_s: float
) -> float | None:
    waits = []
    if sink is not None and (due := sink.due_in()) is not None:
        waits.append(due)
    if stop is not None and (deadline := stop.deadline(grace_s)) is not None:
        waits.append(max(0.0, deadline - time.monotonic()))
    return min(waits) if waits else None


__all__ = ["MAX_PENDING_INPUT", "connection", "run_service"]
