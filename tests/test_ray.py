"""sandbx_pool.integrations.ray on a two-node Ray cluster on this machine (a head and one more
node, each with its own raylet: ``ray.cluster_utils.Cluster``, how Ray tests multi-node code).

One cluster for the whole module (a cluster takes several seconds to start). The autouse
no-process-left check is replaced here: the node actors (and their pools' templates and
workers) live as long as the cluster, by design. Each kill test checks its own processes gone,
and the module's teardown checks that nothing at all is left once the cluster is shut down.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from busybox_image import write_busybox_image
from conftest import MARKER, _uptime, leftover_processes
from helpers import pids_with, tagged_sleep, unique_tag, wait_until, wait_until_sync
from ray.cluster_utils import Cluster

from sandbx_pool import CancelToken, Config
from sandbx_pool.batch.run import resume_plan
from sandbx_pool.integrations.ray import RayPool, node_pool, shutdown_node_pools
from sandbx_pool.journal.reader import read_journal
from sandbx_pool.journal.records import NODE_LOST, OutcomeRecord
from sandbx_pool.outcome import KilledBy, Status
from sandbx_pool.telemetry import SCHEDULE_MS

pytestmark = [
    pytest.mark.timeout(180),
    # Ray's own modules warn about their dependencies; ours must not, but theirs are not ours.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

#: Small object stores: this machine holds two nodes beside the other engineers' tests.
NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80_000_000}

#: The node pools' layer store (test_a_layer_runs_on_the_node_that_holds_it), removed at the end.
LAYERS = tempfile.mkdtemp(prefix="sbx-ray-layers-")
#: The node pools' image store (test_layers_over_an_image_on_the_nodes), removed at the end.
IMAGES = tempfile.mkdtemp(prefix="sbx-ray-images-")

CONFIG = Config().override(
    env={"set": {MARKER: os.environ[MARKER]}},
    pool={"workers": 3},
    workspace={"layers": LAYERS},
    images={"store": IMAGES},
)


@pytest.fixture(autouse=True)
def no_process_left_behind() -> Iterator[None]:
    return  # checked once for the module, by ``cluster`` (the node actors outlive each test)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    since = _uptime() - 0.01
    # Ray's sessions (logs, sockets) in a directory of ours, removed at the end, not in /tmp/ray.
    temp_dir = tempfile.mkdtemp(prefix="sbx-ray-")
    # Whatever temp_dir says, Ray writes the head's address to <tmp>/ray/ray_current_cluster,
    # and fails when that directory does not exist (a fresh machine).
    address_dir = os.path.join(tempfile.gettempdir(), "ray")
    made_address_dir = not os.path.isdir(address_dir)
    os.makedirs(address_dir, exist_ok=True)
    node_args = {**NODE_ARGS, "temp_dir": temp_dir}
    head = {
        **node_args,
        # A dead node is noticed in about 1 s instead of 15 (test_node_loss).
        "_system_config": {"health_check_period_ms": 200, "health_check_failure_threshold": 3},
    }
    cluster = Cluster(initialize_head=True, connect=True, head_node_args=head)
    try:
        cluster.add_node(**node_args)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            shutdown_node_pools()
            ray.shutdown()
        cluster.shutdown()
        left = leftover_processes(since)
        deadline = time.monotonic() + 15.0
        while left and time.monotonic() < deadline:
            time.sleep(0.1)  # the outside world: Ray's processes being reaped
            left = leftover_processes(since)
        shutil.rmtree(temp_dir, ignore_errors=True)
        shutil.rmtree(LAYERS, ignore_errors=True)
        shutil.rmtree(IMAGES, ignore_errors=True)
        if made_address_dir:
            shutil.rmtree(address_dir, ignore_errors=True)
        assert not left, f"the Ray cluster left processes behind: {left}"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    (root / "t").mkdir()
    return root


def live_nodes() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node["Alive"]}


async def started(tag: str) -> list[int]:
    await wait_until(lambda: bool(pids_with(tag)), within_s=20, what=f"{tag} running")
    return pids_with(tag)


async def test_calls_spread_over_both_nodes_one_node_per_workspace(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    async with RayPool(root, journal=tmp_path / "j.jsonl", config=CONFIG) as pool:
        names = [f"ep-{n}" for n in range(6)]
        for name in names:
            (root / name).mkdir()

        async def episode(name: str) -> list[Any]:
            wrote = await pool.call("write", {"path": "a.txt", "content": name}, workspace=name)
            read = await pool.call("read", {"path": "a.txt"}, workspace=name)
            listed = await pool.call("bash", {"command": "cat a.txt; pwd"}, workspace=name)
            return [wrote, read, listed]

        results = dict(zip(names, await asyncio.gather(*map(episode, names)), strict=True))
    for name, outcomes in results.items():
        assert [o.status for o in outcomes] == [Status.OK] * 3, outcomes
        assert len({o.node for o in outcomes}) == 1, f"{name} ran on several nodes"
        assert (root / name / "a.txt").read_text() == name
        assert outcomes[2].value is not None
        assert outcomes[2].value["stdout"] == f"{name}{root / name}\n"
    assert {outcomes[0].node for outcomes in results.values()} == live_nodes()
    nodes = {
        r.call_id: r.node
        for r in read_journal(tmp_path / "j.jsonl").records
        if isinstance(r, OutcomeRecord)
    }
    assert len(nodes) == 18
    assert set(nodes.values()) == live_nodes()


@pytest.mark.needs("overlayfs layers (pool.layer)")
async def test_a_layer_runs_on_the_node_that_holds_it(cluster: Cluster, root: Path) -> None:
    base = root / "base"
    base.mkdir()
    (base / "a.txt").write_text("base\n")
    async with RayPool(root, config=CONFIG) as pool:
        paths = [await pool.layer(f"ray-{n}", base=base) for n in range(4)]
        for n, path in enumerate(paths):
            wrote = await pool.call("write", {"path": "a.txt", "content": str(n)}, workspace=path)
            read = await pool.call("read", {"path": "a.txt"}, workspace=path)
            assert (wrote.status, read.status) == (Status.OK, Status.OK), (wrote, read)
            assert read.value is not None
            assert read.value["content"] == str(n)
            assert wrote.node == read.node == pool.nodes()[path]
        assert {pool.nodes()[path] for path in paths} == live_nodes()
    assert (base / "a.txt").read_text() == "base\n"


@pytest.mark.needs("overlayfs layers (pool.layer)")
async def test_layers_over_an_image_on_the_nodes(cluster: Cluster, root: Path) -> None:
    ref = write_busybox_image(root.parent / "layout")
    async with RayPool(root, config=CONFIG) as pool:
        paths = [await pool.layer(f"ray-image-{n}", image=ref) for n in range(4)]
        for n, path in enumerate(paths):
            wrote = await pool.call(
                "bash", {"command": f"echo {n} > mine; cat /etc/os-release mine"}, workspace=path
            )
            assert wrote.status is Status.OK, wrote
            assert wrote.value is not None
            assert wrote.value["stdout"] == f"NAME=busybox-image\n{n}\n"  # the image's /etc
            assert wrote.node == pool.nodes()[path]
        assert {pool.nodes()[path] for path in paths} == live_nodes()
        with pytest.raises(TypeError, match="reference"):
            await pool.layer("x", image=object())  # type: ignore[arg-type]
    # Pulled once into the store (the two nodes of this machine share it).
    assert len(os.listdir(Path(IMAGES) / "images")) == 1


async def test_spans_come_from_the_driver_one_a_call_with_its_node(
    cluster: Cluster, root: Path
) -> None:
    from test_telemetry import Collector  # the OTLP/HTTP receiver of the telemetry tests

    collector = Collector()
    collector.thread.start()
    try:
        # The node pools are made with this config too when this test runs first: they must
        # send nothing of their own (ray_node drops [telemetry]), so each call has one span.
        config = CONFIG.override(telemetry={"otlp_endpoint": collector.url})
        async with RayPool(root, config=config) as pool:
            outcomes = [
                await pool.call("bash", {"command": f"exit {n}"}, workspace="t") for n in range(3)
            ]
        # A node pool's spans would come on its export schedule (it outlives the RayPool):
        # proving that none come takes waiting out a few rounds of it.
        await asyncio.sleep(2.5 * SCHEDULE_MS / 1000)
    finally:
        collector.server.shutdown()
        collector.server.server_close()
    spans = {s["attributes"]["sandbx.call_id"]: s["attributes"] for s in collector.spans}
    assert len(collector.spans) == len(spans) == 3
    for n, outcome in enumerate(outcomes):
        assert spans[outcome.call_id]["sandbx.node"] == outcome.node
        assert spans[outcome.call_id]["sandbx.exit_code"] == n
        assert spans[outcome.call_id]["sandbx.status"] == "ok"


async def test_a_workspace_cannot_leave_the_root(cluster: Cluster, root: Path) -> None:
    async with RayPool(root, config=CONFIG) as pool:
        with pytest.raises(ValueError, match="not a folder under the root"):
            await pool.call("ls", {}, workspace="../elsewhere")
        outcome = await pool.call("read", {"path": "../../etc/passwd"}, workspace="w")
    assert outcome.status is Status.DENIED


async def test_a_token_kills_the_call_on_its_node(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    tag = unique_tag()
    async with RayPool(root, journal=tmp_path / "j.jsonl", config=CONFIG) as pool:
        token = CancelToken()
        call = asyncio.create_task(
            pool.call("bash", {"command": tagged_sleep(tag)}, cancel=token, workspace="t")
        )
        await started(tag)
        asked = time.monotonic()
        token.cancel("enough")
        outcome = await call
        answered = time.monotonic() - asked
    assert outcome.status is Status.CANCELLED
    assert outcome.killed_by is KilledBy.TOKEN
    assert outcome.reason == "enough"
    assert outcome.node in live_nodes()
    assert answered < 2.0
    await wait_until(lambda: not pids_with(tag), within_s=0.5, what="gone")
    record = read_journal(tmp_path / "j.jsonl").records[-1]
    assert isinstance(record, OutcomeRecord)
    assert (record.status, record.killed_by, record.node) == ("cancelled", "token", outcome.node)


async def test_a_task_cancel_kills_the_call_on_its_node(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    tag = unique_tag()
    async with RayPool(root, journal=tmp_path / "j.jsonl", config=CONFIG) as pool:
        call = asyncio.create_task(pool.call("bash", {"command": tagged_sleep(tag)}, workspace="t"))
        await started(tag)
        asked = time.monotonic()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert time.monotonic() - asked < 2.0
    await wait_until(lambda: not pids_with(tag), within_s=0.5, what="gone")
    record = read_journal(tmp_path / "j.jsonl").records[-1]
    assert isinstance(record, OutcomeRecord)
    assert (record.status, record.killed_by) == ("cancelled", "task")


def test_a_rollout_worker_calls_its_nodes_pool_and_ray_cancel_kills(
    cluster: Cluster, root: Path
) -> None:
    (root / "a.txt").write_text("hello\n")

    @ray.remote(num_cpus=0)
    def rollout_step(workspace: str) -> Any:
        handle = node_pool()  # this node's pool, shared by every task on the node
        return ray.get(handle.call.remote("read", {"path": "a.txt"}, workspace=workspace))

    outcome = ray.get(rollout_step.remote(str(root)), timeout=60)
    assert outcome.status is Status.OK
    assert outcome.value["content"] == "hello\n"
    assert outcome.node in live_nodes()

    tag = unique_tag()
    handle = node_pool(config=CONFIG)
    ref = handle.call.remote("bash", {"command": tagged_sleep(tag)}, workspace=str(root))
    wait_until_sync(lambda: bool(pids_with(tag)), within_s=20, what=f"{tag} running")
    ray.cancel(ref)
    with pytest.raises(ray.exceptions.TaskCancelledError):
        ray.get(ref, timeout=10)
    wait_until_sync(lambda: not pids_with(tag), within_s=2, what="gone")


def test_the_cli_runs_a_batch_on_the_cluster(cluster: Cluster, root: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    lines = [
        {
            "id": f"w{n}",
            "tool": "write",
            "args": {"path": "x", "content": "1"},
            "workspace": f"e{n}",
        }
        for n in range(4)
    ] + [
        {
            "id": f"r{n}",
            "tool": "read",
            "args": {"path": "x"},
            "workspace": f"e{n}",
            "after": [f"w{n}"],
        }
        for n in range(4)
    ]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for n in range(4):
        (root / f"e{n}").mkdir()
    journal = tmp_path / "j.jsonl"
    argv = [
        sys.executable,
        "-m",
        "sandbx_pool.cli",
        "run",
        str(calls),
        "--workspace",
        str(root),
        "--ray",
        cluster.address,
        "--journal",
        str(journal),
        "--parallel",
        "4",
    ]
    env = {**os.environ, "RAY_ADDRESS": ""}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert "calls per node:" in done.stdout
    for node in live_nodes():
        assert node in done.stdout
    outcomes = [r for r in read_journal(journal).records if isinstance(r, OutcomeRecord)]
    assert sorted(r.call_id for r in outcomes if r.status == "ok") == sorted(
        line["id"] for line in lines
    )
    by_call = {r.call_id: r.node for r in outcomes}
    assert all(by_call[f"w{n}"] == by_call[f"r{n}"] for n in range(4))
    resumed = subprocess.run(
        [*argv, "--resume"], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "8 skipped" in resumed.stdout


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_the_cli_runs_image_lines_on_the_cluster(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    ref = write_busybox_image(tmp_path / "layout")
    lines = [
        {
            "id": f"i{n}",
            "tool": "bash",
            "args": {"command": f"echo {n} > mine; cat /etc/os-release mine"},
            "layer": f"cli-image-{n}",
            "image": ref,
        }
        for n in range(4)
    ]
    calls = tmp_path / "calls.jsonl"
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    journal = tmp_path / "j.jsonl"
    argv = [sys.executable, "-m", "sandbx_pool.cli", "run", str(calls), "--workspace", str(root)]
    argv += ["--ray", cluster.address, "--journal", str(journal), "--parallel", "4"]
    env = {**os.environ, "RAY_ADDRESS": ""}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert done.returncode == 0, done.stderr
    outcomes = {r.call_id: r for r in read_journal(journal).records if isinstance(r, OutcomeRecord)}
    assert sorted(outcomes) == [f"i{n}" for n in range(4)]
    for n in range(4):
        record = outcomes[f"i{n}"]
        assert record.status == "ok", record
        assert record.value_summary is not None
        assert record.value_summary["stdout"] == f"NAME=busybox-image\n{n}\n"
    assert {r.node for r in outcomes.values()} == live_nodes()


def test_a_signal_stops_a_cluster_batch_and_its_calls(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    tag = unique_tag()
    lines = [
        {"id": f"s{n}", "tool": "bash", "args": {"command": tagged_sleep(tag)}, "workspace": "t"}
        for n in range(2)
    ]
    calls = tmp_path / "calls.jsonl"
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    journal = tmp_path / "j.jsonl"
    argv = [sys.executable, "-m", "sandbx_pool.cli", "run", str(calls), "--workspace", str(root)]
    argv += ["--ray", cluster.address, "--journal", str(journal)]
    with (tmp_path / "out").open("w") as out:
        run = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_until_sync(lambda: len(pids_with(tag)) == 2, within_s=60, what="both running")
            run.send_signal(signal.SIGINT)
            assert run.wait(timeout=30) == 128 + signal.SIGINT
        finally:
            run.kill()
            run.wait()
    wait_until_sync(lambda: not pids_with(tag), within_s=2, what="the calls' processes gone")
    outcomes = [r for r in read_journal(journal).records if isinstance(r, OutcomeRecord)]
    assert {(r.call_id, r.status, r.killed_by) for r in outcomes} == {
        ("s0", "cancelled", "shutdown"),
        ("s1", "cancelled", "shutdown"),
    }


async def test_node_loss_ends_its_calls_crashed_and_moves_its_workspaces(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    """Last in the module: it removes the second node."""
    head = cluster.head_node.node_id
    other = next(node for node in cluster.list_all_nodes() if node.node_id != head)
    tag = unique_tag()
    journal = tmp_path / "j.jsonl"
    async with RayPool(root, journal=journal, config=CONFIG) as pool:
        # Place workspaces until one lands on the node about to go.
        for n in range(8):
            (root / f"w{n}").mkdir()
            placed = await pool.call("ls", {}, workspace=f"w{n}")
            if placed.node == other.node_id:
                name = f"w{n}"
                break
        call = asyncio.create_task(
            pool.call("bash", {"command": tagged_sleep(tag)}, workspace=name, call_id="b")
        )
        await started(tag)
        cluster.remove_node(other, allow_graceful=False)
        outcome = await asyncio.wait_for(call, 30)
        assert outcome.status is Status.CRASHED
        assert outcome.reason == NODE_LOST
        assert other.node_id in (outcome.error or "")
        assert outcome.node == other.node_id
        later = await pool.call("ls", {}, workspace=name)
        assert later.status is Status.OK
        assert later.node == head
    await wait_until(lambda: not pids_with(tag), within_s=10, what="gone")
    plan = resume_plan(journal)
    assert "b" not in plan.finished
    assert plan.in_doubt == {"b": "bash"}


async def test_under_policy_always_a_call_returns_only_once_its_outcome_is_on_disk(
    cluster: Cluster, root: Path, tmp_path: Path
) -> None:
    # docs/journal.md: under "always" the caller never sees an outcome that is not on disk.
    # RayPool shares Pool's call life (call_life), so its journal keeps that promise too.
    journal = tmp_path / "j.jsonl"
    config = CONFIG.override(journal={"policy": "always"})
    async with RayPool(root, journal=journal, config=config) as pool:
        for n in range(20):
            tool, args = ("write", {"path": f"{n}.txt", "content": "x"}) if n % 2 else ("ls", {})
            outcome = await pool.call(tool, args, workspace="t")
            # Read at once, without yielding to the loop: only what is on disk counts.
            on_disk = {
                r.call_id for r in read_journal(journal).records if isinstance(r, OutcomeRecord)
            }
            assert outcome.call_id in on_disk, f"call {n} returned before its outcome was written"
