"""Paths stay in the workspace and walks stay finite, through the Pool with real workers.

* ``..``, absolute paths outside and symlinks leading outside (last component or middle) are
  ``denied`` by every path tool: the lexical cases before any fork, the symlinks in the worker;
* grep and find never hang on FIFOs, sockets or devices, survive symlink loops and unreadable
  directories, cap their results and say so;
* grep honours .gitignore files when asked.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config

from sandbx_pool import Pool, Status
from sandbx_pool.workers import landlock
from sandbx_pool.workers.errors import Denied
from sandbx_pool.workers.paths import check_opened
from sandbx_pool.workers.protocol import ExecutionContext


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the workspace that no call may touch, with a file and a subdir."""
    directory = tmp_path / "outside"
    (directory / "sub").mkdir(parents=True)
    (directory / "secret.txt").write_text("needle outside\n")
    (directory / "sub" / "deep.txt").write_text("needle deep\n")
    return directory


@pytest.fixture
def links(workspace: Path, outside: Path) -> Path:
    (workspace / "d").symlink_to(outside)  # a symlink in the middle: d/secret.txt
    (workspace / "leak.txt").symlink_to(outside / "secret.txt")  # a symlink at the end
    (workspace / "up").symlink_to("..")  # relative, one level up: up/outside/secret.txt
    return workspace


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"<dir>"
        for p in sorted(directory.rglob("*"))
    }


# Each tool with the extra arguments it needs, and whether it takes a file or a directory.
TOOLS: dict[str, tuple[dict[str, Any], str]] = {
    "read": ({}, "file"),
    "write": ({"content": "pwned\n"}, "file"),
    "edit": ({"old_string": "needle", "new_string": "pwned"}, "file"),
    "ls": ({}, "dir"),
    "grep": ({"pattern": "needle"}, "dir"),
    "find": ({"pattern": "**"}, "dir"),
}

# (path to a file, path to a directory, checked lexically before any fork?)
ESCAPES = {
    "dotdot": ("../outside/secret.txt", "../outside", True),
    "dotdot-inside": ("src/../../outside/secret.txt", "src/../../outside/sub", True),
    "absolute": ("{outside}/secret.txt", "{outside}", True),
    "symlink-at-end": ("leak.txt", "d", False),
    "symlink-in-middle": ("d/secret.txt", "d/sub", False),
    "relative-symlink": ("up/outside/secret.txt", "up/outside", False),
}


@pytest.mark.parametrize("escape", list(ESCAPES))
@pytest.mark.parametrize("tool", list(TOOLS))
async def test_every_path_tool_refuses_every_escape(
    pool: Pool, links: Path, outside: Path, tool: str, escape: str
) -> None:
    extra, kind = TOOLS[tool]
    file_path, dir_path, lexical = ESCAPES[escape]
    path = (file_path if kind == "file" else dir_path).format(outside=outside)
    before = snapshot(outside)
    outcome = await pool.call(tool, {"path": path, **extra})
    assert outcome.status is Status.DENIED, outcome
    assert outcome.error is not None
    assert "outside the workspace" in outcome.error
    assert outcome.value is None
    # Lexical escapes never reach a worker; only a worker may look at symlinks.
    assert outcome.started is not lexical
    assert (outcome.worker_pid is None) is lexical
    assert snapshot(outside) == before


@pytest.mark.parametrize("tool", ["grep", "find"])
async def test_a_cwd_through_a_symlink_is_refused_too(
    pool: Pool, links: Path, outside: Path, tool: str
) -> None:
    extra, _ = TOOLS[tool]
    outcome = await pool.call(tool, {"path": ".", **extra}, cwd="d")
    assert outcome.status is Status.DENIED, outcome
    assert outcome.started


async def test_walks_do_not_follow_symlinks_out(pool: Pool, links: Path) -> None:
    grep = await pool.call("grep", {"pattern": "needle"})
    assert grep.value is not None
    assert grep.value["matches"] == []
    find = await pool.call("find", {"pattern": "**"})
    assert find.value is not None
    assert find.value["paths"] == ["d", "hello.txt", "leak.txt", "src", "src/a.py", "up"]


async def test_absolute_paths_inside_are_allowed(pool: Pool, workspace: Path) -> None:
    outcome = await pool.call("read", {"path": str(workspace / "hello.txt")})
    assert outcome.status is Status.OK, outcome


