"""A root pool's file tools hold no capability beyond what its bash holds.

read, write, edit, ls, grep and find of a pool run as root keep uid 0 (the workspace's files
stay their own) but none of root's power: file modes hold against them as against a command,
so a mode-000 file is ``EACCES`` and a directory another uid made read-only takes no new file;
a write that would hand another user's file to root is refused (no CAP_CHOWN). With
``[sandbox] keep_root`` they keep what bash keeps then (a container's default set). The
capabilities are looked at from the host, on a worker blocked in a read of a FIFO.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import fifo_has_reader, wait_until

from sandbx_pool import Outcome, Pool, Status
from sandbx_pool.workers.lockdown import CONTAINER_CAPS

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs a pool run as root")

#: Not root, not the pool's user: owns what the tools must not take over.
OTHER_UID = 1000

_CAP_FIELDS = ("CapEff", "CapPrm", "CapInh", "CapAmb", "CapBnd")


@pytest.fixture
def sealed(workspace: Path) -> Iterator[Path]:
    """A mode-000 file, a mode-000 directory with a file in it, and a directory of another
    uid's that nobody may write (0555); the modes are restored for pytest's cleanup."""
    (workspace / "sealed.txt").write_text("needle sealed\n")
    (workspace / "locked").mkdir()
    (workspace / "locked" / "inner.txt").write_text("needle inside\n")
    (workspace / "theirs").mkdir()
    os.chown(workspace / "theirs", OTHER_UID, OTHER_UID)
    os.chmod(workspace / "sealed.txt", 0)
    os.chmod(workspace / "locked", 0)
    os.chmod(workspace / "theirs", 0o555)
    try:
        yield workspace
    finally:
        for path in ("sealed.txt", "locked", "theirs"):
            os.chmod(workspace / path, 0o755)


async def _pool(workspace: Path, tmp_path: Path, *, keep_root: bool) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 2}, sandbox={"keep_root": keep_root})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        yield pool


@pytest.fixture
async def pool(workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    async for pool in _pool(workspace, tmp_path, keep_root=False):
        yield pool


@pytest.fixture
async def root_pool(workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    async for pool in _pool(workspace, tmp_path, keep_root=True):
        yield pool


def _state(path: Path) -> tuple[str, int, int, int]:
    """A file's text, owner, group and permission bits."""
    info = path.stat()
    return path.read_text(), info.st_uid, info.st_gid, info.st_mode & 0o7777


def _status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def _refused(outcome: Outcome, code: str = "EACCES") -> None:
    assert outcome.status is Status.ERROR, outcome
    assert outcome.error_code == code, outcome


async def test_file_modes_hold_against_a_root_pools_file_tools(pool: Pool, sealed: Path) -> None:
    _refused(await pool.call("read", {"path": "sealed.txt"}))
    _refused(await pool.call("write", {"path": "sealed.txt", "content": "x"}))
    _refused(await pool.call("edit", {"path": "sealed.txt", "old_string": "n", "new_string": "m"}))
    _refused(await pool.call("ls", {"path": "locked"}))
    _refused(await pool.call("read", {"path": "locked/inner.txt"}))
    _refused(await pool.call("write", {"path": "theirs/new.txt", "content": "x"}))
    found = await pool.call("find", {"pattern": "**"})
    grep = await pool.call("grep", {"pattern": "needle"})
    listed = await pool.call("ls", {"path": "."})
    assert found.value is not None, found
    assert grep.value is not None, grep
    assert "locked/inner.txt" not in found.value["paths"], found
    assert found.value["skipped"] == 1, found  # the locked directory
    assert grep.value["matches"] == [], grep
    assert grep.value["skipped"] == 2, grep  # the locked directory and the sealed file
    assert listed.status is Status.OK, listed
    os.chmod(sealed / "sealed.txt", 0o644)
    assert (sealed / "sealed.txt").read_text() == "needle sealed\n"
    assert not (sealed / "theirs" / "new.txt").exists()


