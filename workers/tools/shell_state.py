"""A shell session's state, carried from one bash call to the next (sandbx_pool.sessions).

Inside the worker, for a call with ``ExecutionContext.session_env``::

    Capture(ctx): a pipe; its write end is handed to bash alone (pass_fds), as fd N
    bash -c WRAPPER bash COMMAND          env = the pool's env + the session's exports
        WRAPPER: trap (report) EXIT; eval "$COMMAND"; report; exit with COMMAND's status
        report:  "sbx-session-1\\0" `pwd -P` "\\0" $PWD "\\0" `declare -px` "\\0sbx-end\\0" >&N
                 (builtins only: no program runs; parse_declare reads bash's quoting back)
    the worker's selector reads fd N beside stdout and stderr (never into them), bounded
    bash exited, its leftovers killed --> EOF --> Capture.state(): ShellState for Result.session
        cwd: resolved here, confined to the workspace (outside or gone: a fallback, and a note)
        env: what the shell exported beyond the pool's environment, reserved names left out

Why a descriptor and not stdout: the report must not appear in, nor be cut by, the command's
output (merge_stderr, keep_output_bytes, streaming); the capture's own stderr goes to
/dev/null and xtrace is switched off before it runs. Why ``eval`` of a positional argument
rather than a prefix to the command text: the command is parsed as it was written (its first
line is line 1), and the wrapper's last list was parsed before the command ran, so nothing
the command does to aliases or ``set -v`` reaches it.

What the command can do to the report is no more than what it can do with ``cd`` and
``export``: a forged report is parsed under the same bounds and the same confinement. What it
can do to prevent one (``exec``, ``kill -9 $$``, closing fd N, replacing the EXIT trap and
then calling ``exit``) leaves no report: the session keeps its previous state, and the note
says so.

Variables the session never carries (``RESERVED``): what the pool sets per call or for the
confinement (TMPDIR, the call's private one; HOME, USER and LOGNAME, set for the call's user
or a readable HOME; an allow-listed call's proxy variables, naming a port of that call's own
namespace: workers.netns), what bash keeps itself (PWD, OLDPWD, SHLVL, ``_``), and what would act on
the next call's bash before its wrapper does (BASH_ENV, ENV, SHELLOPTS, BASHOPTS,
BASH_XTRACEFD). The session's
exports are applied to bash's environment after the worker is confined: the confinement
(its Landlock rules read PATH's directories and HOME) is built from the pool's environment
only, so a session's PATH or LD_PRELOAD reaches nothing the call could not reach anyway.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Final

from sandbx_pool.workers.errors import Denied
from sandbx_pool.workers.paths import is_within, real_workspace, resolve
from sandbx_pool.workers.protocol import SESSION_ENV_BYTES, ExecutionContext, ShellState

#: Never carried from one call to the next (see above).
RESERVED: Final = frozenset(
    {"TMPDIR", "HOME", "USER", "LOGNAME", "PWD", "OLDPWD", "SHLVL", "_"}
    # What would run code or switch options in the next call's bash before its wrapper (a
    # startup file, xtrace printing the wrapper's own lines into the command's output).
    | {"BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "BASH_XTRACEFD"}
    # An allow-listed call's way to its proxy: a port in that call's namespace only.
    | {"HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY"}
    | {"http_proxy", "https_proxy", "all_proxy", "no_proxy"}
)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_HEADER: Final = b"sbx-session-1\0"
_TRAILER: Final = b"sbx-end"
_READ_BYTES = 64 * 1024

#: The script bash runs; {fd} is the report's descriptor. The command is $1 (shifted away, so
#: that its own $1 is empty as under ``bash -c COMMAND``). Everything after ``eval`` is one
#: list, parsed before the command runs.
_WRAPPER: Final = """__sbx_state() {{
  [ -z "${{__sbx_done-}}" ] || return 0
  __sbx_done=1
  {{ builtin printf 'sbx-session-1\\0'; builtin pwd -P; builtin printf '\\0%s\\0' "$PWD"
    builtin declare -px; builtin printf '\\0sbx-end\\0'; }} >&{fd} 2>/dev/null || :
}}
trap '{{ set +x; __sbx_state; }} 2>/dev/null' EXIT
__sbx_c=$1; builtin shift
eval "$__sbx_c"; {{ __sbx_rc=$?; set +x; __sbx_state; }} 2>/dev/null; builtin exit "$__sbx_rc"
"""

#: The same for a POSIX sh: the command as $1, shifted away; no report.
_SH_WRAPPER: Final = '__sbx_c=$1; command shift; eval "$__sbx_c"'

#: ``declare -px``'s lines: ``declare -FLAGS NAME``, then ``="..."`` or ``=$'...'`` or nothing
#: (exported, never set). A builtin: no fork and exec of env(1) on every call's clock (measured:
#: 2 ms a call against a loop of builtins over every name, 0.1 ms for this), and no exec that
#: refuses a string over 128 KiB.
_DECLARE = re.compile(rb"declare -([A-Za-z-]+) ([A-Za-z_][A-Za-z0-9_]*)")
_ANSI_ESCAPES: Final = {
    ord("a"): 7, ord("b"): 8, ord("e"): 27, ord("E"): 27, ord("f"): 12, ord("n"): 10,
    ord("r"): 13, ord("t"): 9, ord("v"): 11, ord("\\"): 92, ord("'"): 39, ord('"'): 34,
    ord("?"): 63,
}  # fmt: skip
_DOUBLE_QUOTED_ESCAPES: Final = frozenset(b'$`"\\\n')

#: The kernel's bound on one string of a program's environment (MAX_ARG_STRLEN, NAME=VALUE and
#: its NUL): a variable past it would make every later call's exec of bash fail (E2BIG).
_MAX_VARIABLE_BYTES: Final = 32 * 4096


def env_bytes(env: dict[str, str]) -> int:
    """How much of the bound ``env`` takes: names, values, and a separator each."""
    return sum(len(k.encode()) + len(v.encode()) + 2 for k, v in env.items())


def session_env(ctx: ExecutionContext, base: dict[str, str]) -> dict[str, str]:
    """bash's environment for a session call: ``base`` (the pool's, as the confinement set
    it), then the session's exports, reserved names left as the pool set them."""
    carried = ctx.session_env or {}
    return {**base, **{k: v for k, v in carried.items() if k not in RESERVED}}


