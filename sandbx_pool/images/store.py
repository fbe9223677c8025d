"""The image store: every layer unpacked once, keyed by its diff_id, shared by the images that
have it; least recently used images' layers evicted past ``max_size``, never a pinned one's.

    <store>/                       [images] store (default $XDG_DATA_HOME/sandbx-pool/images)
        lock                       flock: shared while an image is found, pulled or pinned;
                                   exclusive while one is removed or the store pruned
        images/<key>.json          one per reference (key: sha256 of its canonical form):
                                   the Image, its blobs; its mtime is its last use
        layers/<hex>/root/         one unpacked layer, named by its diff_id: an overlay lower
        layers/<hex>/layer.json    its diff_id, blob, bytes and disk use
        blobs/sha256/<hex>         the blobs as fetched (an OCI layout's): a later pull of an
                                   image sharing them does not fetch them again
        pins/<key>                 flock'ed shared by each holder of a pin (a layer over the image)
        locks/ref-<key>, locks/layer-<hex>
                                   one pull of a reference, one unpack of a layer at a time,
                                   across every pool and process sharing the store
        tmp/.pull-<owner>-<random>/  a pull in progress: skopeo's staging layout and layers
                                   being unpacked, renamed into place only when whole
        tmp/.trash-<owner>-<random>/ what eviction or removal set aside, then deletes

Nothing is half-made: a layer appears by one rename once unpacked and checked, a record once
every layer it names is in place; a pull killed midway leaves only its ``tmp/.pull-`` entry,
which the next store opened on the directory deletes once its owner is gone (the name carries
the owner's pid and start time). Two pools pulling one image wait for each other on its ref lock
and the second finds the first's record; two images sharing a layer unpack it once, under the
layer's lock.

Every method blocks (skopeo, hashing, unpacking, deleting trees): the pool calls them through
``asyncio.to_thread``.
"""

from __future__ import annotations

import builtins
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
from collections.abc import Iterable, Iterator

import msgspec

from sandbx_pool.config import Config
from sandbx_pool.errors import ImageError
from sandbx_pool.images import fetch
from sandbx_pool.images.image import Image
from sandbx_pool.images.refs import parse_ref
from sandbx_pool.images.unpack import check_blob, unpack_layer
from sandbx_pool.runtime_dir import owner_is_dead, owner_tag

RECORD_VERSION = 1
PULL, TRASH = ".pull-", ".trash-"


class StoredImage(msgspec.Struct, frozen=True, kw_only=True):
    """One image of ``ImageStore.list()``: ``disk`` counts its layers and blobs whether or not
    another image shares them; ``last_used`` is a Unix time."""

    image: Image
    last_used: float
    disk: int
    pinned: bool


class Pruned(msgspec.Struct, frozen=True, kw_only=True):
    """What ``prune`` removed: images' refs, layers' diff_ids, bytes of disk freed."""

    images: tuple[str, ...]
    layers: tuple[str, ...]
    freed: int


