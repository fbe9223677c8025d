"""The coordinator's own actions on a layer (sandbx_pool.layers decides them).

_layer_open   run in the new layer, mounted (workers.overlay.enter_layer, with the base
              resolved): the probe that it mounts here, and the base's real path, which
              the layer records
_layer_diff   run confined to the base, the layer's upper directory readable besides:
              the upper directory scanned against the base (workers.upper_scan.scan, the
              change sets' own scan), listed as an outcome's ``changes`` are
"""

from __future__ import annotations

import os
from typing import Any

from sandbx_pool.workers import upper_scan
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import LayerDiffArgs, LayerOpenArgs


def open_layer(args: LayerOpenArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """The layer is mounted (the worker did it before confining itself): its base's real path,
    and whether the workspace is the overlay (a sanity check the coordinator can show)."""
    base = os.path.realpath(ctx.layer_base) if ctx.layer_base is not None else None
    return {"base": base, "mounted": os.path.ismount(ctx.workspace)}


def diff_layer(args: LayerDiffArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """What the layer's upper directory changes of its base (the call's workspace). Not
    applied: nothing of it is ever in the base."""
    # Over an image: the workspace is the image alone, mounted read-only for this scan.
    found = upper_scan.scan(args.upper, os.path.realpath(ctx.workspace))
    return {"changes": upper_scan.listed(found, False)}


__all__ = ["diff_layer", "open_layer"]