def test_an_open_file_outside_is_refused(workspace: Path, outside: Path) -> None:
    """check_opened asks the kernel where an open fd is: a path swapped after resolve() is
    caught once the file is open (here the fd is simply opened outside)."""
    ctx = ExecutionContext(call_id="t", workspace=str(workspace), cwd=str(workspace), env={})
    fd = os.open(outside / "secret.txt", os.O_RDONLY)
    try:
        with pytest.raises(Denied, match="outside the workspace"):
            check_opened(ctx, fd, "leak.txt")
    finally:
        os.close(fd)
    fd = os.open(workspace / "hello.txt", os.O_RDONLY)
    try:
        check_opened(ctx, fd, "hello.txt")
    finally:
        os.close(fd)


def run_confined(script: str, workspace: Path, outside: Path) -> Any:
    """Run ``script`` (it confines itself: irreversible, hence its own interpreter) with the
    workspace and the outside directory as arguments; what it prints, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", script, str(workspace), str(outside)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


_CHECK_OPENED_CONFINED = """
import json, os, sys
from sandbx_pool.workers import libc, landlock, sandbox
from sandbx_pool.workers.errors import Denied
from sandbx_pool.workers.paths import check_opened
from sandbx_pool.workers.protocol import ExecutionContext
workspace, outside = sys.argv[1], sys.argv[2]
inside_fd = os.open(os.path.join(workspace, "hello.txt"), os.O_RDONLY)
outside_fd = os.open(os.path.join(outside, "secret.txt"), os.O_RDONLY)  # opened before the rules
libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
ruleset = landlock.Ruleset(handled_fs=landlock.fs_rights(99))
ruleset.allow_path(workspace, landlock.READ_FILE | landlock.READ_DIR)
ruleset.restrict_self()  # no rule for /proc, as a file tool's worker
ctx = ExecutionContext(call_id="t", workspace=workspace, cwd=workspace, env={})
check_opened(ctx, inside_fd, "hello.txt")
try:
    check_opened(ctx, outside_fd, "leak.txt")
    verdict = "missed"
except Denied:
    verdict = "denied"
try:
    open("/proc/self/status").read()
    proc = "readable"
except PermissionError:
    proc = "refused"
print(json.dumps({"outside": verdict, "proc": proc}))
"""


@pytest.mark.skipif(landlock.abi_version() == 0, reason="no Landlock here")
def test_check_opened_needs_no_proc_rule(workspace: Path, outside: Path) -> None:
    # A file tool's worker is granted no /proc: its check of what it opened must still work
    # (readlink of /proc/self/fd is not a read Landlock mediates), and /proc stays closed.
    verdicts = run_confined(_CHECK_OPENED_CONFINED, workspace, outside)
    assert verdicts == {"outside": "denied", "proc": "refused"}


_FILE_RULES_ENTERED = """
import json, os, sys
from sandbx_pool.workers import libc, rules, sandbox
from sandbx_pool.workers.protocol import ExecutionContext, Sandbox
workspace, outside = sys.argv[1], sys.argv[2]
file_rules = rules.build_file_rules(workspace, Sandbox(), timeout_s=10)
assert file_rules is not None, "the helper built no ruleset"
ctx = ExecutionContext(call_id="t", workspace=workspace, cwd=workspace, env={})
fits = [file_rules.fits(ctx), file_rules.fits(ExecutionContext(
    call_id="t", workspace=outside, cwd=outside, env={}))]
libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
file_rules.take().restrict_self()
def reach(path, mode="r"):
    try:
        with open(path, mode) as f:
            f.write("x") if "w" in mode else f.read()
        return "yes"
    except PermissionError:
        return "refused"
