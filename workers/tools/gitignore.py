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
Not supported: ``.git/info/exclude``, ``core.excludesFile``, backslash escapes other than the
two above. Every .gitignore from the workspace root down to the searched directory counts,
as git would count the ones above a subdirectory.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from sandbx_pool.workers.globs import translate_parts
from sandbx_pool.workers.tools.files import open_regular

#: Bytes read from one .gitignore at most: a pathological one must not cost a whole grep.
MAX_GITIGNORE_BYTES = 256 * 1024


class _Rule(NamedTuple):
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    anchored: bool


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
    return _Rule(re.compile(translate_parts(parts), re.DOTALL), negate, dir_only, anchored)


def parse_gitignore(text: str) -> list[_Rule]:
    return [rule for line in text.splitlines() if (rule := _compile_line(line)) is not None]


class GitIgnore:
    """The rules met so far on a walk, keyed by the directory of their .gitignore.

    Paths are walk-relative (``a/b.txt`` under the searched directory); ``base`` is where that
    directory sits in the workspace (``""`` or ``src/``), so rules found above it apply too.
    """

    def __init__(self, base: str, ancestors: list[int]) -> None:
        """``base`` is the searched directory's path in the workspace (``""``, ``src/``);
        ``ancestors`` the fds of the directories above it, the workspace first."""
        self._rules: dict[str, list[_Rule]] = {}
        self.base = base
        # The .gitignore files above the searched directory, from the workspace root down.
        prefix = ""
        for name, dir_fd in zip(base.split("/")[:-1], ancestors, strict=False):
            self._load(prefix, dir_fd)
            prefix = f"{prefix}{name}/"

    def enter(self, rel_dir: str, dir_fd: int) -> None:
        """Read the .gitignore of a directory the walk is about to list (``""``: the root)."""
        self._load(f"{self.base}{rel_dir}", dir_fd)

    def _load(self, prefix: str, dir_fd: int) -> None:
        try:
            # Never a symlink, a FIFO or a device: the walk's own rule for what it opens.
            f = open_regular(".gitignore", dir_fd=dir_fd)
        except OSError:
            return
        if f is None:
            return
        with f:
            try:
                data = f.read(MAX_GITIGNORE_BYTES)
            except OSError:
                return
        rules = parse_gitignore(data.decode("utf-8", errors="replace"))
        if rules:
            self._rules[prefix] = rules

    def ignored(self, rel: str, is_dir: bool) -> bool:
        """Whether the walk-relative ``rel`` is excluded by the rules above it."""
        path = f"{self.base}{rel}"
        verdict = False
        # Every ancestor directory, shallowest first, so deeper rules are consulted last.
        cut = 0
        while cut != -1:
            rules = self._rules.get(path[:cut])
            if rules:
                verdict = _apply(rules, path[cut:], is_dir, verdict)
            slash = path.find("/", cut)
            cut = -1 if slash == -1 else slash + 1
        return verdict


def _apply(rules: list[_Rule], sub: str, is_dir: bool, verdict: bool) -> bool:
    name = sub.rsplit("/", 1)[-1]
    for rule in rules:
        if rule.dir_only and not is_dir:
            continue
        if rule.regex.fullmatch(sub if rule.anchored else name) is not None:
            verdict = not rule.negate
    return verdict
