"""An image as a call sees it: its identity, its config, and its layers unpacked in the store.

The store (``sandbx_pool.images``) makes an ``Image``; a layer over an image
(``Pool.layer(name, image=...)``) mounts ``layer_dirs`` as the overlay's lower directories and
takes ``env``, ``workdir`` and ``user`` as a container runtime takes the image config's.
"""

from __future__ import annotations

import msgspec


class Image(msgspec.Struct, frozen=True, kw_only=True):
    """One image of the store. ``layers`` and ``layer_dirs`` are bottom first; each directory
    is an unpacked layer ready to be an overlay lower mounted with ``userxattr``: OCI whiteouts
    are 0/0 character devices, opaque directories carry ``user.overlay.opaque=y``."""

    ref: str
    #: the manifest's digest, ``sha256:...``
    digest: str
    #: the layers' diff_ids (the sha256 of each uncompressed tar), bottom first
    layers: tuple[str, ...]
    #: the image config's Env, ``K=V``
    env: tuple[str, ...] = ()
    #: the image config's WorkingDir; "" when the image sets none (a call then starts in ``/``)
    workdir: str = ""
    #: the image config's User, who a call in a layer over the image runs as
    #: (workers.image_user); "" when the image sets none (uid 0)
    user: str = ""
    #: bytes unpacked, all layers
    size: int = 0
    #: the unpacked layers in the store, bottom first, one per entry of ``layers``
    layer_dirs: tuple[str, ...] = ()
