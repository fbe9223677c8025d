"""Services: a command an agent starts on purpose to outlive its call (a dev server, a REPL).

    pool.service(name, command, session=...) --> start_service
        |  checks that raise: a bad or taken name, a network list, a layer, a session's
        |  offline service where workers cannot share a network namespace
        |  the session's cwd and exports (once its calls so far have ended)
        |  a ServiceCall (tool ``_service``, no timeout), driven as any call is: intent,
        |  worker, confinement, limits and cgroup as a bash call's, outcome (call_life)
        |  waits for the worker's "started" mark: the command runs, confined
        v
    Service: output(since) <-- Output chunks, kept head and tail (transcript.py)
             write / resize --> ServiceInput / ServiceResize to its worker (after the Call)
             stop() --> the call's kill (killer ``token``, the reason naming who stopped it)
             wait() <-- the call's outcome: ``exited`` with its exit code, or ``killed``

Nothing of a service outlives its owner. It is a call in flight: the pool's close() kills it
(``shutdown``) as it kills any call, and a coordinator killed with SIGKILL takes it along as it
takes any worker. ``end_session`` stops the session's services. Its journal entries are a
call's: the intent when it starts, the outcome when it ends, and after a crash, an intent
without an outcome, listed by ``pool.interrupted`` and never started again.

Network: with ``network = true`` the service is on the host's network (as bash is), and any
call reaches its ports. With ``network = false`` it gets a namespace of its own with loopback
only, where it may listen; the session's later bash calls, and its later services, join that
namespace (``Sandbox.join_network``: ``/proc/PID/ns/net`` of the service's worker, entered
before the call's mounts) and reach it on localhost, while no other session's call does. A
session with such a service is offline for as long as it runs. Joining needs the pool's
workers to be in the initial user namespace (root): workers in user namespaces of their own
(a pool without root) cannot enter one another's, so there a session's offline service is
refused at its start (ValueError) rather than left where its session's calls cannot reach it.
Services' own start, in the worker, and its input: workers.tools.service. The tools a model
calls (bash's ``background``, service_output...): sandbx_pool.service_tools.
"""

from __future__ import annotations

import asyncio
import enum
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

from sandbx_pool import allow_list
from sandbx_pool.call_state import CallState
from sandbx_pool.errors import ServiceNotRunning
from sandbx_pool.outcome import KilledBy, Outcome
from sandbx_pool.output import OutputChunk
from sandbx_pool.sessions import check_id
from sandbx_pool.transcript import Transcript
from sandbx_pool.workers.protocol import (
    MAX_MESSAGE_BYTES,
    ServiceInput,
    ServiceResize,
    encoder,
)

if TYPE_CHECKING:
    from sandbx_pool.pool import Pool

