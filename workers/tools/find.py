"""The find tool: a walk by descriptor of its own, written for speed.

find lists every kind of entry (directories, symlinks, FIFOs), so it cannot hand the walk to
``rg --files``, which lists regular files only; and a program would cost every call bash's
confinement. It walks in Python, by descriptor, with the guarantees of the shared walk
(``workers.tools.search``'s docstring: no symlink followed, nothing opened but directories,
each by its single name with ``O_NOFOLLOW``, so a parallel symlink swap is refused by the
kernel), and gives the answer that walk gives: the same entries, visited in the same order
(preorder, each directory sorted by name), so that a truncated answer keeps the same paths.

What makes it fast: every step the shared walk took per entry, in Python, is done once per
directory or in C. On the search bench's 20,000-file tree (CPU, in-process, min of 30): the
shared walk 76.6 ms, this loop 32.2 ms, the sorted ``scandir`` walk alone 16.4 ms.

* one loop, no generator: each entry is judged where it is listed;
* a directory's ignore rules are combined once (``gitignore.DirectoryRules``): without ``!``
  and anchored rules, the entry's test is the alternation's own ``fullmatch``;
* ``**/NAME`` (``globs.name_glob``) matches the name alone, and where the rules decide by name
  a file takes one regex for both: NAME behind a negative lookahead of the ignore alternation;
* a glob that does not start with ``**`` enters only the directories a match can lie in
  (``globs.descent``: ``*.py`` lists the root alone, ``src/**`` only ``src``);
* a matching path goes to a plain list (``_Answer.pending``) that the answer takes in a few
  thousand at a time, in order, with the caps applied as path by path;
* a directory that holds no directory (a leaf: link count 2, on a filesystem known to keep
  that count, ``LEAF_FILESYSTEMS``) is listed by name with ``os.listdir`` and judged whole in
  a few ``filter`` and ``map`` passes (``_Tests.leaf``): no ``DirEntry``, no type test, no
  frame. Most of a tree's entries lie in leaves. On the same tree, on another day (one core,
  in-process, min of 30): 16.9 ms before leaves, 14.0 ms with them, the sorted ``scandir`` walk
  alone 8.7 ms; through the pool, ``**/*.py`` went from 0.99-1.01x ``rg --files`` to
  0.89-0.97x (three runs each, quiet machine).

On a tree past ``SPLIT_AFTER`` entries the walk goes on two cores (``_Search``): the later
half of the top directory's remaining subdirectories goes to a forked helper
(``workers.tools.helper_process``), whose capped answer the worker appends to its own. The
answer is the sequential walk's, truncation included; a helper that cannot be forked, dies
or answers garbage leaves its part to the worker. The split is static (a half by count of
subdirectories), so a tree whose bulk lies in one top-level directory gains nothing. A worker
allowed one CPU never splits: the helper would take turns with it there (through the pool on
one CPU, ``taskset -c 0``: 1.44-1.54x ``rg --files`` splitting, 1.31-1.36x not).

Tried and no faster: judging a whole listing through ``itertools`` filters and interleaving
its paths with the subdirectories by ``bisect`` (44.8 against 45.2 ms at the time: the lists
made per directory cost what the per-entry calls saved); the same for a directory without
subdirectories only, found by type (37.5 against 29.7 ms: ``methodcaller("is_dir",
follow_symlinks=False)`` over a listing costs more than this loop's own call). The link count
is what made leaves pay: it tells without looking at a single entry.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import re
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import msgspec

from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.globs import compile_glob, descent, name_glob
from sandbx_pool.workers.libc import filesystem_type
from sandbx_pool.workers.paths import DIRECTORY_FLAGS, resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import FindArgs
from sandbx_pool.workers.tools.files import os_error, printable
from sandbx_pool.workers.tools.gitignore import NAMES as IGNORE_NAMES
from sandbx_pool.workers.tools.gitignore import DirectoryRules, GitIgnore
from sandbx_pool.workers.tools.helper_process import Helper, start
from sandbx_pool.workers.tools.search import Root

#: find stops after this many paths even below max_output_bytes.
MAX_FIND_RESULTS = 10_000

#: Bytes of framing counted per result besides its strings, roughly what the encoding adds.
_RESULT_OVERHEAD = 32

#: Entries listed past which the walk gives the later half of the top directory's remaining
#: subdirectories to a second process (``_Search.split``), when what is left looks as big
#: again at least. Below it nothing is forked: on a small tree the fork would cost more than
#: it saves (a worker lists 200-600 entries a millisecond; the fork and the answer's merge
#: cost 1-3 ms). 1,000 and 2,000 measured alike on the search bench, within its noise.
SPLIT_AFTER = 1000

#: ``split_after`` once the walk will not split (again).
NEVER = 1 << 62

#: Filesystems whose directories count their subdirectories in ``st_nlink`` (2, plus one for
#: each subdirectory's ``..``), as Unix filesystems always have: there a directory of link
#: count 2 holds no directory, and the walk lists it by name alone (``_Walk.enter``). GNU find
#: (gnulib's fts) takes the same shortcut, and not where the count lies or is not kept: btrfs
#: (always 1), overlayfs, NFS, CIFS, AFS, FUSE, /proc. What is not known here is not trusted.
LEAF_FILESYSTEMS = frozenset(
    {
        0xEF53,  # ext2, ext3, ext4
        0x58465342,  # xfs
        0x01021994,  # tmpfs
    }
)

#: A stack frame of the walk: a directory being listed (see ``_Search.run``).
_Frame = tuple[str, str, int, Any, Any, Any, Any]

_NAME = operator.attrgetter("name")

#: A test of a name; truthy when it passes.
Test = Callable[[str], object]

#: A directory's entries, sorted by name, and the ignore rules for them.
_Listing = tuple[list[os.DirEntry[str]], DirectoryRules | None]

#: Of a list of a directory's names, its walk-relative path and its path in the workspace: the
#: paths to keep, in order (``_Tests.leaf``).
LeafTest = Callable[[list[str], str, str], Iterable[str]]


class _Leaf(NamedTuple):
    """A directory that holds no directory: its names, sorted, and the ignore rules for them."""

    names: list[str]
    rules: DirectoryRules | None


class _Answer:
    """The paths kept, within the caps, and how many matched in all.

    The walk appends each matching path to ``pending`` (a list's own append: no Python call
    per path) and has them taken in, in order, between directories, a few thousand at most
    at a time: the answer stays bounded however many paths match, and the caps are applied
    as if path by path."""

    #: Paths pending past which the walk has them taken in (at its next directory).
    PENDING = 4096

    def __init__(self, room: int) -> None:
        self.paths: list[str] = []
        self.pending: list[str] = []
        self.total = 0
        self.room = room
        self.full = False  # a path was refused: the rest are only counted

    def take_pending(self) -> None:
        """``add`` each pending path, in order: those the result cap leaves room for at once
        when their bytes fit too, the rest only counted once the answer is full."""
        pending = self.pending
        if not self.full:
            head = pending[: MAX_FIND_RESULTS - len(self.paths)]
            try:
                size = sum(map(len, map(str.encode, head)))
            except UnicodeEncodeError:
                size = self.room  # a name that is not UTF-8: one by one, made printable
            cost = size + _RESULT_OVERHEAD * len(head)
            if cost <= self.room:
                self.room -= cost
                self.paths += head
                self.total += len(head)
                self.full = len(head) < len(pending)  # the next one is past the cap
            else:
                for path in head:
                    self.add(path)
            self.total += len(pending) - len(head)
        else:
            self.total += len(pending)
        pending.clear()

    def add(self, path: str) -> None:
        """One path, the next in preorder: kept if it fits, counted either way."""
        self.total += 1
        if self.full:
            return
        try:
            size = len(path.encode())
        except UnicodeEncodeError:
            path = printable(path)
            size = len(path.encode())
        cost = size + _RESULT_OVERHEAD
        if len(self.paths) >= MAX_FIND_RESULTS or cost > self.room:
            self.full = True
            return
        self.room -= cost
        self.paths.append(path)


class _Walk:
    """What the walk needs of each directory it enters: its sorted entries and its rules."""

    def __init__(self, ignore: GitIgnore | None) -> None:
        self.ignore = ignore
        self.skipped = 0
        self.listed = 0  # entries listed so far: what decides whether to split
        #: st_dev -> whether its link counts say which directories are leaves (LEAF_FILESYSTEMS)
        self._counts_subdirectories: dict[int, bool] = {}

    def listing(self, fd: int, rel_dir: str) -> _Listing:
        """Raises OSError."""
        with os.scandir(fd) as it:
            entries = sorted(it, key=_NAME)
        self.listed += len(entries)
        return entries, self._rules(fd, rel_dir, map(_NAME, entries))

    def _rules(self, fd: int, rel_dir: str, names: Iterable[str]) -> DirectoryRules | None:
        if self.ignore is None:
            return None
        # Which ignore files the directory holds: GitIgnore.enter opens only those.
        self.ignore.enter(rel_dir, fd, IGNORE_NAMES.intersection(names))
        return self.ignore.for_directory(rel_dir)

    def leaf(self, fd: int, rel_dir: str) -> _Leaf | None:
        """The directory's names when it holds no directory and its filesystem says so
        truthfully; None when it may hold one. Raises OSError.

        A leaf costs the walk no ``DirEntry`` and no per-entry type test: most of a tree's
        entries lie in leaves, and this is the larger part of what find spends on them."""
        status = os.fstat(fd)
        if status.st_nlink != 2:
            return None
        trusted = self._counts_subdirectories.get(status.st_dev)
        if trusted is None:
            trusted = filesystem_type(fd) in LEAF_FILESYSTEMS
            self._counts_subdirectories[status.st_dev] = trusted
        if not trusted:
            return None
        # A directory made in it since the fstat is listed as a name and not entered: the walk
        # of a tree that changes under it sees some of the changes, whichever it reads first.
        names = os.listdir(fd)
        names.sort()
        self.listed += len(names)
        return _Leaf(names, self._rules(fd, rel_dir, names))

    def enter(self, name: str, parent: int, rel_dir: str) -> tuple[int, _Listing] | _Leaf | None:
        """The directory ``name`` of ``parent``: open, with its listing, or listed and closed
        when it is a leaf; None (counted as skipped) when it cannot be."""
        try:
            fd = os.open(name, DIRECTORY_FLAGS, dir_fd=parent)
        except OSError:
            self.skipped += 1  # a symlink swapped in (ELOOP), unreadable, or gone
            return None
        try:
            leaf = self.leaf(fd, rel_dir)
            if leaf is not None:
                os.close(fd)
                return leaf
            return fd, self.listing(fd, rel_dir)
        except OSError:
            os.close(fd)
            self.skipped += 1
            return None


class _Tests:
    """The tests a directory's entries go through, made once per set of ignore rules."""

    def __init__(
        self,
        regex: re.Pattern[str],
        dir_only: bool,
        by_name: re.Pattern[str] | None,
        hidden: bool,
        base: str,
    ) -> None:
        self.regex = regex
        self.dir_only = dir_only
        self.by_name = by_name
        self.base = base
        #: What a name must not be to be listed: .git never, a hidden name unless asked for.
        self.unlisted = r"(?!\.git\Z)" if hidden else r"(?!\.)"
        self._made: dict[DirectoryRules, tuple[Test | None, Test | None, Test | None]] = {}
        self._leaves: dict[DirectoryRules | None, LeafTest] = {}

    def of(self, rules: DirectoryRules | None) -> tuple[Test | None, Test | None, Test | None]:
        """(listed, ignored, directory ignored): ``listed`` tests an entry that is not a
        directory in one call, when one regex can (``_listed``); otherwise None, and
        ``ignored`` then the glob are asked in turn."""
        if rules is None:
            listed = self._listed(None)
            return None if listed is None else listed.fullmatch, None, None
        made = self._made.get(rules)
        if made is None:
            listed = self._listed(rules)
            made = (
                None if listed is None else listed.fullmatch,
                rules.check(is_dir=False),
                rules.check(is_dir=True),
            )
            if rules.anywhere:  # the same object for every directory it serves
                self._made[rules] = made
        return made

    def _listed(self, rules: DirectoryRules | None) -> re.Pattern[str] | None:
        """The one regex that decides whether an entry that is not a directory is listed, when
        one can (a ``**/NAME`` glob, and ignore rules that decide by name): NAME where the
        ignore alternation does not fullmatch."""
        if self.by_name is None or self.dir_only:
            return None
        if rules is None:
            return self.by_name
        alone, alternation = rules.by_name(is_dir=False)
        if not alone:
            return None
        if alternation is None:
            return self.by_name
        combined = f"(?!(?:{alternation.pattern})\\Z)(?:{self.by_name.pattern})"
        return re.compile(combined, re.DOTALL)

    def leaf(self, rules: DirectoryRules | None) -> LeafTest:
        """The paths a leaf keeps, taken from its list of names in a few passes in C (a
        ``filter`` or ``map`` each) rather than a Python step per name."""
        made = self._leaves.get(rules)
        if made is None:
            made = self._make_leaf(rules)
            if rules is None or rules.anywhere:  # the same object for every directory it serves
                self._leaves[rules] = made
        return made

    def _make_leaf(self, rules: DirectoryRules | None) -> LeafTest:
        if self.dir_only:  # a leaf holds no directory
            return lambda names, prefix, full: ()
        listed = self._listed(rules)
        if listed is not None:
            one = re.compile(f"{self.unlisted}(?:{listed.pattern})", re.DOTALL).fullmatch
            return lambda names, prefix, full: map(full.__add__, filter(one, names))
        visible = re.compile(self.unlisted).match
        ignored = None if rules is None else rules.check(is_dir=False)
        by_name, glob, base = self.by_name, self.regex.fullmatch, self.base

        def kept(names: list[str], prefix: str, full: str) -> Iterable[str]:
            left: Iterable[str] = filter(visible, names)
            if ignored is not None:
                left = itertools.filterfalse(ignored, left)
            if by_name is not None:
                return map(full.__add__, filter(by_name.fullmatch, left))
            return map(base.__add__, filter(glob, map(prefix.__add__, left)))

        return kept


