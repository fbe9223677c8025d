"""The files every section works on, and the marker that tells our processes from others'.

The machine is shared with other agents running their own tests (with their own ``sleep
1000``), so a process counts as ours when it descends from the bench process or carries
``MARKER`` in its environment: the template and workers inherit it from ours, and every call's
scrubbed environment gets it through the pool's config (``env.set``), so an escaped ``sleep``
carries it too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbx_pool import Config

MARKER = "SANDBX_BENCH_RUN"

#: The file every read reads: 16 lines of 64 bytes.
DATA_BYTES = 1024
_LINE = "sandbx-pool bench: a line of text that is 64 bytes long, newline"


@dataclass(frozen=True)
class BenchWorkspace:
    root: Path  # private temporary directory, removed at the end
    workspace: Path  # the pool's workspace (the peers read the same file)
    data: Path  # workspace/data.txt, DATA_BYTES long
    fifo: Path  # workspace/fifo: a read of it blocks until a writer comes (none does)
    marker: str

    def config(self, **sections: dict[str, Any]) -> Config:
        """The default config with the run's marker in every call's environment."""
        config = Config().override(env={"set": {MARKER: self.marker}})
        return config.override(**sections) if sections else config

    def journal(self, name: str) -> Path:
        return self.root / f"{name}.jsonl"


@contextmanager
def bench_workspace() -> Iterator[BenchWorkspace]:
    marker = os.environ.setdefault(MARKER, f"{os.getpid()}-{os.urandom(4).hex()}")
    root = Path(tempfile.mkdtemp(prefix="sandbx-bench-"))
    workspace = root / "ws"
    workspace.mkdir()
    data = workspace / "data.txt"
    line = _LINE[:63] + "\n"
    data.write_text(line * (DATA_BYTES // len(line)))
    assert data.stat().st_size == DATA_BYTES
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    (workspace / "soak").mkdir()
    try:
        yield BenchWorkspace(root, workspace, data, fifo, marker)
    finally:
        shutil.rmtree(root, ignore_errors=True)
