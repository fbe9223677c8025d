"""Layers: copy-on-write workspaces over a base directory, kept between calls and pools.

    ws = await pool.layer("s1", base=DIR)      Layers.open: the name checked, the layer made in
        |                                      the store (sandbx_pool.layer_store) or opened
        |  made: a probe worker mounts it (_layer_open: it mounts here, the base's real path),
        |  then one rename puts it in place; refused (ValueError, LayerUnavailable): nothing made
        v
    await pool.call(tool, args, workspace=ws)  the call's worker mounts an overlay
        |                                      lower = DIR (read only), upper = the layer's own,
        |                                      on the layer's root, in its own mount namespace
        |                                      (workers.overlay.enter_layer); the tool sees DIR
        |                                      plus the layer's changes, DIR is never written
    ws.diff()    a worker confined to DIR scans the upper directory (workers.upper_scan.scan, the
                 change sets' scan): the same dicts as an outcome's ``changes``, applied False
    ws.reset()   the upper directory emptied        } on a coordinator thread, by descriptor
    ws.fork(n)   a copy of it under a new name      } (layer_store): the store is the pool's
    ws.remove()  the layer gone                     } own directory, never a workspace

One call at a time. Two live overlays on one upper directory are undefined in the kernel, so a
layer runs its calls one after another (``Layer.turn``): a call waits for the previous one's
worker to be gone, not merely to have answered, since the mount lives as long as the worker's
namespace. reset, fork, remove and diff take the same turn. A pool holds an flock on each
layer it has open, so two pools never run calls in one layer either (the second gets a
ValueError naming the layer).

Over a container image (``pool.layer(name, image=img)``, sandbx_pool.image_layer) the lowers
are the image's layers and the call enters the overlay as its ``/`` (workers.image_root); the
record keeps the image, so the layer reopens without it. The rest is as above.

A call in a layer is direct into the layer: the pool's ``changes`` mode does not apply (the
layer is the change set: ``diff`` lists it, ``reset`` drops it), and asking a call for
``changes="tracked"`` or ``"transactional"`` in a layer is a ValueError.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

from sandbx_pool import image_layer, layer_store
from sandbx_pool.call_state import CallState
from sandbx_pool.config import ChangeMode, change_mode
from sandbx_pool.errors import LayerUnavailable
from sandbx_pool.images.image import Image
from sandbx_pool.outcome import Outcome

#: Runs one of the coordinator's own actions on a worker: (call id, action, args, workspace,
#: the layer to mount as (its directory, its base: None over an image) or None, extra
#: read-only paths, the image's layer directories for a layer over an image, else None).
RunLayerAction = Callable[
    [
        str,
        str,
        dict[str, Any],
        str,
        tuple[str, str | None] | None,
        tuple[str, ...],
        tuple[str, ...] | None,
    ],
    Awaitable[Outcome],
]

#: ``error_code`` of a call refused because its layer could not be mounted, or its base is not
#: what it was (workers.overlay).
LAYER_UNAVAILABLE = "LAYER_UNAVAILABLE"
LAYER_BASE = "LAYER_BASE"


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class Layer:
    """A copy-on-write workspace over ``base`` (see the module's docstring). Pass it, or its
    ``path``, as a call's ``workspace``. Its methods are coroutines."""

    def __init__(
        self, layers: Layers, name: str, base: str | None, lock_fd: int, image: Image | None = None
    ) -> None:
        self._layers = layers
        self.name = name
        #: The base's real path, as recorded when the layer was made; None over an image.
        self.base = base
        #: The image the layer lies over (sandbx_pool.image_layer), as recorded; None over a
        #: base directory.
        self.image = image
        self.directory = os.path.join(layers.store, name)
        #: The layer's mount point: the workspace its calls name (empty outside a call).
        self.path = os.path.join(self.directory, "root")
        self._lock_fd: int | None = lock_fd
        self._turn = asyncio.Lock()
        self._ids = 0
        #: Calls waiting for their turn (one call at a time in a layer).
        self.waiting = 0

    def __repr__(self) -> str:
        state = "removed" if self._lock_fd is None else ("busy" if self._turn.locked() else "idle")
        over = self.base if self.image is None else f"image {self.image.ref or self.image.digest}"
        return f"<Layer {self.name!r} over {over} [{state} | {self.waiting} waiting]>"

    def __fspath__(self) -> str:
        return self.path

    @property
    def open(self) -> bool:
        return self._lock_fd is not None

    def _check_open(self) -> None:
        if self._lock_fd is None:
            raise ValueError(f"layer {self.name!r} was removed or its pool closed")

    # -- a call's turn -------------------------------------------------------------------------

    async def turn(self, call: CallState) -> bool:
        """Wait until no other call or operation is in the layer; False when the call was
        killed meanwhile (it then holds nothing)."""
        acquire = asyncio.ensure_future(self._turn.acquire())
        self.waiting += 1
        try:
            either: set[asyncio.Future[Any]] = {acquire, call.kill_requested}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting -= 1
        if acquire.done() and call.killer is None:
            return True
        if acquire.done():
            self._turn.release()
        else:
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquire
            if not acquire.cancelled():
                self._turn.release()
        return False

    def leave(self, call: CallState) -> None:
        """The call is over: the next one may mount the layer once this call's worker is gone
        (a quarantined worker keeps the layer until the kernel lets it go)."""
        worker = call.worker
        if worker is None or worker.exited.done() or worker.gone.done():
            self._turn.release()
            return
        released = False

        def release(_: object) -> None:
            nonlocal released
            if not released:
                released = True
                self._turn.release()

        worker.exited.add_done_callback(release)
        worker.gone.add_done_callback(release)

    # -- operations ----------------------------------------------------------------------------

    async def diff(self) -> list[dict[str, Any]]:
        """The layer's changes against its base: ``{"path", "kind", "type", "size",
        "applied": False}`` each, sorted by path, as an outcome's ``changes``."""
        upper = os.path.join(self.directory, "upper")
        async with self._held():
            self._ids += 1
            opened = await asyncio.to_thread(layer_store.open_up, upper)
            try:
                # Over an image, the worker mounts the image alone, read-only, on the layer's
                # root: what the upper directory is compared with.
                outcome = await self._layers.run(
                    f"layer-{self.name}-diff-{self._ids}",
                    "_layer_diff",
                    {"upper": upper},
                    self.base if self.base is not None else self.path,
                    None if self.image is None else (self.directory, None),
                    (upper,),
                    None if self.image is None else self.image.layer_dirs,
                )
            finally:
                await asyncio.to_thread(layer_store.close_down, opened)
        if outcome.value is None:
            raise ValueError(f"cannot list layer {self.name!r}'s changes: {outcome.error}")
        changes: list[dict[str, Any]] = outcome.value["changes"]
        return changes

    async def reset(self) -> None:
        """Drop every change: the layer is its base again."""
        async with self._held():
            await asyncio.to_thread(layer_store.reset, self._layers.store, self.name)

    async def fork(self, name: str) -> Layer:
        """A new, independent layer ``name`` over the same base with this one's content.
        ValueError when the name is not plain or taken (nothing is made)."""
        layer_store.check_name(name)
        self._layers.check_free(name)
        async with self._held():
            try:
                await asyncio.to_thread(
                    layer_store.fork, self._layers.store, self.name, name, mode=self._layers.mode
                )
            except FileExistsError:
                raise ValueError(f"cannot fork onto layer {name!r}: it exists already") from None
        return await self._layers.open(name, self.base, self.image)

    async def remove(self) -> None:
        """Delete the layer and what it holds; the base is untouched."""
        async with self._held():
            await asyncio.to_thread(layer_store.remove, self._layers.store, self.name)
            self._layers.forget(self)

    @contextlib.asynccontextmanager
    async def _held(self) -> Any:
        self._check_open()
        async with self._turn:
            self._check_open()
            yield

    def close(self) -> None:
        """Release the layer for another pool (the pool is closing, or it was removed)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


class Layers:
    """A pool's layers: its store, and the layers it has open (each once)."""

    def __init__(
        self,
        store: str,
        run: RunLayerAction,
        *,
        shared: bool,
        unavailable: Callable[[], str | None],
    ) -> None:
        os.makedirs(store, mode=0o700, exist_ok=True)
        #: 0711 when calls run as another user: they must pass through to a layer's root.
        self.mode = 0o711 if shared else 0o700
        os.chmod(store, self.mode)
        #: The store's real path (the pool's own directory, like the journal's): what calls
        #: name and what bases are checked against.
        self.store = os.path.realpath(store)
        self.run = run
        #: Why no layer can be mounted here (None: they can): the pool's containment.
        self.unavailable = unavailable
        self.layers: dict[str, Layer] = {}
        #: One opening at a time per name: two batch lanes asking for one new layer make it once.
        self._opening: dict[str, asyncio.Lock] = {}
        layer_store.remove_leftovers(self.store)

    def check_free(self, name: str) -> None:
        if name in self.layers or os.path.lexists(os.path.join(self.store, name)):
            raise ValueError(f"cannot fork onto layer {name!r}: it exists already")

    def _check_base(self, base: str) -> None:
        if is_within(base, self.store) or is_within(self.store, base):
            raise ValueError(
                f"a layer's base must not lie inside the layer store {self.store}, nor the"
                f" store inside it: {base}"
            )

    def name_of(self, path: str) -> str | None:
        """The layer whose root ``path`` (absolute, normalised) is; None when ``path`` is not in
        the store; ValueError for any other path of the store (no call may use it)."""
        if not is_within(path, self.store):
            return None
        parts = os.path.relpath(path, self.store).split(os.sep)
        if len(parts) == 2 and parts[1] == "root" and layer_store.NAME.fullmatch(parts[0]):
            return parts[0]
        raise ValueError(f"{path} is in the layer store: only a layer's root is a workspace")

    async def open(self, name: str, base: str | None, image: object = None) -> Layer:
        why = self.unavailable()
        if why is not None:
            raise LayerUnavailable(why)
        layer_store.check_name(name)
        if image is not None:
            if base is not None:
                raise ValueError("a layer lies over a base directory or an image, not both")
            image = image_layer.check(image, self.store)
        lock = self._opening.setdefault(name, asyncio.Lock())
        async with lock:
            if isinstance(image, Image):
                return await self._open_over_image(name, image)
            return await self._open(name, base)

    async def _open(self, name: str, base: str | None) -> Layer:
        # Lexical: the base is a workspace, which only a worker touches.
        wanted = os.path.abspath(base) if base is not None else None  # noqa: ASYNC240
        if wanted is not None:
            self._check_base(wanted)
        layer = self.layers.get(name)
        meta = await self._meta(name, layer)
        if meta is None:
            if wanted is None:
                raise ValueError(
                    f"no layer {name!r} in {self.store}: give its base (or image) to make it"
                )
            return await self._make(name, wanted)
        if meta.get("base") is None:  # over an image: opened as it was recorded
            if wanted is not None:
                raise ValueError(f"layer {name!r} lies over an image, not over {wanted}")
            recorded_image = image_layer.from_record(name, meta.get("image"))
            return layer if layer is not None else self._hold(name, None, recorded_image)
        recorded = str(meta["base"])
        if wanted is not None and wanted != recorded:
            raise ValueError(
                f"layer {name!r} lies over {recorded}, not {wanted}: a layer's base never changes"
            )
        if layer is not None:
            return layer
        return self._hold(name, recorded)

    async def _meta(self, name: str, layer: Layer | None) -> dict[str, object] | None:
        if layer is None:
            return await asyncio.to_thread(layer_store.read_meta, self.store, name)
        if layer.image is not None:
            return {"base": None, "image": image_layer.record(layer.image)}
        return {"base": layer.base}

    async def _open_over_image(self, name: str, image: Image) -> Layer:
        layer = self.layers.get(name)
        meta = await self._meta(name, layer)
        if meta is None:
            return await self._make(name, None, image)
        if meta.get("base") is not None:
            raise ValueError(f"layer {name!r} lies over {meta['base']}, not over an image")
        recorded = image_layer.from_record(name, meta.get("image"))
        if not image_layer.same_image(recorded, image):
            raise ValueError(
                f"layer {name!r} lies over image {recorded.ref or '?'} ({recorded.digest}), not"
                f" {image.ref or '?'} ({image.digest}): a layer's image never changes"
            )
        return layer if layer is not None else self._hold(name, None, recorded)

    def _hold(self, name: str, base: str | None, image: Image | None = None) -> Layer:
        try:
            fd = layer_store.lock(self.store, name)
        except BlockingIOError:
            raise ValueError(f"layer {name!r} is open in another pool") from None
        layer = Layer(self, name, base, fd, image)
        self.layers[name] = layer
        return layer

    async def _make(self, name: str, base: str | None, image: Image | None = None) -> Layer:
        """Probe, then make (see the module's docstring): nothing is left when it fails. Over
        an image, the probe mounts the image's layers (each must be there, and mount)."""
        over_image = image is not None
        temp = await asyncio.to_thread(
            layer_store.begin, self.store, name, mode=self.mode, image=over_image
        )
        try:
            outcome = await self.run(
                f"layer-{name}-open",
                "_layer_open",
                {},
                os.path.join(temp, "root"),
                (temp, base),
                (),
                image.layer_dirs if image is not None else None,
            )
            if outcome.value is None:
                if outcome.error_code == LAYER_BASE:
                    raise ValueError(f"cannot make layer {name!r}: {outcome.error}")
                raise LayerUnavailable(f"cannot make layer {name!r}: {outcome.error}")
            real = None if image is not None else str(outcome.value["base"])
            if real is not None:
                self._check_base(real)
            recorded = image_layer.record(image) if image is not None else None
            try:
                await asyncio.to_thread(layer_store.commit, self.store, temp, name, real, recorded)
            except FileExistsError:
                raise ValueError(f"layer {name!r} was made meanwhile by another pool") from None
        except BaseException:
            await asyncio.to_thread(layer_store.remove_tree, temp)
            raise
        return self._hold(name, real, image)

    async def named_by(self, workspace: object, configured: str) -> Layer:
        """The layer a call's ``workspace`` names: a Layer of ours, or a layer's root path
        (lexical: the store as configured, or as resolved, a Layer's ``path``), opened."""
        if isinstance(workspace, Layer):
            if self.layers.get(workspace.name) is not workspace:
                raise ValueError(f"{workspace!r} is not a layer this pool has open")
            return workspace
        assert isinstance(workspace, str)
        path = os.path.normpath(workspace)  # noqa: ASYNC240 (lexical)
        if is_within(path, configured):
            path = self.store + path[len(configured) :]
        name = self.name_of(path)
        assert name is not None
        return await self.open(name, None)

    def forget(self, layer: Layer) -> None:
        layer.close()
        if self.layers.get(layer.name) is layer:
            del self.layers[layer.name]

    def close(self) -> None:
        for layer in list(self.layers.values()):
            self.forget(layer)


def names_a_layer(workspace: object, configured: str, layers: Layers | None) -> bool:
    """Whether a call's ``workspace`` is a layer (a Layer, or a path in the layer store as
    configured or as resolved): lexical, the store is not touched."""
    if isinstance(workspace, Layer):
        return True
    if not isinstance(workspace, str) or not os.path.isabs(workspace):
        return False
    path = os.path.normpath(workspace)
    return is_within(path, configured) or (layers is not None and is_within(path, layers.store))


def check_direct(layer: Layer, changes: str | None) -> None:
    """A call in a layer is direct into it: asking for another change mode is a ValueError."""
    if changes is not None and change_mode(changes) is not ChangeMode.DIRECT:
        raise ValueError(
            f"changes={changes!r} in layer {layer.name!r}: a layer keeps its changes apart"
            " already (Layer.diff lists them, Layer.reset drops them)"
        )


def mount_point(layer: Layer | None, view: str | None, layer_at: str | None) -> str | None:
    """Where a call in a view mounts its layer: ``layer_at``, a directory of the view (lexical:
    the view's top level is never a call's to change). None: on the layer's own root."""
    if layer_at is None:
        if layer is not None and view is not None:
            raise ValueError("a layer in a view needs layer_at: where in the view it is mounted")
        return None
    if layer is None or view is None:
        raise ValueError("layer_at needs a layer as the workspace and a view")
    inside = os.path.normpath("/" + layer_at).lstrip("/")
    if not inside or "\x00" in inside:
        raise ValueError(f"layer_at must name a directory inside the view, not {layer_at!r}")
    return os.path.join(os.path.normpath(view), inside)


__all__ = [
    "LAYER_BASE",
    "LAYER_UNAVAILABLE",
    "Layer",
    "Layers",
    "RunLayerAction",
    "check_direct",
    "mount_point",
    "names_a_layer",
]