class Pin:
    """A hold on an image's layers: the store evicts and removes none of them while it is open
    (a shared flock on ``pins/<key>``, released by ``unpin`` or by the holder's death)."""

    def __init__(self, fd: int, image: Image) -> None:
        self._fd: int | None = fd
        self.image = image

    def unpin(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> Pin:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unpin()

    def __repr__(self) -> str:
        return f"<Pin {self.image.ref} [{'held' if self._fd is not None else 'released'}]>"


def ref_key(canonical: str) -> str:
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


class ImageStore:
    """The store at ``root`` (made if missing). ``max_size``: bytes of disk past which the
    least recently used images' layers are evicted after each pull (None: never);
    ``insecure``: ``HOST:PORT`` of registries reached without TLS verification."""

    def __init__(
        self, root: str | os.PathLike[str], *, max_size: int | None = None,
        insecure: Iterable[str] = (),
    ) -> None:  # fmt: skip
        self.root = os.path.abspath(os.fspath(root))
        self.max_size = max_size
        self.insecure = frozenset(insecure)
        for part in ("", "images", "layers", "blobs/sha256", "pins", "locks", "tmp"):
            os.makedirs(os.path.join(self.root, part), mode=0o700, exist_ok=True)
        self._remove_abandoned()

    @classmethod
    def from_config(cls, config: Config) -> ImageStore:
        """The store ``[images]`` describes."""
        settings = config.images
        return cls(settings.store_dir(), max_size=settings.max_bytes(), insecure=settings.insecure)

    def __repr__(self) -> str:
        return f"<ImageStore {self.root} [max_size: {self.max_size}]>"

    # -- paths and locks -------------------------------------------------------------------------

    def _path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def _layer_dir(self, diff_id: str) -> str:
        return self._path("layers", diff_id.split(":", 1)[1])

    @contextlib.contextmanager
    def _lock(self, name: str, operation: int) -> Iterator[None]:
        fd = os.open(self._path(name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, operation)
            yield
        finally:
            os.close(fd)

    def _remove_abandoned(self) -> None:
        for name in os.listdir(self._path("tmp")):
            prefix = PULL if name.startswith(PULL) else TRASH
            if owner_is_dead(name, prefix):
                _remove_tree(self._path("tmp", name))

    # -- records ---------------------------------------------------------------------------------

    def _read_record(self, key: str) -> dict[str, object] | None:
        try:
            with open(self._path("images", f"{key}.json"), "rb") as f:
                record = json.loads(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise ImageError(f"the store's record images/{key}.json is unreadable: {exc}") from exc
        return record if isinstance(record, dict) else None

    def _records(self) -> dict[str, dict[str, object]]:
        found = {}
        for name in sorted(os.listdir(self._path("images"))):
            if name.endswith(".json"):
                record = self._read_record(name[: -len(".json")])
                if record is not None:
                    found[name[: -len(".json")]] = record
        return found

    def _image_of(self, record: dict[str, object]) -> Image:
        image = msgspec.convert(record["image"], Image)
        dirs = tuple(os.path.join(self._layer_dir(d), "root") for d in image.layers)
        return msgspec.structs.replace(image, layer_dirs=dirs)

    def _complete(self, record: dict[str, object]) -> bool:
        image = msgspec.convert(record["image"], Image)
        return all(os.path.isdir(self._layer_dir(d)) for d in image.layers)

    # -- the API ---------------------------------------------------------------------------------

    def image(self, ref: str) -> Image:
        """The image ``ref`` names: found in the store, else pulled into it. Its last use is
        now. ValueError for a malformed ``ref``; ImageError when it cannot be pulled."""
        parsed = parse_ref(ref)
        key = ref_key(parsed.canonical)
        with self._lock("lock", fcntl.LOCK_SH), self._lock(f"locks/ref-{key}", fcntl.LOCK_EX):
            record = self._read_record(key)
            if record is None or not self._complete(record):
                record = self._pull(parsed.canonical, key)
            # Its last use, at the clock's own resolution (a bare utime takes the kernel's
            # coarse clock: two uses a millisecond apart would tie).
            now = time.time_ns()
            os.utime(self._path("images", f"{key}.json"), ns=(now, now))
            image = self._image_of(record)
        if self.max_size is not None:
            self._prune(self.max_size, keep={key})
        return image

    def pin(self, image: Image | str) -> Pin:
        """Hold ``image`` (an Image or a reference) in the store until ``Pin.unpin``; ImageError
        if the store no longer holds it (evicted or removed since: pull it again)."""
        ref = image.ref if isinstance(image, Image) else parse_ref(image).canonical
        key = ref_key(ref)
        with self._lock("lock", fcntl.LOCK_SH):
            record = self._read_record(key)
            if record is None or not self._complete(record):
                raise ImageError(f"{ref}: not in the store (removed or evicted): pull it again")
            fd = os.open(self._path("pins", key), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            return Pin(fd, self._image_of(record))

    def list(self) -> builtins.list[StoredImage]:
        """Every image of the store, the most recently used first."""
        with self._lock("lock", fcntl.LOCK_SH):
            listed = []
            for key, record in self._records().items():
                image = self._image_of(record)
                disk = sum(self._layer_disk(d) for d in image.layers)
                disk += sum(self._blob_disk(b) for b in _blobs(record))
                with contextlib.suppress(FileNotFoundError):
                    last = os.stat(self._path("images", f"{key}.json")).st_mtime
                    listed.append(
                        StoredImage(
                            image=image, last_used=last, disk=disk, pinned=self._pinned(key)
                        )
                    )
        return sorted(listed, key=lambda s: -s.last_used)

    def remove(self, ref: str) -> bool:
        """Remove ``ref``'s record, and its layers and blobs no other image has. False when the
        store does not hold it; ImageError when it is pinned (a layer over it is open)."""
        key = ref_key(parse_ref(ref).canonical)
        with self._lock("lock", fcntl.LOCK_EX):
            if self._read_record(key) is None:
                return False
            if self._pinned(key):
                raise ImageError(f"{ref}: in use (a layer over it is open): not removed")
            os.unlink(self._path("images", f"{key}.json"))
            self._collect()
        return True

    def prune(self, max_size: int = 0) -> Pruned:
        """Evict the least recently used images (never a pinned one) until the store takes at
        most ``max_size`` bytes of disk; layers and blobs no image names go first, and so do
        pulls whose process is gone."""
        return self._prune(max_size, keep=set())

    def disk_usage(self) -> int:
        """Bytes of disk the layers and blobs take."""
        layers = sum(self._layer_disk(f"sha256:{h}") for h in os.listdir(self._path("layers")))
        blobs = sum(self._blob_disk(f"sha256:{h}") for h in os.listdir(self._path("blobs/sha256")))
        return layers + blobs

    # -- pulling ---------------------------------------------------------------------------------

    def _pull(self, ref: str, key: str) -> dict[str, object]:
        staging = self._path("tmp", f"{PULL}{owner_tag()}-{os.urandom(4).hex()}")
        layout = os.path.join(staging, "oci")
        os.makedirs(os.path.join(layout, "blobs", "sha256"))
        try:
            known = self._link_known_blobs(layout)
            parsed = parse_ref(ref)
            fetch.run_copy(parsed, layout, insecure=parsed.registry in self.insecure)
            fetched = fetch.read_layout(layout)
            sizes = []
            for index, (blob, diff_id) in enumerate(
                zip(fetched.blobs, fetched.diff_ids, strict=True)
            ):
                sizes.append(self._ingest_layer(staging, index, layout, blob, diff_id, known))
            self._keep_blobs(layout, fetched, known)
            image = Image(
                ref=ref,
                digest=fetched.digest,
                layers=fetched.diff_ids,
                env=fetched.env,
                workdir=fetched.workdir,
                user=fetched.user,
                size=sum(sizes),
            )
            record = {
                "v": RECORD_VERSION,
                "image": msgspec.to_builtins(msgspec.structs.replace(image, layer_dirs=())),
                "config": fetched.config,
                "blobs": list(fetched.blobs),
            }
            temp = os.path.join(staging, "record.json")
            with open(temp, "w") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.rename(temp, self._path("images", f"{key}.json"))
            return record
        finally:
            _remove_tree(staging)

    def _link_known_blobs(self, layout: str) -> dict[str, int]:
        """Hard-link the store's blobs into the staging layout (skopeo then fetches none of
        them); their inode numbers, to tell a reused blob from a fetched one."""
        known = {}
        store_blobs = self._path("blobs", "sha256")
        for name in os.listdir(store_blobs):
            with contextlib.suppress(FileNotFoundError):
                os.link(os.path.join(store_blobs, name), os.path.join(layout, "blobs/sha256", name))
                known[f"sha256:{name}"] = os.stat(os.path.join(store_blobs, name)).st_ino
        return known

    def _ingest_layer(
        self, staging: str, index: int, layout: str, blob: str, diff_id: str,
        known: dict[str, int],
    ) -> int:  # fmt: skip
        """Unpack one layer unless the store has it; its bytes."""
        final = self._layer_dir(diff_id)
        with self._lock(f"locks/layer-{diff_id.split(':', 1)[1]}", fcntl.LOCK_EX):
            if not os.path.isdir(final):
                temp = os.path.join(staging, f"layer-{index}")
                os.makedirs(os.path.join(temp, "root"), mode=0o755)
                try:
                    unpacked = unpack_layer(
                        fetch.blob_file(layout, blob), blob, diff_id, os.path.join(temp, "root")
                    )
                except ImageError:
                    if blob in known:  # the store's own copy is bad: the next pull fetches it
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(fetch.blob_file(self.root, blob))
                    raise
                meta = {"diff_id": diff_id, "blob": blob, **msgspec.to_builtins(unpacked)}
                with open(os.path.join(temp, "layer.json"), "w") as f:
                    json.dump(meta, f)
                os.rename(temp, final)
        return self._layer_meta(diff_id).get("size", 0)

    def _keep_blobs(self, layout: str, fetched: fetch.Fetched, known: dict[str, int]) -> None:
        """Move the blobs skopeo fetched into the store, each checked against its digest."""
        for blob in (fetched.digest, fetched.config, *fetched.blobs):
            if blob in known:
                continue
            source = fetch.blob_file(layout, blob)
            check_blob(source, blob, "blob")
            with contextlib.suppress(FileExistsError):
                os.link(source, fetch.blob_file(self.root, blob))

    # -- sizes, pins, eviction -------------------------------------------------------------------

    def _layer_meta(self, diff_id: str) -> dict[str, int]:
        try:
            with open(os.path.join(self._layer_dir(diff_id), "layer.json"), "rb") as f:
                meta = json.loads(f.read())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def _layer_disk(self, diff_id: str) -> int:
        return int(self._layer_meta(diff_id).get("disk", 0))

    def _blob_disk(self, blob: str) -> int:
        try:
            return os.stat(fetch.blob_file(self.root, blob)).st_blocks * 512
        except FileNotFoundError:
            return 0

    def _pinned(self, key: str) -> bool:
        try:
            fd = os.open(self._path("pins", key), os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
        return False

    def _prune(self, max_size: int, keep: set[str]) -> Pruned:
        with self._lock("lock", fcntl.LOCK_EX):
            self._remove_abandoned()
            self._remove_idle_locks()
            usage = self.disk_usage()
            removed_layers, freed = self._collect()
            records = self._records()
            order = sorted(
                records, key=lambda k: os.stat(self._path("images", f"{k}.json")).st_mtime
            )
            removed_images = []
            for key in order:
                if usage - freed <= max_size:
                    break
                if key in keep or self._pinned(key):
                    continue
                os.unlink(self._path("images", f"{key}.json"))
                removed_images.append(str(msgspec.convert(records[key]["image"], Image).ref))
                layers, more = self._collect()
                removed_layers += layers
                freed += more
            return Pruned(images=tuple(removed_images), layers=tuple(removed_layers), freed=freed)

    def _collect(self) -> tuple[builtins.list[str], int]:
        """Remove the layers and blobs no record names (called under the exclusive lock);
        their diff_ids and the bytes of disk freed."""
        layers: set[str] = set()
        blobs: set[str] = set()
        for record in self._records().values():
            layers.update(msgspec.convert(record["image"], Image).layers)
            blobs.update(_blobs(record))
        removed, freed = [], 0
        for name in os.listdir(self._path("layers")):
            if f"sha256:{name}" not in layers:
                freed += self._layer_disk(f"sha256:{name}")
                self._trash(self._path("layers", name))
                removed.append(f"sha256:{name}")
        for name in os.listdir(self._path("blobs", "sha256")):
            if f"sha256:{name}" not in blobs:
                freed += self._blob_disk(f"sha256:{name}")
                os.unlink(self._path("blobs", "sha256", name))
        return removed, freed

    def _remove_idle_locks(self) -> None:
        """Delete lock and pin files nobody holds. Safe under the exclusive store lock only:
        ref and layer locks are taken under the shared one, and a pin is taken under it too,
        so none of them is being opened now, and a held pin refuses our exclusive try."""
        for name in os.listdir(self._path("locks")):
            os.unlink(self._path("locks", name))
        for name in os.listdir(self._path("pins")):
            if not self._pinned(name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._path("pins", name))

    def _trash(self, path: str) -> None:
        trash = self._path("tmp", f"{TRASH}{owner_tag()}-{os.urandom(4).hex()}")
        os.rename(path, trash)
        _remove_tree(trash)


def _blobs(record: dict[str, object]) -> list[str]:
    image = record.get("image")
    digest = image.get("digest") if isinstance(image, dict) else None
    blobs = record.get("blobs")
    found = [b for b in blobs if isinstance(b, str)] if isinstance(blobs, list) else []
    extra = [d for d in (digest, record.get("config")) if isinstance(d, str)]
    return found + extra


def _remove_tree(path: str) -> None:
    """Delete ``path`` whatever modes its directories have (a layer's 0555 ones, as non-root)."""
    if not os.path.lexists(path):
        return
    _open_up(path)
    for directory, subdirectories, _ in os.walk(path):
        for name in subdirectories:  # before os.walk lists them
            _open_up(os.path.join(directory, name))
    shutil.rmtree(path, ignore_errors=True)


def _open_up(directory: str) -> None:
    with contextlib.suppress(OSError):
        mode = os.lstat(directory).st_mode
        if stat.S_ISDIR(mode) and mode & 0o700 != 0o700:
            os.chmod(directory, stat.S_IMODE(mode) | 0o700)
