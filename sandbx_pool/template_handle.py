"""The coordinator's handle on the template process that forks the workers.

The process itself is started by ``sandbx_pool.template_launch`` (possibly before this pool
existed: the one-shot command line launches it first thing); this is the pool's side of it.
Messages travel over a SOCK_SEQPACKET socketpair read on the event loop; the first one we send
says where workers connect and whether they may be made in user namespaces (``Attach``), and
the template answers it with ``TemplateReady``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from sandbx_pool.errors import TemplateLost
from sandbx_pool.logs import logger
from sandbx_pool.remains import Launch, weakly
from sandbx_pool.template_launch import TemplateLaunch, take_prelaunched
from sandbx_pool.workers.protocol import (
    Attach,
    FromTemplate,
    PrebuildFileRules,
    Sandbox,
    Shutdown,
    Spawn,
    TemplateReady,
    encoder,
    from_template_decoder,
)

#: How long the template may take to start (an interpreter plus the preloaded modules).
START_TIMEOUT_S = 30.0


class TemplateHandle:
    def __init__(
        self,
        endpoint: str,
        on_message: Callable[[FromTemplate], None],
        on_lost: Callable[[], None],
        nofile: tuple[int, int] | None = None,
        *,
        warm_up: bool = True,
        user_namespaces: bool = True,
    ) -> None:
        self._endpoint = endpoint
        self._user_namespaces = user_namespaces
        self._on_message = on_message
        self._on_lost = on_lost
        # One the command line started for us, if any; else ours, started now.
        self._process = take_prelaunched(warm_up=warm_up) or TemplateLaunch(
            warm_up=warm_up, nofile=nofile
        )
        self._sock = self._process.socket
        self._sock.setblocking(False)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: asyncio.Future[TemplateReady] | None = None
        self.pid: int | None = None
        self.containment: str | None = None
        #: Each worker is made in a user namespace of its own (a pool without root).
        self.user_namespaces = False
        #: The template's pids cgroup, where each worker's lives; None: [limits] processes is
        #: not enforced, for the reason in ``process_limit_why``.
        self.pids_cgroup: str | None = None
        self.process_limit_why: str | None = None
        #: Where a call's memory limit binds (a memory cgroup per worker); None: RLIMIT_DATA,
        #: for the reason in ``memory_limit_why``.
        self.memory_cgroup: str | None = None
        self.memory_limit_why: str | None = None
        self.closed = False
        self._pending_spawns = 0
        self._spawn_scheduled = False

    @property
    def launch(self) -> Launch:
        """What the template's thread shares (for the pool's finalizer)."""
        return self._process.launch

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ready = self._loop.create_future()
        self._loop.add_reader(self._sock.fileno(), weakly(self._on_readable))
        # Queued until the template reads it, once ready: a stream of messages, so it comes
        # before any PrebuildFileRules or Spawn.
        with contextlib.suppress(OSError):  # a template gone already: its EOF reports it
            attach = Attach(endpoint=self._endpoint, user_namespaces=self._user_namespaces)
            self._sock.send(encoder.encode(attach))
        if not self.launch.started.is_set():
            await asyncio.to_thread(self.launch.started.wait)
        if self.launch.error is not None:
            self._loop.remove_reader(self._sock.fileno())
            raise TemplateLost(f"cannot start the worker template: {self.launch.error}")
        try:
            ready = await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except TimeoutError:
            raise TemplateLost("the worker template did not start in time") from None
        self.pid = ready.pid
        self.containment = ready.containment
        self.user_namespaces = ready.user_namespaces
        self.pids_cgroup, self.process_limit_why = ready.pids_cgroup, ready.process_limit_why
        self.memory_cgroup, self.memory_limit_why = ready.memory_cgroup, ready.memory_limit_why
        logger.debug(
            "worker template {} up, containment {}{}",
            ready.pid,
            ready.containment,
            " (a user namespace per worker)" if ready.user_namespaces else "",
        )
        if ready.pids_cgroup is None and ready.process_limit_why is not None:
            logger.debug("per-call process limit not enforced: {}", ready.process_limit_why)

    def _on_readable(self) -> None:
        while True:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._lost()
                return
            message = from_template_decoder.decode(data)
            if isinstance(message, TemplateReady):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(message)
                continue
            self._on_message(message)

    def _lost(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._sock.fileno())
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(TemplateLost("the worker template exited while starting"))
        if not self.closed:
            self.closed = True
            logger.error("the worker template exited unexpectedly")
            self._on_lost()

    def prebuild_file_rules(self, workspace: str, sandbox: Sandbox) -> None:
        """Have the template build the file tools' Landlock rules once, before its first fork
        (the socket is a stream of messages, so this arrives before any Spawn)."""
        try:
            self._sock.send(encoder.encode(PrebuildFileRules(workspace=workspace, sandbox=sandbox)))
        except OSError:  # a new socket is empty: only a template gone already refuses it
            self._lost()

    def spawn(self, count: int) -> None:
        """Ask for ``count`` more workers. Requests made in one turn of the loop travel as one
        message, and a full socket waits until it drains (it is not a lost template)."""
        if count <= 0 or self.closed:
            return
        self._pending_spawns += count
        if not self._spawn_scheduled:
            assert self._loop is not None
            self._spawn_scheduled = True
            self._loop.call_soon(self._send_spawns)

    def _send_spawns(self) -> None:
        assert self._loop is not None
        self._spawn_scheduled = False
        if self.closed or self._pending_spawns == 0:
            return
        try:
            self._sock.send(encoder.encode(Spawn(count=self._pending_spawns)))
        except BlockingIOError:
            self._spawn_scheduled = True
            self._loop.add_writer(self._sock.fileno(), weakly(self._on_writable))
            return
        except OSError:
            self._lost()
            return
        self._pending_spawns = 0

    def _on_writable(self) -> None:
        assert self._loop is not None
        self._loop.remove_writer(self._sock.fileno())
        self._send_spawns()

    @property
    def socket(self) -> socket.socket:
        """Our end of the control socketpair (for the pool's finalizer to close)."""
        return self._sock

    def kill(self) -> None:
        process = self.launch.process
        if process is not None and process.poll() is None:
            process.kill()

    async def close(self) -> None:
        """Ask the template to kill its workers and exit; bounded, even if it is stuck."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self._sock.send(encoder.encode(Shutdown()))
        if self._loop is not None:
            with contextlib.suppress(ValueError, OSError):
                self._loop.remove_reader(self._sock.fileno())
                self._loop.remove_writer(self._sock.fileno())
        await asyncio.to_thread(self._process.stop)
