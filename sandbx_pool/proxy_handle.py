"""The pool's side of its network proxy (sandbx_pool.proxy): started on first need, stopped
with the pool.

    NetworkProxy.prepare (call_seam.py): a call with an allow-list, the proxy not yet started
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
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandbx_pool import preflight
from sandbx_pool.call_seam import CallFeature
from sandbx_pool.config import SandboxSettings
from sandbx_pool.interpreter import CHILD_CWD, python_command
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome, Status

if TYPE_CHECKING:
    from sandbx_pool.call_state import CallState

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


class NetworkProxy(CallFeature):
    """The proxy as a feature of the pool's calls (call_seam.py): started for the first call
    that needs it, stopped with the pool."""

    def __init__(self, settings: SandboxSettings, on_start: Callable[[ProxyHandle], None]) -> None:
        self._settings = settings
        #: Told of the handle when it is made (the pool's remains stop it if close never runs).
        self._on_start = on_start
        #: Where the pool's runtime directory is, once it started.
        self.runtime_dir: str | None = None
        self.handle: ProxyHandle | None = None

    @property
    def socket(self) -> str | None:
        """Where its workers register; None until a call needed it."""
        return self.handle.path if self.handle is not None else None

    def prepare(self, call: CallState) -> Outcome | None:
        """Start the proxy if ``call`` is the first to need it (an allow-listed bash:
        preflight.with_network says why no other tool)."""
        network = call.network if call.network is not None else self._settings.network
        if isinstance(network, bool) or call.tool not in preflight.PROXIED_TOOLS:
            return None
        try:
            if self.handle is None:
                assert self.runtime_dir is not None
                self.handle = ProxyHandle(self.runtime_dir, self._settings.network_hosts)
                self._on_start(self.handle)
            if not self.handle.running:
                self.handle.start()
        except OSError as exc:
            return call.outcome(Status.ERROR, error=f"cannot start the network proxy: {exc}")
        return None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.stop()


__all__ = ["SOCKET_NAME", "NetworkProxy", "ProxyHandle"]