async def test_keep_root_keeps_the_file_tools_root_power(root_pool: Pool, sealed: Path) -> None:
    read = await root_pool.call("read", {"path": "sealed.txt"})
    listed = await root_pool.call("ls", {"path": "locked"})
    found = await root_pool.call("find", {"pattern": "**"})
    written = await root_pool.call("write", {"path": "theirs/new.txt", "content": "x"})
    assert read.status is Status.OK, read
    assert read.value is not None
    assert read.value["content"] == "needle sealed\n"
    assert listed.value is not None, listed
    assert [entry["name"] for entry in listed.value["entries"]] == ["inner.txt"]
    assert found.value is not None, found
    assert "locked/inner.txt" in found.value["paths"], found
    assert written.status is Status.OK, written
    new = sealed / "theirs" / "new.txt"
    assert (new.read_text(), new.stat().st_uid) == ("x", 0)  # root's, as before


@pytest.fixture
def their_file(workspace: Path) -> Path:
    """Another uid's file that anybody may write, in a directory root owns."""
    path = workspace / "shared.txt"
    path.write_text("their text\n")
    os.chown(path, OTHER_UID, OTHER_UID)
    os.chmod(path, 0o666)
    return path


async def test_a_write_that_would_take_another_users_file_is_refused(
    pool: Pool, their_file: Path
) -> None:
    # Replacing the file atomically makes a new one, root's; giving it back to its owner takes
    # CAP_CHOWN, which the worker no longer holds. Nothing changes, nothing is left behind.
    write = await pool.call("write", {"path": "shared.txt", "content": "mine\n"})
    edit = await pool.call("edit", {"path": "shared.txt", "old_string": "their", "new_string": "a"})
    for outcome in (write, edit):
        _refused(outcome, "EPERM")
        assert "keep its owner (uid 1000, gid 1000)" in (outcome.error or ""), outcome
    assert _state(their_file) == ("their text\n", OTHER_UID, OTHER_UID, 0o666)
    assert sorted(os.listdir(their_file.parent)) == ["hello.txt", "shared.txt", "src"]


async def test_keep_root_keeps_the_replaced_files_owner(root_pool: Pool, their_file: Path) -> None:
    write = await root_pool.call("write", {"path": "shared.txt", "content": "theirs still\n"})
    assert write.status is Status.OK, write
    assert _state(their_file) == ("theirs still\n", OTHER_UID, OTHER_UID, 0o666)


async def _capabilities_during_a_read(pool: Pool, workspace: Path) -> dict[str, int]:
    """The capability sets of a read's worker, seen from the host while it waits for a FIFO's
    writer (after its confinement, as the tool runs)."""
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    call = asyncio.ensure_future(pool.call("read", {"path": "fifo"}))
    try:
        await wait_until(lambda: fifo_has_reader(fifo), what="the read blocked")
        # Its pid as the pool knows it: /proc hides a worker's descriptors from a test without
        # CAP_SYS_PTRACE (a container's root), though not its status.
        (running,) = pool.running()
        fields = _status_fields(running["pid"])
    finally:
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
    assert int(fields["Uid"].split()[0]) == 0  # still uid 0: the workspace stays its own
    return {name: int(fields[name], 16) for name in _CAP_FIELDS}


async def test_a_file_tool_holds_no_capability(pool: Pool, workspace: Path) -> None:
    held = await _capabilities_during_a_read(pool, workspace)
    assert held == dict.fromkeys(_CAP_FIELDS, 0)


async def test_with_keep_root_a_file_tool_holds_what_bash_would(
    root_pool: Pool, workspace: Path
) -> None:
    held = await _capabilities_during_a_read(root_pool, workspace)
    container = sum(1 << cap for cap in CONTAINER_CAPS)
    assert held == {
        "CapEff": container,
        "CapPrm": container,
        "CapInh": 0,
        "CapAmb": 0,
        "CapBnd": container,
    }
