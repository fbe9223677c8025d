"""The README's Python example, as written, run twice: a new user copies it, runs it, changes
a line and runs it again. Only its placeholders are replaced: the two paths by real directories,
and the registry image by an OCI layout of busybox written here (no registry is reachable from
the machines the tests run on; `pool.image` takes either)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from oci_images import busybox_layer, have_busybox, write_layout

README = Path(__file__).resolve().parent.parent / "README.md"

#: The registry image the example pulls.
README_IMAGE = "docker.io/library/python:3.12-slim"

#: Seconds one run of the example may take on a loaded machine.
RUN_S = 120

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")


def python_example() -> str:
    """The first ```python block after the README's "## Python API" heading."""
    text = README.read_text()
    found = re.search(r"^## Python API\n.*?^```python\n(.*?)^```$", text, re.M | re.S)
    assert found, "the README has no Python example under ## Python API"
    return found.group(1)


def test_the_readme_example_runs_twice_as_written(tmp_path: Path) -> None:
    workspace = tmp_path / "workspace"
    (workspace / "src").mkdir(parents=True)
    (workspace / "README.md").write_text("# a project\n")
    (workspace / "a.py").write_text("foo = 1\n")
    (workspace / "b.py").write_text("print('b')\n")
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "setup.py").write_text("\n")
    if not have_busybox():
        pytest.skip("the image needs Debian's busybox-static")
    write_layout(tmp_path / "image", [busybox_layer()], tag="3.12-slim")
    example = python_example()
    assert "/path/to/workspace" in example
    assert "/data/repo" in example
    assert README_IMAGE in example
    script = tmp_path / "example.py"
    script.write_text(
        example.replace("/path/to/workspace", str(workspace))
        .replace("/data/repo", str(repo))
        .replace(README_IMAGE, f"oci:{tmp_path / 'image'}:3.12-slim")
    )
    for run in (1, 2):
        done = subprocess.run(
            [sys.executable, str(script)],
            capture_output=True,
            text=True,
            timeout=RUN_S,
            cwd=tmp_path,
            # The layer store is the user's own (~/.local/share): the test's is its own.
            env={**os.environ, "XDG_DATA_HOME": str(tmp_path / "data")},
        )
        assert done.returncode == 0, f"run {run}:\n{done.stderr}"
        assert "Traceback" not in done.stderr, f"run {run}:\n{done.stderr}"
        # The session's exports carried to its next call, as the comment says.
        assert f"{workspace}/src\ndev\n" in done.stdout, done.stdout
        # The transactional call was undone: a.py and b.py as they were.
        assert (workspace / "a.py").read_text() == "foo = 1\n"
        assert (workspace / "b.py").exists()


def test_the_readme_lists_every_exception_a_caller_can_meet() -> None:
    import sandbx_pool

    text = " ".join(README.read_text().split())
    found = re.search(r"only misuse and broken infrastructure raise \((.*?)\)\. ", text)
    assert found, "the README no longer says what raises"
    listed = found.group(1)
    errors = [
        name
        for name in sandbx_pool.__all__
        if isinstance(value := getattr(sandbx_pool, name), type)
        and issubclass(value, sandbx_pool.SandbxPoolError)
        and value is not sandbx_pool.SandbxPoolError
    ]
    assert [name for name in errors if f"`{name}`" not in listed] == []
    # Layers and undo refuse a request they cannot meet with a ValueError.
    for raised_by in ("layer", "undo"):
        assert re.search(rf"`ValueError`.*{raised_by}", listed), raised_by
