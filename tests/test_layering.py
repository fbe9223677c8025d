"""The coordinator loads no tool: what runs in the caller's process imports no ``workers.tools``.

The tools run in the template's workers alone. ``workers.tools`` imports every tool with it
(its ``__init__`` builds the table of them), so one coordinator module reaching a helper through
it (the doctor once took rg's lookup from ``workers.tools.ripgrep``) loads all of them, and
their imports, into every caller. Checked in a fresh ``python -I`` interpreter, which imports
each module of the package outside ``sandbx_pool/workers``; an integration whose optional
dependency is not installed is skipped there, as its users would never import it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import sandbx_pool
import sandbx_pool.workers as workers_package
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


# -- the boundary, read from the source: what each side imports of the other -------------------

REPO = Path(__file__).resolve().parent.parent


def _imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, anywhere in it (inside functions too), by full name."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            # ``from sandbx_pool.workers import landlock`` imports the module landlock.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _worker_side_modules(imported: set[str]) -> set[str]:
    """The worker-side modules among ``imported``, by their name inside the package."""
    prefix = "sandbx_pool.workers."
    return {
        name[len(prefix) :].split(".")[0]
        for name in imported
        if name.startswith(prefix) and name[len(prefix) :].split(".")[0] in WORKER_MODULES
    }


WORKER_MODULES = {p.stem if p.is_file() else p.name for p in (REPO / "workers").iterdir()} - {
    "__init__",
    "__pycache__",
    "py",  # py.typed
}


def test_the_coordinator_imports_of_the_worker_side_only_what_the_rule_allows() -> None:
    allowed = workers_package.COORDINATOR_MAY_IMPORT
    broken = {}
    for path in sorted((REPO / "sandbx_pool").rglob("*.py")):
        used = _worker_side_modules(_imported_modules(path))
        extra = used - allowed
        if path.parent == REPO / "sandbx_pool" / "cli" and path.stem in ("doctor", "doctor_probes"):
            extra -= workers_package.DOCTOR_MAY_IMPORT
        if extra:
            broken[str(path.relative_to(REPO))] = sorted(extra)
    assert broken == {}, (
        f"coordinator modules import more of the worker side than allowed: {broken}"
    )


def test_what_the_coordinator_takes_from_the_worker_side_is_public_there() -> None:
    # A module private by its name (``_libc``) imported across the boundary says it may change
    # without notice, and the coordinator depends on it all the same.
    allowed = workers_package.COORDINATOR_MAY_IMPORT | workers_package.DOCTOR_MAY_IMPORT
    assert sorted(name for name in allowed if name.startswith("_")) == []


def test_the_allowed_helpers_are_leaves() -> None:
    # A helper the coordinator may import brings in nothing of the worker machinery with it.
    allowed = workers_package.COORDINATOR_MAY_IMPORT
    for name in sorted(allowed):
        used = _worker_side_modules(_imported_modules(REPO / "workers" / f"{name}.py"))
        assert used <= allowed, f"workers/{name}.py imports {sorted(used - allowed)}"


def test_the_worker_side_never_imports_the_coordinator() -> None:
    for path in sorted((REPO / "workers").rglob("*.py")):
        coordinator = {
            name
            for name in _imported_modules(path)
            if name.split(".")[0] == "sandbx_pool"
            and not name.startswith("sandbx_pool.workers")
            and name != "sandbx_pool"
        }
        assert coordinator == set(), f"{path.relative_to(REPO)} imports {sorted(coordinator)}"


def test_the_rule_is_stated_once() -> None:
    # The package docstrings point at the rule; only sandbx_pool.workers states it.
    assert "COORDINATOR_MAY_IMPORT" in (workers_package.__doc__ or "")
    assert "COORDINATOR_MAY_IMPORT" in (sandbx_pool.__doc__ or "")


def test_the_map_names_every_module() -> None:
    # docs/design.md's "Where the code lives" is the newcomer's map: a module it does not name
    # is one they will not find.
    design = (REPO / "docs" / "design.md").read_text()
    section = design.split("### Where the code lives", 1)[1].split("\n## ", 1)[0]
    missing = []
    for side in ("sandbx_pool", "workers"):
        for path in sorted((REPO / side).rglob("*.py")):
            relative = path.relative_to(REPO / side)
            named = relative.as_posix()
            short = named.rsplit("/", 1)[-1]
            if f"`{named}`" not in section and f"`{short}`" not in section:
                missing.append(f"{side}/{named}")
    assert missing == [], f"docs/design.md's map leaves out: {missing}"
