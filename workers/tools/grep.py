"""The grep tool: rg where the kernel keeps it inside the workspace, Python's re elsewhere.

::

    grep_files --rg found, workspace bound with symlinks refused--> workers.tools.ripgrep
        |                                       | rg refused the pattern (look-around...)
        v                                       v
    the Python walk (workers.tools.search.TreeWalk, by descriptor) with Python's re

Both give the same answer for the same tree (tests/test_grep_equivalence.py holds them to
``rg -n``): the same files (.gitignore and friends, hidden names, .git never, binary files
skipped), the same lines (CRLF and invalid UTF-8 included), the same bounded answer
(workers.tools.results). ``engine`` in the value says which one ran.
"""

from __future__ import annotations

import bisect
import contextlib
import fnmatch
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.paths import real_workspace, relative_to_workspace, resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.rg_binary import find_rg, symlinks_refused
from sandbx_pool.workers.schemas import GrepArgs
from sandbx_pool.workers.tools.files import (
    SNIFF_BYTES,
    is_binary,
    open_regular,
    os_error,
    printable,
)
from sandbx_pool.workers.tools.gitignore import GitIgnore, compile_glob_rule
from sandbx_pool.workers.tools.results import DEFAULT_MAX_MATCHES, Collector
from sandbx_pool.workers.tools.ripgrep import (
    RgFailed,
    RgRefused,
    context_sizes,
    rg_argv,
    run_rg,
    type_globs,
)
from sandbx_pool.workers.tools.search import Root, TreeWalk, is_regular

#: A file searched whole (multiline, context) is read whole: larger ones are skipped.
MAX_WHOLE_FILE_BYTES = 256 * 1024 * 1024


