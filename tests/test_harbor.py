"""Harbor's own ``harbor run`` with ``-e sandbx_pool.integrations.harbor:SandbxEnvironment``:
its oracle agent and verifier on local tasks whose image is in a registry on loopback (Debian's
docker-registry, started by the test): one prebuilt (``docker_image``), one built from an
``environment/Dockerfile`` FROM that image (buildah), one allow-listed; trials in parallel
(``-n 2``). Then the environment driven directly: files both ways, exec's fields, the network
policy, a cancelled exec, and what start says when buildah is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("harbor", reason="needs the 'harbor' extra (Python 3.12+)")

from busybox_image import host_bash_entries, pids_with_argv, pool_toml, write_busybox_image
from harbor.environments.base import HealthcheckError
from harbor.models.task.config import (
    EnvironmentConfig,
    HealthcheckConfig,
    NetworkMode,
    NetworkPolicy,
)
from harbor.models.trial.paths import TrialPaths
from helpers import wait_until
from image_tools import require
from test_image_registry import Registry, _start

from sandbx_pool.integrations import harbor_build
from sandbx_pool.integrations.harbor import SandbxEnvironment

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")
asyncio_test = pytest.mark.asyncio(loop_scope="function")

DOTTED = "sandbx_pool.integrations.harbor:SandbxEnvironment"

VERIFY = """#!/bin/bash
if [ "$(cat /srv/work/answer)" = "{expected}" ]; then echo 1; else echo 0; fi \\
    > /logs/verifier/reward.txt
