"""``{core.hooksPath}`` in ``[sandbox] protected``: the hooks directory the repository names.

git runs its hooks from ``core.hooksPath`` instead of ``.git/hooks`` when it is set: husky
sets it to ``.husky`` (``.husky/_`` since v9), many projects to ``.githooks``. A call that
writes ``pre-commit`` there plants a hook as surely as in ``.git/hooks``, and the user's next
``git commit`` runs it outside any sandbox. So the entry stands for that directory, read from
the workspace's ``.git/config`` by the worker at each call (the coordinator never touches the
workspace's filesystem), and becomes ``DIR/**``:

    .git/config            [core] hooksPath = .githooks       -> ".githooks/**"
    relative to the workspace (git runs hooks in the top of the work tree), or absolute inside
    it; outside it (``/srv/hooks``, ``..``, ``~/hooks``)   -> nothing: Landlock keeps bash out
    of it unless ``[sandbox] writable`` grants it
    the workspace itself or ``.git``                      -> git's hook names in it, one by one:
    held whole, either would hold the whole repository read-only (every later ``git commit``
    would fail), and git runs nothing else from there

What is read: ``.git/config`` alone, reached without a symlink, at most MAX_CONFIG_BYTES, with
the part of git's syntax a value needs (sections, quotes, escapes, comments, continuation
lines). Not read: ``include.path``, the user's and the system's config, ``GIT_CONFIG_*``, and a
``.git`` that is a file (a linked worktree or a submodule, whose config lies elsewhere).
Reading the one file costs about 20 us; running ``git config`` would cost a process (about a
millisecond) and needs git installed.
"""

from __future__ import annotations

import os

#: The entry of ``[sandbox] protected`` that stands for the directory ``core.hooksPath`` names.
TOKEN = "{core.hooksPath}"

#: The hooks git runs (githooks(5), git 2.45): what a hooks directory that cannot be held as a
#: whole (the workspace itself, ``.git``) is held by.
HOOK_NAMES = (
    "applypatch-msg",
    "pre-applypatch",
    "post-applypatch",
    "pre-commit",
    "pre-merge-commit",
    "prepare-commit-msg",
    "commit-msg",
    "post-commit",
    "pre-rebase",
    "post-checkout",
    "post-merge",
    "pre-push",
    "pre-receive",
    "update",
    "proc-receive",
    "post-receive",
    "post-update",
    "reference-transaction",
    "push-to-checkout",
    "pre-auto-gc",
    "post-rewrite",
    "sendemail-validate",
    "fsmonitor-watchman",
    "p4-changelist",
    "p4-prepare-changelist",
    "p4-post-changelist",
    "p4-pre-submit",
    "post-index-change",
)

#: A .git/config larger than this is not read (git's own are a few hundred bytes; one this
#: large is read at every call): the outcome says its hooksPath is not guarded.
MAX_CONFIG_BYTES = 1 << 20

#: What a note about a path the call's guard does not cover looks like: {"path", "reason"}.
Note = dict[str, str]

_NO_SYMLINK = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def expand(root: str, patterns: tuple[str, ...]) -> tuple[tuple[str, ...], list[Note]]:
    """``patterns`` with TOKEN replaced by what it stands for in the workspace ``root`` (real),
    and notes on what could not be read."""
    if TOKEN not in patterns:
        return patterns, []
    rest = tuple(p for p in patterns if p != TOKEN)
    extra, notes = hooks_patterns(root)
    return rest + extra, notes


def hooks_patterns(root: str) -> tuple[tuple[str, ...], list[Note]]:
    """The protected patterns for the hooks directory ``root/.git/config`` names."""
    text, notes = _read_config(root)
    value = hooks_path(text) if text else None
    if not value:
        return (), notes
    rel = inside(root, value)
    if rel is None:
        return (), notes
    if any(c in rel for c in "*?["):
        reason = f"core.hooksPath {value!r} has a glob character: not guarded"
        return (), [*notes, {"path": rel, "reason": reason}]
    if rel in ("", ".git"):
        return tuple(f"{rel}/{name}".lstrip("/") for name in HOOK_NAMES), notes
    return (f"{rel}/**",), notes


def inside(root: str, value: str) -> str | None:
    """``value`` (a hooksPath) relative to the workspace ``root``, "" for the root itself, or
    None when it lies outside. Lexical, as git uses it: ``..`` is resolved by name."""
    if value.startswith(("~", "%(prefix)")):
        return None  # the user's home or git's installation: never the workspace's own
    path = os.path.normpath(os.path.join(root, value))
    real = os.path.realpath(root)
    for base in dict.fromkeys((os.path.normpath(root), real)):
        if path == base:
            return ""
        if path.startswith(base.rstrip("/") + "/"):
            return path[len(base.rstrip("/")) + 1 :]
    return None


