"""A Harbor task's ``environment/Dockerfile`` built without a daemon, once per build context.

    environment/ (Dockerfile + context) --docker_build_context_hash--> H
        cached: <image store>/../harbor-builds/H   an OCI layout, tag "latest"
        else:   buildah bud --isolation chroot -t sandbx-harbor-H   (Debian's buildah)
                buildah push sandbx-harbor-H oci:<tmp>  -> renamed into place (whole or absent)
                buildah rmi sandbx-harbor-H             (buildah's own storage keeps nothing)
        --> "oci:<layout>:latest", a reference pool.image reads like any other

Concurrent trials of one task build it once: an asyncio lock per hash in this process, a file
lock across processes. A base image in a registry listed in ``[images] insecure`` is pulled by
buildah over plain HTTP too (``--tls-verify=false``), as the pool pulls it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harbor.utils.container_cache import docker_build_context_hash

from sandbx_pool.config import Config

#: The Debian package that has buildah; named in the error when it is missing.
BUILDAH_PACKAGE = "buildah"

#: The builds' tag in the layouts this module writes.
TAG = "latest"

_locks: dict[str, asyncio.Lock] = {}


class BuildError(RuntimeError):
    """The Dockerfile could not be built: buildah missing, or its build failed (its output)."""


def builds_dir(config: Config) -> str:
    """Where built images are kept: beside the pool's image store, the user's own."""
    return os.path.join(os.path.dirname(config.images.store_dir()), "harbor-builds")


async def build(environment_dir: Path, config: Config, *, timeout_s: float) -> str:
    """The reference of ``environment_dir``'s Dockerfile built (cached by its context's hash);
    BuildError saying why not."""
    dockerfile = environment_dir / "Dockerfile"
    key = docker_build_context_hash(context=environment_dir, dockerfile_path=dockerfile)
    layout = os.path.join(builds_dir(config), key)
    reference = f"oci:{layout}:{TAG}"
    lock = _locks.setdefault(key, asyncio.Lock())
    async with lock:
        if await asyncio.to_thread(os.path.isfile, os.path.join(layout, "index.json")):
            return reference
        buildah = shutil.which("buildah")
        if buildah is None:
            raise BuildError(
                f"building {dockerfile} needs buildah, which is not installed (Debian package"
                f" {BUILDAH_PACKAGE!r}); or give the task a prebuilt docker_image"
            )
        await asyncio.to_thread(os.makedirs, builds_dir(config), exist_ok=True)
        with _file_lock(layout + ".lock"):
            if not await asyncio.to_thread(os.path.isfile, os.path.join(layout, "index.json")):
                await _build(buildah, environment_dir, dockerfile, key, layout, config, timeout_s)
    return reference


async def _build(
    buildah: str,
    context: Path,
    dockerfile: Path,
    key: str,
    layout: str,
    config: Config,
    timeout_s: float,
) -> None:
    name = f"localhost/sandbx-harbor-{key[:32]}:{TAG}"
    tls = ["--tls-verify=false"] if config.images.insecure else []
    scratch = tempfile.mkdtemp(prefix=".building-", dir=os.path.dirname(layout))
    try:
        await _run(
            [buildah, "bud", "--isolation", "chroot", "--quiet", *tls,
             "-f", str(dockerfile), "-t", name, str(context)],
            timeout_s, f"buildah could not build {dockerfile}",
        )  # fmt: skip
        try:
            await _run(
                [buildah, "push", "--quiet", name, f"oci:{scratch}/out:{TAG}"],
                timeout_s, f"buildah could not write the image built from {dockerfile}",
            )  # fmt: skip
        finally:
            with contextlib.suppress(BuildError):
                await _run([buildah, "rmi", name], 60, "buildah rmi")
        os.rename(os.path.join(scratch, "out"), layout)  # whole, or not there
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def _run(argv: list[str], timeout_s: float, what: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except BaseException:  # a timeout, or the trial cancelled: no build left running
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        tail = output.decode(errors="replace").strip()[-2000:]
        raise BuildError(f"{what} (exit {process.returncode}): {tail}")


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held only while one build runs
        yield
    finally:
        os.close(fd)
