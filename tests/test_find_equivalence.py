"""find's own walk gives the answer the shared walk gives, on a tree that has everything.

The reference is find as it was before it got a loop of its own: the glob matched against each
path ``TreeWalk`` (the walk grep's Python engine still uses) yields, with the ignore rules
judged rule by rule (``GitIgnore.ignored``), in preorder with each directory sorted, capped in
that order. The tree holds hidden folders, a .gitignored folder, ``.git/``, symlinks to
directories (one looping, one leaving the workspace), a FIFO, a file name that is not UTF-8,
and ignore files of every kind with anchored, directory-only, ``**`` and ``!`` rules, nested.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sandbx_pool.workers.globs import compile_glob, descent
from sandbx_pool.workers.paths import resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import FindArgs, parse_args
from sandbx_pool.workers.tools import TOOLS, helper_process
from sandbx_pool.workers.tools.files import printable
from sandbx_pool.workers.tools.find import MAX_FIND_RESULTS
from sandbx_pool.workers.tools.gitignore import GitIgnore
from sandbx_pool.workers.tools.search import Root, TreeWalk

FILES: dict[str, str] = {
    ".gitignore": "build/\n*.log\n/top_only.txt\ndocs/*.md\n**/gen/\ncache/\nsub/**/x.tmp\n",
    ".ignore": "*.bak\n",
    ".git/info/exclude": "excluded.txt\n",
    ".git/HEAD": "ref: refs/heads/main\n",
    ".git/objects/x.py": "",
    ".github/workflows/ci.yml": "",
    ".hidden/secret.py": "",
    ".hidden/.gitignore": "*.py\n",
    ".env": "",
    "build/out.py": "",
    "build/deep/more.py": "",
    "app.log": "",
    "keep.log": "",
    "old.bak": "",
    "logs/.ignore": "!keep.log\n",
    "logs/keep.log": "",
    "logs/other.log": "",
    "excluded.txt": "",
    "top_only.txt": "",
    "a.py": "",
    "src/top_only.txt": "",
    "src/main.py": "",
    "src/gen/made.py": "",
    "src/cache": "",  # a file: the directory-only rule cache/ does not apply
    "src/sub/x.tmp": "",
    "src/sub/deeper/x.tmp": "",
    "sub/x.tmp": "",
    "sub/deeper/x.tmp": "",
    "sub/deeper/y.tmp": "",
    "docs/guide.md": "",
    "docs/api/ref.md": "",
    "lib/cache/blob.bin": "",
    "lib/.gitignore": "/local.py\n*.o\n!important.o\n",
    "lib/local.py": "",
    "lib/nested/local.py": "",
    "lib/x.o": "",
    "lib/important.o": "",
    "lib/.rgignore": "rgonly.py\n",
    "lib/rgonly.py": "",
    "lib/pkg/mod.py": "",
    "lib/pkg/.git": "gitdir: elsewhere\n",  # a worktree's .git file: never listed
    "empty.d/.keep": "",
    "names/caf\u00e9.py": "",
    "names/[brackets].py": "",
    "names/sp ace.py": "",
}

PATTERNS = [
    "**",
    "**/",
    "**/*.py",
    "**/*.tmp",
    "**/x.tmp",
    "*",
    "*.py",
    "src/**",
    "src/*",
    "lib/**/*.py",
    "**/deeper/*",
    "**/[!a-m]*.py",
    "**/?.py",
    "**/*.log",
    "**/cache",
    "**/cache/",
    "names/\\[*",
    "./a.py",
    "**/.*",
]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    for name, text in FILES.items():
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(text)
    os.mkfifo(ws / "src" / "pipe.py")
    (ws / "src" / "linked").symlink_to("../lib", target_is_directory=True)
    (ws / "loop").symlink_to(".", target_is_directory=True)
    (ws / "outside").symlink_to(tmp_path, target_is_directory=True)
    (ws / "src" / "file_link.py").symlink_to("main.py")
    (ws / "names" / os.fsdecode(b"latin\xe9.py")).write_text("")
    (ws / "empty.d" / "hollow").mkdir()
    return ws


def context(ws: Path, max_output_bytes: int = 1024 * 1024) -> ExecutionContext:
    return ExecutionContext(
        call_id="test",
        workspace=str(ws),
        cwd=str(ws),
        env={"PATH": os.environ["PATH"]},
        max_output_bytes=max_output_bytes,
    )


@pytest.fixture(params=[True, False], ids=["leaves", "no-leaves"])
def leaves(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """find with its leaf shortcut (a directory of link count 2 listed by name, where the
    filesystem is trusted: ``find.LEAF_FILESYSTEMS``) and without it, every directory entered
    the general way: both must give the reference's answer."""
    from sandbx_pool.workers.tools import find as find_module

    if not request.param:
        monkeypatch.setattr(find_module, "LEAF_FILESYSTEMS", frozenset())
    return bool(request.param)