def _read_config(root: str) -> tuple[str | None, list[Note]]:
    """``.git/config``, reached from ``root`` without a symlink; None if it is not there."""
    try:
        top = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None, []
    fd = -1
    try:
        git = os.open(".git", _NO_SYMLINK | os.O_DIRECTORY, dir_fd=top)
        try:
            fd = os.open("config", _NO_SYMLINK, dir_fd=git)
        finally:
            os.close(git)
        data = os.read(fd, MAX_CONFIG_BYTES + 1)
    except OSError:
        return None, []  # no repository here, a .git file, a symlink: nothing to read
    finally:
        if fd >= 0:
            os.close(fd)
        os.close(top)
    if len(data) > MAX_CONFIG_BYTES:
        reason = f"larger than {MAX_CONFIG_BYTES} bytes: its core.hooksPath is not read"
        return None, [{"path": ".git/config", "reason": reason}]
    return data.decode("utf-8", "surrogateescape"), []


def hooks_path(text: str) -> str | None:
    """The last ``core.hooksPath`` a git config file sets, as git reads it; None if unset.

    Sections and names are case-insensitive; ``[core "sub"]`` and ``[core.sub]`` are other
    sections. Where git would refuse the file (a bad header, name or escape, an unterminated
    quote), what was read until then stands: git then runs no command at all, hooks included.
    """
    if "hookspath" not in text.lower():
        return None  # most configs: no need to parse them
    text = text.replace("\r\n", "\n")
    found: str | None = None
    in_core = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in _BLANK or c == "\n":
            i += 1
        elif c in "#;":
            i = _line_end(text, i)
        elif c == "[":
            header = _header(text, i)
            if header is None:
                return found
            in_core, i = header
        elif c.isascii() and c.isalpha():
            j = i
            while j < n and ((text[j].isascii() and text[j].isalnum()) or text[j] == "-"):
                j += 1
            name = text[i:j].lower()
            while j < n and text[j] in " \t":
                j += 1
            value: str | None = None
            if j < n and text[j] == "=":
                value, i = _value(text, j + 1)
                if value is None:
                    return found
            elif j < n and text[j] != "\n":
                return found  # a bare name must end its line
            else:
                i = j  # a bare name is boolean true: not a path
            if in_core and name == "hookspath":
                found = value
        else:
            return found
    return found


#: What git's config parser takes for blanks (its isspace, newline aside).
_BLANK = " \t\r\v\f"


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end + 1


def _header(text: str, i: int) -> tuple[bool, int] | None:
    """Whether the section header at ``text[i]`` (``[``) opens ``[core]``, and where it ends;
    None if git would refuse it."""
    n = len(text)
    j = i + 1
    while j < n and text[j] != "]" and text[j] not in _BLANK + "\n":
        j += 1
    if j < n and text[j] == "]":
        return text[i + 1 : j].lower() == "core", j + 1
    while j < n and text[j] in _BLANK:
        j += 1
    if j >= n or text[j] != '"':
        return None
    j += 1
    while j < n and text[j] != '"':  # a subsection: ``[core "x"]`` is not ``[core]``
        if text[j] == "\n":
            return None
        j += 2 if text[j] == "\\" else 1
    if j + 1 >= n or text[j + 1] != "]":
        return None
    return False, j + 2


_ESCAPES = {"n": "\n", "t": "\t", "b": "\b", "\\": "\\", '"': '"'}


def _value(text: str, i: int) -> tuple[str | None, int]:
    """The value from ``text[i]`` (after the ``=``) to its line's end, as git's parse_value reads
    it, and where the next line starts; None where git would refuse it."""
    out: list[str] = []
    size = spaces = 0
    quoted = comment = False
    n = len(text)
    while True:
        c = text[i] if i < n else "\n"  # the end of the file ends the line
        i += 1
        if c == "\n":
            return (None if quoted else "".join(out)), i
        if comment:
            continue
        if not quoted and c in _BLANK:
            spaces += 1 if size else 0  # leading blanks are dropped, inner ones become spaces
            continue
        if not quoted and c in "#;":
            comment = True
            continue
        if spaces:
            out.append(" " * spaces)
            size, spaces = size + spaces, 0
        if c == "\\":
            c = text[i] if i < n else "\n"
            i += 1
            if c == "\n":
                continue  # a continuation line
            if c not in _ESCAPES:
                return None, i
            out.append(_ESCAPES[c])
            size += 1
        elif c == '"':
            quoted = not quoted
        else:
            out.append(c)
            size += 1
