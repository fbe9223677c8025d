"""The coordinator loads no tool: what runs in the caller's process imports no ``workers.tools``.

The tools run in the template's workers alone. ``workers.tools`` imports every tool with it
(its ``__init__`` builds the table of them), so one coordinator module reaching a helper through
it (the doctor once took rg's lookup from ``workers.tools.ripgrep``) loads all of them, and
their imports, into every caller. Checked in a fresh ``python -I`` interpreter, which imports
each module of the package outside ``sandbx_pool/workers``; an integration whose optional
dependency is not installed is skipped there, as its users would never import it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import sandbx_pool
from sandbx_pool.interpreter import PACKAGE_PARENT

#: Imports each module named in argv, then prints which of them first brought a tool module
#: in (None: none did) and which were skipped for a missing third-party dependency.
_IMPORT_ALL = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])

def tools_loaded():
    return sorted(m for m in sys.modules if m.split(".")[:3] == ["sandbx_pool", "workers", "tools"])

first, skipped = None, []
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if (exc.name or "").startswith("sandbx_pool"):
            raise
        skipped.append(name)
        continue
    if first is None and tools_loaded():
        first = name
print(json.dumps({"first": first, "tools": tools_loaded(), "skipped": skipped}))
"""


def coordinator_modules() -> list[str]:
    """Every module of the package outside its ``workers`` (the worker side), found on disk:
    walking the package by import would import ``workers.tools`` itself."""
    root = Path(sandbx_pool.__file__).parent
    names = []
    for directory, subdirectories, files in os.walk(root):
        here = Path(directory).relative_to(root.parent)
        subdirectories[:] = [
            d for d in subdirectories if not (here == Path("sandbx_pool") and d == "workers")
        ]
        for file in files:
            if not file.endswith(".py") or file == "__main__.py":  # __main__ runs the CLI
                continue
            parts = [*here.parts] if file == "__init__.py" else [*here.parts, file[:-3]]
            names.append(".".join(parts))
    return sorted(names)


def test_no_coordinator_module_imports_a_tool() -> None:
    modules = coordinator_modules()
    assert {"sandbx_pool.cli.doctor", "sandbx_pool.cli.main", "sandbx_pool.pool"} <= set(modules)
    done = subprocess.run(
        [sys.executable, "-I", "-c", _IMPORT_ALL, PACKAGE_PARENT, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd="/",
        env={**os.environ, "MSWEA_SILENT_STARTUP": "1"},  # mini-swe-agent's banner
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["tools"] == [], f"{found['first']} imports the tools: {found['tools']}"
    # The optional integrations are installed here: the check covered them too.
    assert found["skipped"] == [], found["skipped"]
