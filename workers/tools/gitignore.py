"""The .gitignore rules grep applies when asked (``respect_gitignore``).

The common subset of gitignore(5), enough for the files real repositories carry:

* one pattern a line; blank lines and ``#`` comments are skipped; trailing spaces are dropped
  unless escaped (``\\ ``); a leading ``\\#`` or ``\\!`` stands for a literal ``#`` or ``!``;
* ``!pattern`` re-includes what an earlier pattern excluded; the last matching pattern wins,
  and a deeper .gitignore is consulted after (so over) the ones above it;
* a trailing ``/`` matches directories only;
* a pattern with a ``/`` at its start or in its middle is anchored to its .gitignore's
  directory; otherwise it matches a name at any depth below it;
* ``*``, ``?`` and ``[...]`` never cross ``/``; ``**/`` spans any number of directories,
  a final ``/**`` everything inside.

An excluded directory is not entered, so (as in git) nothing below it can be re-included.

The files, as ripgrep reads them (``respect_gitignore``): ``.rgignore``, ``.ignore``,
``.gitignore`` in each directory and ``.git/info/exclude`` in a repository's root. A match in
an earlier kind decides over any match in a later one (an ``.ignore`` re-includes what a
``.gitignore`` excludes); within a kind, the deepest directory's last matching line wins.
Every file from the workspace root down to the searched directory counts, as git would count
the ones above a subdirectory; nothing above the workspace is read. Not supported:
``core.excludesFile``, backslash escapes other than the two above.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Container
from typing import NamedTuple

from sandbx_pool.workers.globs import translate_parts
from sandbx_pool.workers.paths import DIRECTORY_FLAGS
from sandbx_pool.workers.tools.files import open_regular

#: Bytes read from one .gitignore at most: a pathological one must not cost a whole grep.
MAX_GITIGNORE_BYTES = 256 * 1024


#: The ignore files of a directory, the most decisive first; ``.git/info/exclude`` is last.
KINDS = (".rgignore", ".ignore", ".gitignore")
_EXCLUDE = ".git/info/exclude"
#: The names in a directory that hold ignore rules.
NAMES = frozenset({*KINDS, ".git"})


class _Rule(NamedTuple):
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    anchored: bool
    glob: str  # the pattern as written, without "!" and the trailing "/"


def _compile_line(line: str) -> _Rule | None:
    """The rule a .gitignore line holds, or None for a blank line or a comment."""
    line = line.rstrip("\n").rstrip("\r")
    # Trailing spaces are dropped unless the last one is escaped with a backslash.
    line = line[:-2] + " " if line.endswith("\\ ") else line.rstrip(" ")
    if not line or line.startswith("#"):
        return None
    negate = line.startswith("!")
    # Drop the "!", or the backslash that makes a leading # or ! literal.
    if negate or line.startswith(("\\#", "\\!")):
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    # A slash left at the start or in the middle anchors the pattern to its directory.
    anchored = "/" in line
    parts = [part for part in line.split("/") if part]
    if not parts:
        return None
    regex = re.compile(translate_parts(parts), re.DOTALL)
    return _Rule(regex, negate, dir_only, anchored, "/".join(parts))


def compile_glob_rule(glob: str) -> _Rule | None:
    """One pattern as a .gitignore line (what rg's --glob is), None if it holds none."""
    return _compile_line(glob)


def parse_gitignore(text: str) -> list[_Rule]:
    return [rule for line in text.splitlines() if (rule := _compile_line(line)) is not None]


class GitIgnore:
    """The rules met so far on a walk, keyed by the directory of their file and its kind.

    Paths are walk-relative (``a/b.txt`` under the searched directory); ``base`` is where that
    directory sits in the workspace (``""`` or ``src/``), so rules found above it apply too.
    """

    def __init__(self, base: str, ancestors: list[int]) -> None:
        """``base`` is the searched directory's path in the workspace (``""``, ``src/``);
        ``ancestors`` the fds of the directories above it, the workspace first."""
        self._rules: dict[tuple[str, str], list[_Rule]] = {}
        self._applicable: dict[str, list[tuple[int, int, list[_Rule]]]] = {}
        # DirectoryRules that hold for any directory the same files' rules apply in.
        self._shared: dict[tuple[int, ...], DirectoryRules] = {}
        self.base = base
        # The ignore files above the searched directory, from the workspace root down.
        prefix = ""
        for name, dir_fd in zip(base.split("/")[:-1], ancestors, strict=False):
            self._load(prefix, dir_fd)
            prefix = f"{prefix}{name}/"
        #: Their rules, for rg (which reads nothing above the searched directory).
        self.above = dict(self._rules)

    def enter(self, rel_dir: str, dir_fd: int, present: Container[str] | None = None) -> None:
        """Read the ignore files of a directory the walk is about to list (``""``: the root);
        ``present``, the names the directory holds if known, spares opening missing ones
        (five failed opens per directory cost find a third of its time)."""
        self._load(f"{self.base}{rel_dir}", dir_fd, present)

    def _load(self, prefix: str, dir_fd: int, present: Container[str] | None = None) -> None:
        for kind in (*KINDS, _EXCLUDE):
            if present is not None and kind.split("/", 1)[0] not in present:
                continue
            text = _read(kind, dir_fd)
            rules = parse_gitignore(text) if text else []
            if rules:
                self._rules[prefix, kind] = rules

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether the walk-relative ``rel`` is excluded by the rules above it."""
        path = f"{self.base}{rel}"
        slash = path.rfind("/")
        directory = path[: slash + 1]
        applicable = self._collect(directory)
        verdict: bool | None = None
        kind = -1
        for rank, cut, rules in applicable:
            if rank != kind:
                if verdict is not None:
                    return verdict  # an earlier kind decided
                kind = rank
            verdict = _apply(rules, path[cut:], is_dir, verdict)
        return bool(verdict)

    def for_directory(self, rel_dir: str) -> DirectoryRules | None:
        """The rules for the entries of the walk-relative directory ``rel_dir`` (``""``,
        ``a/b/``), combined, or None when no rule applies there. Call it once the walk has
        entered the directory (``enter``); it is worth it for a directory's whole listing."""
        directory = f"{self.base}{rel_dir}"
        applicable = self._collect(directory)
        if not applicable:
            return None
        # The rule lists live as long as we do: their ids name them.
        key = tuple(id(rules) for _, _, rules in applicable)
        shared = self._shared.get(key)
        if shared is not None:
            return shared
        combined = DirectoryRules(self, rel_dir, directory, applicable)
        if combined.anywhere:
            self._shared[key] = combined
        return combined

    def _collect(self, directory: str) -> list[tuple[int, int, list[_Rule]]]:
        """The rules that apply in ``directory`` (``""``, ``a/b/``), each with its kind's rank
        and where its own directory's path ends, the most decisive kind first and, within
        a kind, the shallowest first (so that deeper rules are consulted last). Called once
        the walk has entered the directory, and every directory above, so their files are
        read: each directory's answer is its parent's with its own files' rules added, kept,
        and the very list of its parent's when it has none (most directories: the rules
        combined for the parent then serve it as they are, ``for_directory``)."""
        found = self._applicable.get(directory)
        if found is not None:
            return found
        # The directories from the nearest one already collected down to this one: a loop,
        # not a recursion, since a tree may be deeper than Python's recursion limit.
        missing = [directory]
        while missing[-1]:
            parent = missing[-1][: missing[-1].rfind("/", 0, len(missing[-1]) - 1) + 1]
            found = self._applicable.get(parent)
            if found is not None:
                break
            missing.append(parent)
        else:
            found = []
        for path in reversed(missing):
            own = [
                (rank, len(path), rules)
                for rank, kind in enumerate((*KINDS, _EXCLUDE))
                if (rules := self._rules.get((path, kind)))
            ]
            if own:
                found = sorted([*found, *own], key=lambda item: item[:2])
            self._applicable[path] = found
        return found

    def above_as_text(self) -> str:
        """The rules from above the searched directory as one ignore file whose patterns are
        relative to the workspace root (rg's ``--ignore-file``, run from the workspace)."""
        lines = []
        for kind in (_EXCLUDE, *reversed(KINDS)):  # the least decisive first: the last wins
            for (prefix, rule_kind), rules in self.above.items():
                if rule_kind != kind:
                    continue
                for rule in rules:
                    glob = rule.glob if rule.anchored else f"**/{rule.glob}"
                    line = f"/{prefix}{glob}" if prefix or rule.anchored else rule.glob
                    lines.append(
                        ("!" if rule.negate else "") + line + ("/" if rule.dir_only else "")
                    )
        return "".join(f"{line}\n" for line in lines)


class DirectoryRules:
    """The ignore rules that apply in one directory, for its entries: one regex match per
    entry, instead of a walk over every rule of every ignore file above it.

    Without a ``!`` rule, an entry is ignored when any rule matches it, whatever the kind and
    depth of the file the rule came from: those only decide between verdicts that differ. The
    unanchored rules (which match a name) then become one alternation per entry type
    (directory or not), the same string in every directory under the same files, so ``re``
    compiles it once. The anchored ones (``/build``, ``docs/*.md``) match the path below their
    own directory, which differs in each directory; they are kept apart, and one without
    ``**`` only where its entries are as deep as it has components: few are left to try. With
    a ``!`` rule the order matters, and the entry takes ``GitIgnore.ignored``'s way.
    """

    __slots__ = ("_anchored", "_by_name", "_directory", "_general", "_rel_dir", "anywhere")

    def __init__(
        self,
        ignore: GitIgnore,
        rel_dir: str,
        directory: str,
        applicable: list[tuple[int, int, list[_Rule]]],
    ) -> None:
        self._rel_dir = rel_dir
        self._directory = directory
        rules = [(cut, rule) for _, cut, kind_rules in applicable for rule in kind_rules]
        self._general = ignore if any(rule.negate for _, rule in rules) else None
        #: No ! and no anchored rule: these rules decide alike in every directory they apply to.
        self.anywhere = self._general is None and not any(rule.anchored for _, rule in rules)
        # Index 0: for files (and every entry but a directory), 1: for directories.
        names: tuple[list[str], list[str]] = ([], [])
        self._anchored: tuple[list[tuple[int, _Rule]], list[tuple[int, _Rule]]] = ([], [])
        for cut, rule in rules:
            kinds = (1,) if rule.dir_only else (0, 1)
            if not rule.anchored:
                for kind in kinds:
                    names[kind].append(f"(?:{rule.regex.pattern})")
                continue
            depth = directory.count("/", cut) + 1  # components below the rule's directory
            parts = rule.glob.split("/")
            if "**" in parts or len(parts) == depth:
                for kind in kinds:
                    self._anchored[kind].append((cut, rule))
        self._by_name = tuple(
            re.compile("|".join(alternatives), re.DOTALL) if alternatives else None
            for alternatives in names
        )

    def ignored(self, name: str, is_dir: bool) -> bool:
        """Whether the entry ``name`` of this directory is excluded."""
        if self._general is not None:
            return self._general.ignored(f"{self._rel_dir}{name}", is_dir)
        by_name = self._by_name[is_dir]
        if by_name is not None and by_name.fullmatch(name) is not None:
            return True
        anchored = self._anchored[is_dir]
        if anchored:
            path = f"{self._directory}{name}"
            return any(rule.regex.fullmatch(path, cut) is not None for cut, rule in anchored)
        return False

    def by_name(self, is_dir: bool) -> tuple[bool, re.Pattern[str] | None]:
        """Whether the name alone decides for directories (or the other entries), no ``!``
        or anchored rule applying to them, and then the alternation that does (None: no rule
        applies to them at all)."""
        if self._general is None and not self._anchored[is_dir]:
            return True, self._by_name[is_dir]
        return False, None

    def check(self, is_dir: bool) -> Callable[[str], object] | None:
        """The test of an entry's name (truthy: ignored) for directories or the other entries,
        None when no rule applies to them: where the name alone decides, the alternation's own
        ``fullmatch``, so that the walk calls no Python function per entry."""
        alone, regex = self.by_name(is_dir)
        if alone:
            return None if regex is None else regex.fullmatch
        return functools.partial(self.ignored, is_dir=is_dir)


def _read(name: str, dir_fd: int) -> str:
    """An ignore file's text, '' if missing or unreadable."""
    parent = dir_fd
    opened = []
    try:
        *dirs, leaf = name.split("/")
        for part in dirs:
            # Never through a symlink: the walk's own rule (O_NOFOLLOW at every step).
            parent = os.open(part, DIRECTORY_FLAGS, dir_fd=parent)
            opened.append(parent)
        # Never a symlink, a FIFO or a device: the walk's own rule for what it opens.
        f = open_regular(leaf, dir_fd=parent)
        if f is None:
            return ""
        with f:
            data = f.read(MAX_GITIGNORE_BYTES)
    except OSError:
        return ""
    finally:
        for fd in opened:
            os.close(fd)
    return data.decode("utf-8", errors="replace")


def _apply(rules: list[_Rule], sub: str, is_dir: bool, verdict: bool | None) -> bool | None:
    name = sub.rsplit("/", 1)[-1]
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        if rule.regex.fullmatch(sub if rule.anchored else name) is not None:
            verdict = not rule.negate
    return verdict
