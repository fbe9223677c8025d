"""What a client of the proxy asked for: one request head, parsed strictly.

    b"CONNECT index.example.org:443 HTTP/1.1\\r\\n..."      --> Request(tunnel, host, port)
    b"GET http://index.example.org/simple/ HTTP/1.1\\r\\n..." --> Request(plain, host, 80, head)
    b"GET /simple/ HTTP/1.1\\r\\nHost: index.example.org\\r\\n..."  (the same, by its Host)
    anything else                                             --> BadRequest(status, why)

A CONNECT target must be ``host:port`` (RFC 9110's authority form, the port required). A plain
request is sent on with its target in origin form, its Host set to the authority it names, the
hop-by-hop headers (Connection, Proxy-*, Keep-Alive, TE, Upgrade...) dropped and
``Connection: close`` added: the server's answer is then the end of the connection, so a second
request on it can never go to a host that was not checked. ``https://`` targets must tunnel.
The host is lower-cased and must be a name (sandbx_pool.allow_list): an address literal is
refused as "not on the list", since the list holds names only.
"""

from __future__ import annotations

from dataclasses import dataclass

from sandbx_pool import allow_list

_HOP_BY_HOP = frozenset(
    {
        "connection",
        "proxy-connection",
        "keep-alive",
        "proxy-authorization",
        "proxy-authenticate",
        "te",
        "trailer",
        "upgrade",
        "host",
    }
)


class BadRequest(Exception):
    """A head the proxy will not serve: ``status`` and why; ``host`` if one was named."""

    def __init__(self, status: int, why: str, host: str | None = None) -> None:
        super().__init__(why)
        self.status = status
        self.host = host


@dataclass(frozen=True)
class Request:
    tunnel: bool  # CONNECT: bytes both ways once connected
    host: str
    port: int
    upstream_head: bytes = b""  # a plain request's head as the server gets it


def _authority(text: str, *, default_port: int | None) -> tuple[str, int]:
    """``host[:port]`` as (lower-cased name, port); a BadRequest when it is not a name."""
    host, sep, port_text = text.rpartition(":") if ":" in text else (text, "", "")
    if host.startswith("[") or (sep and ":" in host):
        raise BadRequest(403, f"{text!r}: an address, and the allow-list holds names", text)
    if not sep:
        if default_port is None:
            raise BadRequest(400, f"CONNECT needs host:port, not {text!r}")
        port = default_port
    # isdigit() alone takes "\xb2" (a latin-1 superscript) for a digit, and int() then raises.
    elif (
        port_text.isascii()
        and port_text.isdigit()
        and len(port_text) <= 5
        and 0 < int(port_text) < 65536
    ):
        port = int(port_text)
    else:
        raise BadRequest(400, f"{text!r}: not host:port")
    if allow_list.is_address(host):
        raise BadRequest(403, f"{host!r}: an address, and the allow-list holds names", host)
    try:
        name = allow_list.check_name(host, "host")
    except ValueError:
        raise BadRequest(400, f"{host!r} is not a host name") from None
    return name, port


def parse_head(head: bytes) -> Request:
    """The request ``head`` (ending with its blank line) names; BadRequest if it is not one."""
    text = head.decode("latin-1")
    lines = text[: -len("\r\n\r\n")].split("\r\n")
    if any("\r" in line or "\n" in line or "\0" in line for line in lines):
        # A bare CR or LF ends a line for some servers and not others: nothing to forward.
        raise BadRequest(400, "a bare CR, LF or NUL in the request head")
    parts = lines[0].split(" ")
    if len(parts) != 3 or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[0].isalpha():
        raise BadRequest(400, "not an HTTP/1.x request line")
    method, target, _ = parts
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name.strip() != name or not name.isprintable():
            raise BadRequest(400, "a malformed header line")
        headers.append((name, value.strip()))
    if method == "CONNECT":
        host, port = _authority(target, default_port=None)
        return Request(True, host, port)
    if target.startswith("http://"):
        rest = target[len("http://") :]
        authority, slash, path = rest.partition("/")
        path = slash + path or "/"
    elif target.startswith("/"):
        found = [value for name, value in headers if name.lower() == "host"]
        if len(found) != 1:
            raise BadRequest(400, "an origin-form request needs exactly one Host header")
        authority, path = found[0], target
    elif target.startswith("https://"):
        raise BadRequest(400, "https:// goes through CONNECT (set HTTPS_PROXY)")
    else:
        raise BadRequest(400, f"a request target the proxy does not serve: {target[:80]!r}")
    if "@" in authority or not authority:
        raise BadRequest(400, f"{authority!r}: not host[:port]")
    host, port = _authority(authority, default_port=allow_list.PLAIN_PORT)
    kept = [f"{name}: {value}" for name, value in headers if name.lower() not in _HOP_BY_HOP]
    authority_out = host if port == allow_list.PLAIN_PORT else f"{host}:{port}"
    upstream = [f"{method} {path} HTTP/1.1", f"Host: {authority_out}", *kept, "Connection: close"]
    return Request(False, host, port, ("\r\n".join(upstream) + "\r\n\r\n").encode("latin-1"))


__all__ = ["BadRequest", "Request", "parse_head"]
