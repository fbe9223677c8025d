"""The README's image examples run as written: its Python lines over an image, its
``pool.image`` snippet and its ``call --image`` command, taken from README.md as they stand.

Every registry they name is answered by Debian's ``docker-registry`` on loopback: a
``registries.conf`` in the test's ``$HOME`` (skopeo's own way to send a registry's name
elsewhere) points ``docker.io`` and ``127.0.0.1:5000`` at it. It serves a busybox image
whose ``python`` and ``pip`` are small scripts: the examples are what is checked, not Python.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import journal_records
from image_tools import require
from oci_images import Entry, Layer, busybox_layer, have_busybox, write_layout
from test_batch import marked_toml
from test_image_registry import Registry, registry

from sandbx_pool.pool import Pool

__all__ = ["registry"]  # the fixture, imported for the tests below

README = Path(__file__).resolve().parents[1] / "README.md"

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")


def _script(said: str) -> bytes:
    return f"#!/bin/sh\necho '{said}'\n".encode()


@pytest.fixture
def images(tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """The images the README names, in the loopback registry, reached by their names."""
    require("skopeo", "skopeo")
    if not have_busybox():
        pytest.skip("no static busybox (Debian package busybox-static)")
    tools = Layer(
        [
            Entry("usr", "dir", mode=0o755),
            Entry("usr/local", "dir", mode=0o755),
            Entry("usr/local/bin", "dir", mode=0o755),
            Entry("usr/local/bin/python", "file", _script("Python 3.12.0"), mode=0o755),
            Entry("usr/local/bin/pip", "file", _script("pip 24.0"), mode=0o755),
        ]
    )
    layout = tmp_path / "layout"
    env = ("PATH=/usr/local/bin:/bin",)
    write_layout(layout, [busybox_layer(), tools], tag="3.12-slim", env=env)
    write_layout(layout, [busybox_layer()], tag="v1", env=env)
    registry.push(layout, "3.12-slim", "library/python")
    registry.push(layout, "v1", "team/app")
    # skopeo reads a registries.conf in $HOME before the system's (CONTAINERS_REGISTRIES_CONF
    # is podman's: skopeo 1.9 ignores it).
    conf = tmp_path / "home" / ".config" / "containers" / "registries.conf"
    conf.parent.mkdir(parents=True)
    conf.write_text(
        "".join(
            f'[[registry]]\nprefix = "{name}"\nlocation = "{registry.host}"\ninsecure = true\n\n'
            for name in ("docker.io", "127.0.0.1:5000")
        )
    )
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return registry


def _python_lines(start: str) -> str:
    """The lines of README.md's Python from the one that starts with ``start`` to the next
    blank line (or the block's end), dedented."""
    lines = README.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith(start))
    taken = []
    for line in lines[first:]:
        if not line.strip() or line.startswith("```"):
            break
        taken.append(line)
    return textwrap.dedent("\n".join(taken))


async def _run(code: str, pool: Pool) -> None:
    """``code`` as the body of an async function given ``pool``, as the README's runs."""
    namespace: dict[str, object] = {}
    exec(f"async def example(pool):\n{textwrap.indent(code, '    ')}\n", namespace)
    await namespace["example"](pool)  # type: ignore[operator]


async def test_the_readme_python_over_an_image_runs_as_written(
    tmp_path: Path, images: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    example = _python_lines("# A container image as the call's `/`")
    assert 'pool.image("docker.io/library/python:3.12-slim")' in example
    snippet = _python_lines('img = await pool.image("docker://127.0.0.1:5000/team/app:v1")')
    (tmp_path / "ws").mkdir()
    config = marked_config(
        images={"store": str(tmp_path / "store")}, workspace={"layers": str(tmp_path / "layers")}
    )
    journal = tmp_path / "j.jsonl"
    async with Pool(tmp_path / "ws", config=config, journal=journal) as pool:
        await _run(example, pool)
        await _run(snippet, pool)
    outcomes = [r for r in journal_records(str(journal)) if r["kind"] == "outcome"]
    assert [(r["tool"], r["status"]) for r in outcomes] == [("bash", "ok"), ("read", "ok")]
    assert outcomes[0]["value_summary"]["stdout"] == "Python 3.12.0\npip 24.0\n"
    assert outcomes[1]["value_summary"]["content"] == "NAME=busybox-test\n"
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "[]"  # the layer's diff: the calls changed nothing
    assert re.fullmatch(r"sha256:[0-9a-f]{64} 1 \d+ \('PATH=/usr/local/bin:/bin',\)", printed[1])
    # Both came from the loopback registry, named as the README names them.
    gets = images.log.read_text()
    assert "GET /v2/library/python/manifests/3.12-slim" in gets
    assert "GET /v2/team/app/manifests/v1" in gets


def test_the_readme_call_in_an_image_runs_as_written(tmp_path: Path, images: Registry) -> None:
    (command,) = [
        line.split("#")[0].strip()
        for line in README.read_text().splitlines()
        if line.startswith("sandbx-pool call ") and "--image" in line
    ]
    argv = shlex.split(command)
    assert argv[0] == "sandbx-pool"
    (tmp_path / "ws").mkdir()
    config = marked_toml(
        tmp_path / "pool.toml",
        f'[images]\nstore = "{tmp_path / "store"}"\n'
        f'[workspace]\nlayers = "{tmp_path / "layers"}"\n',
    )
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", *argv[1:], "--config", str(config),
         "--workspace", str(tmp_path / "ws")],
        capture_output=True, text=True, check=False, timeout=120, env=dict(os.environ),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    outcome = json.loads(done.stdout)
    assert outcome["value"]["stdout"] == "Python 3.12.0\n"
    assert outcome["image"]["ref"] == "docker://docker.io/library/python:3.12-slim"
    assert os.listdir(tmp_path / "layers") == []
