"""OCI image layouts written by the tests themselves (no network, no daemon).

``write_layout(dir, [layer, ...])`` writes an OCI image layout whose layers are tars built here
from ``Entry`` lists, compressed as asked (gzip, zstd through Debian's ``zstd``, or plain);
``busybox_layer()`` is a layer with Debian's busybox-static as ``/bin/busybox`` and its applets
as links, the smallest real userland.
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
from dataclasses import dataclass, field
from pathlib import Path

BUSYBOX = "/bin/busybox"


@dataclass
class Entry:
    name: str
    kind: str = "file"  # file | dir | symlink | link | fifo | chr
    data: bytes = b""
    mode: int = 0o644
    target: str = ""  # a symlink's or a hard link's
    uid: int = 0
    gid: int = 0


@dataclass
class Written:
    """What ``write_layout`` wrote: the manifest's digest, the layers' blobs and diff_ids."""

    digest: str
    blobs: list[str]
    diff_ids: list[str]


@dataclass
class Layer:
    entries: list[Entry] = field(default_factory=list)
    compression: str = "gzip"  # gzip | zstd | plain


def layer_tar(layer: Layer) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in layer.entries:
            info = tarfile.TarInfo(entry.name)
            info.mode, info.uid, info.gid, info.mtime = entry.mode, entry.uid, entry.gid, 1700000000
            kinds = {
                "file": tarfile.REGTYPE,
                "dir": tarfile.DIRTYPE,
                "symlink": tarfile.SYMTYPE,
                "link": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
                "chr": tarfile.CHRTYPE,
            }
            info.type = kinds[entry.kind]
            info.linkname = entry.target
            if entry.kind == "file":
                info.size = len(entry.data)
                tar.addfile(info, io.BytesIO(entry.data))
            else:
                tar.addfile(info)
    return buffer.getvalue()


def compress(data: bytes, compression: str) -> tuple[bytes, str]:
    base = "application/vnd.oci.image.layer.v1.tar"
    if compression == "gzip":
        return gzip.compress(data, mtime=0), base + "+gzip"
    if compression == "zstd":
        out = subprocess.run(["zstd", "-q", "-c"], input=data, capture_output=True, check=True)
        return out.stdout, base + "+zstd"
    return data, base


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _put(layout: Path, data: bytes) -> str:
    digest = _sha(data)
    path = layout / "blobs" / "sha256" / digest.split(":")[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return digest


def write_layout(
    layout: Path,
    layers: list[Layer],
    *,
    tag: str = "latest",
    env: tuple[str, ...] = ("PATH=/bin",),
    workdir: str = "/",
    diff_ids: list[str] | None = None,
    user: str = "",
) -> Written:
    """Add an image to the OCI layout at ``layout`` (made if needed) under ``tag``; returns
    what was written: ``digest`` (the manifest's), ``blobs``, ``diff_ids``."""
    layout.mkdir(parents=True, exist_ok=True)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    descriptors, found_diff_ids = [], []
    for layer in layers:
        tar = layer_tar(layer)
        found_diff_ids.append(_sha(tar))
        blob, media_type = compress(tar, layer.compression)
        descriptors.append(
            {"mediaType": media_type, "digest": _put(layout, blob), "size": len(blob)}
        )
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": list(env), "WorkingDir": workdir, **({"User": user} if user else {})},
        "rootfs": {"type": "layers", "diff_ids": diff_ids or found_diff_ids},
    }
    config_bytes = json.dumps(config).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": _put(layout, config_bytes),
            "size": len(config_bytes),
        },
        "layers": descriptors,
    }
    manifest_bytes = json.dumps(manifest).encode()
    digest = _put(layout, manifest_bytes)
    index_path = layout / "index.json"
    index = (
        json.loads(index_path.read_text())
        if index_path.exists()
        else {"schemaVersion": 2, "manifests": []}
    )
    index["manifests"] = [
        m
        for m in index["manifests"]
        if m["annotations"]["org.opencontainers.image.ref.name"] != tag
    ] + [
        {
            "mediaType": manifest["mediaType"],
            "digest": digest,
            "size": len(manifest_bytes),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }
    ]
    index_path.write_text(json.dumps(index))
    return Written(digest, [str(d["digest"]) for d in descriptors], found_diff_ids)


def busybox_layer(compression: str = "gzip") -> Layer:
    """/bin/busybox (Debian's busybox-static) with sh, ls, cat, echo, true as hard links."""
    data = Path(BUSYBOX).read_bytes()
    entries = [
        Entry("bin", "dir", mode=0o755),
        Entry("bin/busybox", "file", data, mode=0o755),
        *(Entry(f"bin/{n}", "link", target="bin/busybox") for n in ("sh", "ls", "cat", "true")),
        Entry("etc", "dir", mode=0o755),
        Entry("etc/os-release", "file", b"NAME=busybox-test\n"),
        Entry("tmp", "dir", mode=0o1777),
    ]
    return Layer(entries, compression)


def have_busybox() -> bool:
    try:
        out = subprocess.run(["file", "-L", BUSYBOX], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        return os.path.exists(BUSYBOX)
    return "statically linked" in out.stdout or "static-pie" in out.stdout


def copy_tree(source: Path, target: Path) -> None:
    shutil.copytree(source, target, symlinks=True)
