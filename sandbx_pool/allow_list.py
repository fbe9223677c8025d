"""The network allow-list: which host names a call may reach through the pool's proxy.

    [sandbox] network = ["index.example.org", "*.files.example.org", "mirror.test:8080"]
        |  parse_network (config load, Pool.call(network=...), a batch line's "network")
        v
    a tuple of HostPattern strings --> the Call (Sandbox.network_allow) --> the worker
        --> registered with the proxy (sandbx_pool.proxy) --> permits(host, port, tunnel)

A pattern is a host name (letters, digits, hyphens, dots; at most 253 characters, labels of
at most 63), or ``*.`` and a name (any name ending in ``.name``, never ``name`` itself), and
optionally ``:port``. Without a port a name is allowed on the standard ports only: 443 for an
HTTPS tunnel (CONNECT), 80 for plain HTTP; with one, on that port alone, for both. Anything
else (a URL, a path, a space, an IP address, ``*.`` alone, ``*`` anywhere but first) is refused
by name: an IP address is never a name the proxy checks (it is reached by name, resolved by the
proxy), and ``network_hosts`` is where a name is pinned to an address.

``network_hosts`` maps names to the addresses the proxy uses for them, DNS unasked: a local
mirror, a test's server on loopback. Only such a pinned name may reach a loopback, private or
link-local address, or one of the host's own (sandbx_pool.proxy says why): ``reachable``
judges an address the proxy resolved.
"""

from __future__ import annotations

import ipaddress
import re
import socket

#: The ports a pattern without one allows: an HTTPS tunnel's, and plain HTTP's.
TUNNEL_PORT = 443
PLAIN_PORT = 80

_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)\Z")

#: More patterns than this in one list is a mistake, not an allow-list; it also keeps the
#: worker's registration within one unix datagram (workers.netns).
MAX_PATTERNS = 256


def is_address(text: str) -> bool:
    """An IP address (``[v6]`` too), or digits and dots an inet_aton would take for one."""
    if re.fullmatch(r"[0-9.]+", text):
        return True
    try:
        ipaddress.ip_address(text.strip("[]"))
    except ValueError:
        return False
    return True


def check_name(name: object, where: str) -> str:
    """``name`` lower-cased, if it is a host name; else a ValueError naming it."""
    if not isinstance(name, str):
        raise ValueError(f"{where}: a host name must be a string, not {name!r}")
    lowered = name.lower()
    if lowered.endswith(".") and len(lowered) > 1:
        lowered = lowered[:-1]  # the root's dot: "example.org." is "example.org"
    if is_address(lowered):
        raise ValueError(f"{where}: {name!r} is an IP address, where a host name is asked")
    labels = lowered.split(".")
    if not lowered or len(lowered) > 253 or not all(_LABEL.match(label) for label in labels):
        raise ValueError(f"{where}: {name!r} is not a host name")
    return lowered


def check_pattern(pattern: object, where: str) -> str:
    """A pattern in its canonical form (lower case), or a ValueError naming it."""
    if not isinstance(pattern, str):
        raise ValueError(f"{where}: a host pattern must be a string, not {pattern!r}")
    host, sep, port = pattern.rpartition(":") if ":" in pattern else (pattern, "", "")
    # isascii() first: isdigit() takes "²" for a digit, which int() then refuses.
    valid_port = port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536
    if sep and not (valid_port and port == str(int(port))):
        raise ValueError(f"{where}: {pattern!r} is not a host name[:port]")
    wildcard = host.startswith("*.")
    if is_address(host) or is_address(pattern):
        raise ValueError(f"{where}: {pattern!r} is an IP address, where a host name is asked")
    try:
        name = check_name(host[2:] if wildcard else host, where)
    except ValueError:
        raise ValueError(
            f"{where}: {pattern!r} is not a host name, '*.' and a host name, or either with ':port'"
        ) from None
    return ("*." if wildcard else "") + name + (f":{port}" if sep else "")


def parse_network(value: object, where: str = "network") -> bool | tuple[str, ...]:
    """``true``, ``false`` or a list of host patterns (canonical, duplicates dropped)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, list | tuple):
        raise ValueError(f"{where}: true, false or a list of host names, not {value!r}")
    if len(value) > MAX_PATTERNS:
        raise ValueError(f"{where}: {len(value)} host patterns, at most {MAX_PATTERNS}")
    return tuple(dict.fromkeys(check_pattern(item, where) for item in value))


def parse_hosts(value: object, where: str = "network_hosts") -> dict[str, str]:
    """``{name: address}``: names checked as names, addresses as IP addresses."""
    if not isinstance(value, dict):
        raise ValueError(f"{where}: a table of host name = address, not {value!r}")
    hosts = {}
    for name, address in value.items():
        key = check_name(name, where)
        try:
            hosts[key] = str(ipaddress.ip_address(address))
        except (ValueError, TypeError):
            raise ValueError(f"{where}: {name!r} = {address!r} is not an IP address") from None
    return hosts


def _own_address(address: str) -> bool:
    """Whether ``address`` is one of this host's own: binding to it succeeds only then."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError:
            return False
    return True


#: IPv6 prefixes whose addresses carry an IPv4 one in their last 32 bits, which a translator
#: on the way reaches (NAT64's well-known prefix, RFC 6052; IPv4-compatible, deprecated): a
#: cloud's DNS64/NAT64 gateway turns 64:ff9b::a00:5 into 10.0.0.5 inside its network.
_CARRY_IPV4_LAST = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("::/96"))
#: NAT64 for local use (RFC 8215): any prefix length, to any network the operator likes.
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")


def _embedded(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address ``ip`` reaches through a mapping or a translator, if it carries one."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in prefix for prefix in _CARRY_IPV4_LAST):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def reachable(address: str) -> bool:
    """A global address that is not this host's own (sandbx_pool.proxy says why); an
    IPv6 one that carries an IPv4 address (mapped, 6to4, NAT64) is judged by that."""
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _LOCAL_NAT64:
            return False
        ip = _embedded(ip) or ip
    return ip.is_global and not ip.is_multicast and not _own_address(str(ip))


def permits(patterns: tuple[str, ...] | list[str], host: str, port: int, *, tunnel: bool) -> bool:
    """Whether ``host:port`` (a lower-cased name) is on the list, for a tunnel or plain HTTP."""
    for pattern in patterns:
        name, sep, allowed = pattern.rpartition(":") if ":" in pattern else (pattern, "", "")
        wanted = int(allowed) if sep else (TUNNEL_PORT if tunnel else PLAIN_PORT)
        if port != wanted:
            continue
        if name.startswith("*."):
            if host.endswith(name[1:]) and len(host) > len(name) - 1:
                return True
        elif host == name:
            return True
    return False


__all__ = [
    "MAX_PATTERNS",
    "PLAIN_PORT",
    "TUNNEL_PORT",
    "check_name",
    "check_pattern",
    "is_address",
    "parse_hosts",
    "parse_network",
    "permits",
    "reachable",
]
