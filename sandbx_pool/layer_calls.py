"""Layers as a feature of the pool's calls (call_seam.py); what a layer is: layers.py, and
over an image: image_layer.py.

    Pool.layer(name, base | image) --> LayerCalls.open: the image pinned in the pool's store,
        the layer made or opened (Layers.open), the store hidden from every call
    Pool.call(workspace=layer | a layer's root, view, layer_at)
        --> LayerCalls.place: which layer, where it is mounted, the call's view and workspace
            (over an image the layer's root is the call's ``/``); a call in a layer is direct
    the call's run: LayerCalls.around: one call at a time in a layer (Layer.turn), the next
        once this call's worker is gone (Layer.leave); a layer removed meanwhile: error
    close: every layer released, every pin dropped
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from dataclasses import dataclass

from sandbx_pool.call_seam import CallFeature, Run
from sandbx_pool.call_state import CallState
from sandbx_pool.config import Config
from sandbx_pool.images.image import Image
from sandbx_pool.images.store import ImageStore, Pin
from sandbx_pool.layers import (
    Layer,
    Layers,
    RunLayerAction,
    check_direct,
    mount_point,
    names_a_layer,
)
from sandbx_pool.outcome import Outcome, Status


@dataclass(frozen=True)
class Placement:
    """Where a call runs, once its ``workspace`` was read as a layer or not."""

    layer: Layer | None
    #: The call's view (over an image: the layer's root); its workspace (None: the pool's).
    view: str | None
    workspace: str | None
    #: Where the worker mounts the layer (None: on the layer's own root).
    mount: str | None


class LayerCalls(CallFeature):
    """A pool's layers and the images they lie over, as its calls use them."""

    def __init__(
        self,
        config: Config,
        run: RunLayerAction,
        hide: Callable[[str], None],
        containment: Callable[[], str | None],
        images: Callable[[], ImageStore],
    ) -> None:
        self._config = config
        #: Runs a layer's own actions on a worker (CallRunner.internal).
        self._run = run
        #: Hides a directory of the pool's from every call (Pool._hide).
        self._hide = hide
        #: The workers' containment (``pidns``: a mount namespace per call), None before start.
        self._containment = containment
        self._images = images
        self._layers: Layers | None = None
        #: The images of open layers, by ref: the store evicts none of them (images/store.py).
        self._pins: dict[str, Pin] = {}

    def hide_store(self) -> None:
        """From the first call on, the store an earlier pool made (the pool is starting)."""
        store = self._config.workspace.layers_dir()
        if os.path.isdir(store):
            self._hide(store)

    async def open(self, name: str, base: str | None, image: Image | object) -> Layer:
        """Pool.layer's work (it says what it does), ``image`` pulled already."""
        if isinstance(image, Image):  # anything else: image_layer.check says what is wrong
            await asyncio.to_thread(self._pin, image)
        return await self._layer_set().open(name, base, image)

    async def place(
        self, workspace: object, view: str | None, layer_at: str | None, changes: str | None
    ) -> Placement:
        """Where a call with these arguments runs; ValueError for a combination that is not
        one (a layer and a change mode, a view over an image, ``layer_at`` without both a
        layer and a view, a workspace that is no absolute path)."""
        layer = await self._layer_of(workspace, changes)
        mount: str | None
        if layer is not None and layer.image is not None:
            # Over an image: the layer's root is the call's `/` (image_layer.py).
            if view is not None or layer_at is not None:
                raise ValueError(
                    f"layer {layer.name!r} lies over an image, which is the call's / already:"
                    " no view or layer_at"
                )
            view = workspace = mount = layer.path
        elif layer is not None:
            mount = mount_point(layer, view, layer_at)
            workspace = layer.path if view is None else None
        else:
            mount = mount_point(layer, view, layer_at)
        if workspace is not None and not (isinstance(workspace, str) and os.path.isabs(workspace)):
            raise ValueError(f"workspace must be an absolute path or None, not {workspace!r}")
        return Placement(layer, view, workspace, mount)

    async def around(self, call: CallState, run: Run) -> Outcome:
        """One call at a time in a layer, once the previous call's worker is gone."""
        layer = call.layer
        if layer is None:
            return await run()
        if not await layer.turn(call):
            return call.killed_outcome()
        try:
            if not layer.open:  # removed (or its pool closing) while the call waited
                return call.outcome(Status.ERROR, error=f"layer {layer.name!r} was removed")
            return await run()
        finally:
            layer.leave(call)

    def close(self) -> None:
        if self._layers is not None:
            self._layers.close()
        for pin in self._pins.values():
            pin.unpin()

    def _pin(self, image: Image) -> None:
        """Hold ``image``'s layers in the pool's store until the pool closes (an Image of
        another store is that store's to keep)."""
        root = self._config.images.store_dir()  # not the store itself: it would be made
        if image.ref in self._pins or not all(
            d.startswith(root + os.sep) for d in image.layer_dirs
        ):
            return
        self._pins[image.ref] = self._images().pin(image)

    def _layer_set(self) -> Layers:
        if self._layers is None:
            self._layers = Layers(
                self._config.workspace.layers_dir(),
                self._run,
                shared=bool(self._config.sandbox.run_as),
                unavailable=self._why_no_layers,
            )
            self._hide(self._layers.store)
        return self._layers

    def _why_no_layers(self) -> str | None:
        containment = self._containment()
        if containment == "pidns":
            return None
        return (
            "layers need a mount namespace per call (root with CAP_SYS_ADMIN, or user"
            f" namespaces allowed); this pool's workers have none ({containment or 'not started'}):"
            " see sandbx-pool doctor"
        )

    async def _layer_of(self, workspace: object, changes: str | None) -> Layer | None:
        """The layer a call's ``workspace`` names (a Layer, or a layer's root path), or None."""
        configured = self._config.workspace.layers_dir()
        if not names_a_layer(workspace, configured, self._layers):
            return None
        layer = await self._layer_set().named_by(workspace, configured)
        check_direct(layer, changes)
        return layer


__all__ = ["LayerCalls", "Placement"]