print(json.dumps({
    "fits": fits,
    "inside": reach(os.path.join(workspace, "hello.txt")),
    "write_inside": reach(os.path.join(workspace, "new.txt"), "w"),
    "outside": reach(os.path.join(outside, "secret.txt")),
    "python": reach(os.__file__),
}))
"""


@pytest.mark.skipif(landlock.abi_version() == 0, reason="no Landlock here")
def test_prebuilt_file_rules_confine_like_a_workers_own(workspace: Path, outside: Path) -> None:
    # The ruleset the template has a helper build once, entered as a file tool's worker
    # enters it: the workspace read-write, Python readable, anything else refused.
    assert run_confined(_FILE_RULES_ENTERED, workspace, outside) == {
        "fits": [True, False],
        "inside": "yes",
        "write_inside": "yes",
        "outside": "refused",
        "python": "yes",
    }


@pytest.mark.skipif(landlock.abi_version() == 0, reason="no Landlock here")
async def test_a_workspace_made_again_under_a_running_pool_still_works(
    workspace: Path, tmp_path: Path
) -> None:
    # The template's prebuilt rules hold the workspace directory of the pool's start, by
    # inode: once it is removed and made again (a harness resetting it between episodes),
    # workers must notice and build their own rules, not refuse the new directory.
    def make_again() -> None:
        shutil.rmtree(workspace)
        workspace.mkdir()
        (workspace / "fresh.txt").write_text("new episode\n")

    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=marked_config()) as pool:
        assert (await pool.call("read", {"path": "hello.txt"})).status is Status.OK
        make_again()
        read = await pool.call("read", {"path": "fresh.txt"})
        assert read.status is Status.OK, read
        write = await pool.call("write", {"path": "w.txt", "content": "x"})
        assert write.status is Status.OK, write
    assert (workspace / "w.txt").read_text() == "x"


# -- walks that never hang --------------------------------------------------------------------


@pytest.fixture
def special_tree(workspace: Path) -> Iterator[Path]:
    """A tree holding a FIFO, a bound unix socket, devices (as root), and symlink loops."""
    special = workspace / "special"
    special.mkdir()
    os.mkfifo(special / "fifo")
    (special / "loop").symlink_to(".")
    (special / "ping").symlink_to("pong")
    (special / "pong").symlink_to("ping")
    (special / "f.txt").write_text("needle here\n")
    # A socket path must fit in 108 bytes: bind it somewhere short, then move it in.
    short = tempfile.mkdtemp(prefix="sbx")
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind(os.path.join(short, "s"))
        os.rename(os.path.join(short, "s"), special / "sock")
        try:
            # /dev/null and /dev/zero alike: opening zero and reading it would never end.
            os.mknod(special / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
            os.mknod(special / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
        except PermissionError:
            pass  # not root: the FIFO and the socket still make the point
        yield special
    finally:
        server.close()
        os.rmdir(short)


async def test_grep_and_find_skip_special_files(pool: Pool, special_tree: Path) -> None:
    grep = await pool.call("grep", {"pattern": "needle", "path": "special"}, timeout=30)
    assert grep.status is Status.OK, grep
    assert grep.value is not None
    assert grep.value["matches"] == [{"path": "special/f.txt", "line": 1, "text": "needle here"}]
    find = await pool.call("find", {"pattern": "**", "path": "special"}, timeout=30)
    assert find.status is Status.OK, find
    assert find.value is not None
    listed = {p.removeprefix("special/") for p in find.value["paths"]}
    assert {"f.txt", "fifo", "loop", "ping", "pong", "sock"} <= listed
    assert listed <= {"f.txt", "fifo", "loop", "ping", "pong", "sock", "null", "zero"}


@pytest.mark.parametrize(
    ("tool", "path", "error"),
    [
        ("grep", "special/fifo", "is not a regular file or a directory"),
        ("grep", "special/sock", "is not a regular file or a directory"),
        ("grep", "special/ping", "Too many levels of symbolic links"),
        ("find", "special/ping", "Too many levels of symbolic links"),
        ("ls", "special/fifo", "is not a directory"),
    ],
)
async def test_a_special_file_named_directly_is_an_error_not_a_hang(
    pool: Pool, special_tree: Path, tool: str, path: str, error: str
) -> None:
    extra, _ = TOOLS[tool]
    outcome = await pool.call(tool, {"path": path, **extra}, timeout=30)
    assert outcome.status is Status.ERROR, outcome
    assert outcome.error is not None
    assert error in outcome.error


async def test_results_are_capped_and_say_so(workspace: Path, tmp_path: Path) -> None:
    many = workspace / "many"
    many.mkdir()
    for i in range(300):
        (many / f"file-{i:03d}.txt").write_text("needle\n" * 3)
    config = marked_config(calls={"max_output_bytes": 4096})
    async with Pool(workspace, config=config, journal=tmp_path / "j.jsonl") as pool:
        few = await pool.call("grep", {"pattern": "needle", "max_results": 10})
        by_bytes = await pool.call("grep", {"pattern": "needle"})
        found = await pool.call("find", {"pattern": "**/*.txt"})
    assert few.value is not None
    assert (len(few.value["matches"]), few.value["truncated"]) == (10, True)
    assert by_bytes.value is not None
    assert by_bytes.value["truncated"] is True
    assert 10 < len(by_bytes.value["matches"]) < 900
    assert found.value is not None
    assert found.value["truncated"] is True
    assert 10 < len(found.value["paths"]) < 300


# Run as a separate process without CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH: root ignores
# permission bits, and a pool inherits its coordinator's capabilities.
_UNPRIVILEGED_POOL = textwrap.dedent(
    """
    import asyncio, ctypes, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # PR_CAPBSET_DROP of CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if os.geteuid() == 0 and libc.prctl(24, cap, 0, 0, 0) != 0:
            sys.exit(77)  # no CAP_SETPCAP: this test cannot make anything unreadable to root
    if os.environ.get("SBX_DROPPED") is None:  # the bounding set counts from the next exec
        os.environ["SBX_DROPPED"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    from sandbx_pool import Config, Pool
    async def main():
        workspace, journal = sys.argv[1], sys.argv[2]
        marker = {"SANDBX_TEST_SESSION": os.environ["SANDBX_TEST_SESSION"]}
        config = Config().override(env={"set": marker})
        async with Pool(workspace, config=config, journal=journal) as pool:
            calls = [
                ("grep", {"pattern": "needle"}),
                ("find", {"pattern": "**"}),
                ("read", {"path": "locked/inner.txt"}),
                ("read", {"path": "sealed.txt"}),
                ("ls", {"path": "locked"}),
            ]
            out = [(await pool.call(t, a)).to_dict() for t, a in calls]
        print(json.dumps(out))
    asyncio.run(main())
    """
)


def test_unreadable_directories_and_files_are_skipped_and_counted(
    workspace: Path, tmp_path: Path
) -> None:
    (workspace / "locked").mkdir()
    (workspace / "locked" / "inner.txt").write_text("needle inside locked\n")
    (workspace / "sealed.txt").write_text("needle sealed\n")
    (workspace / "open.txt").write_text("needle open\n")
    os.chmod(workspace / "locked", 0)
    os.chmod(workspace / "sealed.txt", 0)
    script = tmp_path / "unprivileged_pool.py"
    script.write_text(_UNPRIVILEGED_POOL)
    try:
        result = subprocess.run(
            [sys.executable, str(script), str(workspace), str(tmp_path / "j.jsonl")],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.chmod(workspace / "locked", 0o755)
        os.chmod(workspace / "sealed.txt", 0o644)
    if result.returncode == 77:
        pytest.skip("running as root without CAP_SETPCAP: permission bits cannot bind a worker")
    assert result.returncode == 0, result.stderr[-2000:]
    grep, find, inner, sealed, ls = json.loads(result.stdout)
    assert grep["status"] == "ok", grep
    assert [m["path"] for m in grep["value"]["matches"]] == ["open.txt"]
    assert grep["value"]["skipped"] == 2  # the locked directory and the sealed file
    assert find["status"] == "ok"
    assert "locked" in find["value"]["paths"]
    assert find["value"]["skipped"] == 1
    for outcome in (inner, sealed, ls):
        assert outcome["status"] == "error"
        assert "permission denied" in outcome["error"]


# -- grep and .gitignore -----------------------------------------------------------------------

GITIGNORED_TREE = {
    ".gitignore": "# build output\n*.log\nbuild/\n/top.txt\n!keep.log\ndocs/**/gen.txt\n\\#hash\n",
    "a.log": "needle",  # *.log
    "keep.log": "needle",  # re-included by !keep.log
    "top.txt": "needle",  # /top.txt is anchored to the root...
    "sub/top.txt": "needle",  # ...so this one stays
    "build/x.txt": "needle",  # build/ is a directory anywhere...
    "sub/build/y.txt": "needle",
    "other/build": "needle",  # ...and only a directory
    "docs/gen.txt": "needle",  # ** spans zero directories
    "docs/a/b/gen.txt": "needle",
    "docs/a/kept.txt": "needle",
    "#hash": "needle",  # an escaped leading #
    "sub/.gitignore": "!b.log\nlocal/\n",
    "sub/b.log": "needle",  # a deeper .gitignore re-includes it
    "sub/c.log": "needle",
    "sub/local/z.txt": "needle",
    "src/main.py": "needle",
}


@pytest.fixture
def gitignored(workspace: Path) -> Path:
    for name, content in GITIGNORED_TREE.items():
        (workspace / name).parent.mkdir(parents=True, exist_ok=True)
        (workspace / name).write_text(content + "\n")
    return workspace


async def grep_paths(pool: Pool, **args: Any) -> list[str]:
    outcome = await pool.call("grep", {"pattern": "needle", **args})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    return [match["path"] for match in outcome.value["matches"]]


async def test_grep_respects_gitignore_by_default(pool: Pool, gitignored: Path) -> None:
    everything = sorted(name for name in GITIGNORED_TREE if "gitignore" not in name)
    assert sorted(await grep_paths(pool, respect_gitignore=False)) == everything
    assert sorted(await grep_paths(pool)) == [
        "docs/a/kept.txt",
        "keep.log",
        "other/build",
        "src/main.py",
        "sub/b.log",
        "sub/top.txt",
    ]


async def test_gitignore_files_above_the_searched_directory_count(
    pool: Pool, gitignored: Path
) -> None:
    assert await grep_paths(pool, path="sub", respect_gitignore=True) == [
        "sub/b.log",
        "sub/top.txt",
    ]
    # A file named explicitly is searched whatever .gitignore says, as with glob.
    assert await grep_paths(pool, path="a.log", respect_gitignore=True) == ["a.log"]
