"""Image references as users write them, ``Pool.image``, and the ``sandbx-pool image``
commands: their output, their one-line errors and their exit statuses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import marked_config
from image_tools import require
from oci_images import Entry, Layer, busybox_layer, have_busybox, write_layout

from sandbx_pool import Image, ImageStore, PoolClosed
from sandbx_pool.images.refs import parse_ref
from sandbx_pool.pool import Pool

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("ref", "canonical"),
    [
        ("ubuntu:24.04", "docker://docker.io/library/ubuntu:24.04"),
        ("ubuntu", "docker://docker.io/library/ubuntu:latest"),
        ("docker://busybox", "docker://docker.io/library/busybox:latest"),
        ("user/app:1.0", "docker://docker.io/user/app:1.0"),
        ("index.docker.io/user/app", "docker://docker.io/user/app:latest"),
        ("127.0.0.1:5000/a/b:t", "docker://127.0.0.1:5000/a/b:t"),
        ("localhost/app", "docker://localhost/app:latest"),
        (f"ghcr.io/o/r@{DIGEST}", f"docker://ghcr.io/o/r@{DIGEST}"),
        (f"ghcr.io/o/r:1@{DIGEST}", f"docker://ghcr.io/o/r@{DIGEST}"),  # the digest wins
        ("oci:/images/x:v1", "oci:/images/x:v1"),
        ("oci:/images/x", "oci:/images/x"),
        ("oci-archive:/a/x.tar:v1", "oci-archive:/a/x.tar:v1"),
        ("docker-archive:/a/x.tar", "docker-archive:/a/x.tar"),
    ],
)
def test_references_as_docker_and_skopeo_read_them(ref: str, canonical: str) -> None:
    assert parse_ref(ref).canonical == canonical


def test_a_relative_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_ref("oci:layout:v1").canonical == f"oci:{tmp_path}/layout:v1"


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("", "not an image reference"),
        ("Ubuntu", "not a repository name"),
        ("ubuntu:bad tag", "not a valid tag"),
        ("x@sha256:12", "not a sha256 digest"),
        ("host:99999/x", "port out of range"),
        ("oci:", "no path after oci:"),
        ("docker-archive:/a.tar:tag", "takes no tag"),
        ("http://host/x", "unknown transport"),
        ("containers-storage:x", "unknown transport"),
    ],
)
def test_a_bad_reference_is_one_line_naming_it(ref: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as caught:
        parse_ref(ref)
    assert "\n" not in str(caught.value)


def _layout(tmp_path: Path) -> Path:
    layout = tmp_path / "layout"
    write_layout(layout, [Layer([Entry("hello", "file", b"hi")]), Layer([Entry("two", "file")])])
    return layout


async def test_pool_image_pulls_into_the_configured_store_off_the_loop(tmp_path: Path) -> None:
    require("skopeo", "skopeo")
    layout = _layout(tmp_path)
    workspace = tmp_path / "ws"
    workspace.mkdir()
    config = marked_config(images={"store": str(tmp_path / "store")})
    pool = Pool(workspace, config=config)
    with pytest.raises(PoolClosed):
        await pool.image(f"oci:{layout}")
    async with pool:
        image = await pool.image(f"oci:{layout}")
        assert isinstance(image, Image)
        assert all(d.startswith(str(tmp_path / "store")) for d in image.layer_dirs)
        assert (Path(image.layer_dirs[0]) / "hello").read_bytes() == b"hi"
        with pytest.raises(ValueError, match="not a repository name"):
            await pool.image("Bad Ref")
        # The store is out of every call's reach.
        outcome = await pool.call("ls", {"path": str(tmp_path / "store")})
        assert outcome.status != "ok"


def _cli(*args: str, config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "image", *args, "--config", str(config)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HOME": str(config.parent)},
    )


def test_the_image_commands(tmp_path: Path) -> None:
    require("skopeo", "skopeo")
    layout = _layout(tmp_path)
    config = tmp_path / "pool.toml"
    config.write_text(f'[images]\nstore = "{tmp_path / "store"}"\n')
    pulled = _cli("pull", f"oci:{layout}", config=config)
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.startswith(f"oci:{layout}  sha256:")
    assert "2 layers" in pulled.stdout
    listed = _cli("ls", "--json", config=config)
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)
    assert entry["ref"] == f"oci:{layout}"
    assert entry["pinned"] is False
    assert entry["disk"] > 0
    assert len(entry["layer_dirs"]) == 2
    assert _cli("ls", config=config).stdout.splitlines()[-1].startswith("1 image, ")
    removed = _cli("rm", f"oci:{layout}", config=config)
    assert (removed.returncode, removed.stdout) == (0, f"removed oci:{layout}\n")
    again = _cli("rm", f"oci:{layout}", config=config)
    assert again.returncode == 1
    assert again.stderr == f"sandbx-pool image rm: oci:{layout}: not in the store\n"
    assert _cli("pull", f"oci:{layout}", config=config).returncode == 0
    pruned = _cli("prune", config=config)
    assert pruned.returncode == 0
    assert pruned.stdout.startswith(f"evicted oci:{layout}\n1 image, 2 layers removed")


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["pull", "Not/A/Ref"], 2, "sandbx-pool image pull: image reference 'Not/A/Ref'"),
        (["pull", "oci:/nonexistent-layout"], 1, "sandbx-pool image pull: oci:/nonexistent"),
        (["prune", "--max-size", "lots"], 2, "'lots' is not a size"),
        (["frobnicate"], 2, "invalid choice"),
    ],
)
def test_image_command_errors_are_one_line(
    tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    require("skopeo", "skopeo")
    config = tmp_path / "pool.toml"
    config.write_text(f'[images]\nstore = "{tmp_path / "store"}"\n')
    done = _cli(*args, config=config)
    assert done.returncode == code
    assert says in done.stderr
    assert "Traceback" not in done.stderr
    if code == 1:
        assert len(done.stderr.splitlines()) == 1


def test_a_bad_images_setting_names_its_key(tmp_path: Path) -> None:
    config = tmp_path / "pool.toml"
    config.write_text('[images]\nmax_size = "huge"\n')
    done = _cli("ls", config=config)
    assert done.returncode == 2
    assert "images.max_size" in done.stderr


@pytest.mark.needs("overlayfs layers (pool.layer)")
async def test_a_layer_over_a_pulled_image_runs_the_images_own_shell(tmp_path: Path) -> None:
    require("skopeo", "skopeo")
    if not have_busybox():
        pytest.skip("no static busybox (Debian package busybox-static)")
    layout = tmp_path / "layout"
    write_layout(layout, [busybox_layer()], env=("PATH=/bin", "GREETING=from-the-image"))
    workspace = tmp_path / "ws"
    workspace.mkdir()
    config = marked_config(images={"store": str(tmp_path / "store")})
    async with Pool(workspace, config=config) as pool:
        # A reference: pulled, then pinned in the store while the pool is open.
        ws = await pool.layer("sample", image=f"oci:{layout}")
        outcome = await pool.call(
            "bash", {"command": "cat /etc/os-release; echo $GREETING"}, workspace=ws
        )
        assert outcome.status == "ok", outcome.error
        assert outcome.value is not None
        assert outcome.value["stdout"] == "NAME=busybox-test\nfrom-the-image\n"
        (stored,) = pool.images().list()
        assert stored.pinned is True
        assert pool.images().prune(0).images == ()
        await ws.remove()
    assert [s.pinned for s in ImageStore(tmp_path / "store").list()] == [False]


# -- sandbx-pool call TOOL ... --image REF ---------------------------------------------------


def _busybox_layout(tmp_path: Path) -> Path:
    require("skopeo", "skopeo")
    if not have_busybox():
        pytest.skip("no static busybox (Debian package busybox-static)")
    layout = tmp_path / "layout"
    write_layout(layout, [busybox_layer()], env=("PATH=/bin", "GREETING=from-the-image"))
    return layout


def _call_config(tmp_path: Path) -> Path:
    """The image store and the layer store in the test's directory; calls marked as ours."""
    from test_batch import marked_toml

    (tmp_path / "ws").mkdir(exist_ok=True)
    extra = (
        f'[images]\nstore = "{tmp_path / "store"}"\n[workspace]\nlayers = "{tmp_path / "layers"}"\n'
    )
    return marked_toml(tmp_path / "call.toml", extra)


