"""The image store on images the tests write themselves: what it unpacks (held to ``umoci raw
unpack`` of the same image, through a real overlay mount), what it refuses, and that nothing is
ever half-stored, whoever pulls, however many at once, killed wherever.

Runs as root and as an unprivileged user (.ci/environments): the store needs no privilege.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import wait_until_sync
from image_tools import list_tree, merged_tree, require, umoci_tree
from oci_images import Entry, Layer, Written, busybox_layer, have_busybox, write_layout

from sandbx_pool import ImageError, ImageStore


@pytest.fixture(autouse=True)
def _tools() -> None:
    require("skopeo", "skopeo")


def _store_is_empty(store: ImageStore) -> None:
    """Nothing of a failed pull: no record, no layer, no staging left."""
    root = Path(store.root)
    assert list((root / "images").iterdir()) == []
    assert list((root / "layers").iterdir()) == []
    assert list((root / "tmp").iterdir()) == []


def _whiteout_image(layout: Path, compression: str = "gzip") -> Written:
    base = Layer(
        [
            Entry("etc", "dir", mode=0o755),
            Entry("etc/a", "file", b"a\n"),
            Entry("etc/b", "file", b"b\n", mode=0o600),
            Entry("opt", "dir", mode=0o755),
            Entry("opt/x", "dir", mode=0o750),
            Entry("opt/x/1", "file", b"1"),
            Entry("opt/x/2", "file", b"2"),
            Entry("gone", "file", b"gone"),
            Entry("gone-dir", "dir", mode=0o755),
            Entry("gone-dir/f", "file", b"f"),
        ],
        compression,
    )
    top = Layer(
        [
            Entry(".wh.gone", "file"),
            Entry(".wh.gone-dir", "file"),
            Entry("etc/.wh.a", "file"),
            Entry("opt/x", "dir", mode=0o755),
            Entry("opt/x/.wh..wh..opq", "file"),
            Entry("opt/x/3", "file", b"3"),
            Entry("etc/link", "symlink", target="../opt/x/3"),
        ],
        compression,
    )
    return write_layout(layout, [base, top])


# -- what is unpacked ------------------------------------------------------------------------


# Their comparison mounts the layers as an overlay: not where none mounts (a container's root).
@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_a_busybox_image_is_what_umoci_unpacks_and_its_layers_are_overlay_lowers(
    tmp_path: Path,
) -> None:
    if not have_busybox():
        pytest.skip("no static busybox (Debian package busybox-static)")
    layout = tmp_path / "layout"
    written = write_layout(
        layout,
        [busybox_layer(), Layer([Entry("etc/motd", "file", b"hi\n")], "plain")],
        env=("PATH=/bin", "A=1"),
        workdir="/tmp",
    )
    store = ImageStore(tmp_path / "store")
    image = store.image(f"oci:{layout}:latest")
    assert image.digest == written.digest
    assert list(image.layers) == written.diff_ids
    assert image.env == ("PATH=/bin", "A=1")
    assert image.workdir == "/tmp"
    assert image.size == Path("/bin/busybox").stat().st_size + len(b"NAME=busybox-test\n") + 3
    assert [Path(d).is_dir() for d in image.layer_dirs] == [True, True]
    owners = os.geteuid() == 0
    merged = merged_tree(image.layer_dirs, tmp_path, owners=owners)
    assert merged == umoci_tree(layout, "latest", tmp_path, owners=owners)
    assert merged["bin/sh"]["sha256"] == merged["bin/busybox"]["sha256"]
    # Found, not pulled again: the same record, the same directories.
    assert store.image(f"oci:{layout}:latest") == image


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_whiteouts_and_opaque_directories_become_the_overlays(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    _whiteout_image(layout)
    store = ImageStore(tmp_path / "store")
    image = store.image(f"oci:{layout}:latest")
    top = Path(image.layer_dirs[1])
    for hidden in ("gone", "gone-dir", "etc/a"):
        info = (top / hidden).lstat()
        assert stat.S_ISCHR(info.st_mode), hidden
        assert info.st_rdev == os.makedev(0, 0), hidden
    assert os.getxattr(top / "opt/x", "user.overlay.opaque") == b"y"
    assert not (top / "opt/x/.wh..wh..opq").exists()
    owners = os.geteuid() == 0
    merged = merged_tree(image.layer_dirs, tmp_path, owners=owners)
    assert sorted(merged) == [
        "etc", "etc/b", "etc/link", "opt", "opt/x", "opt/x/3",
    ]  # fmt: skip
    assert merged == umoci_tree(layout, "latest", tmp_path, owners=owners)


@pytest.mark.parametrize("compression", ["zstd", "plain"])
def test_zstd_and_plain_layers_unpack_as_gzip_ones_do(tmp_path: Path, compression: str) -> None:
    if compression == "zstd":
        require("zstd", "zstd")
    trees = {}
    for kind in ("gzip", compression):
        layout = tmp_path / kind
        _whiteout_image(layout, kind)
        image = ImageStore(tmp_path / f"store-{kind}").image(f"oci:{layout}")
        trees[kind] = [list_tree(d) for d in image.layer_dirs]
    assert trees["gzip"] == trees[compression]


def test_setid_bits_are_stripped_devices_skipped_fifos_kept(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    write_layout(
        layout,
        [
            Layer(
                [
                    Entry("su", "file", b"#!/bin/sh\n", mode=0o4755),
                    Entry("sg", "dir", mode=0o2775),
                    Entry("sticky", "dir", mode=0o1777),
                    Entry("null", "chr"),  # 0/0 by number, but not named .wh.: a device node
                    Entry("fifo", "fifo", mode=0o640),
                ]
            )
        ],
    )
    image = ImageStore(tmp_path / "store").image(f"oci:{layout}")
    root = Path(image.layer_dirs[0])
    assert stat.S_IMODE((root / "su").stat().st_mode) == 0o755
    assert stat.S_IMODE((root / "sg").stat().st_mode) == 0o775
    assert stat.S_IMODE((root / "sticky").stat().st_mode) == 0o1777
    assert not (root / "null").exists()
    assert stat.S_ISFIFO((root / "fifo").lstat().st_mode)
    meta = json.loads((root.parent / "layer.json").read_text())
    assert meta["skipped_devices"] == 1


# -- what is refused -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "named"),
    [
        ([Entry("/etc/evil", "file", b"x")], "'/etc/evil' is an absolute path"),
        ([Entry("../evil", "file", b"x")], "'../evil' climbs out"),
        ([Entry("a/../../evil", "file", b"x")], "'a/../../evil' climbs out"),
        (
            [Entry("out", "symlink", target="OUTSIDE"), Entry("out/evil", "file", b"x")],
            "entry 'out/evil' goes through 'out', a symlink of the layer",
        ),
        (
            [Entry("f", "file", b"x"), Entry("f/evil", "file", b"x")],
            "entry 'f/evil' goes through 'f', not a directory of the layer",
        ),
        ([Entry("h", "link", target="../../etc/passwd")], "'../../etc/passwd' climbs out"),
    ],
)
def test_an_entry_landing_outside_its_layer_is_an_error_naming_it(
    tmp_path: Path, entries: list[Entry], named: str
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    for entry in entries:
        entry.target = entry.target.replace("OUTSIDE", str(outside))
    layout = tmp_path / "layout"
    written = write_layout(layout, [Layer([Entry("ok", "file", b"fine")]), Layer(entries)])
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageError) as caught:
        store.image(f"oci:{layout}")
    assert named in str(caught.value)
    assert written.blobs[1] in str(caught.value)
    assert list(outside.iterdir()) == []
    # The first layer was fine and stays (shared by whatever else has it); no image, no record.
    assert list((Path(store.root) / "images").iterdir()) == []
    assert list((Path(store.root) / "tmp").iterdir()) == []


def test_a_layer_whose_tar_is_not_its_diff_id_is_refused_naming_the_blob(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    written = write_layout(
        layout, [Layer([Entry("a", "file", b"a")])], diff_ids=["sha256:" + "0" * 64]
    )
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageError, match="the config says sha256:0000") as caught:
        store.image(f"oci:{layout}")
    assert written.blobs[0] in str(caught.value)
    _store_is_empty(store)


@pytest.mark.parametrize("damage", ["garbage", "truncated gzip"])
def test_a_blob_that_is_no_tar_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    layout = tmp_path / "layout"
    written = write_layout(layout, [Layer([Entry("a", "file", os.urandom(8192))])])
    blob = layout / "blobs" / "sha256" / written.blobs[0].split(":")[1]
    data = b"not a tar at all" * 64 if damage == "garbage" else blob.read_bytes()[:4000]
    # The blob matches its (rewritten) digest: only its content is wrong.
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blob.unlink()
    (blob.parent / digest.split(":")[1]).write_bytes(data)
    for path in layout.joinpath("blobs", "sha256").iterdir():
        text = path.read_bytes()
        if written.blobs[0].encode() in text:
            fixed = text.replace(written.blobs[0].encode(), digest.encode())
            path.unlink()
            new = "sha256:" + hashlib.sha256(fixed).hexdigest()
            (path.parent / new.split(":")[1]).write_bytes(fixed)
            index = layout / "index.json"
            index.write_text(index.read_text().replace(f"sha256:{path.name}", new))
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageError, match=f"layer blob {digest}"):
        store.image(f"oci:{layout}")
    _store_is_empty(store)


def test_a_corrupt_blob_is_refused_naming_it_and_nothing_is_stored(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    written = write_layout(layout, [Layer([Entry("a", "file", b"a" * 4096)], "plain")])
    blob = written.blobs[0]
    path = layout / "blobs" / "sha256" / blob.split(":")[1]
    data = bytearray(path.read_bytes())
    data[600] ^= 1
    path.write_bytes(bytes(data))
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageError) as caught:
        store.image(f"oci:{layout}")
    assert blob.split(":")[1] in str(caught.value)
    _store_is_empty(store)


def test_a_corrupt_blob_of_the_stores_own_is_found_and_fetched_again(tmp_path: Path) -> None:
    # The store hands its blobs to skopeo, which takes them as they are: the store checks them.
    layout = tmp_path / "layout"
    written = write_layout(layout, [Layer([Entry("a", "file", b"a" * 4096)], "plain")])
    blob, diff_id = written.blobs[0], written.diff_ids[0]
    store = ImageStore(tmp_path / "store")
    store.image(f"oci:{layout}")
    root = Path(store.root)
    cached = root / "blobs" / "sha256" / blob.split(":")[1]
    data = bytearray(cached.read_bytes())
    cached.unlink()
    data[600] ^= 1
    cached.write_bytes(bytes(data))
    for record in (root / "images").iterdir():
        record.unlink()
    os.rename(root / "layers" / diff_id.split(":")[1], root / "tmp" / "gone")
    subprocess.run(["rm", "-rf", str(root / "tmp" / "gone")], check=True)
    with pytest.raises(ImageError, match=blob):
        store.image(f"oci:{layout}")
    assert not cached.exists()
    assert store.image(f"oci:{layout}").layers == (diff_id,)


# -- once, whole, under contention and kills --------------------------------------------------

PULL = """
import sys
from sandbx_pool import ImageStore
image = ImageStore(sys.argv[1]).image(sys.argv[2])
print(":".join(image.layer_dirs))
"""


def _pull_in_child(store: Path, ref: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", PULL, str(store), ref], stdout=subprocess.PIPE, text=True
    )


def _big_image(layout: Path) -> Written:
    # Plain layers of incompressible data: the pull lasts long enough to be killed midway.
    return write_layout(
        layout,
        [
            Layer([Entry("big1", "file", os.urandom(24 << 20))], "plain"),
            Layer([Entry("big2", "file", os.urandom(24 << 20))], "plain"),
        ],
    )


def test_two_pools_pulling_one_image_at_once_store_it_once(tmp_path: Path) -> None:
    layout = tmp_path / "layout"
    _big_image(layout)
    store = tmp_path / "store"
    ImageStore(store)
    # Two references to one image, and the same reference twice.
    children = [
        _pull_in_child(store, f"oci:{layout}:latest"),
        _pull_in_child(store, f"oci:{layout}:latest"),
        _pull_in_child(store, f"oci:{layout}"),
    ]
    outputs = [child.communicate(timeout=300)[0] for child in children]
    assert [child.returncode for child in children] == [0, 0, 0]
    assert len(set(outputs)) == 1
    assert len(list((store / "layers").iterdir())) == 2
    assert len(list((store / "images").iterdir())) == 2
    assert list((store / "tmp").iterdir()) == []


@pytest.mark.parametrize("kill_when", ["fetching", "unpacking"])
def test_a_pull_killed_midway_leaves_nothing_half_made(tmp_path: Path, kill_when: str) -> None:
    layout = tmp_path / "layout"
    _big_image(layout)
    store = tmp_path / "store"
    ImageStore(store)
    child = _pull_in_child(store, f"oci:{layout}")

    def staged() -> bool:
        pulls = list((store / "tmp").glob(".pull-*"))
        if kill_when == "fetching":
            return bool(pulls)
        return any((p / "layer-0").exists() for p in pulls)

    try:
        wait_until_sync(staged, 60, f"the pull {kill_when}")
    finally:
        child.send_signal(signal.SIGKILL)
        child.communicate()
    assert list((store / "images").iterdir()) == []
    for layer in (store / "layers").iterdir():  # only whole ones, if any
        assert (layer / "layer.json").exists()
    # The next store opened here clears what the dead pull left, and pulls it whole.
    again = ImageStore(store)
    assert list((store / "tmp").iterdir()) == []
    image = again.image(f"oci:{layout}")
    assert (Path(image.layer_dirs[1]) / "big2").stat().st_size == 24 << 20


# -- eviction, pins ----------------------------------------------------------------------------


def _small_images(tmp_path: Path, names: list[str]) -> dict[str, str]:
    refs = {}
    base = Layer([Entry("base", "file", b"b" * (64 << 10))], "plain")
    for name in names:
        layout = tmp_path / name
        own = Layer([Entry(name, "file", os.urandom(256 << 10))], "plain")
        write_layout(layout, [base, own])
        refs[name] = f"oci:{layout}"
    return refs


def test_the_least_recently_used_images_are_evicted_never_a_pinned_one(tmp_path: Path) -> None:
    refs = _small_images(tmp_path, ["a", "b", "c"])
    store = ImageStore(tmp_path / "store")
    for name in ("a", "b", "c"):
        store.image(refs[name])
    store.image(refs["a"])  # a is used again: b is now the least recent
    listed = store.list()
    assert [s.image.ref for s in listed] == [refs["a"], refs["c"], refs["b"]]
    total = store.disk_usage()
    pruned = store.prune(total - 1)
    assert pruned.images == (refs["b"],)
    assert pruned.layers == (listed[-1].image.layers[1],)  # b's own; the base is shared
    assert pruned.freed >= 256 << 10
    assert store.disk_usage() == total - pruned.freed
    # The shared base stays: a and c have it.
    assert {s.image.ref for s in store.list()} == {refs["a"], refs["c"]}
    with store.pin(refs["c"]) as pin:
        assert [s.pinned for s in store.list() if s.image.ref == refs["c"]] == [True]
        pruned = store.prune(0)
        assert pruned.images == (refs["a"],)
        assert [s.image.ref for s in store.list()] == [refs["c"]]
        assert all(Path(d).is_dir() for d in pin.image.layer_dirs)
        with pytest.raises(ImageError, match="in use"):
            store.remove(refs["c"])
    assert store.remove(refs["c"]) is True
    assert store.remove(refs["c"]) is False
    assert store.disk_usage() == 0
    with pytest.raises(ImageError, match="not in the store"):
        store.pin(refs["c"])


def test_max_size_evicts_after_each_pull_but_never_the_image_just_pulled(tmp_path: Path) -> None:
    refs = _small_images(tmp_path, ["a", "b"])
    store = ImageStore(tmp_path / "store", max_size=1)
    store.image(refs["a"])
    assert [s.image.ref for s in store.list()] == [refs["a"]]
    image = store.image(refs["b"])
    assert [s.image.ref for s in store.list()] == [refs["b"]]
    assert all(Path(d).is_dir() for d in image.layer_dirs)


def test_a_malformed_reference_is_a_value_error(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ValueError, match="not a repository name"):
        store.image("Not A Ref")
    with pytest.raises(ImageError, match="skopeo copy failed"):
        store.image(f"oci:{tmp_path / 'missing'}")
    _store_is_empty(store)


# -- other sources ----------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["docker-archive", "oci-archive"])
def test_docker_save_and_oci_archives_are_read_as_layouts_are(
    tmp_path: Path, transport: str
) -> None:
    layout = tmp_path / "layout"
    written = _whiteout_image(layout)
    archive = tmp_path / "image.tar"
    subprocess.run(
        ["skopeo", "copy", "--quiet", f"oci:{layout}:latest", f"{transport}:{archive}"],
        check=True,
        capture_output=True,
    )
    store = ImageStore(tmp_path / "store")
    image = store.image(f"{transport}:{archive}")
    assert list(image.layers) == written.diff_ids
    top = Path(image.layer_dirs[1])
    assert os.getxattr(top / "opt/x", "user.overlay.opaque") == b"y"
    # docker save's layers are plain tars: kept so, not gzipped again by skopeo.
    assert image.size == ImageStore(tmp_path / "store2").image(f"oci:{layout}").size


def test_a_manifest_list_gives_the_hosts_platform(tmp_path: Path) -> None:
    from sandbx_pool.images.fetch import host_platform

    here = host_platform().split("/")[1]
    other = "arm64" if here != "arm64" else "amd64"
    layout = tmp_path / "layout"
    images = {
        arch: write_layout(layout, [Layer([Entry("arch", "file", arch.encode())])], tag=arch)
        for arch in (here, other)
    }
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    by_digest = {m["digest"]: m for m in index["manifests"]}
    listed = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": images[arch].digest,
                "size": by_digest[images[arch].digest]["size"],
                "platform": {"architecture": arch, "os": "linux"},
            }
            for arch in (other, here)
        ],
    }
    data = json.dumps(listed).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256" / digest.split(":")[1]).write_bytes(data)
    index["manifests"].append(
        {
            "mediaType": listed["mediaType"],
            "digest": digest,
            "size": len(data),
            "annotations": {"org.opencontainers.image.ref.name": "multi"},
        }
    )
    index_path.write_text(json.dumps(index))
    image = ImageStore(tmp_path / "store").image(f"oci:{layout}:multi")
    assert image.digest == images[here].digest
    assert (Path(image.layer_dirs[0]) / "arch").read_text() == here
