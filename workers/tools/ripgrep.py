"""grep through ``rg``: the binary, its argv for a call, and its output read as it comes.

Data flow inside the worker::

    rg --json ... --stdout pipe--> lines --> msgspec --> _Collector (max_results, byte room)
       |                                                     | full: kill rg, stop reading
       +--stderr--> memfd (one line per file rg could not read: ``skipped``)

Why rg: the Python loop over every line costs 9x to 22x rg's time (issue 12's figures); rg
searches a file at memory speed, on every core. It is a program, so grep gets bash's
confinement (workers.schemas.RUNS_PROGRAMS), and one more step: rg walks by path, so the
worker's mount namespace binds the workspace with symlinks refused (workers.sandbox), and rg
runs only where ``symlinks_refused`` (workers.rg_binary) confirms that bind holds. Elsewhere
grep walks by descriptor in Python (workers.tools.grep).

Where the binary comes from: the ``ripgrep`` wheel, a core dependency, installs ``rg`` next to
the interpreter (the virtual environment's bin, which Landlock lets a call execute), where
``find_rg`` (workers.rg_binary, which the doctor asks too) looks first.

The options that make rg's answer grep's: ``--no-config`` (no RIPGREP_CONFIG_PATH from the
call's environment), ``--no-require-git`` (a .gitignore counts outside a repository too, as it
always has here), ``--no-ignore-parent`` (nothing above the workspace is read: the rules of
the directories between the workspace and a searched subdirectory come in an ``--ignore-file``
instead, rewritten to be relative to the workspace, which is rg's cwd), ``--crlf`` (``$``
matches before a CRLF) and ``-g !.git`` (never search .git, even with ``hidden``).

Results come in no fixed order from rg's threads and are sorted at the end (sorting in rg,
``--sort path``, makes it single-threaded: twice as slow on two cores). When ``max_results``
cuts the answer short, which matches were kept therefore depends on the threads' timing.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import os
import subprocess
from typing import Any

import msgspec

from sandbx_pool.workers.tools.files import printable
from sandbx_pool.workers.tools.results import Collector

#: Threads rg may use: each counts against the call's [limits] processes.
MAX_THREADS = 8

#: Bytes asked of rg's stdout per read.
_READ_BYTES = 256 * 1024


class RgText(msgspec.Struct):
    text: str | None = None
    bytes: str | None = None  # base64, when the text is not valid UTF-8

    def decode(self) -> str:
        if self.text is not None:
            return self.text
        return base64.b64decode(self.bytes or "").decode("utf-8", errors="replace")


class RgData(msgspec.Struct):
    path: RgText | None = None
    lines: RgText | None = None
    line_number: int | None = None


class RgMessage(msgspec.Struct):
    type: str
    data: RgData


_decoder = msgspec.json.Decoder(RgMessage)


class RgRefused(Exception):
    """rg refused the pattern (a look-around, a backreference): Python's re may take it."""


class RgFailed(Exception):
    """rg refused the call for another reason (a bad glob, an unknown type): a one-line error."""


def run_rg(
    argv: list[str], cwd: str, mode: str, collector: Collector, pass_fds: tuple[int, ...] = ()
) -> int:
    """Run rg, feeding ``collector`` until rg ends or the collector is full; the count of
    files rg could not read. Raises RgRefused or RgFailed."""
    errors = os.memfd_create("rg-stderr", os.MFD_CLOEXEC)
    try:
        with open(os.devnull, "rb") as devnull:
            proc = subprocess.Popen(
                argv,
                cwd=cwd,
                stdin=devnull,
                stdout=subprocess.PIPE,
                stderr=errors,
                pass_fds=pass_fds,
            )
        assert proc.stdout is not None
        reader = _JsonReader(collector) if mode == "content" else _NulReader(mode, collector)
        try:
            fd = proc.stdout.fileno()
            while not collector.full:
                data = os.read(fd, _READ_BYTES)
                if not data:
                    break
                reader.feed(data)
            if collector.full:
                proc.kill()  # enough: the rest of the tree is not wanted
        finally:
            proc.stdout.close()
            proc.wait()
            reader.finish()
        os.lseek(errors, 0, os.SEEK_SET)
        stderr = os.read(errors, 64 * 1024).decode("utf-8", errors="replace")
    finally:
        os.close(errors)
    # rg reports a file it cannot read with the OS error ("... (os error 13)") and goes on;
    # any other message on a failed run is about the call itself (a bad glob, type, regex).
    problems = [line for line in stderr.splitlines() if line.startswith("rg: ")]
    unreadable = sum(1 for line in problems if "(os error" in line)
    if proc.returncode == 2 and not collector.full and unreadable < len(problems):
        if "regex parse error" in stderr or "error parsing regex" in stderr:
            raise RgRefused(stderr.strip())
        raise RgFailed(_first_error(stderr))
    return unreadable


def _first_error(stderr: str) -> str:
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith("rg: ") and "(os error" not in line:
            return line.removeprefix("rg: ")
    return stderr.strip().splitlines()[0] if stderr.strip() else "rg failed"


def _display(path: str) -> str:
    return printable(path.removeprefix("./"))


