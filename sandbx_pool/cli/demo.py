"""``sandbx-pool demo``: the batch runner on built-in data, showing every way a call can end.

It builds a small project in a temporary directory (sources, a README, and a FIFO nobody
writes to) and runs a built-in batch through the same loader and runner as ``sandbx-pool run``:

* greps, reads, ls and find in parallel (grep walks past the FIFO without hanging);
* a write, then an edit of the same file, then a read of it: ``after`` orders them;
* an edit whose old_string is absent: ``error``;
* a bash command that outlives its 0.5 s timeout: ``timeout``, its process group killed;
* a read of the FIFO, blocked in open(2) until a CancelToken stops it after 0.3 s: ``cancelled``;
* paths outside the workspace, through ``..`` and absolute: ``denied``, nothing forked.

Each outcome is printed as it arrives, then the run's summary and where the journal is.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from typing import Any, Final, TextIO

from sandbx_pool.batch.calls import CallSpec, parse_batch
from sandbx_pool.batch.progress import format_summary
from sandbx_pool.batch.run import BatchReport, run_batch
from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import Config
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.pool import Pool
from sandbx_pool.runtime_dir import default_journal_path
from sandbx_pool.signals import Stopper

PARALLEL: Final = 4
FIFO_CALL: Final = "read-fifo"
#: Long enough that the read is surely blocked in open(2), short enough not to bore anyone.
FIFO_CANCEL_AFTER_S: Final = 0.3

FILES: Final = {
    "README.md": "# inventory\n\nA tiny service that counts things.\nTODO: document the API\n",
    "src/app.py": (
        "from util import total\n\n\ndef main():\n    print(total([1, 2, 3]))\n\n\n"
        "def health():\n    return 'ok'  # todo: check the database\n"
    ),
    "src/util.py": "def total(items):\n    return sum(items)\n\n\ndef mean(items):\n"
    "    return total(items) / len(items)\n",
    "docs/notes.txt": "Deploy on Fridays only if the tests pass.\n",
}

CALLS: Final[list[dict[str, Any]]] = [
    # First, so that it is blocked before the timer fires; parallel lanes do the rest meanwhile.
    {"id": FIFO_CALL, "tool": "read", "args": {"path": "inbox.fifo"}},
    {"id": "grep-defs", "tool": "grep", "args": {"pattern": r"^def \w+", "glob": "**/*.py"}},
    {"id": "grep-todo", "tool": "grep", "args": {"pattern": "todo", "ignore_case": True}},
    {"id": "read-app", "tool": "read", "args": {"path": "src/app.py"}},
    {"id": "read-readme", "tool": "read", "args": {"path": "README.md", "limit": 2}},
    {"id": "ls-root", "tool": "ls", "args": {}},
    {"id": "find-py", "tool": "find", "args": {"pattern": "**/*.py"}},
    {
        "id": "write-config",
        "tool": "write",
        "args": {"path": "config.ini", "content": "[server]\nport = 8000\n"},
    },
    {
        "id": "edit-config",
        "tool": "edit",
        "args": {"path": "config.ini", "old_string": "8000", "new_string": "9000"},
        "after": ["write-config"],
    },
    {"id": "read-config", "tool": "read", "args": {"path": "config.ini"}, "after": ["edit-config"]},
    {
        "id": "edit-missing",
        "tool": "edit",
        "args": {"path": "src/util.py", "old_string": "def median", "new_string": "def mid"},
    },
    {"id": "bash-count", "tool": "bash", "args": {"command": "grep -c '^def ' src/*.py"}},
    {"id": "bash-slow", "tool": "bash", "args": {"command": "sleep 30"}, "timeout": 0.5},
    {"id": "read-outside", "tool": "read", "args": {"path": "../../etc/passwd"}},
    {"id": "write-outside", "tool": "write", "args": {"path": "/etc/sandbx-demo", "content": "x"}},
]


def build_workspace(root: str) -> None:
    for relative, content in FILES.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(content)
    # Nobody ever opens its write end: a read blocks in open(2) until it is killed.
    os.mkfifo(os.path.join(root, "inbox.fifo"))


def describe(outcome: Outcome) -> str:
    """One short phrase for an outcome: what the tool returned, or why it did not."""
    if outcome.status is not Status.OK:
        if outcome.killed_by is not None:
            return f"killed by {outcome.killed_by}: {outcome.reason or ''}".rstrip(": ")
        return outcome.error or ""
    value = outcome.value or {}
    for key, noun in (
        ("matches", "match(es)"),
        ("entries", "entries"),
        ("paths", "path(s)"),
    ):
        if isinstance(value.get(key), list):
            return f"{len(value[key])} {noun}"
    if "content" in value:
        return f"{str(value['content']).count(chr(10))} line(s): {str(value['content'])[:40]!r}"
    if "replacements" in value:
        return f"{value['replacements']} replacement(s)"
    if "bytes" in value:
        return f"{value['bytes']} bytes written"
    if "exit_code" in value:
        return f"exit {value['exit_code']}, stdout {str(value.get('stdout', '')).strip()!r}"
    return json.dumps(value)[:60]


def outcome_line(spec: CallSpec, outcome: Outcome) -> str:
    return (
        f"  {outcome.status:<9}  {spec.tool:<5}  {spec.call_id:<13}  "
        f"{outcome.duration_s:6.3f} s  {describe(outcome)}"
    )


async def run_demo(
    out: TextIO,
    *,
    config: Config | None = None,
    journal: str | None = None,
    stop: Stopper | None = None,
) -> BatchReport:
    """Run the built-in batch on a fresh temporary workspace; print as it goes."""
    batch = parse_batch([json.dumps(call) for call in CALLS], "<demo>")
    journal = journal or default_journal_path()
    loop = asyncio.get_running_loop()
    token = CancelToken()
    timers: list[asyncio.TimerHandle] = []

    def on_submit(spec: CallSpec) -> None:
        if spec.call_id == FIFO_CALL:
            reason = f"demo: nobody writes to the FIFO; stopped after {FIFO_CANCEL_AFTER_S} s"
            timers.append(loop.call_later(FIFO_CANCEL_AFTER_S, token.cancel, reason))

    with tempfile.TemporaryDirectory(prefix="sandbx-demo-") as root:
        workspace = os.path.join(root, "project")
        build_workspace(workspace)
        print(f"workspace: {workspace} (removed afterwards)", file=out)
        print(f"running {len(batch.calls)} calls, {PARALLEL} at a time:\n", file=out)
        try:
            async with Pool(workspace, workers=PARALLEL, journal=journal, config=config) as pool:
                if stop is not None:
                    stop.watch(pool)
                report = await run_batch(
                    pool,
                    batch.calls,
                    parallel=PARALLEL,
                    stop=stop.stopping if stop is not None else None,
                    on_submit=on_submit,
                    on_outcome=lambda spec, outcome: print(outcome_line(spec, outcome), file=out),
                    tokens={FIFO_CALL: token},
                )
        finally:
            for timer in timers:
                timer.cancel()
    print("", file=out)
    print("\n".join(format_summary(report)), file=out, flush=True)
    return report


def run_demo_command(config: Config, journal: str | None) -> int:
    """``sandbx-pool demo``: stoppable by TERM/INT/HUP/QUIT like ``run``."""
    from sandbx_pool.signals import run_until_signalled

    async def main(stopper: Stopper) -> int:
        report = await run_demo(sys.stdout, config=config, journal=journal, stop=stopper)
        return 0 if report.complete else 1

    return run_until_signalled(main)