"""


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    require("skopeo", "skopeo")
    (tmp_path / "registry").mkdir()
    with contextlib.contextmanager(_start)(tmp_path / "registry", auth=False) as running:
        yield running


@pytest.fixture
def image_ref(tmp_path: Path, registry: Registry) -> str:
    """A busybox image with a bash, pushed to the registry on loopback."""
    write_busybox_image(tmp_path / "layout", extra=host_bash_entries())
    return registry.push(tmp_path / "layout", "v1", "tasks/base")


#: Where the allow-listed task's "listed.test" is pinned (network_hosts): a loopback address of
#: its own, port 80 (a name in an allow-list is reached on the standard ports).
LISTED_ADDRESS = "127.0.0.42"

#: The allow-listed task's solution: a direct connection, then the proxy asked for the listed
#: name and for another, each answer's status line into the answer file.
ALLOWLISTED_SOLVE = r"""
if (exec 3<>/dev/tcp/127.0.0.1/PORT) 2>/dev/null; then direct=reached; else direct=unreachable; fi
proxy=${HTTP_PROXY#http://}; proxy=${proxy%/}
ask() {
    exec 5<>"/dev/tcp/${proxy%:*}/${proxy##*:}"
    printf 'GET http://%s/ HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n' "$1" "$1" >&5
    head -1 <&5 | tr -d '\r'
}
echo "$direct|$(ask listed.test)|$(ask not-listed.test)" > /srv/work/answer
"""


@pytest.fixture
def listed_server() -> Iterator[None]:
    """An HTTP server answering 200 on LISTED_ADDRESS:80, in this process."""
    if os.geteuid() != 0:
        pytest.skip("the listed name is served on port 80, which only root binds")
    server = http.server.ThreadingHTTPServer((LISTED_ADDRESS, 80), _Ok)
    thread = threading.Thread(target=server.serve_forever, name="listed-server")
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "3")
        self.end_headers()
        self.wfile.write(b"ok\n")

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _task(root: Path, name: str, solve: str, expected: str, **environment: object) -> Path:
    task = root / name
    (task / "environment").mkdir(parents=True)
    (task / "solution").mkdir()
    (task / "tests").mkdir()
    (task / "instruction.md").write_text(f"Task {name}.\n")
    lines = [f"{k} = {json.dumps(v)}" for k, v in environment.items() if k != "Dockerfile"]
    (task / "task.toml").write_text(
        'schema_version = "1.4"\n\n[verifier]\ntimeout_sec = 120.0\n\n[agent]\n'
        "timeout_sec = 120.0\n\n[environment]\n" + "\n".join(lines) + "\n"
    )
    if "Dockerfile" in environment:
        (task / "environment" / "Dockerfile").write_text(str(environment["Dockerfile"]))
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve}\n")
    (task / "tests" / "test.sh").write_text(VERIFY.format(expected=expected))
    return task


def _harbor(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    harbor = Path(sys.executable).parent / "harbor"
    return subprocess.run(
        [str(harbor), "run", "--yes", "-q", *args],
        cwd=cwd, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def _rewards(jobs: Path) -> dict[str, float]:
    found = {}
    for result in jobs.glob("*/*/result.json"):
        data = json.loads(result.read_text())
        rewards = (data.get("verifier_result") or {}).get("rewards") or {}
        found[data["task_name"]] = rewards.get("reward")
    return found


def test_the_oracle_passes_prebuilt_built_and_allow_listed_tasks_in_parallel(
    tmp_path: Path, image_ref: str, listed_server: None
) -> None:
    require("buildah", "buildah")
    tasks = tmp_path / "tasks"
    _task(tasks, "prebuilt", "echo 42 > /srv/work/answer", "42", docker_image=image_ref)
    _task(
        tasks,
        "built",
        "echo $(( $(cat /srv/work/base) * 7 )) > /srv/work/answer",
        "42",
        Dockerfile=f"FROM {image_ref}\nRUN echo 6 > /srv/work/base\n",
    )
    # Allow-listed: through the pool's proxy (HTTP_PROXY) the listed name answers and another
    # is refused; nothing is reached directly (the registry, on the host's loopback).
    port = image_ref.split("/")[0].split(":")[1]
    _task(
        tasks,
        "allowlisted",
        ALLOWLISTED_SOLVE.replace("PORT", port),
        "unreachable|HTTP/1.0 200 OK|HTTP/1.1 403 Forbidden",
        docker_image=image_ref,
        network_mode="allowlist",
        allowed_hosts=["listed.test"],
    )
    config = pool_toml(
        tmp_path,
        insecure=(image_ref.split("/")[0],),
        extra=f'\n[sandbox.network_hosts]\n"listed.test" = "{LISTED_ADDRESS}"\n',
    )
    try:
        done = _harbor(
            "-p", str(tasks), "-a", "oracle", "-n", "2", "-e", DOTTED, "--ek", f"config={config}",
            "-o", str(tmp_path / "jobs"), cwd=tmp_path,
        )  # fmt: skip
    finally:
        # buildah keeps a Dockerfile's FROM image in its own storage; this one is the test's.
        subprocess.run(["buildah", "rmi", image_ref], capture_output=True, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert _rewards(tmp_path / "jobs") == {"prebuilt": 1.0, "built": 1.0, "allowlisted": 1.0}
    assert sorted(os.listdir(tmp_path / "layers")) == []  # every trial's layer removed
    # The built image is kept once, under its build context's hash (the next job reuses it).
    builds = sorted(os.listdir(tmp_path / "harbor-builds"))
    assert len([b for b in builds if not b.endswith(".lock")]) == 1


# -- the environment driven directly -------------------------------------------------------------


def _environment(tmp_path: Path, task_dir: Path, **environment: Any) -> SandbxEnvironment:
    (task_dir / "environment").mkdir(parents=True, exist_ok=True)
    insecure = tuple(
        ref.split("/")[0] for ref in [environment.get("docker_image") or ""] if "/" in ref
    )
    trial = tmp_path / "trial"
    trial.mkdir(exist_ok=True)
    return SandbxEnvironment(
        environment_dir=task_dir / "environment",
        environment_name="direct",
        session_id="direct__abc__env",
        trial_paths=TrialPaths(trial),
        task_env_config=EnvironmentConfig(**environment),
        config=pool_toml(tmp_path, insecure=insecure),
    )


@asyncio_test
async def test_exec_files_network_and_stop(tmp_path: Path, image_ref: str) -> None:
    env = _environment(tmp_path, tmp_path / "task", docker_image=image_ref)
    await env.start(force_build=False)
    try:
        assert len(os.listdir(tmp_path / "layers")) == 1
        # exec: the image's WorkingDir and Env, the call's env, cwd, user; output streamed.
        chunks: list[tuple[str, str]] = []

        async def collect(text: str, stream: str) -> None:
            chunks.append((stream, text))

        with env.scoped_output_callback(collect):
            result = await env.exec(
                "pwd; echo $IMAGE_VAR $OWN; echo oops >&2; exit 3", env={"OWN": "mine"}
            )
        assert (result.return_code, result.stdout, result.stderr) == (
            3,
            "/srv/work\nfrom-image mine\n",
            "oops\n",
        )
        assert "".join(t for s, t in chunks if s == "stdout") == result.stdout
        assert (await env.exec("pwd", cwd="/tmp")).stdout == "/tmp\n"
        assert (await env.exec("id -u", user="nobody")).stdout == "65534\n"
        with pytest.raises(RuntimeError, match="timed out"):
            await env.exec("sleep 30", timeout_sec=1)
        # Files both ways: a tree with an empty directory and an executable script.
        source = tmp_path / "up"
        (source / "sub" / "empty").mkdir(parents=True)
        (source / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
        (source / "sub" / "run.sh").chmod(0o755)
        (source / "data.bin").write_bytes(bytes(range(256)) * 100)
        await env.upload_dir(source, "/opt/up")
        await env.upload_file(source / "data.bin", "/etc/renamed.bin")
        assert (await env.exec("/opt/up/sub/run.sh")).stdout == "ran\n"
        await env.download_dir("/opt/up", tmp_path / "down")
        assert (tmp_path / "down" / "data.bin").read_bytes() == bytes(range(256)) * 100
        assert (tmp_path / "down" / "sub" / "empty").is_dir()
        assert os.access(tmp_path / "down" / "sub" / "run.sh", os.X_OK)
        await env.download_file("/etc/renamed.bin", tmp_path / "one" / "file.bin")
        assert (tmp_path / "one" / "file.bin").read_bytes() == bytes(range(256)) * 100
        with pytest.raises(RuntimeError, match="/nowhere"):
            await env.download_file("/nowhere", tmp_path / "x")
        # Healthchecks run in the layer.
        await env.run_healthcheck(HealthcheckConfig(command="test -f /opt/up/data.bin"))
        with pytest.raises(HealthcheckError):
            await env.run_healthcheck(
                HealthcheckConfig(command="false", retries=1, start_period_sec=0)
            )
        # The policy holds from the next call: no network, then public (the host's loopback).
        port = image_ref.split("/")[0].split(":")[1]
        probe = f"(exec 3<>/dev/tcp/127.0.0.1/{port}) 2>/dev/null && echo reached || echo no"
        assert (await env.exec(probe)).stdout == "reached\n"
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.NO_NETWORK))
        assert (await env.exec(probe)).stdout == "no\n"
        await env.set_network_policy(NetworkPolicy(network_mode=NetworkMode.PUBLIC))
        assert (await env.exec(probe)).stdout == "reached\n"
        # A cancelled exec (a trial's cancel) kills the call's processes.
        tag = str(10**6 + int(time.time_ns() % 10**6))
        running = asyncio.create_task(env.exec(f"sleep {tag}", timeout_sec=60))
        await wait_until(lambda: bool(pids_with_argv("sleep", tag)), 10, "the sleep to start")
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        assert pids_with_argv("sleep", tag) == []
    finally:
        await env.stop(delete=True)
    assert os.listdir(tmp_path / "layers") == []


@asyncio_test
async def test_an_images_user_runs_commands_unless_harbor_names_root(tmp_path: Path) -> None:
    ref = write_busybox_image(tmp_path / "layout", extra=host_bash_entries(), user="nobody")
    env = _environment(tmp_path, tmp_path / "task", docker_image=ref)
    await env.start(force_build=False)
    try:
        assert (await env.exec("id -u")).stdout == "65534\n"  # the image's User, as docker
        assert (await env.exec("id -u", user="root")).stdout == "0\n"
        assert (await env.exec("id -u", user=0)).stdout == "0\n"
        with env.with_default_user("root"):
            assert (await env.exec("id -u")).stdout == "0\n"
        # What Harbor does as root (its log directories) works; as the image's User it may not.
        assert (await env.exec("mkdir /logs-made", user="root")).return_code == 0
        assert (await env.exec("mkdir /not-as-nobody")).return_code != 0
    finally:
        await env.stop(delete=True)


@asyncio_test
async def test_a_dockerfile_without_buildah_is_one_error_naming_it(
    tmp_path: Path, image_ref: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    task = tmp_path / "task"
    (task / "environment").mkdir(parents=True)
    (task / "environment" / "Dockerfile").write_text(f"FROM {image_ref}\n")
    env = _environment(tmp_path, task)
    empty = tmp_path / "no-programs"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # buildah, as on a machine without it
    with pytest.raises(harbor_build.BuildError, match=r"needs buildah.*Debian package 'buildah'"):
        await env.start(force_build=False)
    monkeypatch.undo()
    await env.stop(delete=True)  # nothing started: nothing to do
    # An image that cannot be had: one error naming it, the trial's pool closed, no layer.
    missing = _environment(tmp_path, tmp_path / "other", docker_image=f"oci:{tmp_path}/none:v1")
    with pytest.raises(Exception, match="none"):
        await missing.start(force_build=False)
    assert missing.pool is None
    await missing.stop(delete=True)
    assert not (tmp_path / "layers").exists() or os.listdir(tmp_path / "layers") == []
