"""What the command line writes to a terminal: the text it shows, never a control it did not mean.

A call's output, its error text, its call id and the paths it names are a command's or a
model's text. Written raw to a terminal, their control characters drive it: OSC 0 retitles the
window, CSI 2J clears the screen, OSC 52 writes the operator's clipboard (on terminals that
honour it), ``\\r`` overwrites what was shown, and a C1 control (U+0080-U+009F) is a one-character
ESC sequence to some terminals. So on a terminal every control character but ``\\n`` and ``\\t``
(C0, DEL, C1) is shown as ``\\xNN``; written anywhere else (a pipe, a file) text stays exactly
what the call produced, for the programs that read it.

    cli.main: sys.stdout, sys.stderr --guarded()--> GuardedStream (while the command runs)
        print(...), a stream's write --> escape_controls, if the stream is a terminal
    a writer that means a control sequence (the progress line's redraw, the log's colours):
        escape_controls(its text) --> unguarded(stream).write

One guard at the boundary, not an escape at each writer: every line any command prints (the
outcome JSON, streamed output, the run's summary, a journal's table, a usage error, a traceback)
passes through it, including lines written after this module was. A backslash is not escaped:
this is a display, not an encoding (``\\x1b`` in the text looks as an escaped ESC does); a
program that needs the exact bytes reads a pipe.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any, Final, TextIO, cast

#: Every C0 control but newline and tab, DEL, and the C1 controls: each becomes ``\\xNN``.
_CONTROLS: Final = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)]
_ESCAPES: Final = {code: f"\\x{code:02x}" for code in _CONTROLS if chr(code) not in "\n\t"}


def escape_controls(text: str) -> str:
    """``text`` with its control characters (see the module) written as ``\\xNN``."""
    return text.translate(_ESCAPES)


class GuardedStream:
    """A text stream that escapes control characters in what is written to it, for a terminal.

    Everything but ``write`` and ``writelines`` is the wrapped stream's (``fileno``, ``flush``,
    ``buffer``: bytes written there pass unchanged, as a binary writer such as the MCP server
    means them)."""

    def __init__(self, stream: TextIO) -> None:
        self.unguarded = stream

    def write(self, text: str) -> int:
        self.unguarded.write(escape_controls(text))
        return len(text)  # what print() and TextIO callers count: the characters given

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.unguarded, name)


def unguarded(stream: TextIO) -> TextIO:
    """The stream under a guard, for a writer that escapes its text itself (escape_controls)
    and writes control sequences it means; any other stream is returned as it is."""
    if isinstance(stream, GuardedStream):
        return stream.unguarded
    return stream


def _guard(stream: TextIO) -> TextIO:
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):  # no such method, or closed
        terminal = False
    if not terminal or isinstance(stream, GuardedStream):
        return stream
    # A terminal stays one: the decision is made once, not at each write.
    return cast(TextIO, GuardedStream(stream))


@contextlib.contextmanager
def guarded() -> Iterator[None]:
    """Guard ``sys.stdout`` and ``sys.stderr`` (those that are terminals) while the body runs."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _guard(sys.stdout), _guard(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


__all__ = ["GuardedStream", "escape_controls", "guarded", "unguarded"]
