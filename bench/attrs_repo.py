"""The real repository the trajectory works on: attrs 24.2.0's sdist, and a venv for its tests.

Both are made once and kept in ``~/.cache/sandbx-pool-bench`` (``$XDG_CACHE_HOME`` if set):
the sdist as ``pip download attrs==24.2.0 --no-deps --no-binary :all:`` gives it (the source,
its tests and their conftest, as a contributor has it), and a venv with what the conftest and
the tests run import (pytest, hypothesis). attrs itself is not installed there: the tests run
with ``PYTHONPATH=src``, so they test the copy the trajectory edited.

The venv lies outside every workspace, so a pool has to be told it may read it (``[sandbox]
read_only``: the venv and the interpreter it was made from), as a user running a repository's
tests through a pool would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from loguru import logger

NAME, VERSION = "attrs", "24.2.0"
#: What the conftest and the chosen test files import, besides attrs.
TEST_REQUIREMENTS = ("pytest", "hypothesis")
#: pip's and venv's own work, online the first time: generous, but bounded.
SETUP_TIMEOUT_S = 600


@dataclass(frozen=True)
class Repository:
    sdist: Path
    python: Path  # the tests' venv's interpreter
    readable: tuple[str, ...]  # what a pool must be allowed to read to run it

    def extract(self, into: Path) -> Path:
        """A fresh copy of the source tree in ``into``; returns its root."""
        with tarfile.open(self.sdist) as archive:
            archive.extractall(into, filter="data")
        return into / f"{NAME}-{VERSION}"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sandbx-pool-bench"


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=SETUP_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"{' '.join(argv[:4])}... failed: " + " / ".join(tail))


def repository() -> Repository:
    """The sdist and the tests' venv, made first if the cache lacks them."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"{NAME}-{VERSION}.tar.gz"
    if not sdist.exists():
        logger.info("trajectory: downloading the {} {} sdist into {}", NAME, VERSION, cache)
        pip = [sys.executable, "-m", "pip", "download", f"{NAME}=={VERSION}", "--no-deps"]
        _run([*pip, "--no-binary", ":all:", "--dest", str(cache)])
    venv = cache / f"{NAME}-{VERSION}-tests-venv"
    python = venv / "bin" / "python"
    done = venv / ".installed"  # written last: a venv whose install broke off is made again
    if not done.exists():
        logger.info("trajectory: a venv for {}'s tests ({})", NAME, ", ".join(TEST_REQUIREMENTS))
        _run([sys.executable, "-m", "venv", "--clear", str(venv)])
        _run([str(python), "-m", "pip", "install", "--quiet", *TEST_REQUIREMENTS])
        done.touch()
    return Repository(sdist, python, (str(venv), sys.base_prefix))
