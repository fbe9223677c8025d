"""Fetching an image into a staging OCI layout with skopeo, and reading what it fetched.

    ImageRef --skopeo copy--> <staging>/ (an OCI image layout: index.json, blobs/sha256/...)
        --read_layout--> Fetched: the manifest's digest, config, layer blobs and diff_ids

Why skopeo (Debian's ``skopeo``, the containers/image library podman and buildah use): it
speaks every transport the store accepts (registries, OCI layouts and archives, docker-archive),
the registry's bearer-token flow, credentials from the files docker and podman write, mirrors
and ``registries.conf``, manifest lists (it picks the host's platform), parallel layer fetches
with retries, and checks each blob's digest as it arrives. A Python registry client would be
one more piece to keep for the registry case alone, and the local formats would still need a
reader. skopeo runs as a child process of the pulling thread with PDEATHSIG set (``setpriv``):
a pool killed mid-pull leaves no skopeo behind.

What the store passes it:

* ``--src-tls-verify=false`` for a registry listed in ``[images] insecure`` (a plain-HTTP
  registry, or one with a certificate the host does not trust), and for nothing else;
* ``--authfile``: ``REGISTRY_AUTH_FILE`` when set, else ``~/.docker/config.json`` when it
  exists, else podman's ``$XDG_RUNTIME_DIR/containers/auth.json`` when it exists, else none;
* the host's signature policy (``/etc/containers/policy.json``) where there is one; where there
  is none (Debian's skopeo ships none) ``--insecure-policy``, which is what "no policy" means
  to docker: digests are still checked, signatures are not asked for.

Blobs the store already holds are hard-linked into the staging layout first: skopeo finds them
there and does not fetch them again. The layout then holds the manifest as skopeo wrote it: a
registry's Docker schema 2 manifest becomes an OCI one (the layers' blobs are the same bytes;
the manifest, and so its digest, is the OCI form), which is the digest ``Image.digest`` records.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
from typing import Any

import msgspec

from sandbx_pool.errors import ImageError
from sandbx_pool.images.refs import ImageRef
from sandbx_pool.images.unpack import check_blob

#: The tag the staging layout holds the image under (one image per staging layout).
STAGED = "sbx"
#: How long one skopeo copy may take before the pull is given up (a stalled registry).
COPY_TIMEOUT_S = 3600.0
#: skopeo's stderr kept for the error message.
STDERR_TAIL = 600

SYSTEM_POLICY = "/etc/containers/policy.json"


class Fetched(msgspec.Struct, frozen=True, kw_only=True):
    """One image in a staging layout: digests are ``sha256:HEX``; ``blobs`` and ``diff_ids``
    are bottom first, one per layer."""

    digest: str
    config: str
    blobs: tuple[str, ...]
    diff_ids: tuple[str, ...]
    env: tuple[str, ...] = ()
    workdir: str = ""
    user: str = ""


def skopeo() -> str | None:
    """The skopeo command, or None where it is not installed."""
    return shutil.which("skopeo")


def authfile() -> str | None:
    """The credentials file skopeo is given (see the module's docstring), if any."""
    configured = os.environ.get("REGISTRY_AUTH_FILE")
    if configured:
        return configured
    for candidate in (
        os.path.expanduser("~/.docker/config.json"),
        os.path.join(os.environ.get("XDG_RUNTIME_DIR") or "/nonexistent", "containers/auth.json"),
    ):
        if os.path.isfile(candidate):
            return candidate
    return None


def copy_command(ref: ImageRef, layout: str, *, insecure: bool) -> list[str]:
    """The skopeo command that copies ``ref`` into the OCI layout ``layout``."""
    command = skopeo()
    if command is None:
        raise ImageError("pulling an image needs skopeo (Debian: skopeo); sandbx-pool doctor")
    argv = [command]
    user_policy = os.path.expanduser("~/.config/containers/policy.json")
    if not (os.path.exists(SYSTEM_POLICY) or os.path.exists(user_policy)):
        argv.append("--insecure-policy")
    # Uncompressed layers stay so: skopeo would gzip them for an OCI layout, a new manifest
    # and minutes of CPU for a docker-archive, whose layers are all plain tars.
    argv += ["copy", "--quiet", "--retry-times", "2", "--dest-oci-accept-uncompressed-layers"]
    if ref.transport == "docker":
        if insecure:
            argv.append("--src-tls-verify=false")
        # Without a file of credentials, one that does not exist (read as none): left to
        # itself, skopeo run without XDG_RUNTIME_DIR (cron, runuser, a batch job) opens
        # /run/containers/<uid>/auth.json, which only root may, and fails the pull.
        credentials = authfile() or os.path.join(layout, "no-credentials.json")
        argv += ["--authfile", credentials]
    argv += [ref.source, f"oci:{layout}:{STAGED}"]
    return argv


def run_copy(ref: ImageRef, layout: str, *, insecure: bool) -> None:
    """Copy ``ref`` into ``layout`` (an existing directory, maybe holding blobs already);
    ImageError with skopeo's last words when it fails."""
    argv = copy_command(ref, layout, insecure=insecure)
    if shutil.which("setpriv"):
        # PDEATHSIG is set by setpriv after the fork: a puller killed before that would leave
        # skopeo running, reparented. So the shell it then execs checks that its parent is
        # still the puller before it execs skopeo (the signal is kept across both execs).
        argv = [
            "setpriv", "--pdeathsig", "KILL", "--",
            "sh", "-c", 'test "$PPID" = "$1" || exit 111; shift; exec "$@"', "sh",
            str(os.getpid()), *argv,
        ]  # fmt: skip
    try:
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=COPY_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ImageError(f"{ref}: skopeo copy took over {COPY_TIMEOUT_S:.0f} s") from None
    if done.returncode != 0:
        raise ImageError(f"{ref}: skopeo copy failed: {_last_words(done.stderr)}")


def _last_words(stderr: bytes) -> str:
    """skopeo's fatal message (it logs retries as warnings before it), on one line."""
    text = stderr.decode(errors="replace")
    match = re.search(r'level=fatal msg="((?:[^"\\]|\\.)*)"', text)
    said = match[1].replace('\\"', '"') if match else " ".join(text.split())
    return said[-STDERR_TAIL:] or "no message"


def _blob_path(layout: str, digest: str) -> str:
    algorithm, _, hexdigest = digest.partition(":")
    if (
        algorithm != "sha256"
        or len(hexdigest) != 64
        or not all(c in "0123456789abcdef" for c in hexdigest)
    ):
        raise ImageError(f"unsupported or malformed digest {digest!r}")
    return os.path.join(layout, "blobs", "sha256", hexdigest)


def _read_json(layout: str, digest: str, what: str) -> Any:
    path = _blob_path(layout, digest)
    check_blob(path, digest, what)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ImageError(f"{what} {digest}: unreadable: {exc}") from exc


def read_layout(layout: str) -> Fetched:
    """The image skopeo staged in ``layout``: its manifest and config checked against their
    digests; the layers' blobs are checked when they are unpacked."""
    try:
        with open(os.path.join(layout, "index.json"), "rb") as f:
            index = json.loads(f.read())
        (descriptor,) = [
            m
            for m in index.get("manifests", [])
            if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == STAGED
        ]
    except (OSError, ValueError) as exc:
        raise ImageError(f"the staged image's index is unreadable: {exc}") from exc
    digest = descriptor["digest"]
    manifest = _read_json(layout, digest, "manifest")
    try:
        config_digest = manifest["config"]["digest"]
        blobs = tuple(layer["digest"] for layer in manifest["layers"])
    except (KeyError, TypeError) as exc:
        raise ImageError(f"manifest {digest}: not an image manifest ({exc})") from None
    config = _read_json(layout, config_digest, "config")
    try:
        diff_ids = tuple(config["rootfs"]["diff_ids"])
        settings = config.get("config") or {}
        env = tuple(settings.get("Env") or ())
        workdir = settings.get("WorkingDir") or ""
        user = settings.get("User") or ""
    except (KeyError, TypeError, AttributeError) as exc:
        raise ImageError(f"config {config_digest}: not an image config ({exc})") from None
    if len(diff_ids) != len(blobs):
        raise ImageError(
            f"config {config_digest}: {len(diff_ids)} diff_ids for {len(blobs)} layers"
        )
    for diff_id in diff_ids:
        _blob_path(layout, diff_id)  # well-formed, as every digest the store names a file by
    if not all(isinstance(e, str) for e in env) or not isinstance(workdir, str):
        raise ImageError(f"config {config_digest}: Env or WorkingDir of the wrong type")
    return Fetched(
        digest=digest,
        config=config_digest,
        blobs=blobs,
        diff_ids=diff_ids,
        env=env,
        workdir=workdir,
        user=str(user),
    )


def blob_file(layout: str, digest: str) -> str:
    """Where a blob of ``layout`` lives (the digest checked for form)."""
    return _blob_path(layout, digest)


def host_platform() -> str:
    """``linux/<arch>`` as the registry names it (what skopeo picks from a manifest list)."""
    machine = platform.machine()
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(machine, machine)
    return f"linux/{arch}"