def reference_find(args: FindArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """find before its own loop: TreeWalk, the glob against each path, rules one by one."""
    regex, dir_only = compile_glob(args.pattern)
    real = resolve(ctx, args.path)
    found: list[str] = []
    room = ctx.max_output_bytes
    total = 0
    with contextlib.ExitStack() as stack:
        root = stack.enter_context(Root(ctx, real, args.path))
        root_fd = root.open_directory()
        ignore = GitIgnore(root.prefix, root.ancestors()) if args.respect_gitignore else None
        walk = TreeWalk(root_fd, prune={".git"}, ignore=ignore, hidden=args.hidden)
        for rel, entry, _ in walk:
            if regex.fullmatch(rel) is None or entry.name == ".git":
                continue
            if dir_only and not entry.is_dir(follow_symlinks=False):
                continue
            total += 1
            if total > len(found) + 1:
                continue
            path = printable(f"{root.prefix}{rel}")
            cost = len(path.encode()) + 32
            if len(found) >= MAX_FIND_RESULTS or cost > room:
                continue
            room -= cost
            found.append(path)
    value: dict[str, Any] = {
        "paths": sorted(found),
        "truncated": total > len(found),
        "skipped": walk.skipped,
    }
    if total > len(found):
        value["total"] = total
    return value


def find(ctx: ExecutionContext, **args: Any) -> dict[str, Any]:
    return TOOLS["find"](parse_args("find", args), ctx)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("respect_gitignore", [True, False])
def test_find_answers_as_the_shared_walk(
    tree: Path, pattern: str, hidden: bool, respect_gitignore: bool, leaves: bool
) -> None:
    ctx = context(tree)
    for path in [".", "src", "lib", "sub/deeper"]:
        args = {"pattern": pattern, "path": path, "hidden": hidden}
        args["respect_gitignore"] = respect_gitignore
        expected = reference_find(parse_args("find", args), ctx)
        assert find(ctx, **args) == expected, args


#: Rules that decide by name alone (no anchored or ! rule): find then tests a file's name
#: against the ignore alternation and the glob in one regex, which this tree exercises.
BY_NAME: dict[str, str] = {
    ".gitignore": "build/\n*.log\n",
    "pkg/.gitignore": "*.tmp\n",
    "pkg/.ignore": "gen/\n",
    "a.py": "",
    "a.log": "",
    "a.py.log": "",
    "build/b.py": "",
    "pkg/c.py": "",
    "pkg/c.tmp": "",
    "pkg/c.log": "",
    "pkg/gen/d.py": "",
    "pkg/dir.py/e.py": "",  # a directory that matches **/*.py
    "pkg/.git": "gitdir: elsewhere\n",
    "other/f.tmp": "",
    "other/.hidden.py": "",
}


@pytest.fixture
def by_name_tree(tmp_path: Path) -> Path:
    ws = tmp_path / "by-name"
    for name, text in BY_NAME.items():
        (ws / name).parent.mkdir(parents=True, exist_ok=True)
        (ws / name).write_text(text)
    os.mkfifo(ws / "pkg" / "fifo.py")
    (ws / "pkg" / "link.py").symlink_to("c.py")
    (ws / "other" / "up.py").symlink_to("..", target_is_directory=True)
    return ws


@pytest.mark.parametrize("pattern", ["**/*.py", "**/*", "**/*.log", "**/[cd]*", "**/*.py/"])
@pytest.mark.parametrize("hidden", [False, True])
def test_find_by_name_answers_as_the_shared_walk(
    by_name_tree: Path, pattern: str, hidden: bool, leaves: bool
) -> None:
    ctx = context(by_name_tree)
    for path in [".", "pkg", "other"]:
        args = {"pattern": pattern, "path": path, "hidden": hidden}
        assert find(ctx, **args) == reference_find(parse_args("find", args), ctx), args
    if pattern == "**/*.py" and not hidden:
        assert find(ctx, pattern=pattern)["paths"] == [
            "a.py",
            "other/up.py",
            "pkg/c.py",
            "pkg/dir.py",
            "pkg/dir.py/e.py",
            "pkg/fifo.py",
            "pkg/link.py",
        ]


def test_the_tree_exercises_every_case(tree: Path) -> None:
    """What the comparison above would not notice if the tree lost it."""
    ctx = context(tree)
    every = find(ctx, pattern="**", hidden=True)["paths"]
    # Listed without being followed or entered: symlinks (to directories too) and the FIFO.
    assert {"loop", "outside", "src/linked", "src/pipe.py", "src/file_link.py"} <= set(every)
    assert not any(p.startswith(("loop/", "outside/", "src/linked/")) for p in every)
    assert not any(p == ".git" or p.startswith(".git/") or p.endswith("/.git") for p in every)
    # The rules: .gitignore, .ignore, .git/info/exclude, anchored, nested, ! (only below logs/
    # and lib/: elsewhere find combines the rules, which a ! rule above would prevent).
    for gone in ["build", "app.log", "keep.log", "old.bak", "excluded.txt", "top_only.txt"]:
        assert gone not in every
    for gone in ["src/gen", "lib/cache", "sub/x.tmp", "lib/local.py", "lib/x.o", "lib/rgonly.py"]:
        assert gone not in every
    assert {"logs/keep.log", "docs/api/ref.md"} <= set(every) - {"logs/other.log", "docs/guide.md"}
    for kept in ["src/top_only.txt", "src/cache", "sub/deeper"]:
        assert kept in every
    assert {"lib/nested/local.py", "lib/important.o", "names/latin\ufffd.py"} <= set(every)
    assert ".hidden/secret.py" not in every  # its own .gitignore
    assert ".github/workflows/ci.yml" in every


@pytest.mark.parametrize("pending", [1, 4096])
def test_truncation_keeps_the_same_paths_and_counts_all(
    tree: Path, pending: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether the paths are taken in a directory at a time or all at the end."""
    from sandbx_pool.workers.tools.find import _Answer

    monkeypatch.setattr(_Answer, "PENDING", pending)
    for room in [200, 300, 450, 1024 * 1024]:
        ctx = context(tree, max_output_bytes=room)
        for pattern in ["**", "**/*.py"]:
            args = {"pattern": pattern, "hidden": True, "respect_gitignore": False}
            expected = reference_find(parse_args("find", args), ctx)
            got = find(ctx, **args)
            assert got == expected
            assert got["truncated"] is (room < 1024)
            if got["truncated"]:
                assert got["total"] > len(got["paths"]) > 0


def test_truncation_at_the_result_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MAX_FIND_RESULTS, lowered so that the tree stays small: the first paths in preorder."""
    from sandbx_pool.workers.tools import find as find_module

    ws = tmp_path / "ws"
    for top in ["a", "b", "b.c", "c"]:
        for leaf in ["x.py", "y.py"]:
            (ws / top / leaf).parent.mkdir(parents=True, exist_ok=True)
            (ws / top / leaf).write_text("")
    monkeypatch.setattr(find_module, "MAX_FIND_RESULTS", 5)
    got = find(context(ws), pattern="**/*.py")
    # Preorder: a/x.py a/y.py b/x.py b/y.py b.c/x.py, then sorted.
    assert got == {
        "paths": ["a/x.py", "a/y.py", "b.c/x.py", "b/x.py", "b/y.py"],
        "truncated": True,
        "skipped": 0,
        "total": 8,
    }


@pytest.mark.parametrize(
    ("pattern", "entered", "left"),
    [
        ("*.py", [], [(0, "src")]),
        ("src/*", [(0, "src")], [(0, "lib"), (1, "deep")]),
        ("src/**/*.py", [(0, "src"), (1, "any"), (5, "thing")], [(0, "lib")]),
        ("s[rt]c/*/x", [(0, "src"), (1, "any")], [(0, "sac"), (2, "any")]),
        ("./src/b.py", [(0, "src")], [(1, "src")]),
    ],
)
def test_descent_enters_only_where_a_match_can_lie(
    pattern: str, entered: list[tuple[int, str]], left: list[tuple[int, str]]
) -> None:
    may_hold = descent(pattern)
    assert may_hold is not None
    assert all(may_hold(depth, name) for depth, name in entered)
    assert not any(may_hold(depth, name) for depth, name in left)


def test_descent_enters_everything_under_a_leading_double_star() -> None:
    assert descent("**/*.py") is None
    assert descent("**") is None


def test_filesystem_type_is_the_kernels(tmp_path: Path) -> None:
    """fstatfs through ctypes gives the magic number ``stat -f`` prints (coreutils)."""
    from sandbx_pool.workers.libc import filesystem_type

    printed = subprocess.run(
        ["stat", "-f", "-c", "%t", str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert filesystem_type(fd) == int(printed, 16) != 0
    finally:
        os.close(fd)
    assert filesystem_type(-1) == 0  # EBADF: not known, so never trusted


def test_the_walk_lists_leaves_by_name_where_the_count_is_kept(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a trusted filesystem the tree's leaves (src/gen, names, lib/pkg...) take the
    shortcut, so that the equivalence above compares it for real."""
    from sandbx_pool.workers.libc import filesystem_type
    from sandbx_pool.workers.tools import find as find_module

    fd = os.open(tree, os.O_RDONLY | os.O_DIRECTORY)
    try:
        trusted = filesystem_type(fd) in find_module.LEAF_FILESYSTEMS
    finally:
        os.close(fd)
    if not trusted:
        pytest.skip("the test tree's filesystem is not one whose link counts find trusts")
    leaves: list[int] = []
    real_leaf = find_module._Walk.leaf

    def counted(self: Any, fd: int, rel_dir: str) -> Any:
        found = real_leaf(self, fd, rel_dir)
        if found is not None:
            leaves.append(len(found.names))
        return found

    monkeypatch.setattr(find_module._Walk, "leaf", counted)
    assert "names/caf\u00e9.py" in find(context(tree), pattern="**", hidden=True)["paths"]
    assert len(leaves) >= 8


def test_a_filesystem_not_known_to_count_subdirectories_is_not_trusted(
    tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FUSE (sshfs and the like report any link count), btrfs, NFS: a link count of 2 there
    says nothing, and the directory is entered the general way."""
    from sandbx_pool.workers.tools import find as find_module

    fuse = 0x65735546
    monkeypatch.setattr(find_module, "filesystem_type", lambda fd: fuse)
    walk = find_module._Walk(None)
    fd = os.open(tree / "src" / "gen", os.O_RDONLY | os.O_DIRECTORY)
    try:
        if os.fstat(fd).st_nlink != 2:  # btrfs: always 1
            pytest.skip("this filesystem does not count subdirectories in st_nlink")
        assert walk.leaf(fd, "src/gen/") is None
    finally:
        os.close(fd)
    monkeypatch.undo()
    fd = os.open(tree / "src", os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert walk.leaf(fd, "src/") is None  # it holds directories, whatever the filesystem
    finally:
        os.close(fd)


# The split walk: past SPLIT_AFTER entries the later top-level subdirectories go to a forked
# helper (workers.tools.helper_process), whose answer the worker appends to its own. Lowered
# to 0, it splits on these small trees at the first directory entered; every answer above is
# compared again, and the helper is counted so that a split that never happens cannot pass.


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """SPLIT_AFTER at 0; the list of helpers forked (their pids), through the real start()."""
    from sandbx_pool.workers.tools import find as find_module

    started: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        helper = helper_process.start(*args, **kwargs)
        started.append(-1 if helper is None else helper.pid)
        return helper

    monkeypatch.setattr(find_module, "SPLIT_AFTER", 0)
    monkeypatch.setattr(find_module, "start", counted)
    return started


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("hidden", [False, True])
@pytest.mark.parametrize("respect_gitignore", [True, False])
def test_the_split_walk_answers_as_the_shared_walk(
    tree: Path,
    pattern: str,
    hidden: bool,
    respect_gitignore: bool,
    split: list[int],
    leaves: bool,
) -> None:
    ctx = context(tree)
    for path in [".", "src", "lib"]:
        args = {"pattern": pattern, "path": path, "hidden": hidden}
        args["respect_gitignore"] = respect_gitignore
        expected = reference_find(parse_args("find", args), ctx)
        assert find(ctx, **args) == expected, args
    if pattern == "**":
        assert split
        assert all(pid > 0 for pid in split)


@pytest.mark.parametrize("room", [200, 300, 450, 700, 1024 * 1024])
@pytest.mark.parametrize("pending", [1, 4096])
def test_the_split_walk_truncates_as_the_shared_walk(
    tree: Path, room: int, pending: int, split: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The byte budget cutting in the worker's part, in the helper's, or not at all."""
    from sandbx_pool.workers.tools.find import _Answer

    monkeypatch.setattr(_Answer, "PENDING", pending)
    ctx = context(tree, max_output_bytes=room)
    for pattern in ["**", "**/*.py", "**/*.md"]:
        args = {"pattern": pattern, "hidden": True, "respect_gitignore": False}
        assert find(ctx, **args) == reference_find(parse_args("find", args), ctx), args
    assert split


def wide_tree(ws: Path, tops: int = 12, files: int = 6) -> Path:
    for top in range(tops):
        for leaf in range(files):
            path = ws / f"d{top:02d}" / f"sub{leaf % 2}" / f"f{leaf}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
    return ws


@pytest.mark.parametrize("cap", [1, 5, 13, 40, 71, 72, 73, 200])
def test_the_split_walk_keeps_the_first_paths_at_the_result_cap(
    tmp_path: Path, cap: int, split: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """MAX_FIND_RESULTS cutting before the helper's part, inside it, or past the end."""
    from sandbx_pool.workers.tools import find as find_module

    ws = wide_tree(tmp_path / "ws")
    monkeypatch.setattr(find_module, "MAX_FIND_RESULTS", cap)
    monkeypatch.setitem(globals(), "MAX_FIND_RESULTS", cap)  # the reference's cap
    ctx = context(ws)
    for pattern in ["**", "**/*.py"]:
        args = {"pattern": pattern, "hidden": False}
        got = find(ctx, **args)
        assert got == reference_find(parse_args("find", args), ctx), (pattern, cap)
        assert got["truncated"] is (cap < (72 if pattern == "**/*.py" else 108))
    assert len(split) == 2
    assert all(pid > 0 for pid in split)


def test_no_split_below_the_threshold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tree smaller than SPLIT_AFTER is walked by the worker alone: no fork."""
    from sandbx_pool.workers.tools import find as find_module

    ws = wide_tree(tmp_path / "ws")
    started: list[object] = []
    monkeypatch.setattr(find_module, "start", lambda *a: started.append(a))
    assert len(find(context(ws), pattern="**")["paths"]) == 108
    assert started == []


def test_no_split_on_one_cpu(tree: Path, split: list[int]) -> None:
    """Allowed one CPU (taskset, a cpuset), the walk never forks a helper: both would take
    turns on that CPU, and the fork and the merge would only add to the call."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        ctx = context(tree)
        args = {"pattern": "**", "hidden": True}
        assert find(ctx, **args) == reference_find(parse_args("find", args), ctx)
    finally:
        os.sched_setaffinity(0, allowed)
    assert split == []
    # The control: the same call on every CPU allowed splits (SPLIT_AFTER is 0 here).
    if len(allowed) > 1:
        find(context(tree), pattern="**", hidden=True)
        assert split


def _garbage(self: Any) -> bytes:
    return b"\xc1 not msgpack"


def _killed(self: Any) -> bytes:
    os.kill(os.getpid(), signal.SIGKILL)
    return b""


def _raises(self: Any) -> bytes:
    raise RuntimeError("the helper's walk failed")


def _too_much(self: Any) -> bytes:
    return bytes(64 * 1024 * 1024)


def _implausible(self: Any) -> bytes:
    from sandbx_pool.workers.tools.find import _Part, _part_encoder

    return _part_encoder.encode(_Part(paths=["x"] * 3, total=1, skipped=0))


@pytest.mark.parametrize("failure", [_garbage, _killed, _raises, _too_much, _implausible])
def test_a_failed_helper_leaves_its_part_to_the_worker(
    tree: Path, failure: Callable[[Any], bytes], split: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the helper does wrong, the answer is the sequential one (and no process is
    left: the autouse fixture checks)."""
    from sandbx_pool.workers.tools.find import _Search

    monkeypatch.setattr(_Search, "walk_handed", failure)
    for room in [300, 1024 * 1024]:
        ctx = context(tree, max_output_bytes=room)
        args = {"pattern": "**", "hidden": True}
        assert find(ctx, **args) == reference_find(parse_args("find", args), ctx)
    assert split
    assert all(pid > 0 for pid in split)


def test_a_refused_fork_leaves_the_walk_to_the_worker(
    tree: Path, split: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fork() failing as under a process limit (EAGAIN): the walk goes on alone."""

    def refused() -> int:
        raise OSError(errno.EAGAIN, "fork: Resource temporarily unavailable")

    monkeypatch.setattr(helper_process, "fork", refused)
    ctx = context(tree)
    args = {"pattern": "**", "hidden": True}
    assert find(ctx, **args) == reference_find(parse_args("find", args), ctx)
    assert split
    assert all(pid == -1 for pid in split)
