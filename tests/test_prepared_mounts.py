"""The pool's prepared mount namespace (workers/prepared_mounts.py), entered per call by a copy.

A bash call's mounts shared by every call (root's secrets masked, /sys read-only, a private
/dev/shm) are made once by the template; each call joins a copy. What is asserted:

* nothing a call does reaches the next: a hostile call's try at the mounts, its files in
  TMPDIR and /dev/shm, and the call's own mounts (its TMPDIR's tmpfs, its /proc) are not seen
  by the next call, whose mount table is the same size as the first's;
* what goes stale is never used: a mount made on the host since the pool started is seen by the
  next call, and a secret made since is masked;
* the namespace itself: a copy is entered, a stale one is refused, the template's own namespace
  and working directory are as before.

Where the template is not root with CAP_SYS_ADMIN nothing is prepared and each call builds its
own namespace as before (the same guarantees, asserted by test_host_objects and the others).
"""

from __future__ import annotations

import contextlib
import os
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config

from sandbx_pool import Pool, Status
from sandbx_pool.workers import libc, prepared_mounts

ROOT = os.geteuid() == 0


def as_template(check: Callable[[], object]) -> str:
    """Run ``check`` in a forked child, single-threaded as the template is (setns needs it,
    and this process may have threads): "" once it returned, else why it failed."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        answer = ""
        try:
            check()
        except BaseException:
            answer = traceback.format_exc() or "failed"
        finally:
            os.write(write, answer.encode())
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as answer:
            return answer.read().decode()
    finally:
        os.waitpid(pid, 0)


def _prepares() -> None:
    prepared = prepared_mounts.PreparedMounts.build("/tmp")
    assert prepared is not None
    prepared.close()


def can_prepare() -> bool:
    return ROOT and as_template(_prepares) == ""


needs_prepared = pytest.mark.skipif(
    not can_prepare(), reason="prepared mounts need root with CAP_SYS_ADMIN"
)


@contextlib.asynccontextmanager
async def a_pool(workspace: Path, **sandbox: object) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 2}, sandbox=sandbox)
    async with Pool(workspace, config=config) as pool:
        yield pool


async def bash(pool: Pool, command: str) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, timeout=60)
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    return outcome.value


def in_child(handle: prepared_mounts.Handle) -> tuple[bool, str]:
    """Enter ``handle`` in a forked child: (entered, the child's mount namespace)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            entered = handle.enter()
            os.write(write, f"{int(entered)} {os.readlink('/proc/self/ns/mnt')}".encode())
        finally:
            os._exit(0)
    os.close(write)
    handle.forked()
    try:
        with os.fdopen(read, "rb") as answer:
            entered, namespace = answer.read().decode().split()
    finally:
        os.waitpid(pid, 0)
    return entered == "1", namespace


@needs_prepared
def test_a_worker_enters_a_copy_and_the_template_stays_home() -> None:
    def check() -> None:
        home, cwd = os.readlink("/proc/self/ns/mnt"), os.getcwd()
        refresher = prepared_mounts.Refresher("/tmp")
        assert refresher.prepared is not None
        prepared = os.readlink(f"/proc/self/fd/{refresher.prepared.namespace_fd}")
        for _ in range(2):
            handle = refresher.for_fork()
            assert handle is not None
            entered, namespace = in_child(handle)
            assert entered
            # A copy of its own: neither the prepared namespace nor ours.
            assert namespace not in (home, prepared)
        assert (os.readlink("/proc/self/ns/mnt"), os.getcwd()) == (home, cwd)
        refresher.close()

    assert as_template(check) == ""


@needs_prepared
def test_a_mount_made_on_the_host_since_makes_it_stale(tmp_path: Path) -> None:
    target = tmp_path / "mnt"
    target.mkdir()

    def check() -> None:
        refresher = prepared_mounts.Refresher("/tmp")
        handle = refresher.for_fork()
        assert handle is not None
        before = refresher.prepared
        libc.mount("sbxtest", str(target), "tmpfs", 0, "size=4k")
        try:
            entered, namespace = in_child(handle)
            assert not entered  # the worker builds its own instead
            assert namespace == os.readlink("/proc/self/ns/mnt")
            # The template makes a new one before its next fork, which that worker enters.
            handle = refresher.for_fork()
            assert handle is not None
            assert refresher.prepared is not before
            assert in_child(handle)[0]
        finally:
            libc.umount(str(target), libc.MNT_DETACH)
            refresher.close()

    assert as_template(check) == ""


@needs_prepared
@pytest.mark.parametrize("filesystem", ["workspace", "host"])
async def test_nothing_a_call_does_is_seen_by_the_next(workspace: Path, filesystem: str) -> None:
    """A hostile call tries the mounts and leaves files where it can; the next call, in a copy
    of the same prepared namespace, finds none of it, and as many mounts as the first found.
    With ``filesystem = "host"`` no Landlock rule keeps the command out of /dev/shm."""
    async with a_pool(workspace, filesystem=filesystem) as pool:
        first = await bash(
            pool,
            'echo "$TMPDIR"; wc -l < /proc/self/mountinfo; echo left > "$TMPDIR/left";'
            " echo left > /dev/shm/left && echo wrote; umount -l /etc/shadow; umount -l /sys;"
            " mount -t tmpfs x /mnt; mount --bind / /mnt; true",
        )
        tmpdir, mounts, *wrote = first["stdout"].split()
        # Where Landlock grants it none, /dev/shm is refused; without the rules it is written.
        assert wrote == (["wrote"] if filesystem == "host" else []), first
        for _ in range(3):
            after = await bash(
                pool,
                f'echo "$TMPDIR"; wc -l < /proc/self/mountinfo; ls {tmpdir} /dev/shm;'
                " cat /etc/shadow; : > /sys/kernel/mm/ksm/run",
            )
            lines = after["stdout"].split()
            assert lines[0] != tmpdir, after
            assert lines[1] == mounts, after
            assert "left" not in after["stdout"], after
            assert "root:" not in after["stdout"], after
            assert "Read-only file system" in after["stderr"], after


@needs_prepared
async def test_a_host_mount_made_after_the_start_is_seen(workspace: Path) -> None:
    target = workspace / "mounted-later"
    target.mkdir()
    async with a_pool(workspace) as pool:
        await bash(pool, "true")  # workers forked ahead, with the namespace as it was
        libc.mount("sbxtest", str(target), "tmpfs", 0, "size=64k")
        try:
            (target / "inside").write_text("on the host's new mount\n")
            for _ in range(3):  # those forked before the mount, and after
                value = await bash(pool, "cat mounted-later/inside")
                assert value["stdout"] == "on the host's new mount\n", value
        finally:
            libc.umount(str(target), libc.MNT_DETACH)


@needs_prepared
async def test_a_secret_made_after_the_start_is_masked(workspace: Path) -> None:
    # ssh_host_*_key is among the masks' globs (workers.lockdown.SECRETS).
    secret = f"/etc/ssh/ssh_host_sbxtest{uuid.uuid4().hex[:8]}_key"
    async with a_pool(workspace) as pool:
        await bash(pool, "true")
        try:
            make_secret(secret)
            for _ in range(3):
                value = await bash(pool, f"cat {secret}")
                assert value["exit_code"] != 0, value
                assert "sbxtest secret" not in value["stdout"], value
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(secret)


def make_secret(path: str) -> None:
    if not os.path.isdir(os.path.dirname(path)):
        pytest.skip("no /etc/ssh here")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as secret:
        secret.write("sbxtest secret\n")


@needs_prepared
async def test_a_layers_calls_mount_their_overlay_on_the_prepared_copy(
    workspace: Path, tmp_path: Path
) -> None:
    """A call in a layer enters the prepared copy before its overlay is mounted: root's secrets
    are masked there too, and what the call leaves outside the layer is not seen by the next,
    while what it writes in the layer is."""
    base = tmp_path / "base"
    base.mkdir()
    config = marked_config(pool={"workers": 2}, workspace={"layers": str(tmp_path / "layers")})
    async with Pool(workspace, config=config) as pool:
        layer = await pool.layer("prepared", base=base)
        first = await pool.call(
            "bash",
            {
                "command": 'echo kept > kept; echo left > /dev/shm/left; echo "$TMPDIR";'
                " cat /etc/shadow; umount -l /etc/shadow; true"
            },
            workspace=layer,
            timeout=60,
        )
        assert first.status is Status.OK, first
        assert first.value is not None
        assert "root:" not in first.value["stdout"], first
        tmpdir = first.value["stdout"].split()[0]
        second = await pool.call(
            "bash",
            {"command": f"cat kept; ls /dev/shm {tmpdir}; cat /etc/shadow"},
            workspace=layer,
            timeout=60,
        )
        assert second.status is Status.OK, second
        assert second.value is not None
        assert second.value["stdout"].startswith("kept\n"), second
        assert "left" not in second.value["stdout"], second
        assert "root:" not in second.value["stdout"], second
        await layer.remove()
