"""Pulling from a real registry: Debian's ``docker-registry`` (distribution 2.x) on 127.0.0.1 at
a free port, started per test with its config in the test's directory and stopped after it.

Anonymous over plain HTTP (``[images] insecure``), refused without it; htpasswd credentials
read from ``REGISTRY_AUTH_FILE`` or ``~/.docker/config.json``; blobs the store holds are not
fetched again (the registry's own access log says which were).
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import json
import os
import socket
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import wait_until_sync
from image_tools import require
from oci_images import Entry, Layer, Written, write_layout

from sandbx_pool import Config, ImageError, ImageStore


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    log: Path
    user: str = ""
    password: str = ""

    def push(self, layout: Path, tag: str, repo: str) -> str:
        """Copy ``layout:tag`` to ``repo:tag`` here; the reference to pull it by."""
        creds = (
            ["--dest-creds", f"{self.user}:{self.password}"] if self.user else ["--dest-no-creds"]
        )
        subprocess.run(
            ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", *creds,
             f"oci:{layout}:{tag}", f"docker://{self.host}/{repo}:{tag}"],
            check=True, capture_output=True,
        )  # fmt: skip
        return f"{self.host}/{repo}:{tag}"

    def blob_gets(self) -> list[str]:
        """The blobs fetched so far (GET .../blobs/sha256:..., from the access log)."""
        found = []
        for line in self.log.read_text(errors="replace").splitlines():
            if '"GET /v2/' in line and "/blobs/sha256:" in line:
                found.append(line.split("/blobs/", 1)[1].split()[0].split("?")[0])
        return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _bcrypt(password: str) -> str:
    """An htpasswd line's hash, through libcrypt (no htpasswd command on a bare Debian)."""
    lib = ctypes.CDLL(ctypes.util.find_library("crypt") or "libcrypt.so.1")
    lib.crypt_gensalt.restype = ctypes.c_char_p
    lib.crypt.restype = ctypes.c_char_p
    salt = lib.crypt_gensalt(b"$2b$", 5, None, 0)
    hashed: bytes = lib.crypt(password.encode(), salt)
    return hashed.decode()


def _start(tmp_path: Path, *, auth: bool) -> Iterator[Registry]:
    binary = require("docker-registry", "docker-registry")
    port = _free_port()
    registry = Registry(host=f"127.0.0.1:{port}", log=tmp_path / "registry.log")
    config = [
        "version: 0.1",
        "log: {level: info, accesslog: {disabled: false}}",
        f"storage: {{filesystem: {{rootdirectory: {tmp_path / 'registry-data'}}}}}",
        f"http: {{addr: '127.0.0.1:{port}', secret: test-only}}",
    ]
    if auth:
        registry.user, registry.password = "tester", "s3cret-pass"
        (tmp_path / "htpasswd").write_text(f"{registry.user}:{_bcrypt(registry.password)}\n")
        config.append(f"auth: {{htpasswd: {{realm: test, path: {tmp_path / 'htpasswd'}}}}}")
    (tmp_path / "registry.yml").write_text("\n".join(config) + "\n")
    with registry.log.open("wb") as log:
        process = subprocess.Popen(
            [binary, "serve", str(tmp_path / "registry.yml")], stdout=log, stderr=log
        )
    try:

        def answers() -> bool:
            try:
                urllib.request.urlopen(f"http://{registry.host}/v2/", timeout=1).close()
            except urllib.error.HTTPError:
                return True  # 401: up, asking for credentials
            except OSError:
                return process.poll() is not None  # refused: not up yet (or died: say so below)
            return True

        wait_until_sync(answers, 30, "the registry to answer")
        assert process.poll() is None, registry.log.read_text()
        yield registry
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    require("skopeo", "skopeo")
    yield from _start(tmp_path, auth=False)


@pytest.fixture
def auth_registry(tmp_path: Path) -> Iterator[Registry]:
    require("skopeo", "skopeo")
    yield from _start(tmp_path, auth=True)


