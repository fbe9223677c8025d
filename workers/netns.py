"""A call's network by allow-list: a namespace of its own whose one way out is the pool's proxy.

    confine (workers.sandbox), first, while the worker may still unshare and reach the pool's
    runtime directory:
      unshare(CLONE_NEWNET)        loopback only, down: brought up (SIOCSIFFLAGS)
      listen on 127.0.0.1:0        in that namespace: the port bash's HTTP(S)_PROXY name
      connect proxy.sock           SOCK_SEQPACKET, close-on-exec: never bash's
      send Register + listener     SCM_RIGHTS: the proxy accepts on the listener itself
                                   (sandbx_pool.proxy draws its side)
    ... the mounts then cover the runtime directory; the tool runs ...
    Link.denied(): "done" --> the hosts the proxy refused --> value["network_denied"]

The worker keeps no copy of the listener: the proxy holds it, and a command cannot close or
replace it (its port stays taken, so no program of the call can listen there instead). A
connection to anything else fails in the namespace itself: no route but loopback (ENETUNREACH),
nothing listening on its loopback but the proxy's port, and no resolver reachable (a name is
only ever resolved by the proxy).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

import msgspec

from sandbx_pool.workers import libc

_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
#: How long the worker waits for the proxy to take its registration, or to answer "done".
PROXY_TIMEOUT_S = 5.0
#: What bash is not sent through the proxy: its own loopback (the proxy would refuse it).
NO_PROXY = "localhost,127.0.0.1,::1"


class NetworkUnavailable(Exception):
    """The allow-list cannot be set up: the call must not run (workers.sandbox refuses it)."""


def loopback_up() -> None:
    """Bring this network namespace's loopback up (a new one's is down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(sock, _SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


class Link:
    """The worker's end of its call's registration with the proxy."""

    def __init__(self, control: socket.socket, port: int) -> None:
        self.control = control
        self.port = port

    def env(self) -> dict[str, str]:
        """What bash's programs read to reach the proxy (curl, pip, git, npm, uv...)."""
        url = f"http://127.0.0.1:{self.port}"
        names = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy")
        found = dict.fromkeys(names, url)
        found.update({"all_proxy": url, "NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY})
        return found

    def denied(self) -> list[str]:
        """The hosts the proxy refused this call (closing the call's connections there); []
        if the proxy does not answer in time."""
        try:
            self.control.sendall(b"done")
            answer = msgspec.json.decode(self.control.recv(64 * 1024))
        except (OSError, msgspec.DecodeError):
            return []
        denied = answer.get("denied") if isinstance(answer, dict) else None
        return [str(host) for host in denied] if isinstance(denied, list) else []

    def close(self) -> None:
        self.control.close()


def enter(proxy_socket: str | None, allow: tuple[str, ...], call_id: str) -> Link:
    """Give this process a network namespace reaching only the proxy; NetworkUnavailable if
    anything of it cannot be made (the call must then not run: it would not be confined)."""
    if proxy_socket is None:
        raise NetworkUnavailable("the pool's network proxy is not running")
    error = libc.try_unshare(libc.CLONE_NEWNET)
    if error != 0:
        raise NetworkUnavailable(
            "network = [allow-list] needs a network namespace of the call's own, and unshare"
            f" refused it ({os.strerror(error)}): it takes root with CAP_SYS_ADMIN (not a"
            " container's root), or a pool whose workers get user namespaces; here, network ="
            " true or false runs (sandbx-pool doctor says which this machine enforces)"
        )
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        loopback_up()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(socket.SOMAXCONN)
            port = listener.getsockname()[1]
            control.settimeout(PROXY_TIMEOUT_S)
            control.connect(proxy_socket)
            register = msgspec.json.encode({"call_id": call_id, "allow": list(allow)})
            # No answer is awaited (a round trip to another process on the call's clock): a
            # connection the command makes first waits in the listener's backlog until the
            # proxy serves it, and one the proxy refused to serve meets a closed listener.
            socket.send_fds(control, [register], [listener.fileno()])
    except OSError as exc:
        control.close()
        raise NetworkUnavailable(f"cannot reach the pool's network proxy: {exc}") from exc
    return Link(control, port)


__all__ = ["NO_PROXY", "PROXY_TIMEOUT_S", "Link", "NetworkUnavailable", "enter", "loopback_up"]
