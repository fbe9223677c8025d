"""The pool's side of its network proxy (sandbx_pool.proxy): started on first need, stopped
with the pool.

    Pool._run: a call with an allow-list, the proxy not yet started
      --> ProxyHandle.start(): bind <runtime dir>/proxy.sock (SOCK_SEQPACKET, 0600), then
          python -I -m sandbx_pool.proxy FD (interpreter.python_command), the bound socket
          inherited, network_hosts on its stdin, the stdin pipe kept open
    Pool close (or release() of a pool never closed) --> stop(): stdin closed, the process
          waited for (bounded), SIGKILLed if it lingers

The socket is bound here, before the process starts: a worker may connect at once, its
registration waiting in the backlog until the proxy accepts, so no call waits for the proxy's
interpreter to start. The stdin pipe is the proxy's lifeline: it exits at its EOF, which comes
when the pool closes it or when the pool's process is gone however it ended (a SIGKILL
included; PDEATHSIG would follow the thread that started it, not the pool). Started only when
a call needs it: a pool whose calls never ask for an allow-list never starts it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess

from sandbx_pool.interpreter import CHILD_CWD, python_command
from sandbx_pool.logs import logger

#: The proxy's control socket, in the pool's runtime directory (hidden from every call).
SOCKET_NAME = "proxy.sock"
_STOP_WAIT_S = 2.0


class ProxyHandle:
    """One pool's proxy process; ``path`` is where its workers register."""

    def __init__(self, runtime_dir: str, hosts: dict[str, str]) -> None:
        self.path = os.path.join(runtime_dir, SOCKET_NAME)
        self.hosts = hosts
        self.process: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        pid = self.process.pid if self.process is not None else None
        return f"<ProxyHandle {self.path} pid={pid}>"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Bind the control socket and start the process; OSError if either fails."""
        control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # a proxy of this pool that died left it
            control.bind(self.path)
            os.chmod(self.path, 0o600)
            control.listen(128)
            self.process = subprocess.Popen(
                python_command("sandbx_pool.proxy", str(control.fileno())),
                stdin=subprocess.PIPE,
                pass_fds=(control.fileno(),),
                cwd=CHILD_CWD,
                env={"PATH": os.defpath},
                # Out of the terminal's process group: Ctrl-C stops the pool, which stops this.
                start_new_session=True,
            )
        finally:
            control.close()
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(self.hosts).encode() + b"\n")
        self.process.stdin.flush()
        logger.debug("network proxy started: pid {}", self.process.pid)

    def stop(self) -> None:
        """Close its lifeline and wait for it (bounded), then SIGKILL. Idempotent."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):
                process.stdin.close()
        try:
            process.wait(_STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


__all__ = ["SOCKET_NAME", "ProxyHandle"]
