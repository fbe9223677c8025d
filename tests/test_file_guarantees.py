"""What write, edit and read promise, checked through the Pool with real workers.

* a kill at any moment leaves the old content or the new, never part, and no temp file for long;
* the mode survives write and edit;
* parallel edits of one file all land; writes in different directories do not wait on each
  other; bash takes no lock;
* read copes with large, binary and invalid UTF-8 files.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import random
import stat
import time
from pathlib import Path

import pytest
from conftest import MakePool, marked_config
from helpers import wait_until

from sandbx_pool import CancelToken, Outcome, Pool, Status
from sandbx_pool.workers.tools.atomic import lock_file_name
from sandbx_pool.workers.tools.files import TEMP_MARKER

_MiB = 1024 * 1024


@pytest.fixture
async def pool8(make_pool: MakePool) -> Pool:
    # kill_wait_s is generous: a worker killed during the fsync of 30 MB finishes it first.
    return await make_pool(pool={"workers": 8}, calls={"kill_wait_s": 10.0})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def temps(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if TEMP_MARKER in name)


def big_text(tag: str, size: int = 30 * _MiB) -> str:
    """``size`` bytes of 64-byte numbered lines carrying ``tag``, with one ``MARK-0`` line."""
    line_count = size // 64
    lines = [f"{i:08d} {tag} ".ljust(63, ".") + "\n" for i in range(line_count)]
    lines[line_count // 2] = "MARK-0\n".rjust(64, "#")
    return "".join(lines)


async def cancelled_after(pool: Pool, tool: str, args: dict[str, str], delay: float) -> Outcome:
    """Run a call and cancel it with a token ``delay`` seconds later (if it is still going)."""
    token = CancelToken()
    task = asyncio.create_task(pool.call(tool, args, cancel=token))
    await asyncio.sleep(delay)  # a random moment to strike, not an ordering
    token.cancel("chaos")
    return await task


# -- atomic write and edit ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["write", "edit"])
async def test_a_kill_at_any_moment_leaves_old_or_new_and_no_leftover(
    pool8: Pool, workspace: Path, tool: str
) -> None:
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    target = workspace / "big" / "data.txt"
    target.parent.mkdir()
    versions = [big_text("old"), big_text("new")]
    digests = [hashlib.sha256(v.encode()).hexdigest() for v in versions]
    target.write_text(versions[0])
    os.chmod(target, 0o600)
    current = 0

    def next_call(mark: int) -> tuple[dict[str, str], str]:
        """The call that changes the file from what it holds, and the digest it would leave."""
        if tool == "write":
            return {"path": "big/data.txt", "content": versions[1 - current]}, digests[1 - current]
        text = target.read_text()
        args = {
            "path": "big/data.txt",
            "old_string": f"MARK-{mark}",
            "new_string": f"MARK-{mark + 1}",
        }
        return args, hashlib.sha256(
            text.replace(args["old_string"], args["new_string"]).encode()
        ).hexdigest()

    # The typical duration, measured once: the kills below land anywhere inside it.
    mark = 0
    args, expected = next_call(mark)
    began = time.monotonic()
    outcome = await pool8.call(tool, args)
    typical = time.monotonic() - began
    assert outcome.status is Status.OK, outcome
    assert sha256(target) == expected
    current, mark = 1, 1

    struck = leftovers_seen = 0
    for _ in range(25):
        before = sha256(target)
        args, expected = next_call(mark)
        outcome = await cancelled_after(pool8, tool, args, rng.uniform(0, typical))
        after = sha256(target)
        assert after in (before, expected), f"torn file (seed {seed}): {outcome}"
        if after == expected:
            current, mark = 1 - current, mark + 1
        struck += outcome.status is Status.CANCELLED and outcome.started
        # At most the dead writer's own temp: each writer sweeps before it makes one.
        left = temps(target.parent)
        assert len(left) <= 1, left
        leftovers_seen += len(left)
        probe = await pool8.call("write", {"path": "big/probe.txt", "content": "x"})
        assert probe.status is Status.OK, probe
        assert temps(target.parent) == [], f"seed {seed}"
    assert struck > 0, f"no kill landed while a worker ran the call (seed {seed})"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    print(f"{tool}: typical {typical:.3f} s, {struck}/25 killed mid-call, {leftovers_seen} temps")


async def test_the_next_write_or_edit_removes_a_dead_writers_temp(
    pool: Pool, workspace: Path
) -> None:
    (workspace / "d").mkdir()
    (workspace / "d" / "f.txt").write_text("one\n")
    for tool, args in [
        ("write", {"path": "d/f.txt", "content": "two\n"}),
        ("edit", {"path": "d/f.txt", "old_string": "two", "new_string": "three"}),
    ]:
        # Named as a killed write would have left it.
        (workspace / "d" / f".f.txt{TEMP_MARKER}0badc0de").write_text("half a fi")
        (workspace / f".elsewhere{TEMP_MARKER}0badc0de").write_text("half")
        outcome = await pool.call(tool, args)
        assert outcome.status is Status.OK, outcome
        assert temps(workspace / "d") == []
        # Only the call's own directory is swept; recovery (remove_leftover_temps) does others.
        assert temps(workspace) == [f".elsewhere{TEMP_MARKER}0badc0de"]
    assert (workspace / "d" / "f.txt").read_text() == "three\n"


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o755])
async def test_write_and_edit_keep_the_mode(pool: Pool, workspace: Path, mode: int) -> None:
    target = workspace / "script.sh"
    target.write_text("echo one\n")
    os.chmod(target, mode)
    outcome = await pool.call("write", {"path": "script.sh", "content": "echo two\n"})
    assert outcome.status is Status.OK, outcome
    assert stat.S_IMODE(target.stat().st_mode) == mode
    outcome = await pool.call(
        "edit", {"path": "script.sh", "old_string": "two", "new_string": "three"}
    )
    assert outcome.status is Status.OK, outcome
    assert stat.S_IMODE(target.stat().st_mode) == mode
    assert target.read_text() == "echo three\n"


# -- ordering of parallel calls ----------------------------------------------------------------


async def test_thirty_parallel_edits_of_one_file_all_land(pool8: Pool, workspace: Path) -> None:
    target = workspace / "shared.txt"
    target.write_text("".join(f"item-{i:02d} = old\n" for i in range(30)))
    outcomes = await asyncio.gather(
        *(
            pool8.call(
                "edit",
                {
                    "path": "shared.txt",
                    "old_string": f"item-{i:02d} = old",
                    "new_string": f"item-{i:02d} = new-{i}",
                },
            )
            for i in range(30)
        )
    )
    assert [o.status for o in outcomes] == [Status.OK] * 30
    assert len({o.worker_pid for o in outcomes}) == 30
    assert target.read_text() == "".join(f"item-{i:02d} = new-{i}\n" for i in range(30))


def flock_waiters(lock: Path) -> int:
    """Processes blocked on a flock of the file ``lock`` (``->`` lines of /proc/locks)."""
    suffix = f":{lock.stat().st_ino} 0 EOF"
    with open("/proc/locks") as f:
        return sum(1 for line in f if " -> " in line and line.rstrip().endswith(suffix))


class DirectoryLock:
    """The write lock write and edit take for a directory (a file in the pool's lock
    directory, which no call can reach), held here by the test itself."""

    def __init__(self, pool: Pool, directory: Path) -> None:
        assert pool.lock_dir is not None
        self.path = Path(pool.lock_dir, lock_file_name(directory.stat()))
        self.fd = os.open(self.path, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # the lock goes with the last fd of its open file
            self.fd = -1


async def test_same_directory_waits_other_directories_and_bash_do_not(
    pool: Pool, workspace: Path
) -> None:
    locked = workspace / "a"
    locked.mkdir()
    (locked / "mine.txt").write_text("old\n")
    lock = DirectoryLock(pool, locked)
    try:
        # We play a writer in the middle of its write: its temp must survive the waiters.
        ours = locked / f".mine.txt{TEMP_MARKER}12345678"
        ours.write_text("in progress\n")
        first = asyncio.create_task(pool.call("write", {"path": "a/x.txt", "content": "x"}))
        second = asyncio.create_task(
            pool.call("edit", {"path": "a/mine.txt", "old_string": "in", "new_string": "done"})
        )
        await wait_until(lambda: flock_waiters(lock.path) == 2)

        elsewhere = await pool.call("write", {"path": "b/y.txt", "content": "y"})
        assert elsewhere.status is Status.OK, elsewhere
        shell = await pool.call("bash", {"command": "echo z > a/z.txt && cat a/z.txt"})
        assert shell.value is not None
        assert shell.value["stdout"] == "z\n"  # bash takes no lock: no order with file tools
        assert not first.done()
        assert not second.done()
        assert temps(locked) == [ours.name]
        # Finish our write as write does (rename over the target), then let the others in.
        os.rename(ours, locked / "mine.txt")
    finally:
        lock.release()
    assert (await first).status is Status.OK
    edited = await second
    assert edited.status is Status.OK, edited  # it read what our write left, under the lock
    assert (locked / "mine.txt").read_text() == "done progress\n"
    assert (locked / "x.txt").read_text() == "x"
    assert temps(locked) == []


# -- robust reading ----------------------------------------------------------------------------


async def test_read_a_window_of_a_large_file(pool: Pool, workspace: Path) -> None:
    (workspace / "large.txt").write_text("".join(f"line {i}\n" for i in range(200_000)))
    outcome = await pool.call("read", {"path": "large.txt", "offset": 150_000, "limit": 3})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["content"] == "line 150000\nline 150001\nline 150002\n"
    assert outcome.value["lines"] == 3
    assert outcome.value["total_lines"] == 200_000
    assert outcome.value["truncated"] is False
    print(f"read of lines 150000-150002 of 200k: {outcome.duration_s * 1000:.1f} ms")


async def test_read_stops_at_the_byte_cap(workspace: Path, tmp_path: Path) -> None:
    (workspace / "large.txt").write_text("".join(f"line {i}\n" for i in range(200_000)))
    config = marked_config(calls={"max_output_bytes": 64 * 1024})
    async with Pool(workspace, config=config, journal=tmp_path / "j.jsonl") as pool:
        outcome = await pool.call("read", {"path": "large.txt", "offset": 10})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    content = outcome.value["content"]
    assert outcome.value["truncated"] is True
    assert 60 * 1024 < len(content.encode()) <= 64 * 1024
    assert content.startswith("line 10\n")
    assert content.endswith("\n")  # cut at a line boundary
    assert outcome.value["lines"] == content.count("\n")


async def test_read_refuses_a_binary_file(pool: Pool, workspace: Path) -> None:
    (workspace / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(300))
    outcome = await pool.call("read", {"path": "image.png"})
    assert outcome.status is Status.ERROR
    assert outcome.error == "image.png is a binary file (316 bytes)"


async def test_read_replaces_invalid_utf8_and_says_so(pool: Pool, workspace: Path) -> None:
    (workspace / "latin1.txt").write_bytes("caf\xe9\nna\xefve\n".encode("latin-1"))
    outcome = await pool.call("read", {"path": "latin1.txt"})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["content"] == "caf\ufffd\nna\ufffdve\n"
    assert outcome.value["invalid_utf8"] is True
