"""What the command line writes to a terminal: a call's control characters escaped, never
obeyed; the same command piped gives the exact bytes. The terminal is a real pseudo-terminal."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import termios
import time
from pathlib import Path

from helpers import cli_argv, marked_pool_toml

from sandbx_pool.terminal import escape_controls

#: Seconds a command may take on a loaded machine.
CHILD_S = 60

#: What the bash call prints: a window title (OSC 0), clear screen (CSI 2J), the clipboard
#: (OSC 52), a C1 CSI (U+009B, in UTF-8), a carriage return, a tab, a DEL and a newline.
RAW = b"\x1b]0;pwned\x07\x1b[2J\x1b]52;c;aGk=\x07\xc2\x9bX\rY\tZ\x7f\n"
COMMAND = r"printf '\033]0;pwned\007\033[2J\033]52;c;aGk=\007\302\233X\rY\tZ\177\n'"
SHOWN = rb"\x1b]0;pwned\x07\x1b[2J\x1b]52;c;aGk=\x07\x9bX\x0dY" + b"\tZ" + rb"\x7f" + b"\n"

#: Bytes that would drive a terminal: C0 but newline and tab, DEL, and C1 as UTF-8 (C2 80-9F).
DRIVING = re.compile(rb"[\x00-\x08\x0b-\x1f\x7f]|\xc2[\x80-\x9f]")


def on_terminal(argv: list[str], cwd: Path) -> tuple[int, bytes]:
    """Run ``argv`` with its stdout and stderr on a new pseudo-terminal; what it showed there."""
    master, slave = os.openpty()
    # No output processing: the master then reads the bytes written, not \n made into \r\n.
    attrs = termios.tcgetattr(slave)
    attrs[1] &= ~termios.OPOST
    termios.tcsetattr(slave, termios.TCSANOW, attrs)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd)
    finally:
        os.close(slave)
    shown = bytearray()
    deadline = time.monotonic() + CHILD_S
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not select.select([master], [], [], left)[0]:
                continue
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer of the terminal has closed it
                break
            if not data:
                break
            shown += data
        code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    return code, bytes(shown)


def test_escape_controls_escapes_every_control_but_newline_and_tab() -> None:
    controls = [*range(0x20), 0x7F, *range(0x80, 0xA0)]
    for code in controls:
        expected = chr(code) if chr(code) in "\n\t" else f"\\x{code:02x}"
        assert escape_controls(f"a{chr(code)}b") == f"a{expected}b"
    text = "plain ascii, é, 日本, \u00a0, \U0001f600, a \\ backslash"
    assert escape_controls(text) == text


def test_call_on_a_terminal_shows_controls_escaped_and_a_pipe_gets_the_bytes(
    workspace: Path, tmp_path: Path
) -> None:
    argv = cli_argv(
        "-q",  # no warning of this machine's fallbacks among the bytes compared
        "call",
        "bash",
        f"command={COMMAND}",
        "--workspace",
        str(workspace),
        "--journal",
        str(tmp_path / "journal.jsonl"),
        "--config",
        marked_pool_toml(tmp_path),
    )
    code, shown = on_terminal(argv, tmp_path)
    assert code == 0, shown
    assert shown.startswith(SHOWN), shown  # the streamed output, escaped
    assert not DRIVING.search(shown), shown
    outcome = json.loads(shown[len(SHOWN) :])
    assert outcome["value"]["stdout"].encode() == RAW  # the outcome keeps what was printed

    piped = subprocess.run(argv, capture_output=True, timeout=CHILD_S, cwd=tmp_path, check=False)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == RAW  # streamed output, byte for byte
    assert json.loads(piped.stdout)["value"]["stdout"].encode() == RAW


def test_run_on_a_terminal_escapes_ids_output_and_warnings_not_its_files(
    workspace: Path, tmp_path: Path
) -> None:
    evil_id = "id\x1b]0;pwned\x07\r\x9b"
    calls = tmp_path / "calls.jsonl"
    lines = [
        {"id": evil_id, "tool": "bash", "args": {"command": COMMAND}},
        # An argument the tool refuses: the warning quotes its name.
        {"id": "typo", "tool": "read", "args": {"path": "hello.txt", "bad\x1b[2J": 1}},
    ]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    outputs = tmp_path / "outputs"

    def argv(journal: str) -> list[str]:
        return cli_argv(
            "run",
            str(calls),
            "--workspace",
            str(workspace),
            "--journal",
            str(tmp_path / journal),
            "--config",
            marked_pool_toml(tmp_path),
            "--output-dir",
            str(outputs),
        )

    code, shown = on_terminal(argv("tty.jsonl"), tmp_path)
    assert code == 0, shown
    # The run's own controls are the progress line's redraw and the log's colours: nothing else.
    own = re.sub(rb"\r|\x1b\[K|\x1b\[[0-9;]*m", b"", shown)
    assert not DRIVING.search(own), own
    assert rb"id\x1b]0;pwned\x07\x0d\x9b" in own  # the id, in the summary's slowest calls
    assert rb"bad\x1b[2J" in own  # the warning about the argument
    assert rb"\x1b[0m" not in shown, "the log's colours were escaped as if they were text"
    # The output file is the call's output as it was, for tail -f and programs.
    (output_file,) = outputs.iterdir()
    assert output_file.read_bytes() == RAW

    output_file.unlink()
    piped = subprocess.run(
        argv("pipe.jsonl"), capture_output=True, timeout=CHILD_S, cwd=tmp_path, check=False
    )
    assert piped.returncode == 0, piped.stderr
    assert evil_id.encode() in piped.stdout  # the summary, byte for byte
    assert b"bad\x1b[2J" in piped.stderr
