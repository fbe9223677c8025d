"""Globs over relative ``/``-separated paths, shared by find, grep's ``glob`` and .gitignore.

Written here rather than taken from fnmatch, whose ``*`` crosses ``/`` and which has no ``**``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from sandbx_pool.workers.errors import ToolError


def _translate_class(part: str, start: int) -> tuple[str, int] | None:
    """The regex for the ``[...]`` opening at ``part[start - 1]``, and the index after it."""
    j = start
    if j < len(part) and part[j] in "!^":
        j += 1
    if j < len(part) and part[j] == "]":
        j += 1  # a leading ] is a member, as in fnmatch
    while j < len(part) and part[j] != "]":
        j += 1
    if j >= len(part):
        return None
    body = part[start:j]
    negate = body[:1] in ("!", "^")
    if negate:
        body = body[1:]
    # Escape what re treats specially inside a set (and what it warns about as future set
    # syntax); keep '-' so ranges work.
    body = "".join(f"\\{c}" if c in "\\^[]&~|" else c for c in body)
    # A range such as [!-0] spans '/', which must still never match inside a component.
    regex = f"[^/{body}]" if negate else f"(?!/)[{body}]"
    return regex, j + 1


def translate_component(part: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(part):
        c = part[i]
        i += 1
        if c == "*":
            while i < len(part) and part[i] == "*":
                i += 1  # '**' inside a component is just '*'
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[" and (translated := _translate_class(part, i)) is not None:
            regex, i = translated
            out.append(regex)
        else:
            out.append(re.escape(c))
    return "".join(out)


def compile_glob(pattern: str) -> tuple[re.Pattern[str], bool]:
    """Compile a glob for matching relative paths; also say whether it wants directories only.

    ``**`` as a whole component matches any number of directories (``**/`` zero or more, a
    final ``**`` everything below); ``*`` and ``?`` never cross ``/``; ``[...]`` is a class
    (``!`` or ``^`` negates). Unlike a shell, ``*`` matches a leading dot: an agent asking for
    ``**/*.yml`` means ``.github/workflows/ci.yml`` too. A trailing ``/`` matches directories
    only. Leading ``/`` and ``./`` are ignored: the pattern is always relative.
    """
    dir_only = pattern.endswith("/")
    parts = [part for part in pattern.split("/") if part not in ("", ".")]
    if not parts:
        raise ToolError(f"empty glob pattern {pattern!r}")
    return re.compile(translate_parts(parts), re.DOTALL), dir_only


def translate_parts(parts: list[str]) -> str:
    """The regex of a glob split on "/": ``**`` spans any number of directories."""
    out: list[str] = []
    for index, part in enumerate(parts):
        last = index == len(parts) - 1
        if part == "**":
            out.append(".*" if last else "(?:[^/]+/)*")
        else:
            out.append(translate_component(part))
            if not last:
                out.append("/")
    return "".join(out)


def name_glob(pattern: str) -> re.Pattern[str] | None:
    """For ``**/NAME`` (the commonest find, ``**/*.py``), the regex of NAME alone: a path
    matches the whole glob exactly when its last component matches NAME, since ``**/`` takes
    any directories and NAME never crosses ``/``. None for any other glob."""
    parts = [part for part in pattern.rstrip("/").split("/") if part not in ("", ".")]
    if len(parts) != 2 or parts[0] != "**" or parts[1] == "**":
        return None
    return re.compile(translate_component(parts[1]), re.DOTALL)


def descent(pattern: str) -> Callable[[int, str], bool] | None:
    """Which directories a walk must enter to find every path the glob matches: a test of a
    directory's name and depth (0: the walk's root's entries), or None when any directory
    may hold a match (the glob starts with ``**``).

    A glob's leading components before its first ``**`` fix the directories a match lies in
    (``src/*/*.py``: ``src``, then any name); a glob without ``**`` also fixes the depth, so
    nothing deeper than its last directory needs listing (``*.py``: the root alone).
    """
    parts = [part for part in pattern.split("/") if part not in ("", ".")]
    if not parts or parts[0] == "**":
        return None
    star = parts.index("**") if "**" in parts else None
    fixed = [
        re.compile(translate_component(part), re.DOTALL)
        for part in parts[: star if star is not None else len(parts) - 1]
    ]

    def may_hold(depth: int, name: str) -> bool:
        if depth < len(fixed):
            return fixed[depth].fullmatch(name) is not None
        return star is not None  # past the fixed components only a ** reaches deeper

    return may_hold