def start_cwd(ctx: ExecutionContext, cwd: str) -> tuple[str, str | None]:
    """Where a session's call starts: its cwd, or, when another call removed that directory
    since, the nearest one above it that still exists (and a note saying so)."""
    if os.path.isdir(cwd):
        return cwd, None
    found = _existing_ancestor(ctx, cwd)
    shown = os.path.relpath(found, real_workspace(ctx.workspace))
    return found, f"the session's directory no longer exists: the call started in {shown}"


def _existing_ancestor(ctx: ExecutionContext, path: str) -> str:
    root = real_workspace(ctx.workspace)
    while is_within(path, root) and path != root and not os.path.isdir(path):
        path = os.path.dirname(path)
    return path if is_within(path, root) else root


class Capture:
    """The descriptor a session's bash reports its state on, read beside its output."""

    def __init__(self, ctx: ExecutionContext, base_env: dict[str, str], cwd: str) -> None:
        self.ctx = ctx
        self.base_env = base_env
        self.cwd = cwd  # where the call started (real path)
        self.read_fd, self.write_fd = os.pipe()
        self.data = bytearray()
        # The whole exported environment passes through here, the pool's part included.
        self.limit = SESSION_ENV_BYTES + env_bytes(base_env) + 2 * 4096 + 64
        self.overflow = False
        self.notes: list[str] = []

    def argv(self, command: str, shell: str = "bash") -> list[str]:
        if os.path.basename(shell) != "bash":
            # An image's sh (busybox, dash) has neither ``builtin`` nor ``declare``: it runs the
            # command alone, its exit status its own, and reports nothing (the session keeps
            # its state, and the outcome's note says so).
            return [shell, "-c", _SH_WRAPPER, "sh", command]
        return [shell, "-c", _WRAPPER.format(fd=self.write_fd), "bash", command]

    def started(self) -> None:
        """bash has its copy of the write end: ours must go, or EOF would never come."""
        os.close(self.write_fd)
        self.write_fd = -1

    def read(self) -> bool:
        """Take what the pipe holds; False at EOF, or once past the bound (the read end is
        then closed: a writer gets EPIPE instead of filling our memory)."""
        data = os.read(self.read_fd, _READ_BYTES)
        if not data:
            return False
        room = self.limit - len(self.data)
        self.data += data[: max(room, 0)]
        if len(data) > room:
            self.overflow = True
            self.close()
            return False
        return True

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.read_fd = self.write_fd = -1

    def state(self) -> ShellState:
        """What the report says, confined and bounded (see the module's docstring)."""
        data = bytes(self.data)
        if not data.startswith(_HEADER):
            note = (
                "the shell did not report its state (exec replaced it, a signal killed it, or"
                " its EXIT trap was replaced before it exited): the session keeps its state"
            )
            return ShellState(note=self._note(note))
        fields = data[len(_HEADER) :].split(b"\0")
        physical = fields[0].removesuffix(b"\n") if fields else b""
        logical = fields[1] if len(fields) > 1 else b""
        cwd = self._cwd(physical, logical)
        env = self._env(fields[2:])
        return ShellState(cwd=cwd, env=env, note=self._note())

    def _note(self, *more: str) -> str | None:
        notes = [*self.notes, *more]
        return "; ".join(notes) if notes else None

    def _cwd(self, physical: bytes, logical: bytes) -> str | None:
        root = real_workspace(self.ctx.workspace)
        if not physical:
            # `pwd -P` failed: the directory was removed under the shell.
            gone = os.path.realpath(os.fsdecode(logical)) if logical else self.cwd
            found = _existing_ancestor(self.ctx, gone if is_within(gone, root) else self.cwd)
            rel = os.path.relpath(found, root)
            self.notes.append(f"the shell's directory was removed: the session continues in {rel}")
            return _text(rel)
        path = os.fsdecode(physical)
        try:
            real = resolve(self.ctx, path) if os.path.isabs(path) else None
        except Denied:
            real = None
        if real is None or not os.path.isdir(real) or _text(os.path.relpath(real, root)) is None:
            fallback = _existing_ancestor(self.ctx, self.cwd)
            rel = os.path.relpath(fallback, root)
            shown = path.encode("utf-8", "backslashreplace").decode()
            self.notes.append(
                f"the shell ended outside the workspace ({shown}): the session stays in {rel}"
            )
            return _text(rel)
        return _text(os.path.relpath(real, root))

    def _env(self, entries: list[bytes]) -> dict[str, str] | None:
        if self.overflow:
            self.notes.append(
                f"its exported variables passed {SESSION_ENV_BYTES} bytes: the session keeps"
                " the ones it had"
            )
            return None
        listed = parse_declare(entries[0]) if entries[1:2] == [_TRAILER] else None
        if listed is None:
            self.notes.append(
                "its report of the exported variables was cut short or garbled: the session"
                " keeps the ones it had"
            )
            return None
        kept: dict[str, str] = {}
        dropped: list[str] = []
        too_large: list[str] = []
        for raw_name, raw_value in listed:
            try:
                name, value = raw_name.decode(), raw_value.decode()
            except UnicodeDecodeError:
                dropped.append(raw_name.decode("utf-8", "backslashreplace"))
                continue
            if not _NAME.match(name) or name in RESERVED:
                continue
            if len(raw_name) + len(raw_value) + 2 > _MAX_VARIABLE_BYTES:
                too_large.append(name)
            elif self.base_env.get(name) != value:
                kept[name] = value
        if dropped:
            self.notes.append(f"variables that are not UTF-8 are not kept: {', '.join(dropped)}")
        if too_large:
            self.notes.append(
                f"variables too large for a program's environment ({_MAX_VARIABLE_BYTES} bytes)"
                f" are not kept: {', '.join(too_large)}"
            )
        size = env_bytes(kept)
        if size > SESSION_ENV_BYTES:
            self.notes.append(
                f"its exported variables take {size} bytes, over {SESSION_ENV_BYTES}: the"
                " session keeps the ones it had"
            )
            return None
        return kept


