"""The coordinator's own actions on a call's change set (sandbx_pool.change_sets decides them).

Run by a worker confined like the file tools to the call's workspace, with the journal's
directory (``J.d``) writable besides and root's secrets left out by Landlock whatever mounts
there are (workers.sandbox): the coordinator never touches the workspace itself. Every path of
the workspace and of the upper directory is reached without following a symlink
(workers.beneath).

The change list is written out of band, to ``report`` in J.d (workers.protocol.ChangeReport),
and read there by the coordinator.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from sandbx_pool.workers import change_images, paths, upper_scan
from sandbx_pool.workers.beneath import Beneath, Swapped
from sandbx_pool.workers.protocol import ChangeReport as Report
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import ApplyChangesArgs, UndoChangesArgs


def _write_report(path: str, report: Report) -> None:
    temp = f"{path}.{os.urandom(4).hex()}.tmp"
    with open(temp, "wb") as f:
        f.write(msgspec.json.encode(report))
    os.rename(temp, path)


def _protected(ctx: ExecutionContext, found: list[upper_scan.Change], root: str) -> list[str]:
    """The paths of ``found`` that no call may change ([sandbox] protected, core.hooksPath
    read now): never applied, never undone, as bash holds them."""
    return [
        item.path
        for item in found
        if paths.protected_by(ctx, os.path.join(root, item.path)) is not None
    ]


def apply_changes(args: ApplyChangesArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Scan the call's upper directory; with ``apply``, set the workspace to it, its pre-images
    kept first. A path in ``taken`` (applied by another call since this one started), or a
    directory swapped for a symlink since, is a conflict: nothing is applied. Run again after a
    crash, it finishes what it began. The change list goes to ``report``."""
    root = paths.real_workspace(ctx.workspace)
    answer: dict[str, Any] = {"applied": False, "report": args.report}
    images: upper_scan.Images | None = None
    if os.path.exists(args.images):
        # A second run: the first scan is the truth.
        images, answer["images_sha256"] = change_images.read_images(args.images)
        found = images.changes
    else:
        bound = None
        if args.max_paths is not None and args.max_bytes is not None:
            bound = upper_scan.Bound(args.max_paths, args.max_bytes)
        try:
            found = upper_scan.scan(args.upper, root, bound)
        except upper_scan.TooLarge as exc:
            _write_report(args.report, Report([]))
            return {**answer, "too_large": str(exc)}
    protected = _protected(ctx, found, root)
    report = Report(upper_scan.listed(found, False), protected)
    if not args.apply:
        _write_report(args.report, report)
        return answer
    for item in found:
        if item.path in args.taken:
            _write_report(args.report, report)
            return {**answer, "conflict": {"path": item.path, "call_id": args.taken[item.path]}}
    skip = frozenset(protected)
    done: list[str] = []
    with Beneath(args.upper) as upper, Beneath(root) as workspace:
        try:
            if images is None:
                applicable = [item for item in found if item.path not in skip]
                change_images.check_ancestors((item.path for item in applicable), workspace)
                images = change_images.take_images(
                    args.call_id, applicable, upper, workspace, args.objects
                )
                answer["images_sha256"] = change_images.write_images(images, args.images)

            def source(path: str, _: upper_scan.Image) -> int:
                return upper.read_file(path)

            change_images.set_to(images, "post", workspace, source, skip=skip, done=done)
        except Swapped as exc:
            answer["swapped"] = exc.path
        finally:
            applied = set(done)
            _write_report(args.report, Report(upper_scan.listed(found, applied), protected))
    return {**answer, "applied": bool(done) or "swapped" not in answer}


def undo_changes(args: UndoChangesArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Put back every path's pre-image, unless images.json or a kept object is not what was
    journaled (``forged``), or a path is no longer its post-image or lies below a directory
    swapped for a symlink (``changed``): then nothing is changed, and the paths are named.
    Protected paths are never written."""
    images, digest = change_images.read_images(args.images)
    if args.images_sha256 is None or digest != args.images_sha256:
        return {"undone": False, "forged": "images.json"}
    missing: list[str] = []
    for path, image in sorted(images.paths.items()):
        if image.pre.sha256 is None:
            continue
        try:
            fd = os.open(os.path.join(args.objects, image.pre.sha256), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            missing.append(path)
            continue
        if change_images.hash_fd(fd) != image.pre.sha256:
            return {"undone": False, "forged": path}
    if missing:
        return {"undone": False, "missing": missing}
    root = paths.real_workspace(ctx.workspace)
    modified = [upper_scan.Change(p, "modified", "file", None) for p in images.paths]
    skip = frozenset(_protected(ctx, modified, root))
    done: list[str] = []
    with Beneath(root) as workspace:
        changed = change_images.mismatches(images, workspace, skip)
        if changed:
            return {"undone": False, "changed": changed}

        def source(path: str, image: upper_scan.Image) -> int:
            assert image.sha256 is not None
            return os.open(os.path.join(args.objects, image.sha256), os.O_RDONLY | os.O_NOFOLLOW)

        try:
            change_images.check_ancestors(set(images.paths) - skip, workspace)
            change_images.set_to(images, "pre", workspace, source, skip=skip, done=done)
        except Swapped as exc:
            return {"undone": False, "changed": [exc.path], "partly": bool(done)}
        finally:
            _write_report(args.report, Report([], sorted(skip), sorted(done)))
    return {"undone": True}
