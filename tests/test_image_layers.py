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
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
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
    "touch", "sleep", "readlink", "head", "wc", "true", "grep", "mount", "wget", "yes", "chmod",
    "mv", "ln",
)  # fmt: skip


@pytest.fixture(autouse=True)
def _workspace(tmp_path: Path) -> None:
    """The pools here work in ``tmp_path / "ws"``, made first: a pool refuses a workspace that
    is missing (WorkspaceError); a layer over an image never looks at it."""
    (tmp_path / "ws").mkdir(exist_ok=True)


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
        assert ws.image == image
        assert ws.base is None
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
        assert read.value is not None
        assert read.value["content"] == "v3\n"
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
        # Made by uid 0 in the call's namespace, owned by the pool's user outside.
        made = os.stat(Path(ws.directory) / "upper" / "new")
        assert (made.st_uid, made.st_gid) == (os.getuid(), os.getgid())
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


async def test_nothing_of_the_host_is_in_reach(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret.txt"
    secret.write_text("host only\n")
    image = make_image(tmp_path / "image")
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("img", image=image)
        probe = await _bash(
            pool,
            ws,
            f"ls /work /root/.ssh /home /usr/bin/python3 {secret} {tmp_path} 2>/dev/null;"
            " echo rc=$?; cat /etc/shadow 2>&1; ls /; ls /proc | grep -c '^[0-9]';"
            " echo x > /sys/kernel/test 2>&1 || echo sys-ro; hostname; cat /etc/hostname;"
            " grep -c image-own-hosts /etc/hosts; echo ok > /dev/null && echo dev-ok",
        )
        lines = probe["stdout"].splitlines()
        assert lines[0] == "rc=1", probe  # none of them is there (busybox ls: 1)
        assert "No such file" in lines[1]  # the image has no /etc/shadow: not the host's
        listing = lines[2:]
        top = listing[: listing.index("tmp") + 1]
        assert top == ["bin", "dev", "etc", "gone.txt", "old", "proc", "root", "srv", "sys", "tmp"][
            : len(top)
        ] or set(top) <= {"bin", "dev", "etc", "old", "proc", "root", "srv", "sys", "tmp"}, top
        rest = listing[len(top) :]
        # The call's own processes only: its shell, ls and grep, under the worker.
        assert 1 <= int(rest[0]) <= 6, probe
        assert rest[1:] == ["sys-ro", "img", "img", "0", "dev-ok"], probe
        for path in (str(secret), "/proc/1/root/etc/shadow", f"/proc/1/root{secret}"):
            read = await pool.call("read", {"path": path}, workspace=ws)
            assert read.status is not Status.OK, (path, read.value)
        # The image's own /etc/passwd is what a read of /etc/passwd finds, however reached.
        own = await pool.call("read", {"path": "../../../../etc/passwd"}, workspace=ws)
        assert own.value is not None
        assert own.value["content"] == "root:x:0:0:root:/root:/bin/sh\n"


async def test_an_images_device_nodes_open_nothing_and_mount_points_stay_put(
    tmp_path: Path,
) -> None:
    image = make_image(tmp_path / "image")
    if os.geteuid() == 0:  # only root makes a device node: an image's tar may hold any
        os.mknod(Path(image.layer_dirs[2]) / "zero", stat.S_IFCHR | 0o666, os.makedev(1, 5))
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("img", image=image)
        if os.geteuid() == 0:
            node = await _bash(pool, ws, "head -c 1 /zero > /dev/null 2>&1; echo $?")
            assert node["stdout"] == "1\n"  # nodev: the node opens nothing
        # A call cannot swap a mount point (each is in use: busy, or a lower directory that
        # overlayfs will not rename); were the layer's upper directory to hold one as a
        # symlink to the host's tree all the same, the next call is refused, never mounted
        # through it, until the layer is reset.
        swap = await _bash(pool, ws, "rm -f /etc/hosts; mv /proc /p; ls -ld /etc/hosts /proc")
        assert swap["stdout"].count("\n") == 2, swap
        assert "->" not in swap["stdout"], swap
        os.symlink("/root", Path(ws.directory) / "upper" / "proc")
        refused = await pool.call("bash", {"command": "true"}, workspace=ws)
        assert refused.status is Status.ERROR
        assert refused.error is not None
        assert "/proc in this layer is not a directory" in refused.error, refused
        await ws.reset()
        assert (await _bash(pool, ws, "cat /etc/hostname"))["stdout"] == "img\n"


async def test_env_cwd_and_network_as_a_container_gives_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LANG", "host-lang-must-not-leak")
    host_resolv = Path("/etc/resolv.conf").read_text()  # noqa: ASYNC240 (the test's own)
    image = make_image(tmp_path / "image", env=("IMAGE_VAR=from-image", "SHARED=image"))
    config = _config(tmp_path, env={"set": {"SHARED": "pool", "POOL_VAR": "pool"}})
    async with Pool(tmp_path / "ws", config=config) as pool:
        ws = await pool.layer("img", image=image)
        value = await _bash(pool, ws, "env | sort", env={"CALL_VAR": "call", "POOL_VAR": "c"})
        env = dict(line.split("=", 1) for line in value["stdout"].splitlines() if "=" in line)
        assert env["IMAGE_VAR"] == "from-image"
        assert env["SHARED"] == "pool"  # [env] set over the image's
        assert env["POOL_VAR"] == "c"  # the call's over [env] set
        assert env["PATH"] == "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        assert env["HOME"] == "/root"
        assert "LANG" not in env, env
        assert env["PWD"] == "/srv/app"
        # cwd: the call's own, relative paths from it.
        there = await pool.call("bash", {"command": "pwd; cat a"}, workspace=ws, cwd="/old")
        assert there.value is not None
        assert there.value["stdout"] == "/old\n", there
        # Offline: no network namespace but loopback, and an empty resolv.conf; online: the
        # host's resolv.conf.
        offline = await _bash(pool, ws, "cat /etc/resolv.conf | wc -c", network=False)
        assert offline["stdout"].strip() == "0"
        online = await _bash(pool, ws, "cat /etc/resolv.conf", network=True)
        assert online["stdout"] == host_resolv


async def test_fork_persists_and_refuses_another_image(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image")
    other = make_image(tmp_path / "other")
    journal = tmp_path / "run.jsonl"
    async with Pool(tmp_path / "ws", config=_config(tmp_path), journal=journal) as pool:
        ws = await pool.layer("img", image=image)
        await _bash(pool, ws, "echo mine > /srv/app/mine")
        branches = [await ws.fork(f"branch-{i}") for i in range(3)]
        for index, branch in enumerate(branches):
            assert branch.image == image
            await _bash(pool, branch, f"echo {index} > /srv/app/mine")
        seen = [
            (await _bash(pool, layer, "cat /srv/app/mine"))["stdout"] for layer in (ws, *branches)
        ]
        assert seen == ["mine\n", "0\n", "1\n", "2\n"]
        with pytest.raises(ValueError, match="image never changes"):
            await pool.layer("img", image=other)
        with pytest.raises(ValueError, match="not both"):
            await pool.layer("new", base=tmp_path, image=image)
        with pytest.raises(ValueError, match="no view or layer_at"):
            await pool.call("ls", {}, workspace=ws, view=str(tmp_path / "ws" / "v"))
        with pytest.raises(ValueError, match="changes='tracked'"):
            await pool.call("ls", {}, workspace=ws, changes="tracked")
        with pytest.raises(TypeError, match="must be an Image"):
            await pool.layer("new", image=42)  # type: ignore[arg-type]
        # A reference is pulled (pool.image): a malformed one is a ValueError, nothing made.
        with pytest.raises(ValueError, match="not a repository name"):
            await pool.layer("new", image="Not A Ref")
        await branches[2].remove()
    # Another pool opens the layer from its record alone: the image is found there.
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        again = await pool.layer("img")
        assert again.image == image
        assert (await _bash(pool, again, "cat /srv/app/mine"))["stdout"] == "mine\n"
        with pytest.raises(ValueError, match="lies over an image"):
            await pool.layer("branch-0", base=tmp_path / "image")
        with pytest.raises(ValueError, match="no layer 'branch-2'"):
            await pool.layer("branch-2")
    records = [r for r in journal_records(str(journal)) if r["kind"] == "intent"]
    assert any(r["tool"] == "bash" for r in records)


async def test_a_missing_image_layer_is_refused_and_nothing_is_made(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image")
    broken = Image(
        ref=image.ref,
        digest=image.digest,
        layers=(*image.layers, "sha256:" + "0" * 64),
        layer_dirs=(*image.layer_dirs, str(tmp_path / "evicted")),
    )
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        with pytest.raises(LayerUnavailable, match="evicted"):
            await pool.layer("img", image=broken)
        assert sorted(os.listdir(tmp_path / "layers")) == []
        ws = await pool.layer("img", image=image)
        assert ws.open
        # A layer directory the store evicted since: the call says so, and runs nowhere else.
        os.rename(image.layer_dirs[1], tmp_path / "moved")
        gone = await pool.call("read", {"path": "/etc/passwd"}, workspace=ws)
        assert gone.status is Status.ERROR
        assert gone.error is not None
        assert "gone from the image store" in gone.error, gone


async def test_a_40_layer_image(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", extra_layers=37)
    assert len(image.layer_dirs) == 40
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("img", image=image)
        value = await _bash(pool, ws, "ls /stack | wc -l; cat /stack/top /srv/app/main.txt")
        assert value["stdout"] == "38\n36\nv3\n"


async def test_an_image_past_a_page_of_mount_options(tmp_path: Path) -> None:
    """300 layers: their descriptors' names fill more than the page mount(2) copies, so the
    overlay is made through fsconfig, one lower at a time (Linux 6.8)."""
    image = make_image(tmp_path / "image", extra_layers=297)
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("img", image=image)
        value = await _bash(pool, ws, "ls /stack | wc -l; cat /stack/top; echo x > /stack/new")
        assert value["stdout"] == "298\n296\n"
        assert [c["path"] for c in await ws.diff()] == ["stack/new"]


async def test_cancel_timeout_and_output_limit_hold(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image")
    config = _config(tmp_path, calls={"max_output_bytes": 100_000})
    async with Pool(tmp_path / "ws", config=config) as pool:
        ws = await pool.layer("img", image=image)
        slow = await pool.call("bash", {"command": "sleep 30"}, workspace=ws, timeout=0.5)
        assert slow.status is Status.TIMEOUT
        token = CancelToken()
        task = pool.call("bash", {"command": "echo started; sleep 30"}, workspace=ws, cancel=token)
        import asyncio

        running = asyncio.ensure_future(task)
        from helpers import wait_until

        await wait_until(lambda: bool(pool.running()), what="the call to start")
        token.cancel("stop")
        cancelled = await running
        assert cancelled.status is Status.CANCELLED
        assert cancelled.reason == "stop"
        flood = await pool.call("bash", {"command": "yes"}, workspace=ws, timeout=30)
        assert flood.status is Status.OUTPUT_LIMIT
        # The layer is usable after each kill.
        assert (await _bash(pool, ws, "echo fine"))["stdout"] == "fine\n"


def _bash_layer(root: Path) -> Path:
    """A layer holding the host's bash and the libraries it links (an image with a bash)."""
    layer = root / "bash-layer"
    (layer / "bin").mkdir(parents=True)
    shutil.copy2(os.path.realpath("/bin/bash"), layer / "bin" / "bash")
    listed = subprocess.run(["ldd", "/bin/bash"], capture_output=True, text=True, check=True)
    for line in listed.stdout.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            target = layer / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)
    return layer


async def test_bash_is_the_images_own_and_a_session_keeps_its_state(tmp_path: Path) -> None:
    plain = make_image(tmp_path / "image")
    layer = _bash_layer(tmp_path)
    image = msgspec.structs.replace(
        plain,
        digest="sha256:" + "b" * 64,
        layers=(*plain.layers, _diff_id(layer)),
        layer_dirs=(*plain.layer_dirs, str(layer)),
    )
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        sh_only = await pool.layer("sh", image=plain)
        shell = await _bash(pool, sh_only, "readlink /proc/$$/exe")
        assert shell["stdout"] == "/bin/busybox\n"  # no bash in that image: its /bin/sh
        in_session = await pool.call("bash", {"command": "echo hi"}, workspace=sh_only, session="x")
        assert in_session.status is Status.OK, in_session
        assert in_session.value is not None
        assert in_session.value["stdout"] == "hi\n", in_session.value
        # busybox's sh has no `declare`: the session keeps its state, and says so.
        assert in_session.session is not None
        assert in_session.session["updated"] is False
        assert "keeps its state" in in_session.session["note"]
        ws = await pool.layer("img", image=image)
        assert (await _bash(pool, ws, "echo $BASH"))["stdout"] == "/bin/bash\n"
        first = await pool.call(
            "bash", {"command": "cd /old && export KEPT=1"}, workspace=ws, session="s"
        )
        assert first.status is Status.OK, first
        second = await pool.call("read", {"path": "c"}, workspace=ws, session="s")
        assert second.value is not None
        assert second.value["content"] == "c\n", second
        third = await _bash(pool, ws, "pwd; echo $KEPT", session="s")
        assert third["stdout"] == "/old\n1\n"


def test_the_image_record_is_json(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image")
    from sandbx_pool import image_layer

    assert image_layer.from_record("x", json.loads(json.dumps(image_layer.record(image)))) == image


_CONTAINER_ROOT = [
    "setpriv",
    "--bounding-set=-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,"
    "+net_bind_service,+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap",
    "--inh-caps=-all",
]

_WITHOUT_OVERLAY = r"""
import asyncio, json, os, sys
from sandbx_pool import LayerUnavailable, Pool
from sandbx_pool.config import load_config
from sandbx_pool.images import Image

async def main(workspace, store, layer):
    config = load_config(None).override(workspace={"layers": store})
    image = Image(ref="t", digest="sha256:" + "1" * 64, layers=("sha256:" + "2" * 64,),
                  layer_dirs=(layer,))
    async with Pool(workspace, config=config) as pool:
        try:
            await pool.layer("x", image=image)
        except LayerUnavailable as exc:
            made = os.listdir(store) if os.path.isdir(store) else []
            print(json.dumps({"error": str(exc), "made": made}))

asyncio.run(main(*sys.argv[1:]))
"""


def test_without_overlays_an_image_layer_is_refused_naming_why(tmp_path: Path) -> None:
    """A container's root (no CAP_SYS_ADMIN) whose workers get no user namespace."""
    if os.geteuid() != 0:
        pytest.skip("plays a container's root: needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    image = make_image(tmp_path / "image")
    args = [str(tmp_path / "ws"), str(tmp_path / "s"), image.layer_dirs[0]]
    done = subprocess.run(
        [*_CONTAINER_ROOT, sys.executable, "-c", _WITHOUT_OVERLAY, *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "mount namespace" in out["error"]
    assert "doctor" in out["error"]
    assert out["made"] == []


@pytest.mark.needs("network allow-list")
async def test_an_allow_listed_call_in_an_image_reaches_only_its_hosts(tmp_path: Path) -> None:
    from test_network_allowlist import Server, allow_config

    server = Server()
    try:
        image = make_image(tmp_path / "image")
        allow = [f"index.test:{server.port}"]
        config = allow_config(allow).override(workspace={"layers": str(tmp_path / "layers")})
        async with Pool(tmp_path / "ws", config=config, workers=2) as pool:
            ws = await pool.layer("net", image=image)
            # busybox's wget, the image's own program, goes through the proxy's variables.
            outcome = await pool.call(
                "bash",
                {
                    "command": f"wget -q -O /got http://index.test:{server.port}/b;"
                    f" wget -q -O - http://evil.test:{server.port}/ || echo refused;"
                    " grep -c nameserver /etc/resolv.conf || true"
                },
                workspace=ws,
            )
            changed = [c["path"] for c in await ws.diff()]
    finally:
        server.close()
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["stdout"].startswith("refused\n"), outcome.value
    assert outcome.value["network_denied"] == ["evil.test"]
    assert changed == ["got"]


def _merged(image: Image) -> dict[str, str]:
    """The image's tree as the OCI layer rules make it (what `umoci raw unpack` writes):
    each layer over the ones below, a whiteout deleting its path, an opaque directory hiding
    what lay below it. Path -> "d" | "l:TARGET" | "f:SHA256"."""
    tree: dict[str, str] = {}
    for layer in map(Path, image.layer_dirs):
        for path in sorted(layer.rglob("*"), key=lambda p: len(p.parts)):
            rel = "/" + str(path.relative_to(layer))
            st = os.lstat(path)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                tree = {p: k for p, k in tree.items() if p != rel and not p.startswith(rel + "/")}
                continue
            if stat.S_ISDIR(st.st_mode):
                if "user.overlay.opaque" in os.listxattr(path):
                    tree = {p: k for p, k in tree.items() if not p.startswith(rel + "/")}
                tree[rel] = "d"
            elif stat.S_ISLNK(st.st_mode):
                tree[rel] = "l:" + os.readlink(path)
            else:
                tree[rel] = "f:" + hashlib.sha256(path.read_bytes()).hexdigest()
    return tree


async def test_the_merged_tree_is_the_images_by_the_oci_rules(tmp_path: Path) -> None:
    image = make_image(tmp_path / "image", extra_layers=2)
    expected = _merged(image)
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("img", image=image)
        value = await _bash(
            pool,
            ws,
            "cd /; find . -xdev -type d; find . -xdev -type l -exec sh -c"
            ' \'for p; do echo "$p -> $(readlink "$p")"; done\' _ {} +;'
            " find . -xdev -type f -exec sha256sum {} +",
        )
    seen: dict[str, str] = {}
    for line in value["stdout"].splitlines():
        if " -> " in line:
            path, target = line.split(" -> ", 1)
            seen[path[1:]] = "l:" + target
        elif "  " in line:
            digest, path = line.split("  ", 1)
            seen[path[1:]] = "f:" + digest
        elif line != ".":
            seen[line[1:]] = "d"
    # What a call is given on top, as a runtime gives it, is all else: its mount points (the
    # layer's own skeleton) and the /etc files bound there.
    given = {"/proc", "/sys", "/dev", "/etc/hosts", "/etc/hostname", "/etc/resolv.conf"}
    assert {p: k for p, k in seen.items() if p not in expected and p not in given} == {}
    assert {p: k for p, k in expected.items() if seen.get(p) != k and p not in given} == {}
    assert len(expected) > 40
