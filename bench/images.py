"""Section: images, ingesting a real Debian image into the store (sandbx_pool.images).

Rows, one run each, in turns (ours, then podman's, on the same OCI layout):

* ingest of a Debian image built by ``mmdebstrap --variant=minbase`` without docs, man pages
  and locales, as debian:*-slim (one gzip layer, about 100 MB unpacked):
  ``ImageStore.image("oci:...")`` (skopeo copy, blob checked, layer unpacked and checked
  against its diff_id) against ``podman pull oci:...`` into a storage of its own (``--root``:
  the overlay driver), with the disk each then takes;
* a second image sharing that base plus one layer of its own: the time, and the disk added.

The base tar is built once and kept in ``$XDG_CACHE_HOME/sandbx-pool-bench`` (mmdebstrap needs
a Debian mirror; the build is not timed). The per-call rows of a layer over an image come with
``Pool.layer(name, image=...)``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from bench.workspace import BenchWorkspace
from sandbx_pool import ImageStore

SUITE = "bookworm"
#: What debian:*-slim leaves out (docs, man pages, locales): the image comes to about 100 MB.
SLIM = [
    f"--dpkgopt=path-exclude=/usr/share/{part}/*"
    for part in ("doc", "man", "locale", "info", "lintian", "linda")
]
#: The second image's own layer: this many MiB of files (a small application on the base).
SECOND_MIB = 8


@dataclass
class Ingest:
    seconds: float
    disk: int  # bytes of disk, after


@dataclass
class ImagesResult:
    unpacked_bytes: int = 0
    compressed_bytes: int = 0
    ours: dict[str, Ingest] = field(default_factory=dict)  # "first", "second"
    podman: dict[str, Ingest] = field(default_factory=dict)
    podman_error: str = ""


def _cache() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    path = Path(root) / "sandbx-pool-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _debian_tar() -> Path:
    tar = _cache() / f"debian-{SUITE}-minbase-slim.tar"
    if not tar.exists():
        logger.info("images: building a {} minbase tar with mmdebstrap (once)", SUITE)
        partial = tar.with_suffix(".partial")
        command = ["mmdebstrap", "--variant=minbase", "--format=tar", "--quiet", *SLIM]
        subprocess.run([*command, SUITE, str(partial)], check=True)
        partial.rename(tar)
    return tar


def _put(layout: Path, data: bytes) -> dict[str, object]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob = layout / "blobs" / "sha256" / digest.split(":")[1]
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _layout(layout: Path, tag: str, layer_tars: list[bytes]) -> None:
    """Add an image of these (uncompressed) layer tars to the OCI layout, gzip-compressed as a
    registry serves them."""
    layers, diff_ids = [], []
    for tar in layer_tars:
        diff_ids.append("sha256:" + hashlib.sha256(tar).hexdigest())
        blob = _put(layout, gzip.compress(tar, compresslevel=6, mtime=0))
        layers.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **blob})
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_put(layout, json.dumps(config).encode()),
        },
        "layers": layers,
    }
    descriptor = _put(layout, json.dumps(manifest).encode())
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2}
    index.setdefault("manifests", []).append(
        {
            "mediaType": manifest["mediaType"],
            **descriptor,
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }
    )
    index_path.write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')


def _second_layer() -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for i in range(SECOND_MIB):
            data = os.urandom(1 << 20)
            info = tarfile.TarInfo(f"opt/app/blob-{i}.bin")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _disk(path: Path) -> int:
    done = subprocess.run(["du", "-s", "--block-size=1", str(path)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 else 0


def _podman_pull(root: Path, ref: str) -> float:
    start = time.perf_counter()
    subprocess.run(
        ["podman", "--root", str(root / "storage"), "--runroot", str(root / "run"),
         "--storage-driver", "overlay", "pull", "--quiet", ref],
        check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - start


def run(ws: BenchWorkspace) -> ImagesResult:
    result = ImagesResult()
    base = _debian_tar().read_bytes()
    result.unpacked_bytes = len(base)
    layout = ws.root / "debian-layout"
    _layout(layout, "base", [base])
    _layout(layout, "app", [base, _second_layer()])
    result.compressed_bytes = _disk(layout / "blobs")
    store_root = ws.root / "image-store"
    store = ImageStore(store_root)
    for name, tag in (("first", "base"), ("second", "app")):
        start = time.perf_counter()
        store.image(f"oci:{layout}:{tag}")
        result.ours[name] = Ingest(time.perf_counter() - start, store.disk_usage())
        logger.info("images: ours, {}: {:.2f} s", name, result.ours[name].seconds)
    if shutil.which("podman") is None:
        result.podman_error = "podman is not installed"
        return result
    podman_root = ws.root / "podman"
    try:
        for name, tag in (("first", "base"), ("second", "app")):
            seconds = _podman_pull(podman_root, f"oci:{layout}:{tag}")
            result.podman[name] = Ingest(seconds, _disk(podman_root / "storage"))
            logger.info("images: podman, {}: {:.2f} s", name, seconds)
    except subprocess.CalledProcessError as exc:
        result.podman_error = (exc.stderr or b"").decode(errors="replace").strip()[-300:]
    finally:
        subprocess.run(
            ["podman", "--root", str(podman_root / "storage"), "--runroot",
             str(podman_root / "run"), "system", "reset", "--force"],
            capture_output=True, check=False,
        )  # fmt: skip
        shutil.rmtree(podman_root, ignore_errors=True)
    return result


def render(result: ImagesResult) -> str:
    from bench.report import table  # bench.report imports this module

    def mib(value: int) -> str:
        return f"{value / (1 << 20):.1f} MiB"

    rows = []
    for who, ingests in (("sandbx-pool store", result.ours), ("`podman pull`", result.podman)):
        first, second = ingests.get("first"), ingests.get("second")
        if first is None or second is None:
            continue
        rows.append(
            (
                who,
                f"{first.seconds:.2f} s",
                mib(first.disk),
                f"{second.seconds:.2f} s",
                f"+{mib(second.disk - first.disk)}",
            )
        )
    text = (
        "## Images: ingesting a Debian image\n\n"
        + table(
            ("who", "ingest", "disk", f"2nd image (+{SECOND_MIB} MiB layer)", "disk added"),
            rows,
            "lrrrr",
        )
        + f"\n\nThe image: `mmdebstrap --variant=minbase {SUITE}` without docs, man pages and"
        f" locales, one layer of"
        f" {mib(result.unpacked_bytes)} ({mib(result.compressed_bytes)} of gzip blobs for both"
        " images), from an OCI layout on the same disk. Ours keeps the fetched blobs beside the"
        " unpacked layers (a later pull of an image sharing them fetches none again)."
    )
    if result.podman_error:
        text += f"\n\npodman: {result.podman_error}"
    return text