def parse_declare(text: bytes) -> list[tuple[bytes, bytes]] | None:
    """The exported variables ``declare -px`` printed, as (name, value) bytes; exported names
    never set are left out. None when the text is not what bash prints (then nothing of it is
    trusted)."""
    found: list[tuple[bytes, bytes]] = []
    pos, end = 0, len(text)
    while pos < end:
        match = _DECLARE.match(text, pos)
        if match is None:
            return None
        flags, name = match.group(1), match.group(2)
        pos = match.end()
        if pos == end or text[pos] == 10:  # "\n": exported, no value
            pos += 1
            continue
        if text[pos] != 61:  # "="
            return None
        pos += 1
        if text.startswith(b"$'", pos):
            parsed = _ansi_c(text, pos + 2)
        elif text.startswith(b'"', pos):
            parsed = _double_quoted(text, pos + 1)
        else:
            return None
        if parsed is None:
            return None
        value, pos = parsed
        if pos < end and text[pos] != 10:
            return None
        pos += 1
        if b"a" not in flags and b"A" not in flags:  # an array is never exported
            found.append((name, value))
    return found


def _double_quoted(text: bytes, pos: int) -> tuple[bytes, int] | None:
    """``"..."`` from just after the opening quote: the value and the index after the closing
    one. A backslash escapes only $, `, ", \\ and a newline there."""
    out = bytearray()
    end = len(text)
    while pos < end:
        byte = text[pos]
        if byte == 34:  # the closing quote
            return bytes(out), pos + 1
        if byte == 92 and pos + 1 < end and text[pos + 1] in _DOUBLE_QUOTED_ESCAPES:
            out.append(text[pos + 1])
            pos += 2
            continue
        out.append(byte)
        pos += 1
    return None


