"""The seven tools called directly, in-process (no pool, no worker): values, errors, confinement.

Tests that need process containment (bash leaving ``sleep 1000 &`` behind) or a resource limit
run in a forked child, as a worker would: the child makes itself a child subreaper, so what bash
leaves behind is reparented to it and ``kill_descendants()`` can find it.
"""

from __future__ import annotations

import errno
import os
import pickle
import resource
import select
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbx_pool.workers.containment import set_child_subreaper
from sandbx_pool.workers.errors import Denied, LimitExceeded, OutputLimitExceeded, ToolError
from sandbx_pool.workers.globs import compile_glob
from sandbx_pool.workers.protocol import ExecutionContext, encoder
from sandbx_pool.workers.schemas import SERVICE_TOOL_ARGS, TOOL_ARGS, parse_args
from sandbx_pool.workers.tools import TOOLS
from sandbx_pool.workers.tools.files import TEMP_MARKER, open_regular, remove_leftover_temps

# -- helpers -----------------------------------------------------------------------------------


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    """An empty workspace, with a sibling directory ``outside`` for escape attempts."""
    (tmp_path / "ws").mkdir()
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.txt").write_text("needle outside\n")
    return (tmp_path / "ws").resolve()


def make_ctx(
    ws: Path, *, cwd: Path | None = None, max_output_bytes: int = 1024 * 1024
) -> ExecutionContext:
    return ExecutionContext(
        call_id="test",
        workspace=str(ws),
        cwd=str(cwd or ws),
        env={"PATH": os.environ["PATH"]},
        max_output_bytes=max_output_bytes,
    )


@pytest.fixture
def ctx(ws: Path) -> ExecutionContext:
    return make_ctx(ws)


def call(ctx: ExecutionContext, tool: str, **args: Any) -> dict[str, Any]:
    """Validate ``args`` as the runtime does, then run the tool."""
    return TOOLS[tool](parse_args(tool, args), ctx)


