"""The ``sandbx`` provider on images: ``SandbxConfig(image=REF)`` and a compose file whose one
service names an ``image:``. Each sample is a layer over the image (a busybox image written by
the test, ``oci:DIR:TAG``); Inspect's own conformance suite runs on such samples in
test_inspect.py (kind "image"). Here: what a sample sees, that samples are apart, that their
layers go at cleanup, and an eval driven by Inspect from a compose file.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

pytest.importorskip("inspect_ai", reason="needs the 'inspect' extra")

from busybox_image import WORKDIR, pool_toml, write_busybox_image
from helpers import journal_records
from inspect_ai import Task, eval_async
from inspect_ai.dataset import Sample
from inspect_ai.solver import Generate, Solver, TaskState, solver
from inspect_ai.util import sandbox

from sandbx_pool.integrations import inspect_compose
from sandbx_pool.integrations.inspect_provider import SandbxConfig, SandbxSandboxEnvironment

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")


def _layers(directory: Path) -> list[str]:
    store = directory / "layers"
    return sorted(os.listdir(store)) if store.exists() else []


@pytest.mark.asyncio
async def test_samples_are_layers_over_the_image_and_go_at_cleanup(tmp_path: Path) -> None:
    config = SandbxConfig(
        journal=str(tmp_path / "journal.jsonl"),
        pool_config=pool_toml(tmp_path),
        image=write_busybox_image(tmp_path / "layout"),
        env=(("FROM_CONFIG", "yes"),),
    )
    await SandbxSandboxEnvironment.task_init("t", config)
    try:
        first = await SandbxSandboxEnvironment.sample_init("t", config, {})
        second = await SandbxSandboxEnvironment.sample_init("t", config, {})
        a, b = first["default"], second["default"]
        assert len(_layers(tmp_path)) == 2
        seen = await a.exec(["sh", "-c", "pwd; cat README; echo $IMAGE_VAR $FROM_CONFIG $HOME"])
        assert seen.stdout == f"{WORKDIR}\nfrom the image\nfrom-image yes /root\n", seen
        # The image's own /etc, through a command and read_file; the host's is not there.
        assert await a.read_file("/etc/os-release") == "NAME=busybox-image\n"
        assert (await a.exec(["cat", "/etc/shadow"])).success is False
        # Writes land in the sample's layer: relative paths from the WorkingDir, absolute ones
        # anywhere in the image (its /etc included: the sample's root is the image's).
        await a.write_file("notes/mine.txt", "a")
        await a.write_file("/etc/added", "b")
        assert (await a.exec(["cat", f"{WORKDIR}/notes/mine.txt", "/etc/added"])).stdout == "ab"
        assert (await b.exec(["ls", "-A"])).stdout == "README\n"
        listed = (await b.exec(["ls", "/etc"])).stdout.split()
        assert "os-release" in listed
        assert "added" not in listed
        assert (await a.exec(["pwd"], cwd="/tmp")).stdout == "/tmp\n"
        for environments in (first, second):
            await SandbxSandboxEnvironment.sample_cleanup("t", config, environments, False)
        assert _layers(tmp_path) == []
    finally:
        await SandbxSandboxEnvironment.task_cleanup("t", config, True)
    records = journal_records(config.journal or "")
    assert any(r["kind"] == "outcome" for r in records)


def _compose(path: Path, service: str) -> str:
    path.write_text(service)
    return str(path)


def test_a_compose_file_is_read_as_its_one_services_image(tmp_path: Path) -> None:
    ref = write_busybox_image(tmp_path / "layout")
    compose = _compose(
        tmp_path / "compose.yaml",
        "services:\n  default:\n    image: oci:layout:v1\n    command: tail -f /dev/null\n"
        "    init: true\n    working_dir: /tmp\n    environment:\n      - KEY=value\n"
        "    network_mode: none\n    x-sandbx:\n      workers: 3\n",
    )
    assert inspect_compose.read(compose) == {
        "image": ref,  # the relative layout is the compose file's
        "workdir": "/tmp",
        "env": (("KEY", "value"),),
        "network": False,
        "workers": 3,
    }
    bad = {
        "services:\n  a: {image: x}\n  b: {image: y}\n": "one service (it has 2)",
        "services:\n  a: {build: .}\n": "names no image",
        "services:\n  a: {image: x, volumes: ['.:/src'], ports: ['80']}\n": "ports, volumes",
        "services:\n  a: {image: x, environment: [HOST_VALUE]}\n": "has no value",
        "services: [\n": "not YAML",
    }
    for text, message in bad.items():
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            inspect_compose.read(_compose(tmp_path / "bad.yml", text))
    with pytest.raises(ValueError, match="cannot read"):
        inspect_compose.read(str(tmp_path / "missing.yaml"))


@solver
def _in_the_image() -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        box = sandbox()
        state.metadata["where"] = (await box.exec(["sh", "-c", "pwd; echo $KEY"])).stdout
        await box.write_file("answer", state.input_text)
        state.metadata["answer"] = (await box.exec(["cat", "/tmp/answer"])).stdout
        return state

    return solve


@pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.asyncio
async def test_an_eval_runs_its_samples_in_the_compose_files_image(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INSPECT_DISPLAY", "none")
    write_busybox_image(tmp_path / "layout")
    compose = _compose(
        tmp_path / "compose.yaml",
        "services:\n  default:\n    image: oci:layout:v1\n    working_dir: /tmp\n"
        f"    environment: {{KEY: set}}\n    x-sandbx:\n      pool_config: {pool_toml(tmp_path)}\n"
        f"      journal: {tmp_path / 'journal.jsonl'}\n",
    )
    task = Task(
        dataset=[Sample(input="first"), Sample(input="second")],
        solver=_in_the_image(),
        sandbox=("sandbx", compose),
    )
    [log] = await eval_async(task, model="mockllm/model", log_dir=str(tmp_path / "logs"))
    gc.collect()
    assert log.status == "success", log.error
    assert log.samples is not None
    for sample in log.samples:
        assert sample.metadata["where"] == "/tmp\nset\n"
        assert sample.metadata["answer"] == sample.input
    assert _layers(tmp_path) == []


@pytest.mark.asyncio
async def test_an_images_user_runs_the_sample_and_root_is_root(tmp_path: Path) -> None:
    config = SandbxConfig(
        journal=str(tmp_path / "journal.jsonl"),
        pool_config=pool_toml(tmp_path),
        image=write_busybox_image(tmp_path / "layout", user="nobody"),
    )
    await SandbxSandboxEnvironment.task_init("t", config)
    try:
        made = await SandbxSandboxEnvironment.sample_init("t", config, {})
        box = made["default"]
        assert (await box.exec(["id", "-u"])).stdout == "65534\n"  # as docker runs it
        assert (await box.exec(["id", "-u"], user="root")).stdout == "0\n"
        # The file tools run as the image's User too: root's directory is not theirs.
        with pytest.raises(PermissionError):
            await box.write_file("/root/x", "no")
        await box.write_file("/tmp/mine", "yes")
        assert (await box.exec(["stat", "-c", "%u", "/tmp/mine"])).stdout == "65534\n"
        await SandbxSandboxEnvironment.sample_cleanup("t", config, made, False)
    finally:
        await SandbxSandboxEnvironment.task_cleanup("t", config, True)