class _Part(msgspec.Struct, array_like=True):
    """What the helper sends back for its part of the walk: its answer, capped as find's is
    (at most ``MAX_FIND_RESULTS`` paths within the call's bytes), and its skipped count."""

    paths: list[str]
    total: int
    skipped: int


def _plausible(part: _Part) -> bool:
    return len(part.paths) <= min(part.total, MAX_FIND_RESULTS) and part.skipped >= 0


_part_encoder = msgspec.msgpack.Encoder()
_part_decoder = msgspec.msgpack.Decoder(_Part)


class _Search:
    """One call's walk, in preorder, and its split across two processes when the tree is big.

    The split keeps the answer the sequential walk gives: the helper takes a suffix of the
    walk (the later subdirectories of the top directory, with the entries between them), so
    the worker's paths then the helper's are the walk's own order, and the caps apply to that
    concatenation as they would path by path. The helper caps its own answer as find does:
    whatever it drops, the worker (which comes to it with less room) would drop too. A helper
    that cannot be forked, dies or answers garbage leaves its part to the worker: the answer
    is the same, only later."""

    def __init__(
        self,
        walk: _Walk,
        tests: _Tests,
        pattern: tuple[re.Pattern[str], bool, re.Pattern[str] | None, Any],
        hidden: bool,
        root_fd: int,
        base: str,
        room: int,
    ) -> None:
        self.walk = walk
        self.tests = tests
        self.regex, self.dir_only, self.by_name, self.descend = pattern
        self.hidden = hidden
        self.root_fd = root_fd
        self.base = base
        self.room = room
        self.answer = _Answer(room)
        # One CPU to run on (taskset, a container's cpuset): a helper would only take turns
        # with the worker on it, and add its fork and its answer's merge.
        self.split_after = SPLIT_AFTER if len(os.sched_getaffinity(0)) > 1 else NEVER
        self.helper: Helper | None = None
        self.handed: list[os.DirEntry[str]] = []  # the top directory's entries the helper takes
        self.top: list[os.DirEntry[str]] = []
        self.top_rules: DirectoryRules | None = None

    def frame(self, entries: list[os.DirEntry[str]]) -> _Frame:
        """The top directory's frame, listing ``entries`` (some of its own)."""
        return ("", self.base, self.root_fd, iter(entries), *self.tests.of(self.top_rules))

    def search(self, top: list[os.DirEntry[str]], top_rules: DirectoryRules | None) -> _Answer:
        """The answer for the whole tree below the top directory (listed: ``top``)."""
        self.top, self.top_rules = top, top_rules
        try:
            self.run([self.frame(top)])
            self.answer.take_pending()
            if self.handed:
                self.join()
        finally:
            if self.helper is not None:
                self.helper.kill()
        return self.answer

    def join(self) -> None:
        """The helper's part after the worker's own, or the worker walks it when it failed."""
        part = None
        if self.helper is not None:
            raw, self.helper = self.helper.result(), None
            if raw is not None:
                with contextlib.suppress(msgspec.DecodeError):
                    part = _part_decoder.decode(raw)
        if part is None or not _plausible(part):
            self.run([self.frame(self.handed)])
        else:
            self.answer.pending += part.paths
            self.answer.total += part.total - len(part.paths)
            self.walk.skipped += part.skipped
        self.answer.take_pending()

    def split(self, stack: list[_Frame]) -> None:
        """Hands the later half of the top directory's subdirectories still to come (and the
        entries between them) to a helper, when what is left looks worth a process.

        Called once, past ``split_after`` entries, between two directories: the top
        directory's frame is not being iterated then, so its iterator can be replaced."""
        self.split_after = NEVER  # once per call, whatever it decides
        top = stack[0]
        rest = list(top[3])
        dirs = [i for i, entry in enumerate(rest) if self._worth_entering(entry)]
        done = len(self.top) - len(rest)
        dirs_done = sum(1 for entry in self.top[:done] if self._worth_entering(entry))
        # What is left, guessed from the subdirectories done so far (the current one counted
        # as done): at least ``SPLIT_AFTER`` entries more, or no helper.
        left = self.walk.listed * len(dirs) / max(dirs_done, 1)
        if not dirs or left < SPLIT_AFTER:
            stack[0] = (*top[:3], iter(rest), *top[4:])
            return
        cut = dirs[len(dirs) // 2]  # the worker has the rest of its current subtree besides
        self.handed = rest[cut:]
        stack[0] = (*top[:3], iter(rest[:cut]), *top[4:])
        self.helper = start(self.walk_handed, self.room + 4096)

    def _worth_entering(self, entry: os.DirEntry[str]) -> bool:
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            return False
        name = entry.name
        return is_dir and name != ".git" and (self.hidden or name[0] != ".")

    def walk_handed(self) -> bytes:
        """In the helper: the handed part's answer, from a fresh one."""
        self.answer = _Answer(self.room)
        self.walk.skipped = 0
        self.run([self.frame(self.handed)])
        self.answer.take_pending()
        part = _Part(paths=self.answer.paths, total=self.answer.total, skipped=self.walk.skipped)
        return _part_encoder.encode(part)

    def run(self, stack: list[_Frame]) -> None:
        """The walk of what ``stack`` holds, matching paths appended to the answer."""
        walk, tests, answer = self.walk, self.tests, self.answer
        by_name, dir_only, descend, hidden = self.by_name, self.dir_only, self.descend, self.hidden
        match = (by_name or self.regex).fullmatch
        keep = answer.pending.append
        root_fd = self.root_fd
        split_after = self.split_after
        # A directory being listed: its walk-relative path ("" or ending in "/"), its path in
        # the workspace, its fd, what is left of its entries, and its tests (_Tests.of). An
        # explicit stack rather than recursion:
        # depth is bounded by the tree (and the open-files limit), not by Python's recursion
        # limit.
        try:
            while stack:
                prefix, full, fd, entries, listed, file_ignored, dir_ignored = stack[-1]
                for entry in entries:
                    name = entry.name
                    if name[0] == "." and not hidden:
                        continue
                    try:
                        # The entry's own type (lstat): False for a symlinked directory, which
                        # is therefore never entered.
                        is_dir = entry.is_dir(follow_symlinks=False)
                    except OSError:
                        is_dir = False
                    if not is_dir:
                        if listed is not None:
                            # .git is never listed, even when it is a file (a worktree's).
                            if listed(name) and name != ".git":
                                keep(f"{full}{name}")
                            continue
                        if (file_ignored is not None and file_ignored(name)) or dir_only:
                            continue
                        subject = name if by_name is not None else f"{prefix}{name}"
                        if match(subject) is not None and name != ".git":
                            keep(f"{full}{name}")
                        continue
                    if (dir_ignored is not None and dir_ignored(name)) or name == ".git":
                        continue
                    rel = f"{prefix}{name}"
                    if match(name if by_name is not None else rel) is not None:
                        keep(f"{full}{name}")
                    if descend is not None and not descend(prefix.count("/"), name):
                        continue  # no path below it can match: not even opened
                    if len(answer.pending) > answer.PENDING:
                        answer.take_pending()
                    child = walk.enter(name, fd, f"{rel}/")
                    if child is None:
                        continue
                    if isinstance(child, _Leaf):
                        # Listed whole, here: its paths come before the next sibling's, as
                        # preorder wants, and no frame is pushed for it.
                        kept = tests.leaf(child.rules)(child.names, f"{rel}/", f"{full}{name}/")
                        answer.pending += kept
                        if walk.listed <= split_after:
                            continue
                    else:
                        child_fd, (child_entries, child_rules) = child
                        stack.append(
                            (
                                f"{rel}/",
                                f"{full}{name}/",
                                child_fd,
                                iter(child_entries),
                                *tests.of(child_rules),
                            )
                        )
                    if walk.listed > split_after:
                        self.split(stack)  # may replace the top frame: the loop takes it anew
                        split_after = self.split_after
                    break  # preorder: the directory's entries before its next sibling
                else:
                    stack.pop()
                    if fd != root_fd:
                        os.close(fd)
        finally:
            for frame in stack:
                if frame[2] != root_fd:
                    os.close(frame[2])


def find_paths(args: FindArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Paths under ``path`` whose path relative to it matches the glob ``pattern``.

    Lists every kind of entry (symlinks, FIFOs, directories) without opening any, and never
    descends a symlinked directory nor ``.git``. Hidden names and what the ignore files
    exclude are left out unless asked for, as rg --files does. Results are relative to the
    workspace, sorted; past the cap, ``total`` says how many matched.
    """
    regex, dir_only = compile_glob(args.pattern)
    by_name = name_glob(args.pattern)
    descend = descent(args.pattern)
    real = resolve(ctx, args.path)
    with contextlib.ExitStack() as opened:
        try:
            root = opened.enter_context(Root(ctx, real, args.path))
            root.mode()  # a symlink loop is ELOOP, as it was when the root was opened by path
            root_fd = root.open_directory()
            ignore = GitIgnore(root.prefix, root.ancestors()) if args.respect_gitignore else None
            walk = _Walk(ignore)
            top, top_rules = walk.listing(root_fd, "")
        except NotADirectoryError:
            raise ToolError(f"{args.path} is not a directory", code="ENOTDIR") from None
        except OSError as exc:
            raise os_error(args.path, exc) from exc
        pattern = (regex, dir_only, by_name, descend)
        search = _Search(
            walk,
            _Tests(regex, dir_only, by_name, args.hidden, root.prefix),
            pattern,
            args.hidden,
            root_fd,
            root.prefix,
            ctx.max_output_bytes,
        )
        answer = search.search(top, top_rules)
    value: dict[str, Any] = {
        "paths": sorted(answer.paths),
        "truncated": answer.total > len(answer.paths),
        "skipped": walk.skipped,
    }
    if answer.total > len(answer.paths):
        value["total"] = answer.total
    return value