def in_child(fn: Callable[[], Any], *, subreaper: bool = False, timeout: float = 60.0) -> Any:
    """Run ``fn`` in a forked child; return its value or re-raise its ToolError's kind.

    Waits on the result pipe with a deadline, so a tool that hangs fails the test instead of
    hanging the run.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            if subreaper:
                set_child_subreaper()
            try:
                result: tuple[Any, ...] = ("ok", fn())
            except ToolError as exc:
                result = ("raised", type(exc).__name__, str(exc), getattr(exc, "limit", None))
            with os.fdopen(write_end, "wb") as pipe:
                pickle.dump(result, pipe)
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    data = bytearray()
    deadline = time.monotonic() + timeout
    with os.fdopen(read_end, "rb", buffering=0) as pipe:
        while True:
            ready, _, _ = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the child did not finish within {timeout} s")
            chunk = pipe.read(65536)
            if not chunk:
                break
            data += chunk
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result = pickle.loads(data)
    if result[0] == "raised":
        _, kind, message, limit = result
        if kind == "LimitExceeded":
            raise LimitExceeded(limit, message)
        kinds = {"Denied": Denied, "OutputLimitExceeded": OutputLimitExceeded}
        raise kinds.get(kind, ToolError)(message)
    return result[1]


def test_tools_cover_every_schema() -> None:
    # The service tools are answered by the coordinator (sandbx_pool.service_tools).
    assert set(TOOLS) == set(TOOL_ARGS) - set(SERVICE_TOOL_ARGS)


# -- confinement -------------------------------------------------------------------------------

ESCAPES = ["../outside/secret.txt", "{outside}/secret.txt", "link_file", "link_dir/secret.txt"]


@pytest.fixture
def escapes(ws: Path) -> list[str]:
    outside = ws.parent / "outside"
    (ws / "link_file").symlink_to(outside / "secret.txt")  # symlink as the last component
    (ws / "link_dir").symlink_to(outside)  # symlink in the middle of the path
    return [escape.format(outside=outside) for escape in ESCAPES]


@pytest.mark.parametrize("index", range(len(ESCAPES)))
@pytest.mark.parametrize(
    ("tool", "extra"),
    [
        ("read", {}),
        ("write", {"content": "x"}),
        ("edit", {"old_string": "needle", "new_string": "pin"}),
        ("ls", {}),
        ("grep", {"pattern": "needle"}),
        ("find", {"pattern": "**"}),
    ],
)
def test_paths_outside_the_workspace_are_denied(
    ctx: ExecutionContext,
    ws: Path,
    escapes: list[str],
    index: int,
    tool: str,
    extra: dict[str, Any],
) -> None:
    path = escapes[index]
    with pytest.raises(Denied, match="outside the workspace"):
        call(ctx, tool, path=path, **extra)
    assert (ws.parent / "outside" / "secret.txt").read_text() == "needle outside\n"


def test_symlinks_inside_the_workspace_are_followed(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "real.txt").write_text("inside\n")
    (ws / "alias.txt").symlink_to("real.txt")
    assert call(ctx, "read", path="alias.txt")["content"] == "inside\n"
    call(ctx, "write", path="alias.txt", content="rewritten\n")
    assert (ws / "alias.txt").is_symlink()
    assert (ws / "real.txt").read_text() == "rewritten\n"


def test_bash_cwd_through_an_outside_symlink_is_denied(ws: Path, escapes: list[str]) -> None:
    with pytest.raises(Denied):
        call(make_ctx(ws, cwd=ws / "link_dir"), "bash", command="pwd")


# -- read --------------------------------------------------------------------------------------


def test_read_whole_file(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.txt").write_text("one\ntwo\nthree")
    assert call(ctx, "read", path="f.txt") == {
        "content": "one\ntwo\nthree",
        "lines": 3,
        "total_lines": 3,
        "truncated": False,
        "invalid_utf8": False,
    }


def test_read_window(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.txt").write_text("a\nb\nc\nd\n")
    value = call(ctx, "read", path="f.txt", offset=1, limit=2)
    assert (value["content"], value["lines"], value["total_lines"]) == ("b\nc\n", 2, 4)
    past_end = call(ctx, "read", path="f.txt", offset=10)
    assert (past_end["content"], past_end["lines"], past_end["total_lines"]) == ("", 0, 4)


def test_read_counts_lines_of_a_large_file(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "big.txt").write_text("".join(f"line {i}\n" for i in range(100_000)))
    value = call(ctx, "read", path="big.txt", offset=99_998)
    assert value["content"] == "line 99998\nline 99999\n"
    assert value["total_lines"] == 100_000


def test_read_truncates_at_a_line_boundary(ws: Path) -> None:
    (ws / "f.txt").write_text("aaaa\n" * 5)
    value = call(make_ctx(ws, max_output_bytes=12), "read", path="f.txt")
    assert value["content"] == "aaaa\naaaa\n"
    assert (value["lines"], value["total_lines"], value["truncated"]) == (2, 5, True)


def test_read_cuts_a_single_oversized_line_on_a_character_boundary(ws: Path) -> None:
    (ws / "f.txt").write_text("é" * 10 + "\nnext\n")
    value = call(make_ctx(ws, max_output_bytes=5), "read", path="f.txt")
    assert value["content"] == "éé"
    assert (value["lines"], value["total_lines"], value["truncated"]) == (1, 2, True)
    assert value["invalid_utf8"] is False


def test_read_invalid_utf8_is_replaced(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.txt").write_bytes(b"ok \xff\xfe\n")
    value = call(ctx, "read", path="f.txt")
    assert value["content"] == "ok \ufffd\ufffd\n"
    assert value["invalid_utf8"] is True


def test_read_errors(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "bin").write_bytes(b"ELF\x00" + b"x" * 96)
    (ws / "dir").mkdir()
    with pytest.raises(ToolError, match=r"bin is a binary file \(100 bytes\)"):
        call(ctx, "read", path="bin")
    with pytest.raises(ToolError, match="dir is a directory"):
        call(ctx, "read", path="dir")
    with pytest.raises(ToolError, match=r"missing\.txt not found"):
        call(ctx, "read", path="missing.txt")


# -- write -------------------------------------------------------------------------------------


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_write_creates_with_parents(ctx: ExecutionContext, ws: Path) -> None:
    assert call(ctx, "write", path="a/b/c.txt", content="héllo") == {"bytes": 6, "created": True}
    assert (ws / "a/b/c.txt").read_text() == "héllo"
    assert stat.S_IMODE((ws / "a/b/c.txt").stat().st_mode) == 0o666 & ~_umask()
    assert sorted(os.listdir(ws / "a/b")) == ["c.txt"]


def test_write_replaces_and_keeps_the_mode(ctx: ExecutionContext, ws: Path) -> None:
    target = ws / "script.sh"
    target.write_text("old")
    target.chmod(0o750)
    assert call(ctx, "write", path="script.sh", content="new") == {"bytes": 3, "created": False}
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert os.listdir(ws) == ["script.sh"]


def test_write_errors(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "dir").mkdir()
    (ws / "file").write_text("x")
    with pytest.raises(ToolError, match="dir is a directory"):
        call(ctx, "write", path="dir", content="x")
    with pytest.raises(ToolError, match="names a directory"):
        call(ctx, "write", path="new/", content="x")
    with pytest.raises(ToolError, match="parent directory of file/child"):
        call(ctx, "write", path="file/child", content="x")


def test_a_failed_write_leaves_the_old_content_and_no_temp(
    ctx: ExecutionContext, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ws / "f.txt").write_text("old")

    def failing_fsync(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(ToolError, match=r"f\.txt: Input/output error"):
        call(ctx, "write", path="f.txt", content="new")
    monkeypatch.undo()
    assert (ws / "f.txt").read_text() == "old"
    assert os.listdir(ws) == ["f.txt"]


def test_write_over_the_file_size_limit(ws: Path) -> None:
    def write_big() -> Any:
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, hard))
        return call(make_ctx(ws), "write", path="big.txt", content="x" * 5000)

    with pytest.raises(LimitExceeded, match="file size limit") as raised:
        in_child(write_big)
    assert raised.value.limit == "file_size"
    assert os.listdir(ws) == []


def test_remove_leftover_temps(ws: Path) -> None:
    leftovers = [f".a.txt{TEMP_MARKER}1a2b3c4d", f".b{TEMP_MARKER}"]
    kept = ["a.txt", ".hidden", f"x{TEMP_MARKER}1"]
    for name in leftovers + kept:
        (ws / name).write_text("x")
    (ws / f".d{TEMP_MARKER}1").mkdir()
    assert remove_leftover_temps(str(ws)) == sorted(leftovers)
    assert sorted(os.listdir(ws)) == sorted([*kept, f".d{TEMP_MARKER}1"])
    assert remove_leftover_temps(str(ws / "missing")) == []


# -- edit --------------------------------------------------------------------------------------


def test_edit_replaces_a_unique_string(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.py").write_text("x = 1\ny = 2\n")
    (ws / "f.py").chmod(0o600)
    assert call(ctx, "edit", path="f.py", old_string="y = 2", new_string="y = 3") == {
        "replacements": 1
    }
    assert (ws / "f.py").read_text() == "x = 1\ny = 3\n"
    assert stat.S_IMODE((ws / "f.py").stat().st_mode) == 0o600
    assert os.listdir(ws) == ["f.py"]


def test_edit_uniqueness(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.txt").write_text("a a a")
    with pytest.raises(ToolError, match=r"old_string is not unique in f.txt \(3 occurrences\)"):
        call(ctx, "edit", path="f.txt", old_string="a", new_string="b")
    assert (ws / "f.txt").read_text() == "a a a"
    value = call(ctx, "edit", path="f.txt", old_string="a", new_string="b", replace_all=True)
    assert value == {"replacements": 3}
    assert (ws / "f.txt").read_text() == "b b b"


def test_edit_errors(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.txt").write_text("text")
    (ws / "bin").write_bytes(b"\x00\x01")
    (ws / "latin1.txt").write_bytes(b"caf\xe9")
    (ws / "dir").mkdir()
    with pytest.raises(ToolError, match=r"old_string not found in f\.txt"):
        call(ctx, "edit", path="f.txt", old_string="nope", new_string="x")
    with pytest.raises(ToolError, match="identical"):
        call(ctx, "edit", path="f.txt", old_string="text", new_string="text")
    with pytest.raises(ToolError, match="bin is a binary file"):
        call(ctx, "edit", path="bin", old_string="a", new_string="b")
    with pytest.raises(ToolError, match=r"latin1\.txt is not valid UTF-8"):
        call(ctx, "edit", path="latin1.txt", old_string="caf", new_string="b")
    with pytest.raises(ToolError, match="dir is not a regular file"):
        call(ctx, "edit", path="dir", old_string="a", new_string="b")
    with pytest.raises(ToolError, match=r"missing\.txt not found"):
        call(ctx, "edit", path="missing.txt", old_string="a", new_string="b")


def test_parallel_edits_lose_no_update(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "f.txt").write_text("a=0\nb=0\n")
    errors: list[BaseException] = []

    def bump(key: str) -> None:
        try:
            for i in range(30):
                call(
                    ctx,
                    "edit",
                    path="f.txt",
                    old_string=f"{key}={i}\n",
                    new_string=f"{key}={i + 1}\n",
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=bump, args=(key,)) for key in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert (ws / "f.txt").read_text() == "a=30\nb=30\n"


# -- ls ----------------------------------------------------------------------------------------


def test_ls_entries(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "b.txt").write_text("12345")
    (ws / "a_dir").mkdir()
    (ws / "c_link").symlink_to("a_dir")
    os.mkfifo(ws / "d_fifo")
    entries = call(ctx, "ls", path=".")["entries"]
    assert [(e["name"], e["type"]) for e in entries] == [
        ("a_dir", "dir"),
        ("b.txt", "file"),
        ("c_link", "symlink"),
        ("d_fifo", "other"),
    ]
    assert entries[1]["size"] == 5


def test_ls_errors_and_cap(ws: Path) -> None:
    (ws / "f.txt").write_text("x")
    for i in range(20):
        (ws / f"n{i:02}").write_text("")
    with pytest.raises(ToolError, match=r"f\.txt is not a directory"):
        call(make_ctx(ws), "ls", path="f.txt")
    with pytest.raises(ToolError, match="missing not found"):
        call(make_ctx(ws), "ls", path="missing")
    value = call(make_ctx(ws, max_output_bytes=300), "ls")
    assert value["truncated"] is True
    assert 0 < len(value["entries"]) < 21


# -- grep --------------------------------------------------------------------------------------


def test_grep_matches(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "src" / "pkg").mkdir(parents=True)
    (ws / "src" / "pkg" / "m.py").write_text("import os\nNEEDLE = 1\r\nneedle()\n")
    (ws / "top.py").write_text("no match\n")
    value = call(ctx, "grep", pattern=r"needle\b", ignore_case=True)
    assert value == {
        "matches": [
            {"path": "src/pkg/m.py", "line": 2, "text": "NEEDLE = 1"},
            {"path": "src/pkg/m.py", "line": 3, "text": "needle()"},
        ],
        "truncated": False,
        "skipped": 0,
        "engine": "python",  # unconfined: no bind that refuses symlinks, so no rg
    }
    only_file = call(make_ctx(ws, cwd=ws / "src"), "grep", pattern="needle", path="pkg/m.py")
    assert only_file["matches"] == [{"path": "src/pkg/m.py", "line": 3, "text": "needle()"}]


def test_grep_glob(ctx: ExecutionContext, ws: Path) -> None:
    for name in ["a.py", "a.txt", "sub/b.py", "sub/b.txt"]:
        (ws / name).parent.mkdir(exist_ok=True)
        (ws / name).write_text("hit\n")

    def paths(glob: str) -> list[str]:
        return [m["path"] for m in call(ctx, "grep", pattern="hit", glob=glob)["matches"]]

    assert paths("*.py") == ["a.py", "sub/b.py"]
    assert paths("sub/*.txt") == ["sub/b.txt"]
    assert paths("**/*.txt") == ["a.txt", "sub/b.txt"]
    assert paths("b.*") == ["sub/b.py", "sub/b.txt"]


def test_grep_skips_binary_git_and_unreadable(
    ctx: ExecutionContext, ws: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (ws / ".git").mkdir()
    (ws / ".git" / "config").write_text("hit\n")
    (ws / "blob").write_bytes(b"hit\x00\n")
    (ws / "locked.txt").write_text("hit\n")
    (ws / "ok.txt").write_text("hit\n")

    def open_or_refuse(path: str, *, dir_fd: int | None = None) -> Any:
        if path.endswith("locked.txt"):  # root ignores chmod, so refuse by hand
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return open_regular(path, dir_fd=dir_fd)

    monkeypatch.setattr("sandbx_pool.workers.tools.grep.open_regular", open_or_refuse)
    value = call(ctx, "grep", pattern="hit")
    assert [m["path"] for m in value["matches"]] == ["ok.txt"]
    assert value["skipped"] == 1


def test_grep_does_not_hang_on_fifos_or_loops(ctx: ExecutionContext, ws: Path) -> None:
    (ws / "d").mkdir()
    os.mkfifo(ws / "d" / "fifo")
    (ws / "d" / "loop").symlink_to("..")
    (ws / "d" / "self").symlink_to(".")
    (ws / "d" / "outside").symlink_to(ws.parent / "outside" / "secret.txt")
    (ws / "d" / "f.txt").write_text("needle\n")
    value = in_child(lambda: call(make_ctx(ws), "grep", pattern="needle"), timeout=30)
    assert value["matches"] == [{"path": "d/f.txt", "line": 1, "text": "needle"}]
    with pytest.raises(ToolError, match="fifo is not a regular file or a directory"):
        in_child(lambda: call(make_ctx(ws), "grep", pattern="x", path="d/fifo"), timeout=30)


def test_grep_limits(ws: Path) -> None:
    (ws / "f.txt").write_text("hit\n" * 5 + "hit " + "x" * 1000 + "\n")
    few = call(make_ctx(ws), "grep", pattern="hit", max_results=2)
    assert (len(few["matches"]), few["truncated"]) == (2, True)
    exact = call(make_ctx(ws), "grep", pattern="hit", max_results=6)
    assert (len(exact["matches"]), exact["truncated"]) == (6, False)
    assert len(exact["matches"][5]["text"]) == 500
    small = call(make_ctx(ws, max_output_bytes=100), "grep", pattern="hit")
    assert small["truncated"] is True
    assert 0 < len(small["matches"]) < 6


def test_grep_bad_regex(ctx: ExecutionContext) -> None:
    with pytest.raises(ToolError, match=r"invalid regular expression '\(unclosed'"):
        call(ctx, "grep", pattern="(unclosed")


# -- find --------------------------------------------------------------------------------------


@pytest.fixture
def tree(ws: Path) -> Path:
    for name in ["a.py", "src/b.py", "src/deep/c.py", "src/deep/d.txt", ".github/ci.yml"]:
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text("")
    return ws


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("**/*.py", ["a.py", "src/b.py", "src/deep/c.py"]),
        ("*.py", ["a.py"]),
        ("src/**/*.py", ["src/b.py", "src/deep/c.py"]),
        ("src/**", ["src/b.py", "src/deep", "src/deep/c.py", "src/deep/d.txt"]),
        ("src/*", ["src/b.py", "src/deep"]),
        ("**/deep/*", ["src/deep/c.py", "src/deep/d.txt"]),
        ("?.py", ["a.py"]),
        ("[ab].py", ["a.py"]),
        ("[!a].py", []),
        ("**/", ["src", "src/deep"]),  # .github is hidden
        ("**/*.yml", []),
        ("./src/b.py", ["src/b.py"]),
    ],
)
def test_find_glob(ctx: ExecutionContext, tree: Path, pattern: str, expected: list[str]) -> None:
    assert call(ctx, "find", pattern=pattern) == {
        "paths": expected,
        "truncated": False,
        "skipped": 0,
    }


def test_find_hidden_gitignore_and_total(ctx: ExecutionContext, tree: Path) -> None:
    assert call(ctx, "find", pattern="**/*.yml", hidden=True)["paths"] == [".github/ci.yml"]
    (tree / ".gitignore").write_text("deep/\n")
    assert call(ctx, "find", pattern="**/*.py")["paths"] == ["a.py", "src/b.py"]
    every = call(ctx, "find", pattern="**/*.py", respect_gitignore=False)
    assert every["paths"] == ["a.py", "src/b.py", "src/deep/c.py"]
    (tree / ".git").mkdir()
    (tree / ".git" / "x.py").write_text("")
    assert ".git/x.py" not in call(ctx, "find", pattern="**", hidden=True)["paths"]
    for i in range(50):
        (tree / f"n{i:02}.py").write_text("")
    cut = call(make_ctx(tree, max_output_bytes=300), "find", pattern="**/*.py")
    assert cut["truncated"] is True
    assert cut["total"] == 52
    assert 0 < len(cut["paths"]) < 52


def test_find_under_a_path_reports_workspace_paths(ctx: ExecutionContext, tree: Path) -> None:
    assert call(ctx, "find", pattern="**/*.py", path="src")["paths"] == [
        "src/b.py",
        "src/deep/c.py",
    ]


def test_compile_glob() -> None:
    regex, dir_only = compile_glob("a/**/b")
    assert not dir_only
    assert all(regex.fullmatch(p) for p in ["a/b", "a/x/b", "a/x/y/b"])
    assert not any(regex.fullmatch(p) for p in ["ab", "a/xb", "b"])
    star, _ = compile_glob("*")
    assert star.fullmatch("x")
    assert not star.fullmatch("x/y")
    literal, _ = compile_glob("f[.txt")  # an unclosed class is a literal '['
    assert literal.fullmatch("f[.txt")
    with pytest.raises(ToolError, match="empty glob"):
        compile_glob("./")


def test_find_lists_special_files_without_following(ctx: ExecutionContext, ws: Path) -> None:
    os.mkfifo(ws / "fifo")
    (ws / "loop").symlink_to(".")
    (ws / "out").symlink_to(ws.parent / "outside")
    value = in_child(lambda: call(make_ctx(ws), "find", pattern="**"), timeout=30)
    assert value["paths"] == ["fifo", "loop", "out"]
    with pytest.raises(ToolError, match="fifo is not a directory"):
        in_child(lambda: call(make_ctx(ws), "find", pattern="**", path="fifo"), timeout=30)


def test_find_errors_and_cap(ws: Path) -> None:
    (ws / "f.txt").write_text("")
    for i in range(50):
        (ws / f"n{i:02}").write_text("")
    with pytest.raises(ToolError, match=r"f\.txt is not a directory"):
        call(make_ctx(ws), "find", pattern="*", path="f.txt")
    value = call(make_ctx(ws, max_output_bytes=200), "find", pattern="*")
    assert value["truncated"] is True
    assert 0 < len(value["paths"]) < 51


# -- bash --------------------------------------------------------------------------------------


def test_bash_output_and_exit_codes(ctx: ExecutionContext, ws: Path) -> None:
    assert call(ctx, "bash", command="echo out; echo err >&2") == {
        "exit_code": 0,
        "signal": None,
        "stdout": "out\n",
        "stderr": "err\n",
        "omitted_bytes": 0,
    }
    assert call(ctx, "bash", command="exit 3")["exit_code"] == 3
    killed = call(ctx, "bash", command="kill -TERM $$")
    assert (killed["exit_code"], killed["signal"]) == (128 + signal.SIGTERM, signal.SIGTERM)


def test_bash_cwd_env_and_bad_bytes(ws: Path) -> None:
    (ws / "sub").mkdir()
    value = call(
        make_ctx(ws, cwd=ws / "sub"), "bash", command="pwd; echo ${HOME-unset}; printf '\\377'"
    )
    assert value["stdout"] == f"{ws / 'sub'}\nunset\n\ufffd"


def test_bash_reads_both_pipes_at_once(ctx: ExecutionContext) -> None:
    # Both streams well past a pipe's 64 KiB: reading one at a time would deadlock.
    command = "head -c 300000 /dev/zero | tr '\\0' a >&2; head -c 300000 /dev/zero | tr '\\0' b"
    value = call(ctx, "bash", command=command)
    assert (len(value["stdout"]), len(value["stderr"])) == (300_000, 300_000)


def test_bash_output_limit_kills(ws: Path) -> None:
    with pytest.raises(OutputLimitExceeded, match="output exceeded 1000 bytes"):
        call(make_ctx(ws, max_output_bytes=1000), "bash", command="yes")


def _gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.mark.parametrize(
    "command",
    [
        "sleep 1000 & echo $!",
        "setsid sleep 1000 & echo $!",  # its own session: a group kill would miss it
        "( sleep 1000 & echo $! ) ; echo started",  # orphaned by the subshell at once
    ],
)
def test_bash_background_jobs_do_not_block_and_are_killed(ws: Path, command: str) -> None:
    def run() -> tuple[float, dict[str, Any]]:
        started = time.monotonic()
        value = call(make_ctx(ws), "bash", command=command)
        return time.monotonic() - started, value

    elapsed, value = in_child(run, subreaper=True, timeout=60)
    assert value["exit_code"] == 0
    assert elapsed < 30
    assert _gone(int(value["stdout"].split()[0]))


def test_undecodable_file_names_still_encode(ctx: ExecutionContext, ws: Path) -> None:
    # A lone surrogate from os.fsdecode would make msgpack refuse the whole result.
    with open(os.path.join(os.fsencode(ws), b"bad\xff.txt"), "w") as f:
        f.write("needle\n")
    for tool, args in [("ls", {}), ("find", {"pattern": "*"}), ("grep", {"pattern": "needle"})]:
        value = call(ctx, tool, **args)
        assert "bad\ufffd.txt" in str(value)
        encoder.encode(value)
