"""The pool's network proxy: the one way out of an allow-listed call's network namespace.

    worker, before its call is confined (workers.netns)      this process (``python -I -m
      unshare(CLONE_NEWNET): loopback only, brought up        sandbx_pool.proxy``, one per pool,
      listen on 127.0.0.1:P, in that namespace                started by sandbx_pool.proxy_handle)
      connect <runtime dir>/proxy.sock -- SCM_RIGHTS -->    Register: call id, allow-list, and the
                                                            listening socket itself
                                                            accept on it (each connection made
      bash: HTTP(S)_PROXY=http://127.0.0.1:P                  in the call's namespace, served here)
        connect 127.0.0.1:P ---------------------------->  head: CONNECT host:port, or a plain
                                                            request (absolute URI, or Host:)
                                                            on the list? pinned (network_hosts),
                                                            or resolved here and public?
                                                            no: 403, host noted; yes: connect out
      tool ends: "done" ------------------------------->    the call's listener and connections
      <-- {"denied": [hosts]} --------------------------    closed (EOF instead: the same, silently)
    stdin, the pool's pipe, at EOF (the pool closed or died) --> exit

**Why the listening socket travels.** A socket belongs to the network namespace it was made
in, whoever holds it: the call's listener, made in the call's namespace, accepts connections
from that namespace only, and this process accepts on it from the host's namespace, where its
own connections out are made. No forwarder runs in the call (nothing to kill, nothing a
command could take over), and each connection is the call's by construction: the listener it
came through is registered under the call's id. The control socket lies in the pool's runtime
directory, which every call's mount namespace covers (a call cannot register a listener of its
own with a wider list: the worker refuses an allow-list where no mount namespace hides it). A
registration is served only from a process descending from this proxy's pool, and only for a
listening TCP socket: another pool's call, whose namespace covers its own runtime directory
and not this one, may reach the socket by path but gets nothing from it.

**Why a process, not a thread of the coordinator.** A flood of connections through the proxy
costs CPU in the proxy; in a thread it would take the GIL from the coordinator's event loop
(every call's latency). A process of its own, whose one job is this, costs the pool nothing
until a call uses the network; it ends with its stdin, so it cannot outlive the pool, however
the pool ends.

**What a call can never reach.** Names are resolved here, never by the call (its namespace has
no route and no DNS). A name on the list is refused if any address it resolves to is not global
(loopback, private, link-local such as a cloud's metadata service, CGNAT, multicast,
unspecified) or is one of this host's own (bound here to check: the host's public address would
reach its services): otherwise ``*.example.org`` with a DNS record pointing at 127.0.0.1 (DNS
rebinding) would reach the host's own services. The checked address is the one connected to, so
a second lookup cannot swap it. Only a name pinned in ``network_hosts`` reaches what it is pinned
to, loopback included: the user said so.

**What it holds.** No capability (dropped at start, no_new_privs set, not dumpable): as root it
is still uid 0, but without root's power over the machine.

**Bounded per call.** At most MAX_CONNECTIONS_PER_CALL connections of one call are served at
once (more get 503 at once); a head must arrive within HEADER_TIMEOUT_S and fit in
MAX_HEADER_BYTES; at most RESOLVING_PER_CALL of its lookups run at once, each within
RESOLVE_TIMEOUT_S. A call's flood, its slow clients or its slow names fill its own slots, never
another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import socket
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from sandbx_pool import allow_list
from sandbx_pool.allow_list import reachable
from sandbx_pool.proxy_requests import BadRequest, Request, parse_head
from sandbx_pool.runtime_dir import parent_pid
from sandbx_pool.workers import libc

#: A client's head (request line and headers) must arrive within this long: a slow client holds
#: one of its call's slots for this long at most before it is answered 408.
HEADER_TIMEOUT_S = 10.0
#: A head larger than this is answered 431: no client needs more, and the buffer is bounded.
MAX_HEADER_BYTES = 16 * 1024
#: Connecting out: a host that does not answer in this long is answered 504.
CONNECT_TIMEOUT_S = 15.0
#: Connections of one call served at once. Enough for pip's and a package manager's parallel
#: downloads (pip uses one, uv up to 50 HTTP/2 streams over few), small enough that a flood
#: from one call holds a bounded share of the process's descriptors.
MAX_CONNECTIONS_PER_CALL = 32
#: Distinct refused hosts kept per call (the outcome's ``network_denied``).
MAX_DENIED = 64
#: Each of them cut to this (a host name's 253, and a port): 64 of them, JSON-escaped, fit
#: the worker's read of the answer many times over.
MAX_DENIED_CHARS = 260
#: Name lookups of one call at once, and how long one may take (then 504). Lookups run on
#: threads (getaddrinfo blocks); a call whose names resolve slowly (a wildcard's random
#: subdomains) holds two of them at most, never every other call's.
RESOLVING_PER_CALL = 2
RESOLVE_TIMEOUT_S = 10.0
_RESOLVER_THREADS = 64
_CHUNK = 64 * 1024
_REGISTER_TIMEOUT_S = 5.0
#: A worker is the pool's grandchild (pool, template, worker): far fewer steps than this.
_MAX_ANCESTRY = 16


@dataclass
class CallLink:
    """One registered call: its list, what was refused, and its connections in flight."""

    call_id: str
    allow: tuple[str, ...]
    denied: list[str] = field(default_factory=list)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    resolving: asyncio.Semaphore = field(
        default_factory=lambda: asyncio.Semaphore(RESOLVING_PER_CALL)
    )
    #: The call has ended: a connection accepted just before, whose task had not yet run when
    #: the call's tasks were cancelled, is closed unserved rather than tunnelled past its call.
    ended: bool = False

    def end(self) -> None:
        self.ended = True
        for task in list(self.tasks):
            task.cancel()

    def deny(self, host: str) -> None:
        # Clipped and ASCII: a refused target may be 16 KiB of anything, and the answer to
        # "done" must fit the worker's one datagram read (workers.netns), or the whole list
        # is lost: a call could hide what it was refused behind a few huge targets.
        host = host.encode("ascii", "backslashreplace").decode()[:MAX_DENIED_CHARS]
        if host not in self.denied and len(self.denied) < MAX_DENIED:
            self.denied.append(host)


class Refused(Exception):
    """A name on the list that may still not be reached (it resolves somewhere internal)."""


class Proxy:
    """The proxy's state: the pinned names, and the calls registered."""

    def __init__(self, hosts: dict[str, str]) -> None:
        self.hosts = hosts
        self.calls: dict[int, CallLink] = {}

    async def serve(self, control: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        registrations: set[asyncio.Task[None]] = set()
        while True:
            conn, _ = await loop.sock_accept(control)
            task = asyncio.create_task(self._registration(conn))
            registrations.add(task)
            task.add_done_callback(registrations.discard)

    async def _registration(self, conn: socket.socket) -> None:
        """One call, from its worker's Register to its "done" (or the worker's end)."""
        loop = asyncio.get_running_loop()
        server = link = None
        stack = contextlib.ExitStack()
        try:
            conn.setblocking(False)
            async with asyncio.timeout(_REGISTER_TIMEOUT_S):
                await _readable(loop, conn)
            message, fds, _, _ = socket.recv_fds(conn, 128 * 1024, 1)
            if len(fds) != 1:
                for fd in fds:
                    os.close(fd)
                return
            listener = socket.socket(fileno=fds[0])
            listener.setblocking(False)
            # Closed with this registration however it ends: a connection of the call's then
            # meets a refusal, never a wait.
            stack.callback(listener.close)
            if not (_from_our_pool(conn) and _a_call_listener(listener)):
                return
            register = json.loads(message)
            allow = tuple(allow_list.check_pattern(p, "allow") for p in register["allow"])
            link = CallLink(str(register["call_id"]), allow)
            self.calls[id(link)] = link
            server = await asyncio.start_server(
                partial(self._client, link), sock=listener, limit=MAX_HEADER_BYTES
            )
            await _readable(loop, conn)
            done = conn.recv(16) == b"done"
            server.close()
            server = None
            link.end()
            if done:
                await loop.sock_sendall(conn, json.dumps({"denied": link.denied}).encode())
        except (OSError, ValueError, KeyError, TypeError, TimeoutError):
            pass  # a worker that died or spoke garbage: its call is simply served no more
        finally:
            if server is not None:
                server.close()
            if link is not None:
                link.end()
                self.calls.pop(id(link), None)
            stack.close()
            conn.close()

    async def _client(
        self, link: CallLink, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            if link.ended:
                return
            if len(link.tasks) >= MAX_CONNECTIONS_PER_CALL:
                await _answer(writer, 503, "too many connections from this call at once")
                return
            link.tasks.add(task)
            await self._serve(link, reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            link.tasks.discard(task)
            writer.close()

    async def _serve(
        self, link: CallLink, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            async with asyncio.timeout(HEADER_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            await _answer(writer, 408, "the request head took too long")
            return
        except (asyncio.LimitOverrunError, ValueError):
            await _answer(writer, 431, f"the request head exceeds {MAX_HEADER_BYTES} bytes")
            return
        try:
            request = parse_head(head)
        except BadRequest as exc:
            if exc.host is not None:
                link.deny(exc.host)
            await _answer(writer, exc.status, str(exc))
            return
        if not allow_list.permits(link.allow, request.host, request.port, tunnel=request.tunnel):
            link.deny(request.host)
            await _answer(writer, 403, f"{request.host}:{request.port} is not on the allow-list")
            return
        try:
            address = await self._lookup(link, request.host, request.port)
        except TimeoutError:
            await _answer(writer, 504, f"resolving {request.host} took too long")
            return
        except Refused as exc:
            link.deny(request.host)
            await _answer(writer, 403, str(exc))
            return
        except OSError as exc:
            await _answer(writer, 502, f"cannot resolve {request.host}: {exc}")
            return
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                up_reader, up_writer = await asyncio.open_connection(address, request.port)
        except TimeoutError:
            await _answer(writer, 504, f"{request.host}:{request.port} did not answer")
            return
        except OSError as exc:
            await _answer(writer, 502, f"cannot connect to {request.host}:{request.port}: {exc}")
            return
        try:
            if request.tunnel:
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
            else:
                up_writer.write(request.upstream_head)
            await _relay(reader, writer, up_reader, up_writer, tunnel=request.tunnel)
        finally:
            up_writer.close()

    async def _lookup(self, link: CallLink, host: str, port: int) -> str:
        """``_resolve`` in one of the call's lookup slots, within RESOLVE_TIMEOUT_S. The slot
        is freed when the lookup ends, not when it is given up on: getaddrinfo's thread cannot
        be stopped, and a call whose names time out would otherwise hold ever more of the
        threads every call's lookups share."""
        async with asyncio.timeout(RESOLVE_TIMEOUT_S):
            await link.resolving.acquire()
            lookup = asyncio.ensure_future(self._resolve(host, port))
            lookup.add_done_callback(partial(_free_slot, link.resolving))
            return await asyncio.shield(lookup)

    async def _resolve(self, host: str, port: int) -> str:
        pinned = self.hosts.get(host)
        if pinned is not None:
            return pinned
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [str(info[4][0]) for info in infos]
        for address in addresses:
            if not reachable(address):
                raise Refused(
                    f"{host} resolves to {address}, which is not a public address of another"
                    " host (pin it in [sandbox] network_hosts to allow it)"
                )
        if not addresses:
            raise OSError(f"no address for {host}")
        return addresses[0]


def _from_our_pool(conn: socket.socket) -> bool:
    """Whether the registering process descends from this proxy's pool (its parent). Another
    pool's call that reaches this socket by path (pools of one user whose runtime directories
    differ, so its mount namespace covers its own only) must not register a listener of its own
    with a list of its own: it would be a way out of a ``network = false`` call."""
    pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    pool = os.getppid()
    for _ in range(_MAX_ANCESTRY):
        if pid == pool:
            return True
        parent = parent_pid(pid) if pid > 1 else None
        if parent is None:
            return False
        pid = parent
    return False


def _a_call_listener(listener: socket.socket) -> bool:
    """What workers.netns sends: a listening TCP socket (of the call's namespace). Anything
    else (a unix socket, which would reach the host's namespace from anywhere) is not served."""
    return listener.family == socket.AF_INET and listener.type == socket.SOCK_STREAM


def _free_slot(slot: asyncio.Semaphore, lookup: asyncio.Future[str]) -> None:
    slot.release()
    if not lookup.cancelled():
        lookup.exception()  # retrieved: one given up on is not "never retrieved" noise


async def _readable(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _answer(writer: asyncio.StreamWriter, status: int, why: str) -> None:
    body = f"sandbx-pool proxy: {why}\n".encode()
    reasons = {403: "Forbidden", 408: "Request Timeout", 431: "Request Header Fields Too Large"}
    reason = reasons.get(status, "Bad Gateway" if status >= 500 else "Bad Request")
    if status == 503:
        reason = "Service Unavailable"
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(OSError):
        writer.write(head.encode() + body)
        await writer.drain()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One direction, until its EOF, passed on (a half-closed side keeps the other open)."""
    with contextlib.suppress(OSError):
        while data := await reader.read(_CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    *,
    tunnel: bool,
) -> None:
    """Both directions; plain HTTP ends with the server's answer (it was asked to close)."""
    outward = asyncio.create_task(_pipe(reader, up_writer))
    try:
        await _pipe(up_reader, writer)
        if tunnel:
            await outward
    finally:
        outward.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await outward


async def _run(control: socket.socket, hosts: dict[str, str]) -> None:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(_RESOLVER_THREADS, "resolve"))
    gone = loop.create_future()

    def on_stdin() -> None:
        # The pool's end of the pipe: EOF when it closes it, or when its process is gone.
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data and not gone.done():
            gone.set_result(None)

    loop.add_reader(0, on_stdin)
    control.setblocking(False)
    serving = asyncio.create_task(Proxy(hosts).serve(control))
    await gone
    serving.cancel()


def _shed_privileges() -> None:
    """What this process needs is a socket or two and the resolver's files: no capability at
    all. Dropped before any thread starts (each thread inherits its creator's sets), so that a
    flaw in the parsing of what a hostile client sends gains nothing of root's power."""
    with contextlib.suppress(OSError):
        libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
        libc.capset(0)
    with contextlib.suppress(OSError):
        libc.prctl(libc.PR_SET_DUMPABLE, 0)


def main(argv: list[str]) -> None:
    _shed_privileges()
    control = socket.socket(fileno=int(argv[0]))
    hosts = json.loads(sys.stdin.buffer.readline() or b"{}")
    # Each call holds up to MAX_CONNECTIONS_PER_CALL * 2 descriptors here: take what we may.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    del soft
    asyncio.run(_run(control, allow_list.parse_hosts(hosts)))


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = [
    "CONNECT_TIMEOUT_S",
    "HEADER_TIMEOUT_S",
    "MAX_CONNECTIONS_PER_CALL",
    "MAX_HEADER_BYTES",
    "CallLink",
    "Proxy",
    "Request",
    "reachable",
]
