"""Layers over a container image: the image's layers are the call's `/`, the layer keeps the
writes. Real overlays of real layer directories, made here as an image store unpacks them
(busybox-static as the image's programs, a whiteout as a 0:0 character device, an opaque
directory by its ``user.overlay.opaque`` attribute), on a real pool: as root, and as an
unprivileged user in a user namespace (.ci/environments)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from helpers import journal_records

from sandbx_pool import CancelToken, Config, Layer, LayerUnavailable, Pool, Status
from sandbx_pool.images import Image

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")

BUSYBOX = shutil.which("busybox") or "/bin/busybox"
#: The programs the image's first layer links to busybox.
APPLETS = (
    "sh", "ls", "cat", "echo", "id", "stat", "mkdir", "rm", "hostname", "env", "pwd", "test",
    "touch", "sleep", "readlink", "head", "wc", "true", "grep", "mount",
)  # fmt: skip


def _config(tmp_path: Path, **sections: dict[str, object]) -> Config:
    return marked_config(
        pool={"workers": 4}, workspace={"layers": str(tmp_path / "layers")}, **sections
    )


def _whiteout(path: Path) -> None:
    """An OCI whiteout as the store unpacks it: a 0:0 character device (as root; in a user
    namespace, the kernel lets its root make this one device)."""
    os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(0, 0))


def _diff_id(layer: Path) -> str:
    """A stand-in for the layer's diff_id: a hash of its listing (the test's store)."""
    listing = sorted(str(p.relative_to(layer)) for p in layer.rglob("*"))
    return "sha256:" + hashlib.sha256("\n".join(listing).encode()).hexdigest()


def make_image(
    root: Path,
    *,
    extra_layers: int = 0,
    env: tuple[str, ...] = ("PATH=/bin", "IMAGE_VAR=from-image"),
    workdir: str = "/srv/app",
) -> Image:
    """A 3-layer image (plus ``extra_layers`` small ones on top), its layers as a store holds
    them: bottom first."""
    layers: list[Path] = []
    one = root / "l1"
    (one / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, one / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", one / "bin" / applet)
    for name in ("etc", "root", "srv/app", "old", "tmp"):
        (one / name).mkdir(parents=True, exist_ok=True)
    os.chmod(one / "tmp", 0o1777)
    (one / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (one / "etc" / "os-release").write_text("ID=sandbx-test\n")
    (one / "etc" / "hosts").write_text("10.9.9.9 image-own-hosts\n")
    (one / "srv" / "app" / "main.txt").write_text("v1\n")
    (one / "gone.txt").write_text("deleted by layer 2\n")
    (one / "old" / "a").write_text("a\n")
    (one / "old" / "b").write_text("b\n")
    layers.append(one)
    two = root / "l2"
    (two / "old").mkdir(parents=True)
    _whiteout(two / "gone.txt")
    os.setxattr(two / "old", "user.overlay.opaque", b"y")
    (two / "old" / "c").write_text("c\n")
    (two / "etc").mkdir()
    (two / "etc" / "layer2").write_text("two\n")
    layers.append(two)
    three = root / "l3"
    (three / "srv" / "app").mkdir(parents=True)
    (three / "srv" / "app" / "main.txt").write_text("v3\n")
    layers.append(three)
    for index in range(extra_layers):
        extra = root / f"x{index}"
        (extra / "stack").mkdir(parents=True)
        (extra / "stack" / f"{index:03d}").write_text(f"{index}\n")
        (extra / "stack" / "top").write_text(f"{index}\n")
        layers.append(extra)
    return Image(
        ref=f"oci:{root}:test",
        digest="sha256:" + hashlib.sha256(str(root).encode()).hexdigest(),
        layers=tuple(_diff_id(layer) for layer in layers),
        env=env,
        workdir=workdir,
        size=0,
        layer_dirs=tuple(str(layer) for layer in layers),
    )


def _tree(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``root``: type, mode, owner, content or target, mtime, xattrs."""
    found: dict[str, tuple[Any, ...]] = {}
    for path in [root, *root.rglob("*")]:
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode):
            what: object = path.read_bytes()
        elif stat.S_ISLNK(st.st_mode):
            what = os.readlink(path)
        else:
            what = None
        attrs = {name: os.getxattr(path, name, follow_symlinks=False) for name in
                 os.listxattr(path, follow_symlinks=False)}  # fmt: skip
        found[str(path.relative_to(root))] = (st.st_mode, st.st_uid, st.st_mtime_ns, what, attrs)
    return found


async def _bash(pool: Pool, ws: Layer, command: str, **kwargs: Any) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, workspace=ws, **kwargs)
    assert outcome.status is Status.OK, (outcome.error, outcome.value)
    assert outcome.value is not None
    return outcome.value


async def test_calls_see_the_image_as_root_and_the_layer_keeps_the_writes(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image")
    before = _tree(tmp_path / "image")
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("img", image=image)
        assert ws.image == image and ws.base is None
        # The merged tree: layer 3 over 2 over 1, the whiteout and the opaque directory hold.
        seen = await _bash(
            pool,
            ws,
            "pwd; cat main.txt; ls /old; test -e /gone.txt || echo gone; cat /etc/layer2;"
            " cat /etc/os-release; id -u; echo $IMAGE_VAR; readlink /proc/self/exe",
        )
        assert seen["stdout"].split("\n") == [
            "/srv/app",
            "v3",
            "c",
            "gone",
            "two",
            "ID=sandbx-test",
            "0",
            "from-image",
            "/bin/busybox",
            "",
        ], seen
        # File tools take image paths: absolute, or relative to the image's WorkingDir.
        read = await pool.call("read", {"path": "main.txt"}, workspace=ws)
        assert read.value is not None and read.value["content"] == "v3\n"
        wrote = await pool.call(
            "write", {"path": "/usr/local/bin/tool", "content": "#!/bin/sh\necho tool\n"},
            workspace=ws,
        )  # fmt: skip
        assert wrote.status is Status.OK, wrote.error
        edit = await pool.call(
            "edit", {"path": "/etc/os-release", "old_string": "test", "new_string": "edited"},
            workspace=ws,
        )  # fmt: skip
        assert edit.status is Status.OK, edit.error
        listed = await pool.call("ls", {"path": "/old"}, workspace=ws)
        assert listed.value is not None
        assert [e["name"] for e in listed.value["entries"]] == ["c"]
        await _bash(pool, ws, "chmod +x /usr/local/bin/tool && rm /bin/cat && echo x > /new")
        again = await _bash(
            pool,
            ws,
            "/usr/local/bin/tool; cat /etc/os-release; ls /new; test -e /bin/cat || echo rm",
        )
        assert again["stdout"] == "tool\nID=sandbx-edited\n/new\nrm\n", again
        changes = {c["path"]: (c["kind"], c["type"]) for c in await ws.diff()}
        assert changes == {
            "bin/cat": ("deleted", "symlink"),
            "etc/os-release": ("modified", "file"),
            "new": ("created", "file"),
            "usr": ("created", "dir"),
            "usr/local": ("created", "dir"),
            "usr/local/bin": ("created", "dir"),
            "usr/local/bin/tool": ("created", "file"),
        }, changes
        # reset: the image again; the image itself was never written.
        await ws.reset()
        assert await ws.diff() == []
        back = await _bash(pool, ws, "cat /etc/os-release; test -e /new || echo no-new")
        assert back["stdout"] == "ID=sandbx-test\nno-new\n"
    assert _tree(tmp_path / "image") == before