def _call(
    tmp_path: Path, *argv: str, ref: str, config: Path | None = None
) -> subprocess.CompletedProcess[str]:
    config = config or _call_config(tmp_path)
    return subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "call", *argv, "--image", ref,
         "--config", str(config), "--workspace", str(tmp_path / "ws")],
        capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip


def _layers_left(tmp_path: Path) -> list[str]:
    layers = tmp_path / "layers"
    return sorted(os.listdir(layers)) if layers.exists() else []


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_call_in_an_image_runs_in_a_fresh_layer_removed_after(tmp_path: Path) -> None:
    layout = _busybox_layout(tmp_path)
    ref = f"oci:{layout}"
    first = _call(
        tmp_path, "bash", "command=cat /etc/os-release; echo $GREETING; echo x > /made",
        "--no-stream", ref=ref,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr
    outcome = json.loads(first.stdout)
    assert outcome["status"] == "ok"
    assert outcome["value"]["stdout"] == "NAME=busybox-test\nfrom-the-image\n"
    assert outcome["image"]["ref"] == ref
    assert outcome["image"]["digest"].startswith("sha256:")
    assert _layers_left(tmp_path) == []
    # The next call's layer is a fresh one: the image as it is, nothing of the last call's.
    second = _call(tmp_path, "read", "path=/made", ref=ref)
    assert second.returncode == 1
    assert json.loads(second.stdout)["status"] == "error"
    read = _call(tmp_path, "read", "path=/etc/os-release", ref=ref)
    assert read.returncode == 0, read.stderr
    assert "NAME=busybox-test" in json.loads(read.stdout)["value"]["content"]
    assert _layers_left(tmp_path) == []
    # The image stays in the store, unpinned: the call's pool has closed.
    assert [s.pinned for s in ImageStore(tmp_path / "store").list()] == [False]


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_a_call_in_an_image_that_times_out_leaves_no_layer(tmp_path: Path) -> None:
    layout = _busybox_layout(tmp_path)
    done = _call(
        tmp_path, "bash", "command=busybox sleep 60", "--timeout", "0.5", ref=f"oci:{layout}"
    )
    assert done.returncode == 1
    assert json.loads(done.stdout)["status"] == "timeout"
    assert _layers_left(tmp_path) == []


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_a_call_in_an_image_stopped_by_a_signal_leaves_no_layer(tmp_path: Path) -> None:
    from helpers import wait_until_sync
    from test_batch import start_cli

    layout = _busybox_layout(tmp_path)
    config = _call_config(tmp_path)
    argv = ["call", "bash", "command=echo > /started; busybox sleep 60", "--no-stream",
            "--image", f"oci:{layout}", "--config", str(config), "--workspace",
            str(tmp_path / "ws")]  # fmt: skip
    process = start_cli(argv, tmp_path / "cli")
    try:
        # The call's write lands in its layer's upper directory: the call is running.
        wait_until_sync(
            lambda: any((tmp_path / "layers").glob("call-*/upper/started")),
            60,
            "the call in the image to start",
        )
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(60) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert json.loads((tmp_path / "cli.out").read_text())["status"] == "cancelled"
    assert _layers_left(tmp_path) == []


def test_call_image_errors_are_one_line_with_their_own_exit_status(tmp_path: Path) -> None:
    require("skopeo", "skopeo")
    bad = _call(tmp_path, "ls", ref="Not A/Ref")
    assert bad.returncode == 2
    assert bad.stderr == (
        "sandbx-pool call: --image: image reference 'Not A/Ref': 'Not A' is not a"
        " repository name (lowercase, digits, . _ -)\n"
    )
    missing = _call(tmp_path, "ls", ref=f"oci:{tmp_path / 'no-layout'}")
    assert missing.returncode == 3
    assert missing.stderr.startswith(f"sandbx-pool call: --image: oci:{tmp_path / 'no-layout'}:")
    assert len(missing.stderr.splitlines()) == 1
    assert missing.stdout == ""
    assert _layers_left(tmp_path) == []


def test_call_in_an_image_without_overlays_exits_4_naming_why(tmp_path: Path) -> None:
    """A container's root (no CAP_SYS_ADMIN): no layer, so no call; nothing left made."""
    from test_image_layers import _CONTAINER_ROOT

    if os.geteuid() != 0:
        pytest.skip("plays a container's root: needs root")
    require("setpriv", "util-linux")
    layout = _busybox_layout(tmp_path)
    config = _call_config(tmp_path)
    done = subprocess.run(
        [*_CONTAINER_ROOT, sys.executable, "-m", "sandbx_pool.cli", "call", "ls",
         "--image", f"oci:{layout}", "--config", str(config), "--workspace",
         str(tmp_path / "ws")],
        capture_output=True, text=True, check=False, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    assert done.returncode == 4, done.stderr
    assert done.stderr.startswith("sandbx-pool call: --image: layers need a mount namespace")
    assert len(done.stderr.splitlines()) == 1
    assert _layers_left(tmp_path) == []


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_a_pulled_images_user_is_the_calls(tmp_path: Path) -> None:
    """The User of the image's config, through the store (workers.image_user has the rest)."""
    layout = _busybox_layout(tmp_path)
    write_layout(layout, [busybox_layer()], tag="as-user", user="4242:4343")
    done = _call(
        tmp_path, "bash", "command=busybox id -u; busybox id -g; echo $HOME", "--no-stream",
        ref=f"oci:{layout}:as-user",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["value"]["stdout"] == "4242\n4343\n/\n"
