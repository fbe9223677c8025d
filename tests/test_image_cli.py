"""Image references as users write them, ``Pool.image``, and the ``sandbx-pool image``
commands: their output, their one-line errors and their exit statuses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import run_cli
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
    return run_cli(
        "image", *args, "--config", str(config), env={"HOME": str(config.parent)}, timeout=None
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