def _ansi_c(text: bytes, pos: int) -> tuple[bytes, int] | None:
    """``$'...'`` from just after its opening quote, decoded as bash does (``\\n``, octal
    ``\\NNN``, ``\\xHH``...)."""
    out = bytearray()
    end = len(text)
    while pos < end:
        byte = text[pos]
        if byte == 39:  # the closing quote
            return bytes(out), pos + 1
        if byte != 92 or pos + 1 == end:
            out.append(byte)
            pos += 1
            continue
        escape = text[pos + 1]
        pos += 2
        if escape in _ANSI_ESCAPES:
            out.append(_ANSI_ESCAPES[escape])
        elif 48 <= escape <= 55:  # octal: up to three digits, this one included
            digits = bytes([escape])
            while len(digits) < 3 and pos < end and 48 <= text[pos] <= 55:
                digits += text[pos : pos + 1]
                pos += 1
            out.append(int(digits, 8) & 0xFF)
        elif escape == 120:  # \\xHH
            digits = b""
            while (
                len(digits) < 2 and pos < end and text[pos : pos + 1] in b"0123456789abcdefABCDEF"
            ):
                digits += text[pos : pos + 1]
                pos += 1
            out += bytes([int(digits, 16)]) if digits else b"\\x"
        else:  # bash keeps an escape it does not know as it was
            out += bytes([92, escape])
    return None


def _text(path: str) -> str | None:
    """A path the wire can carry (UTF-8), or None."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return path


__all__ = ["RESERVED", "Capture", "env_bytes", "session_env", "start_cwd"]