class _JsonReader:
    """``rg --json``: a begin, matches and context lines, an end per file.

    A match goes to the collector once the lines after it that the context asks for have
    come (rg sends each line once, shared by neighbouring matches), so a file of a million
    matching lines fills the answer from its first ones; only the lines a pending match may
    still need are kept.
    """

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
        self.pending = b""
        self.lines: dict[int, str] = {}
        self.matches: collections.deque[tuple[int, str]] = collections.deque()
        self.path = ""

    def feed(self, data: bytes) -> None:
        data = self.pending + data
        cut = data.rfind(b"\n")
        if cut == -1:
            self.pending = data
            return
        self.pending = data[cut + 1 :]
        for raw in data[: cut + 1].splitlines():
            if self.collector.full:
                return
            message = _decoder.decode(raw)
            kind, body = message.type, message.data
            if kind == "begin":
                self.path = _display(body.path.decode()) if body.path else ""
            elif kind in ("match", "context") and body.line_number is not None and body.lines:
                number = body.line_number
                self._flush(upto=number - 1)
                text = _strip_eol(body.lines.decode())
                if self.collector.before or self.collector.after:
                    self.lines[number] = text
                if kind == "match":
                    self.matches.append((number, text))
            elif kind == "end":
                self._flush()

    def _flush(self, upto: int | None = None) -> None:
        """Hand on the matches whose after-context is complete: every line up to ``upto``
        has come (None: the file has ended)."""
        after = self.collector.after
        while self.matches:
            number, text = self.matches[0]
            if upto is not None and number + text.count("\n") + after > upto:
                break
            self.matches.popleft()
            if not self.collector.add_match(self.path, number, text, self.lines):
                return
        if upto is None:
            self.lines = {}
        elif len(self.lines) > 1024:
            oldest = self.matches[0][0] if self.matches else upto + 1
            keep = oldest - self.collector.before
            self.lines = {n: line for n, line in self.lines.items() if n >= keep}

    def finish(self) -> None:
        self._flush()  # a file cut short by the kill: what was read of it still counts


class _NulReader:
    """``rg --files-with-matches --null`` (``path\\0``) or ``--count --null``
    (``path\\0count\\n``)."""

    def __init__(self, mode: str, collector: Collector) -> None:
        self.mode = mode
        self.collector = collector
        self.pending = b""

    def feed(self, data: bytes) -> None:
        data = self.pending + data
        if self.mode == "files_with_matches":
            *paths, self.pending = data.split(b"\0")
            for path in paths:
                if not self.collector.add_file(_display(os.fsdecode(path))):
                    return
            return
        cut = data.rfind(b"\n")
        self.pending = data[cut + 1 :]
        for line in data[: cut + 1].splitlines():
            path, _, count = line.rpartition(b"\0")
            if not self.collector.add_count(_display(os.fsdecode(path)), int(count)):
                return

    def finish(self) -> None:
        pass


def _strip_eol(text: str) -> str:
    return text.removesuffix("\n").removesuffix("\r")


def rg_argv(rg: str, args: Any, target: str, ignore_file: str | None) -> list[str]:
    """rg's argv for the GrepArgs ``args``, searching ``target`` (relative to the workspace)."""
    argv = [rg, "--no-config", "--no-require-git", "--no-ignore-parent", "--crlf"]
    argv += ["--threads", str(min(os.cpu_count() or 1, MAX_THREADS))]
    if args.output_mode == "files_with_matches":
        argv += ["--files-with-matches", "--null"]
    elif args.output_mode == "count":
        argv += ["--count", "--null"]
    else:
        argv += ["--json"]
        before, after = context_sizes(args)
        if before:
            argv += ["--before-context", str(before)]
        if after:
            argv += ["--after-context", str(after)]
    if args.ignore_case:
        argv.append("--ignore-case")
    if args.multiline:
        argv += ["--multiline", "--multiline-dotall"]
    if args.hidden:
        argv.append("--hidden")
    if not args.respect_gitignore:
        argv.append("--no-ignore")
    elif ignore_file is not None:
        argv += ["--ignore-file", ignore_file]
    if args.glob is not None:
        argv += ["--glob", args.glob]
    argv += ["--glob", "!.git"]
    if args.type is not None:
        argv += ["--type", args.type]
    argv += ["--regexp", args.pattern, "--", target]
    return argv


def context_sizes(args: Any) -> tuple[int, int]:
    """(lines before, lines after) each match: ``context`` unless the specific one is given."""
    before = args.context_before if args.context_before is not None else args.context or 0
    after = args.context_after if args.context_after is not None else args.context or 0
    return before, after


def type_globs(rg: str, name: str) -> list[str] | None:
    """The globs of rg's file type ``name`` (``rg --type-list``), None if rg has no such type."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listing = subprocess.run(
            [rg, "--no-config", "--type-list"], capture_output=True, check=True, timeout=10
        ).stdout.decode()
        for line in listing.splitlines():
            kind, _, globs = line.partition(":")
            if kind.strip() == name:
                return [glob.strip() for glob in globs.split(",") if glob.strip()]
    return None