def grep_files(args: GrepArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Lines matching ``pattern`` in a file, or in the files under a directory.

    ``glob``, ``type``, ``hidden`` and ``respect_gitignore`` do not filter an explicitly named
    file, and a binary file (a NUL byte) is searched only when named.
    """
    real = resolve(ctx, args.path)
    rg = find_rg(ctx.env)
    if rg is not None and symlinks_refused(real):
        try:
            return _grep_rg(rg, args, ctx, real)
        except RgRefused:
            pass  # a pattern only Python's re takes: the walk below
        except RgFailed as exc:
            raise ToolError(str(exc)) from None
    return _grep_python(args, ctx, real, rg)


def _collector(args: GrepArgs, ctx: ExecutionContext) -> Collector:
    max_results = args.max_results or DEFAULT_MAX_MATCHES
    return Collector(args.output_mode, max_results, ctx.max_output_bytes, context_sizes(args))


def _grep_rg(rg: str, args: GrepArgs, ctx: ExecutionContext, real: str) -> dict[str, Any]:
    collector = _collector(args, ctx)
    with Root(ctx, real, args.path) as root:
        try:
            mode = root.mode()
        except OSError as exc:
            raise os_error(args.path, exc) from exc
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise ToolError(f"{args.path} is not a regular file or a directory")
        ignore_text = ""
        if stat.S_ISDIR(mode) and args.respect_gitignore and root.prefix:
            ignore_text = GitIgnore(root.prefix, root.ancestors()).above_as_text()
    target = relative_to_workspace(ctx, real)
    memfd = None
    try:
        if ignore_text:
            # The rules above the searched directory, which rg is told not to read itself.
            memfd = os.memfd_create("rg-ignore", 0)
            os.write(memfd, ignore_text.encode())
        ignore_file = f"/proc/self/fd/{memfd}" if memfd is not None else None
        argv = rg_argv(rg, args, target, ignore_file)
        pass_fds = (memfd,) if memfd is not None else ()
        skipped = run_rg(argv, real_workspace(ctx.workspace), args.output_mode, collector, pass_fds)
    finally:
        if memfd is not None:
            os.close(memfd)
    return collector.value(skipped, "rg")


# -- the Python walk ---------------------------------------------------------------------------


def _compile(args: GrepArgs) -> re.Pattern[str]:
    flags = re.IGNORECASE if args.ignore_case else 0
    if args.multiline:
        flags |= re.MULTILINE | re.DOTALL
    try:
        return re.compile(args.pattern, flags)
    except re.error as exc:
        raise ToolError(f"invalid regular expression {args.pattern!r}: {exc}") from exc


def _type_filter(args: GrepArgs, rg: str | None) -> Callable[[str], bool] | None:
    if args.type is None:
        return None
    globs = type_globs(rg, args.type) if rg is not None else None
    if globs is None:
        reason = "unknown file type" if rg is not None else "file types need rg, not found"
        raise ToolError(f"{reason}: {args.type!r}")
    return lambda name: any(fnmatch.fnmatchcase(name, glob) for glob in globs)


def _glob_filter(glob: str | None) -> Callable[[str], bool | None] | None:
    """rg's --glob: a file matching decides (even an ignored or hidden one), a file that
    does not is left out; a negated glob only leaves out what it matches."""
    if glob is None:
        return None
    rule = compile_glob_rule(glob)
    if rule is None:
        raise ToolError(f"invalid glob {glob!r}")

    def verdict(rel: str) -> bool | None:
        hit = rule.regex.fullmatch(rel if rule.anchored else rel.rsplit("/", 1)[-1]) is not None
        if rule.negate:
            return False if hit else None
        return hit

    return verdict


def _grep_python(
    args: GrepArgs, ctx: ExecutionContext, real: str, rg: str | None
) -> dict[str, Any]:
    regex = _compile(args)
    collector = _collector(args, ctx)
    search = _FileSearch(regex, args, collector)
    skipped = 0
    with contextlib.ExitStack() as stack:
        try:
            root = stack.enter_context(Root(ctx, real, args.path))
            # lstat, not open: the root may be a FIFO, refused below without opening it.
            mode = root.mode()
            if stat.S_ISREG(mode):
                assert root.name is not None  # the workspace is a directory
                display = printable(relative_to_workspace(ctx, real))
                search.file(root.name, root.parent, display, explicit=True)
            elif stat.S_ISDIR(mode):
                root_fd = root.open_directory()
                ignore = None
                if args.respect_gitignore:
                    ignore = GitIgnore(root.prefix, root.ancestors())
                walk = TreeWalk(
                    root_fd,
                    prune={".git"},
                    ignore=ignore,
                    hidden=args.hidden,
                    files=_glob_filter(args.glob),
                )
        except OSError as exc:
            raise os_error(args.path, exc) from exc
        if stat.S_ISDIR(mode):
            of_type = _type_filter(args, rg)
            for rel, entry, dir_fd in walk:
                if not is_regular(entry) or entry.name == ".git":
                    continue
                if of_type is not None and not of_type(entry.name):
                    continue
                try:
                    search.file(entry.name, dir_fd, printable(f"{root.prefix}{rel}"))
                except OSError:
                    skipped += 1
                if collector.full:
                    break
            skipped += walk.skipped
        elif not stat.S_ISREG(mode):
            raise ToolError(f"{args.path} is not a regular file or a directory")
    return collector.value(skipped + search.skipped, "python")


class _FileSearch:
    def __init__(self, regex: re.Pattern[str], args: GrepArgs, collector: Collector) -> None:
        self.regex = regex
        self.collector = collector
        self.mode = args.output_mode
        self.whole = args.multiline or collector.before > 0 or collector.after > 0
        self.multiline = args.multiline
        self.skipped = 0

    def file(self, name: str, dir_fd: int, display: str, *, explicit: bool = False) -> None:
        """Search the file ``name`` in ``dir_fd``. Raises OSError."""
        f = open_regular(name, dir_fd=dir_fd)
        if f is None:
            return  # swapped for a non-regular file since the walk saw it
        with f:
            if not explicit and is_binary(f.peek(SNIFF_BYTES)):
                return
            if self.whole:
                if os.fstat(f.fileno()).st_size > MAX_WHOLE_FILE_BYTES:
                    self.skipped += 1
                    return
                self._whole(f.read(), display)
            else:
                self._lines(f, display)

    def _lines(self, f: Any, display: str) -> None:
        count = 0
        search = self.regex.search
        for number, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace").removesuffix("\n").removesuffix("\r")
            if search(line) is None:
                continue
            count += 1
            if self.mode == "files_with_matches":
                self.collector.add_file(display)
                return
            if self.mode == "content" and not self.collector.add_match(display, number, line, {}):
                return
        if count and self.mode == "count":
            self.collector.add_count(display, count)

    def _whole(self, data: bytes, display: str) -> None:
        text = data.decode("utf-8", errors="replace")
        lines = [line.removesuffix("\r") for line in text.split("\n")]
        if text.endswith("\n"):
            lines.pop()
        # (first line, last line) of each match, 1-based; overlapping ones merged, as rg does.
        spans: list[tuple[int, int]] = []
        if self.multiline:
            starts = [0]
            starts += [i + 1 for i, c in enumerate(text) if c == "\n"]
            for m in self.regex.finditer(text):
                first = _line_of(starts, m.start())
                last = _line_of(starts, max(m.start(), m.end() - 1))
                if spans and first <= spans[-1][1]:
                    spans[-1] = (spans[-1][0], max(last, spans[-1][1]))
                else:
                    spans.append((first, last))
        else:
            spans = [(n, n) for n, line in enumerate(lines, start=1) if self.regex.search(line)]
        if not spans:
            return
        if self.mode == "files_with_matches":
            self.collector.add_file(display)
            return
        if self.mode == "count":
            self.collector.add_count(display, sum(last - first + 1 for first, last in spans))
            return
        by_number = dict(enumerate(lines, start=1))
        for first, last in spans:
            matched = "\n".join(lines[first - 1 : last])
            if not self.collector.add_match(display, first, matched, by_number):
                return


def _line_of(starts: list[int], offset: int) -> int:
    return bisect.bisect_right(starts, offset)
