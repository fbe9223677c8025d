"""Image references: what ``pool.image(ref)`` and ``sandbx-pool image pull REF`` accept.

    oci:DIR[:TAG]                   an OCI image layout (a directory)
    oci-archive:FILE[:TAG]          the same, as a tar file
    docker-archive:FILE             what ``docker save`` / ``podman save`` writes
    [docker://]HOST[:PORT]/REPO[:TAG|@sha256:HEX]
                                    a registry's image; short names as docker reads them:
                                    ``ubuntu:24.04`` is docker.io/library/ubuntu:24.04, a
                                    first component is a host only if it has a dot or a port,
                                    or is ``localhost``; no tag and no digest means ``latest``

Each parses into an ``ImageRef`` whose ``canonical`` form is what the store records (paths
made absolute, short names spelled out, so ``ubuntu`` and ``docker.io/library/ubuntu:latest``
are one image), and whose ``source`` is skopeo's name for it. A reference that is none of
these is a ValueError of one line naming it. With both a tag and a digest, the digest wins and
the tag is dropped, as docker does (containers/image refuses the pair).
"""

from __future__ import annotations

import os
import re

import msgspec

DEFAULT_REGISTRY = "docker.io"

#: distribution/reference's grammar: a path component, a tag, a sha256 digest.
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[a-f0-9]{64}")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = re.compile(rf"(?:{_LABEL}(?:\.{_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::(?P<port>[0-9]{{1,5}}))?")

LOCAL_TRANSPORTS = ("oci", "oci-archive", "docker-archive")


class ImageRef(msgspec.Struct, frozen=True, kw_only=True):
    """A parsed reference. ``location`` is a path for the local transports, ``HOST/REPO`` for
    a registry's; ``tag`` or ``digest`` may be empty."""

    transport: str
    location: str
    tag: str = ""
    digest: str = ""

    @property
    def registry(self) -> str:
        """``HOST[:PORT]`` of a registry reference ("" for a local one): what ``[images]
        insecure`` lists."""
        return self.location.split("/", 1)[0] if self.transport == "docker" else ""

    @property
    def canonical(self) -> str:
        """The one spelling the store records."""
        if self.transport == "docker":
            suffix = f"@{self.digest}" if self.digest else f":{self.tag}"
            return f"docker://{self.location}{suffix}"
        return f"{self.transport}:{self.location}" + (f":{self.tag}" if self.tag else "")

    @property
    def source(self) -> str:
        """skopeo's name for the image."""
        return self.canonical

    def __str__(self) -> str:
        return self.canonical


def parse_ref(ref: object) -> ImageRef:
    """``ref`` parsed; ValueError of one line naming it when it is none of the forms above."""
    if not isinstance(ref, str) or not ref or ref != ref.strip() or "\n" in ref:
        raise ValueError(f"not an image reference: {ref!r}")
    for transport in LOCAL_TRANSPORTS:
        if ref.startswith(f"{transport}:"):
            return _local(transport, ref[len(transport) + 1 :], ref)
    if ref.startswith("docker://"):
        return _registry(ref[len("docker://") :], ref)
    if re.match(r"[a-z][a-z0-9+.-]*://", ref) or re.match(r"(dir|containers-storage):", ref):
        raise ValueError(
            f"image reference {ref!r}: unknown transport (oci:, oci-archive:,"
            " docker-archive:, docker:// or a registry name)"
        )
    return _registry(ref, ref)


def _local(transport: str, rest: str, ref: str) -> ImageRef:
    path, _, tag = rest.partition(":")
    if not path:
        raise ValueError(f"image reference {ref!r}: no path after {transport}:")
    if tag and transport == "docker-archive":
        raise ValueError(
            f"image reference {ref!r}: docker-archive:FILE takes no tag (a path with ':'"
            " cannot be named)"
        )
    if tag and not re.fullmatch(r"[A-Za-z0-9_.+@=-][A-Za-z0-9_.+@=:/-]*", tag):
        raise ValueError(f"image reference {ref!r}: {tag!r} is not a valid tag")
    return ImageRef(transport=transport, location=os.path.abspath(path), tag=tag)


def _registry(name: str, ref: str) -> ImageRef:
    def bad(why: str) -> ValueError:
        return ValueError(f"image reference {ref!r}: {why}")

    digest = ""
    if "@" in name:
        name, _, digest = name.partition("@")
        if not _DIGEST.fullmatch(digest):
            raise bad(f"{digest!r} is not a sha256 digest (sha256: and 64 hex digits)")
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise bad(f"{tag!r} is not a valid tag")
    if not name:
        raise bad("no repository")
    first, _, remainder = name.partition("/")
    if remainder and ("." in first or ":" in first or first == "localhost"):
        host = first
        match = _HOST.fullmatch(host)
        if match is None:
            raise bad(f"{host!r} is not a registry host")
        if match["port"] and not 0 < int(match["port"]) < 65536:
            raise bad(f"{host!r}: port out of range")
        path = remainder
    else:
        host, path = DEFAULT_REGISTRY, name
    if host == "index.docker.io":
        host = DEFAULT_REGISTRY
    if host == DEFAULT_REGISTRY and "/" not in path:
        path = f"library/{path}"
    for component in path.split("/"):
        if not _COMPONENT.fullmatch(component):
            raise bad(f"{component!r} is not a repository name (lowercase, digits, . _ -)")
    if len(host) + 1 + len(path) > 255:
        raise bad("name longer than 255 characters")
    if digest:
        tag = ""
    elif not tag:
        tag = "latest"
    return ImageRef(transport="docker", location=f"{host}/{path}", tag=tag, digest=digest)
