"""Batch lines over container images: ``{"layer": NAME, "image": REF, ...}`` in ``sandbx-pool run``.

The image is pulled from Debian's ``docker-registry`` on loopback (test_image_registry's), once
per run whatever the lanes: the registry's access log counts the manifest fetches. Each layer is
made over the image by its first line and reused by the later ones, across ``--resume`` too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import journal_records
from image_tools import require
from oci_images import busybox_layer, have_busybox, write_layout
from test_batch import marked_toml
from test_image_registry import Registry, registry

from sandbx_pool.batch.calls import BatchFileError, load_batch

__all__ = ["registry"]  # the fixture, imported for the tests below

REF = "127.0.0.1:5000/team/app:v1"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ({"tool": "ls", "image": REF}, '"image" needs "layer"'),
        ({"tool": "ls", "layer": "a", "image": REF, "base": "repo"}, '"base" and "image" do not'),
        ({"tool": "ls", "layer": "a", "image": "Not A/Ref"}, '"image": image reference'),
        ({"tool": "ls", "layer": "a", "image": 7}, '"image" must be an image reference'),
    ],
)
def test_a_batch_line_with_a_bad_image_is_a_file_error(
    tmp_path: Path, line: dict[str, Any], problem: str
) -> None:
    calls = tmp_path / "calls.jsonl"
    calls.write_text(json.dumps(line) + "\n")
    with pytest.raises(BatchFileError, match=problem):
        load_batch(calls)


@pytest.mark.parametrize(
    ("second", "problem"),
    [
        ({"image": "127.0.0.1:5000/team/app:v2"}, r"layer 'a' is over image '.*:v1' \(line 1\)"),
        ({"base": "repo"}, r"layer 'a' is over image '.*:v1' \(line 1\), not over 'repo'"),
    ],
)
def test_one_layer_is_over_one_image(tmp_path: Path, second: dict[str, Any], problem: str) -> None:
    calls = tmp_path / "calls.jsonl"
    lines = [{"tool": "ls", "layer": "a", "image": REF}, {"tool": "ls", "layer": "a", **second}]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(BatchFileError, match=problem):
        load_batch(calls)


def test_every_line_of_a_layer_takes_its_image(tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    lines = [
        {"tool": "ls", "layer": "a"},
        {"tool": "ls", "layer": "a", "image": REF},
        {"tool": "ls", "layer": "a", "image": f"docker://{REF}"},  # the same image
    ]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [spec.image for spec in load_batch(calls).calls] == [f"docker://{REF}"] * 3


def _run(calls: Path, root: Path, config: Path, journal: Path, *more: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "run", str(calls), "--workspace", str(root),
         "--config", str(config), "--journal", str(journal), *more],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _manifest_gets(registry: Registry) -> int:
    log = registry.log.read_text(errors="replace").splitlines()
    return sum('"GET /v2/' in line and "/manifests/" in line for line in log)


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_a_batch_runs_samples_in_layers_over_one_pulled_image(
    tmp_path: Path, registry: Registry
) -> None:
    require("skopeo", "skopeo")
    if not have_busybox():
        pytest.skip("no static busybox (Debian package busybox-static)")
    write_layout(tmp_path / "layout", [busybox_layer()], tag="v1")
    ref = registry.push(tmp_path / "layout", "v1", "team/app")
    root = tmp_path / "root"
    root.mkdir()
    config = marked_toml(
        tmp_path / "pool.toml",
        f'[images]\nstore = "{tmp_path / "store"}"\ninsecure = ["{registry.host}"]\n'
        f'[workspace]\nlayers = "{tmp_path / "layers"}"\n',
    )
    lines: list[dict[str, Any]] = []
    for sample in range(3):
        name = f"s-{sample}"
        write = f"echo {sample} > /answer; cat /etc/os-release"
        lines.append(
            {"tool": "bash", "args": {"command": write}, "image": ref, "layer": name, "id": write}
        )
        # A layer's calls run one at a time, in whichever order lanes take them: "after".
        read = {"tool": "read", "args": {"path": "/answer"}, "layer": name, "id": name}
        lines.append({**read, "after": [write]})
    calls = tmp_path / "calls.jsonl"
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    journal = tmp_path / "j.jsonl"
    _run(calls, root, config, journal, "--parallel", "4")
    outcomes = {r["call_id"]: r for r in journal_records(str(journal)) if r["kind"] == "outcome"}
    assert len(outcomes) == 6
    assert all(r["status"] == "ok" for r in outcomes.values()), outcomes
    for sample in range(3):
        assert outcomes[f"s-{sample}"]["value_summary"]["content"] == f"{sample}\n"
    assert sorted(os.listdir(tmp_path / "layers")) == ["s-0", "s-1", "s-2"]
    # Four lanes, three layers: one pull of the image.
    assert _manifest_gets(registry) == 1

    # Resumed with more lines: s-0 is reopened as it was, t-3 made over the image the store
    # holds (no pull), and nothing that ran runs again.
    more = [
        {"tool": "read", "args": {"path": "/answer"}, "layer": "s-0", "id": "again"},
        {
            "tool": "bash",
            "args": {"command": "cat /answer"},
            "image": ref,
            "layer": "t-3",
            "id": "fresh",
        },
    ]
    calls.write_text("".join(json.dumps(line) + "\n" for line in [*lines, *more]))
    _run(calls, root, config, journal, "--resume")
    outcomes = {r["call_id"]: r for r in journal_records(str(journal)) if r["kind"] == "outcome"}
    assert len(outcomes) == 8
    assert outcomes["again"]["value_summary"]["content"] == "0\n"
    fresh = outcomes["fresh"]
    assert fresh["status"] == "ok"
    assert fresh["value_summary"]["stderr"].startswith("cat: can't open '/answer'")
    assert _manifest_gets(registry) == 1


def test_an_image_that_cannot_be_pulled_stops_the_run_naming_the_line(tmp_path: Path) -> None:
    require("skopeo", "skopeo")
    missing = tmp_path / "no-layout"
    calls = tmp_path / "calls.jsonl"
    lines = [{"tool": "ls", "layer": "a", "image": f"oci:{missing}"}]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = marked_toml(tmp_path / "pool.toml", f'[images]\nstore = "{tmp_path / "store"}"\n')
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "run", str(calls), "--workspace",
         str(tmp_path), "--config", str(config), "--journal", str(tmp_path / "j.jsonl")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"failure: line 1: oci:{missing}: skopeo copy failed" in done.stdout
    assert "resume with: " in done.stdout
