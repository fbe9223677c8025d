"""The image's User: a call in a layer over an image runs as the user its config names (a name
from the image's own /etc/passwd, or numbers), uid 0 when it names none. As root the image's
file owners hold against that user; as an unprivileged user (one mapped uid, .ci/environments)
the call is that uid and owns the image's files, as in a rootless runtime with one uid."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from test_image_layers import _config, make_image

from sandbx_pool import Pool
from sandbx_pool.images import Image
from sandbx_pool.workers.image_user import ROOT, ImageUser, ImageUserError, resolve

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")

PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:App:/home/app:/bin/sh\n"
GROUP = "root:x:0:\napp:x:1000:\nstaff:x:50:other,app\nwheel:x:10:root\n"


def _etc(root: Path, passwd: str = PASSWD, group: str = GROUP) -> Path:
    (root / "etc").mkdir(parents=True, exist_ok=True)
    (root / "etc" / "passwd").write_text(passwd)
    (root / "etc" / "group").write_text(group)
    return root


@pytest.mark.parametrize(
    ("spec", "user"),
    [
        ("", ROOT),
        ("app", ImageUser(1000, 1000, (50,), "/home/app")),
        ("1000", ImageUser(1000, 1000, (50,), "/home/app")),
        ("app:staff", ImageUser(1000, 50, (), "/home/app")),
        ("app:7", ImageUser(1000, 7, (), "/home/app")),
        ("4242", ImageUser(4242, 0, (), "/")),
        ("4242:4343", ImageUser(4242, 4343, (), "/")),
        ("root", ImageUser(0, 0, (10,), "/root")),
    ],
)
def test_a_user_is_read_as_a_container_runtime_reads_it(
    tmp_path: Path, spec: str, user: ImageUser
) -> None:
    assert resolve(spec, str(_etc(tmp_path))) == user


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("nobody-here", "'nobody-here' is not in the image's /etc/passwd"),
        ("app:nogroup", "group 'nogroup', which is not in the image's /etc/group"),
        ("app:", r"is not USER\[:GROUP\]"),
        (":1", r"is not USER\[:GROUP\]"),
    ],
)
def test_a_user_the_image_lacks_is_an_error_naming_it(tmp_path: Path, spec: str, says: str) -> None:
    with pytest.raises(ImageUserError, match=says):
        resolve(spec, str(_etc(tmp_path)))


def test_numbers_need_no_passwd(tmp_path: Path) -> None:
    assert resolve("12:34", str(tmp_path)) == ImageUser(12, 34, (), "/")
    with pytest.raises(ImageUserError, match="not in the image's /etc/passwd"):
        resolve("app", str(tmp_path))


def _image_with_users(tmp_path: Path, user: str) -> Image:
    """make_image's three layers, and one on top with the users, a home and a root-only file
    (owned as a root store keeps owners: only root can chown)."""
    image = make_image(tmp_path / "image")
    top = _etc(tmp_path / "image" / "users")
    (top / "home" / "app").mkdir(parents=True)
    (top / "etc" / "secret").write_text("root only\n")
    os.chmod(top / "etc" / "secret", 0o600)
    if os.geteuid() == 0:
        os.chown(top / "home" / "app", 1000, 1000)
    return msgspec.structs.replace(
        image,
        layers=(*image.layers, "sha256:" + "7" * 64),
        layer_dirs=(*image.layer_dirs, str(top)),
        user=user,
    )


async def _bash(pool: Pool, ws: object, command: str) -> str:
    outcome = await pool.call("bash", {"command": command}, workspace=ws)
    assert outcome.status == "ok", outcome.error
    assert outcome.value is not None
    stdout: str = outcome.value["stdout"]
    return stdout


async def test_a_call_runs_as_the_images_user(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    image = _image_with_users(tmp_path, "app")
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("as-app", image=image)
        said = await _bash(
            pool,
            ws,
            "id -u; id -g; echo $HOME; echo mine > /home/app/f && cat /home/app/f;"
            " cat /etc/secret 2>/dev/null || echo no-secret",
        )
        uid, gid, home, wrote, secret = said.splitlines()
        assert (uid, gid, home, wrote) == ("1000", "1000", "/home/app", "mine")
        if os.geteuid() == 0:
            # The image's owners hold: root's file is root's, the user's home the user's.
            assert secret == "no-secret"
            groups = await _bash(pool, ws, "id -G")
            assert groups.split() == ["1000", "50"]
        else:
            # One mapped uid: every file of the image is the call's (documented).
            assert secret == "root only"
        # The file tools are the user too.
        read = await pool.call("read", {"path": "/home/app/f"}, workspace=ws)
        assert read.status == "ok", read.error
        written = await pool.call("write", {"path": "/etc/new", "content": "x"}, workspace=ws)
        assert (written.status == "ok") is (os.geteuid() != 0), written.error


async def test_numbers_and_no_user(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    numeric = _image_with_users(tmp_path / "a", "4242:4343")
    unnamed = _image_with_users(tmp_path / "b", "")
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("numeric", image=numeric)
        assert (await _bash(pool, ws, "id -u; id -g; echo $HOME")).split() == ["4242", "4343", "/"]
        ws = await pool.layer("unnamed", image=unnamed)
        assert (await _bash(pool, ws, "id -u; id -g; echo $HOME")).split() == ["0", "0", "/root"]


async def test_a_user_the_image_lacks_refuses_the_call_naming_it(tmp_path: Path) -> None:
    (tmp_path / "ws").mkdir()
    image = _image_with_users(tmp_path, "ghost")
    async with Pool(tmp_path / "ws", config=_config(tmp_path)) as pool:
        ws = await pool.layer("ghost", image=image)
        outcome = await pool.call("bash", {"command": "true"}, workspace=ws)
        assert outcome.status == "error"
        assert "'ghost' is not in the image's /etc/passwd" in (outcome.error or "")
