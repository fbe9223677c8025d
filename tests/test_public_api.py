"""The public API: the names ``sandbx_pool`` exports, pinned, and loaded only when used."""

from __future__ import annotations

import subprocess
import sys

import sandbx_pool

#: What users import. A name added here is a promise; one removed breaks their code.
PUBLIC = [
    "CancelToken",
    "Config",
    "ConfigError",
    "JournalError",
    "JournalLocked",
    "JournalPolicy",
    "KilledBy",
    "Limits",
    "Outcome",
    "OutputChunk",
    "Pool",
    "PoolClosed",
    "PoolNotStarted",
    "PoolState",
    "SandbxPoolError",
    "Status",
    "TemplateLost",
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
