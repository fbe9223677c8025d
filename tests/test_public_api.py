"""The public API: the names ``sandbx_pool`` exports, pinned, and loaded only when used."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import sandbx_pool

#: What users import. A name added here is a promise; one removed breaks their code.
PUBLIC = [
    "CancelToken",
    "Config",
    "ConfigError",
    "Image",
    "ImageError",
    "ImageStore",
    "JournalError",
    "JournalLocked",
    "JournalPolicy",
    "KilledBy",
    "Layer",
    "LayerUnavailable",
    "Limits",
    "Outcome",
    "OutputChunk",
    "Pool",
    "PoolClosed",
    "PoolNotStarted",
    "PoolState",
    "Service",
    "ServiceNotRunning",
    "ServiceStatus",
    "SandbxPoolError",
    "Status",
    "TemplateLost",
    "UndoConflict",
    "WorkspaceError",
    "load_config",
    "tool_schemas",
]


def test_the_public_names_are_pinned() -> None:
    assert sorted(sandbx_pool.__all__) == sorted(PUBLIC)


def test_every_public_name_resolves_to_the_object_its_module_defines() -> None:
    for name in PUBLIC:
        value = getattr(sandbx_pool, name)
        home = sys.modules[value.__module__]
        assert getattr(home, name) is value, name
        assert name in dir(sandbx_pool)


def test_importing_the_package_loads_nothing_of_the_coordinator() -> None:
    # The template imports sandbx_pool.workers.template, and with it this package: asyncio,
    # pyzmq and loguru must not load into every worker it forks.
    probe = (
        "import sys, sandbx_pool; "
        "print(sorted(m for m in ('asyncio', 'zmq', 'loguru', 'sandbx_pool.pool') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-I", "-c", probe], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _signature_in_readme(prefix: str) -> list[str]:
    """The parameter names of the signature the README gives as ``prefix(...)``."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    start = readme.index(f"`{prefix}(") + len(prefix) + 2
    text = readme[start : readme.index(")`", start)]
    return [p.split("=")[0].strip() for p in text.replace("\n", " ").split(",") if p.strip()]


def _real(function: Any) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def test_the_readme_gives_the_real_signatures() -> None:
    # A signature in the README that lacks an argument is one users never learn of.
    assert [p for p in _signature_in_readme("await pool.call") if p != "*"] == _real(
        sandbx_pool.Pool.call
    )
    assert [p for p in _signature_in_readme("Pool") if p != "*"] == _real(sandbx_pool.Pool)
    layer = [p for p in _signature_in_readme("await pool.layer") if p != "*"]
    assert layer == _real(sandbx_pool.Pool.layer)


def test_the_readme_lists_every_outcome_field() -> None:
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Outcomes", 1)[1].split("| status |", 1)[0]
    missing = [f for f in sandbx_pool.Outcome.__struct_fields__ if f"`{f}`" not in section]
    assert missing == []