def _image(layout: Path, tag: str, own: bytes) -> Written:
    base = Layer([Entry("base", "file", b"B" * (128 << 10))])
    return write_layout(layout, [base, Layer([Entry("own", "file", own)])], tag=tag)


def _store(tmp_path: Path, registry: Registry) -> ImageStore:
    config = Config().override(
        images={"store": str(tmp_path / "store"), "insecure": [registry.host]}
    )
    return ImageStore.from_config(config)


def test_an_anonymous_pull_over_http_from_an_insecure_registry(
    tmp_path: Path, registry: Registry
) -> None:
    written = _image(tmp_path / "layout", "v1", b"one")
    ref = registry.push(tmp_path / "layout", "v1", "team/app")
    image = _store(tmp_path, registry).image(ref)
    assert image.ref == f"docker://{ref}"
    assert list(image.layers) == written.diff_ids
    assert (Path(image.layer_dirs[1]) / "own").read_bytes() == b"one"
    # docker://, and a digest: the same image.
    by_digest = _store(tmp_path, registry).image(
        f"docker://{registry.host}/team/app@{image.digest}"
    )
    assert by_digest.layers == image.layers


def test_a_registry_not_listed_insecure_must_present_a_valid_certificate(
    tmp_path: Path, registry: Registry
) -> None:
    _image(tmp_path / "layout", "v1", b"one")
    ref = registry.push(tmp_path / "layout", "v1", "app")
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageError, match=r"skopeo copy failed.*https://"):
        store.image(ref)
    assert list((Path(store.root) / "images").iterdir()) == []


def test_a_second_image_fetches_only_the_blobs_the_store_does_not_hold(
    tmp_path: Path, registry: Registry
) -> None:
    first = _image(tmp_path / "layout", "v1", b"one")
    second = _image(tmp_path / "layout", "v2", b"two")
    ref1 = registry.push(tmp_path / "layout", "v1", "app")
    ref2 = registry.push(tmp_path / "layout", "v2", "app")
    store = _store(tmp_path, registry)
    store.image(ref1)
    before = len(registry.blob_gets())
    image = store.image(ref2)
    fetched = registry.blob_gets()[before:]
    blobs1, blobs2 = first.blobs, second.blobs
    assert blobs2[0] == blobs1[0]  # the shared base
    assert blobs2[0] not in fetched
    assert blobs2[1] in fetched
    assert len(list((Path(store.root) / "layers").iterdir())) == 3
    assert image.layer_dirs[0] == store.image(ref1).layer_dirs[0]


@pytest.mark.parametrize("source", ["REGISTRY_AUTH_FILE", "docker config"])
def test_credentials_come_from_the_auth_file_or_dockers_config(
    tmp_path: Path, auth_registry: Registry, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    _image(tmp_path / "layout", "v1", b"secret")
    ref = auth_registry.push(tmp_path / "layout", "v1", "private")
    store = _store(tmp_path, auth_registry)
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))  # podman's auth.json: none
    with pytest.raises(ImageError, match="skopeo copy failed"):
        store.image(ref)
    token = base64.b64encode(f"{auth_registry.user}:{auth_registry.password}".encode()).decode()
    auth = json.dumps({"auths": {auth_registry.host: {"auth": token}}})
    if source == "REGISTRY_AUTH_FILE":
        (tmp_path / "auth.json").write_text(auth)
        monkeypatch.setenv("REGISTRY_AUTH_FILE", str(tmp_path / "auth.json"))
    else:
        (tmp_path / "home" / ".docker").mkdir(parents=True)
        (tmp_path / "home" / ".docker" / "config.json").write_text(auth)
    image = store.image(ref)
    assert (Path(image.layer_dirs[1]) / "own").read_bytes() == b"secret"
    assert os.environ.get("HOME") == str(tmp_path / "home")