#: Most bytes of input in one ServiceInput (well under the frame limit, with its envelope).
_INPUT_CHUNK = min(256 * 1024, MAX_MESSAGE_BYTES // 2)

#: Ended services kept for ``pool.services()`` (their output included), the oldest dropped
#: first: an agent that starts services all day must not hold every transcript it made.
MAX_ENDED_KEPT = 64

#: How often wait_port looks at the service's listening sockets.
_PORT_POLL_S = 0.02


class ServiceStatus(enum.StrEnum):
    RUNNING = "running"
    EXITED = "exited"
    KILLED = "killed"


class ServiceCall(CallState):
    """A service's call: the coordinator's own tool, ``_service``."""

    internal = True
    loopback = True


class Service:
    """A running (or ended) service. Made by ``pool.service``; see the module's docstring."""

    def __init__(
        self,
        name: str,
        session: str | None,
        call: ServiceCall,
        send: Callable[[bytes, bytes], None],
    ) -> None:
        self.name = name
        self.session = session
        self.call = call
        self._send = send
        self._transcript = Transcript()
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.driver: asyncio.Task[Outcome] | None = None
        #: Its network namespace is one its session's calls join (``network`` false).
        self.offline = False
        call.on_output = self._on_output

    def __repr__(self) -> str:
        code = "" if self.exit_code is None else f" {self.exit_code}"
        return f"<Service {self.name!r} [{self.status}{code}]>"

    def _on_output(self, chunk: OutputChunk) -> None:
        if chunk.stream == "stderr" and not chunk.data:  # the worker's started mark
            if not self.started.done():
                self.started.set_result(None)
            return
        self._transcript.add(chunk.data.encode("utf-8", "surrogateescape"), chunk.dropped)

    # -- state --------------------------------------------------------------------------------

    @property
    def outcome(self) -> Outcome | None:
        """The call's outcome once the service has ended (its journal's), else None."""
        driver = self.driver
        if driver is None or not driver.done() or driver.cancelled():
            return None
        return driver.result()

    @property
    def status(self) -> ServiceStatus:
        outcome = self.outcome
        if outcome is None:
            return ServiceStatus.RUNNING
        return ServiceStatus.KILLED if outcome.killed_by is not None else ServiceStatus.EXITED

    @property
    def exit_code(self) -> int | None:
        """The command's exit status once it exited by itself; None while it runs, if it was
        killed, or if it never started (``outcome.error`` says why)."""
        outcome = self.outcome
        if outcome is None or outcome.killed_by is not None or not outcome.ok:
            return None
        code = (outcome.value or {}).get("exit_code")
        return code if isinstance(code, int) else None

    @property
    def pid(self) -> int | None:
        """The pid of the service's worker (the command's process group), while it runs."""
        worker = self.call.worker
        return worker.pid if worker is not None and self.status is ServiceStatus.RUNNING else None

    @property
    def omitted(self) -> int:
        """Output bytes written and no longer held (between the kept head and tail)."""
        return self._transcript.omitted

    # -- use ----------------------------------------------------------------------------------

    async def output(self, since: int = 0) -> tuple[bytes, int]:
        """Its output from byte offset ``since`` (0: the start), and the offset to ask from
        next. Only the first and last KEEP_OUTPUT_BYTES / 2 are held: a gap is a marker line
        ``[... N bytes omitted ...]``."""
        if isinstance(since, bool) or not isinstance(since, int) or since < 0:
            raise ValueError(f"since must be an offset, 0 or more, not {since!r}")
        return self._transcript.read(since)

    async def write(self, data: bytes | str, *, eof: bool = False) -> None:
        """Send ``data`` to its stdin (its terminal's input with ``tty``); ``eof`` closes its
        stdin after (a terminal gets ^D). ServiceNotRunning once it has ended."""
        payload = data.encode() if isinstance(data, str) else bytes(data)
        for at in range(0, max(len(payload), 1), _INPUT_CHUNK):
            last = at + _INPUT_CHUNK >= len(payload)
            chunk = payload[at : at + _INPUT_CHUNK]
            self._deliver(ServiceInput(call_id=self.call.call_id, data=chunk, eof=eof and last))

    async def resize(self, cols: int, rows: int) -> None:
        """Its terminal is now ``cols`` x ``rows`` (``stty size`` says so); nothing without
        ``tty``."""
        for value in (cols, rows):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                raise ValueError(f"cols and rows must be from 1 to 65535, not {value!r}")
        self._deliver(ServiceResize(call_id=self.call.call_id, cols=cols, rows=rows))

    def _deliver(self, message: ServiceInput | ServiceResize) -> None:
        worker = self.call.worker
        if self.status is not ServiceStatus.RUNNING or worker is None or not self.started.done():
            raise ServiceNotRunning(f"service {self.name!r} is {self._state_text()}")
        try:
            self._send(worker.identity, encoder.encode(message))
        except Exception as exc:  # zmq.ZMQError: its worker is gone (the outcome follows)
            raise ServiceNotRunning(f"service {self.name!r} has ended: {exc}") from None

    def _state_text(self) -> str:
        if not self.started.done() and self.outcome is None:
            return "starting"
        outcome = self.outcome
        if outcome is not None and outcome.error and self.exit_code is None:
            return f"{self.status} ({outcome.error})"
        return f"{self.status}" + ("" if self.exit_code is None else f" ({self.exit_code})")

    async def wait(self, timeout: float | None = None) -> Outcome:  # noqa: ASYNC109
        """Its outcome once it has ended; TimeoutError if it runs on past ``timeout`` s (it is
        not stopped then)."""
        assert self.driver is not None
        await asyncio.wait_for(asyncio.shield(self.driver), timeout)
        return self.driver.result()

    async def wait_port(self, port: int, timeout: float) -> bool:  # noqa: ASYNC109
        """True once something in its network namespace listens on TCP ``port`` (with
        ``network = true``, the host's: anything on it); False if it ends first, or after
        ``timeout`` s. Read from /proc/PID/net/tcp of its worker: nothing is connected."""
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"port must be from 1 to 65535, not {port!r}")
        deadline = time.monotonic() + timeout
        first: set[asyncio.Future[Any]] = {self.started, self._driver()}
        await asyncio.wait(first, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        while self.status is ServiceStatus.RUNNING:
            pid = self.pid
            if pid is not None and listening(pid, port):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.wait({self._driver()}, timeout=min(_PORT_POLL_S, left))
        return False

    async def stop(self, reason: str = "stopped by its owner") -> Outcome:
        """Kill its process group (SIGTERM, the grace, then SIGKILL), journaled with killer
        ``token`` and ``reason``; its outcome. Stopping an ended service returns how it ended."""
        driver = self._driver()
        if not driver.done():  # an ended call's killer stays as its outcome says
            self.call.request_kill(KilledBy.TOKEN, f"service {self.name!r}: {reason}")
        await asyncio.shield(driver)
        return driver.result()

    def _driver(self) -> asyncio.Task[Outcome]:
        assert self.driver is not None
        return self.driver


def listening(pid: int, port: int) -> bool:
    """Whether a TCP socket listens on ``port`` in the network namespace of process ``pid``."""
    wanted = f":{port:04X}"
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as lines:
                next(lines, None)
                for line in lines:
                    fields = line.split()
                    # local_address is HEXIP:HEXPORT; state 0A is LISTEN.
                    if len(fields) > 3 and fields[3] == "0A" and fields[1].endswith(wanted):
                        return True
        except OSError:
            continue
    return False


class Services:
    """The pool's services by name (running and ended), and which session owns which."""

    def __init__(self) -> None:
        self._by_name: dict[str, Service] = {}
        #: The most services that ran at once: the pool's worker count was raised by as many.
        self._slots = 0

    def __iter__(self) -> Iterator[Service]:
        return iter(list(self._by_name.values()))

    def take_slot(self) -> bool:
        """Whether the service starting now needs the pool's ``workers`` raised by one: so
        that it takes no call's slot, while ``workers`` grows only to the most services that
        ever ran at once, not with every service started."""
        running = sum(1 for s in self._by_name.values() if s.status is ServiceStatus.RUNNING)
        if running <= self._slots:
            return False
        self._slots = running
        return True

    def check_name(self, name: object) -> str:
        try:
            check_id(name)
        except ValueError as exc:
            raise ValueError(str(exc).replace("session id", "service name", 1)) from None
        assert isinstance(name, str)
        held = self._by_name.get(name)
        if held is not None and held.status is ServiceStatus.RUNNING:
            raise ValueError(f"service name {name!r} is taken (a service of that name runs)")
        return name

    def check_network(
        self, network: object, session: str | None, pool_network: object
    ) -> bool | tuple[str, ...] | None:
        """The service's own network (None: the pool's); ValueError for a bad one, or for an
        allow-list in a session (the session's calls would need the service's registration
        with the proxy: not supported yet)."""
        parsed = None if network is None else allow_list.parse_network(network)
        mine = parsed if parsed is not None else pool_network
        if session is not None and not isinstance(mine, bool):
            raise ValueError(
                "a session's service cannot have an allow-list yet (its calls could not use"
                " the service's proxy): give it network = true or false, or no session"
            )
        return parsed

    def network_of(self, session: str | None) -> str | None:
        """The network namespace the session's calls join: its running offline service's."""
        if session is None:
            return None
        for service in self._by_name.values():
            if service.session == session and service.offline and service.started.done():
                pid = service.pid
                if pid is not None:
                    return f"/proc/{pid}/ns/net"
        return None

    def add(self, service: Service) -> None:
        self._by_name.pop(service.name, None)  # an ended one of that name: last in order now
        self._by_name[service.name] = service
        ended = [s.name for s in self._by_name.values() if s.status is not ServiceStatus.RUNNING]
        for name in ended[: max(0, len(ended) - MAX_ENDED_KEPT)]:
            del self._by_name[name]

    def of_session(self, session: str) -> list[Service]:
        return [s for s in self._by_name.values() if s.session == session]

    def stop_session(self, session: str) -> list[Service]:
        """Ask each running service of the session to stop; the ones asked (their drivers
        end the kill and journal it)."""
        asked = []
        for service in self.of_session(session):
            if service.status is ServiceStatus.RUNNING:
                service.call.request_kill(
                    KilledBy.TOKEN, f"service {service.name!r}: its session {session!r} ended"
                )
                asked.append(service)
        return asked


async def start_service(
    pool: Pool,
    services: Services,
    launch: Callable[[CallState], asyncio.Task[Outcome]],
    send: Callable[[bytes, bytes], None],
    name: str,
    command: str,
    *,
    call_id: str,
    session: str | None,
    workspace: str | None,
    cwd: str | None,
    env: dict[str, str] | None,
    tty: bool,
    network: object,
    session_state: Callable[[str], Awaitable[dict[str, Any]]],
    shared_network: bool,
) -> Service:
    """Start ``command`` as the service ``name`` (Pool.service documents the arguments).
    ``shared_network``: whether the pool's workers can join one another's network namespace
    (a root pool's: each has a PID and network namespace of its own, no user namespace)."""
    services.check_name(name)
    if not isinstance(command, str) or not command:
        raise ValueError("command must be a non-empty str")
    if session is not None:
        check_id(session)
    own_network = services.check_network(network, session, pool.config.sandbox.network)
    if workspace is not None and not (isinstance(workspace, str) and os.path.isabs(workspace)):
        raise ValueError(
            f"a service's workspace must be an absolute path or None, not {workspace!r}"
            " (a layer's services are not supported yet)"
        )
    if cwd is not None and not isinstance(cwd, str):
        raise TypeError(f"cwd must be a str or None, not {type(cwd).__name__}")
    if env is not None and not (
        isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict of str to str, or None")
    own_env = dict(env or {})
    if session is not None:
        state = await session_state(session)
        own_env = {**state["env"], **own_env}
        cwd = cwd if cwd is not None else state["cwd"]
    args = {"command": command, "tty": bool(tty)}
    offline = own_network is False or (own_network is None and pool.config.sandbox.network is False)
    if offline and session is not None and not shared_network:
        raise ValueError(
            "a session's service with network = false needs a pool whose workers can share a"
            " network namespace (root with CAP_SYS_ADMIN); this pool's cannot (sandbx-pool"
            " doctor): start it without a session, or with network = true"
        )
    call = ServiceCall(
        call_id,
        "_service",
        args,
        None,
        cwd,
        own_env or None,
        workspace=workspace or pool.workspace,
        session=session,
        network=own_network,
        # A second offline service of the session joins the first's namespace.
        join_network=services.network_of(session) if offline and session is not None else None,
    )
    service = Service(name, session, call, send)
    service.offline = offline
    services.add(service)
    service.driver = launch(call)
    first: set[asyncio.Future[Any]] = {service.started, service.driver}
    try:
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        # As for a call: the caller that gave up on it does not leave it running unseen.
        call.request_kill(KilledBy.TASK, f"service {name!r}: its start was cancelled")
        raise
    return service


__all__ = [
    "Service",
    "ServiceCall",
    "ServiceStatus",
    "Services",
    "listening",
    "start_service",
]
