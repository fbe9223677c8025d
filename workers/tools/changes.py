"""The coordinator's own actions on a call's change set (sandbx_pool.changes decides them).

Run by a worker confined to the call's workspace, with the journal's directory (``J.d``)
writable besides: the coordinator never touches the workspace itself.
"""

from __future__ import annotations

import os
from typing import Any

from sandbx_pool.workers import changes
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import ApplyChangesArgs, UndoChangesArgs


def apply_changes(args: ApplyChangesArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Scan the call's upper directory; with ``apply``, set the workspace to it, its pre-images
    kept first. A path in ``taken`` (applied by another call since this one started) is a
    conflict: nothing is applied. Run again after a crash, it finishes what it began."""
    workspace = os.path.realpath(ctx.workspace)
    kept = os.path.exists(args.images)
    if kept:
        images = changes.read_images(args.images)  # a second run: the first scan is the truth
        found = images.changes
    else:
        found = changes.scan(args.upper, workspace)
    if not args.apply:
        return {"changes": changes.listed(found, False), "applied": False}
    for item in found:
        if item.path in args.taken:
            conflict = {"path": item.path, "call_id": args.taken[item.path]}
            return {"changes": changes.listed(found, False), "applied": False, "conflict": conflict}
    if not kept:
        images = changes.take_images(args.call_id, found, args.upper, workspace, args.objects)
        changes.write_images(images, args.images)
    changes.set_to(images, "post", workspace, lambda path, _: os.path.join(args.upper, path))
    return {"changes": changes.listed(found, True), "applied": True}


def undo_changes(args: UndoChangesArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Put back every path's pre-image, unless one is no longer its post-image (then nothing
    is changed, and the paths are named)."""
    workspace = os.path.realpath(ctx.workspace)
    images = changes.read_images(args.images)
    changed = changes.mismatches(images, workspace)
    if changed:
        return {"undone": False, "changed": changed}
    missing = [
        path
        for path, image in images.paths.items()
        if image.pre.sha256 is not None
        and not os.path.exists(os.path.join(args.objects, image.pre.sha256))
    ]
    if missing:
        return {"undone": False, "missing": sorted(missing)}

    def source(path: str, image: changes.Image) -> str:
        assert image.sha256 is not None
        return os.path.join(args.objects, image.sha256)

    changes.set_to(images, "pre", workspace, source)
    return {"undone": True, "paths": sorted(images.paths)}
