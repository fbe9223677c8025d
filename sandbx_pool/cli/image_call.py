"""``sandbx-pool call TOOL ... --image REF``: one call in a fresh layer over an image, then gone.

    REF  parse_ref: a malformed reference is a usage error (2), before any process starts
     |
    Pool (one-shot) --> pool.layer("call-<random>", image=REF)
     |                    the image found in the store or pulled (ImageError: 3), the layer
     |                    made over it (LayerUnavailable, no overlay mounts here: 4)
     v
    pool.call(TOOL, ARGS, workspace=layer) --> its outcome printed (0 ok, 1 any other status)
     |
    the pool closed (its workers gone), then the layer removed from the layer store

The layer is removed after the pool has closed, not through ``Layer.remove`` while it is
open: a signal closes the pool under the call (signals.Stopper), and a closed pool's layers
can no longer be removed through it. By then no worker of ours mounts the layer, and its
name, random, is no other pool's. A second SIGINT exits at once (signals) and leaves the
layer behind, as it leaves everything: it is named ``call-...`` in the layer store.

A signal while the image is being pulled stops the command once the pull has ended: a pull
runs whole on its thread (sandbx_pool.images; the store keeps nothing half-made), and a
second SIGINT is the way out before that.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any, Final

from sandbx_pool.config import Config
from sandbx_pool.output import OutputChunk

#: Exit statuses of ``call --image`` beyond the call's own (0 ok, 1 any other status, 2 usage):
#: the image could not be had (a pull failed, an image the store cannot use)...
EXIT_IMAGE: Final = 3
#: ...or no layer can be made over it on this machine (no overlay mounts: sandbx-pool doctor).
EXIT_NO_LAYERS: Final = 4
EXIT_OK, EXIT_FAILED = 0, 1

#: A one-shot call's layer: a prefix saying what made it, then random.
LAYER_PREFIX: Final = "call-"


def check_ref(ref: str) -> str | None:
    """Why ``ref`` is not an image reference (one line), or None."""
    from sandbx_pool.images.refs import parse_ref

    try:
        parse_ref(ref)
    except ValueError as exc:
        return str(exc)
    return None


def run_in_image(
    args: Any,
    tool_args: dict[str, Any],
    config: Config,
    on_output: Callable[[OutputChunk], None] | None,
) -> int:
    """Run the call of ``args`` (``call``'s namespace) in a fresh layer over ``args.image``;
    the exit status (see the module's docstring)."""
    from sandbx_pool.errors import ImageError, LayerUnavailable, PoolClosed
    from sandbx_pool.pool import Pool
    from sandbx_pool.signals import Stopper, run_until_signalled

    name = f"{LAYER_PREFIX}{uuid.uuid4().hex[:16]}"
    layers = config.workspace.layers_dir()

    def fail(message: str, code: int) -> int:
        print(f"sandbx-pool call: --image: {message}".replace("\n", " "),
              file=sys.stderr)  # fmt: skip
        return code

    async def one_call(stopper: Stopper) -> int:
        pool = stopper.watch(Pool(args.workspace, journal=args.journal, config=config))
        try:
            async with pool:
                try:
                    layer = await pool.layer(name, image=args.image)
                except (PoolClosed, ImageError, ValueError, LayerUnavailable) as exc:
                    if stopper.signum is not None:
                        # The stop closed the pool under the layer being made (a shutdown
                        # reads as "no layer"): the runner says 128 + N, nothing more.
                        return EXIT_FAILED
                    if isinstance(exc, LayerUnavailable):
                        return fail(str(exc), EXIT_NO_LAYERS)
                    if isinstance(exc, PoolClosed):
                        raise
                    # ImageError, or a ValueError: an image no layer can lie over
                    # (image_layer.check)
                    return fail(str(exc), EXIT_IMAGE)
                try:
                    outcome = await pool.call(
                        args.tool,
                        tool_args,
                        timeout=args.timeout,
                        on_output=on_output,
                        workspace=layer,
                    )
                except PoolClosed:  # a signal closed it first: the runner says 128 + N
                    return EXIT_FAILED
        finally:
            # Shielded: this is cleanup, and whatever cancels us is re-raised after it.
            await asyncio.shield(asyncio.to_thread(_remove, layers, name))
        printed = outcome.to_dict()
        if pool.journal is not None:
            printed["journal"] = pool.journal.path
        image = layer.image
        if image is not None:
            printed["image"] = {"ref": image.ref, "digest": image.digest}
        print(json.dumps(printed, indent=2))
        return EXIT_OK if outcome.status == "ok" else EXIT_FAILED

    return run_until_signalled(one_call)


def _remove(layers: str, name: str) -> None:
    """The one-shot call's layer, if it was made (by descriptor: layer_store.remove_tree);
    a failure is said, not raised: the call's outcome is what the command is for."""
    from sandbx_pool import layer_store

    if not os.path.lexists(os.path.join(layers, name)):
        return
    try:
        layer_store.remove(layers, name)
    except OSError as exc:
        print(f"sandbx-pool call: cannot remove layer {name} from {layers}: {exc}",
              file=sys.stderr)  # fmt: skip


__all__ = ["EXIT_IMAGE", "EXIT_NO_LAYERS", "LAYER_PREFIX", "check_ref", "run_in_image"]
