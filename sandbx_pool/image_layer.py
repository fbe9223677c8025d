"""A layer over a container image, as the coordinator sees it: what it records, what its calls get.

    ws = await pool.layer("s1", image=img)   img: an Image of the store (sandbx_pool.images)
        |  checked (``check``), recorded in the layer's layer.json (``record``): a pool that
        |  opens the layer again, without ``image=``, finds the image there (``from_record``)
        v
    await pool.call(tool, args, workspace=ws)
        the call's view is the layer's root, and its worker mounts there the overlay of the
        image's layers (lowers) and the layer's own upper directory (workers.image_root),
        then enters it as ``/``: nothing of the host's tree, programs included
        cwd   the call's, else the image's WorkingDir, else ``/`` (``start_dir``)
        env   the image's Env, then ``[env] set``, then the call's env (``call_env``): none of
              the host's variables, not even those ``[env] allow`` passes to other calls
        user  the image's User, looked up in the image by the worker (workers.image_user);
              uid 0 in the call's namespace when the image names none

Everything here is lexical or the layer's own record: the image's directories are only ever
opened by a worker.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec

from sandbx_pool.config import EnvSettings
from sandbx_pool.images.image import Image

#: PATH when the image's Env sets none: what docker and podman give a container.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: HOME when the image's Env sets none: the call is root in its namespace (as podman sets it).
DEFAULT_HOME = "/root"


def check(image: object, store: str) -> Image:
    """``image`` if it is an Image a layer can lie over; TypeError or ValueError saying why
    not (nothing is made)."""
    if not isinstance(image, Image):
        raise TypeError(
            f"image must be an Image (from `await pool.image(ref)`), not {type(image).__name__}"
        )
    if not image.layer_dirs:
        raise ValueError(f"image {image.ref or image.digest!r} has no unpacked layers")
    if image.layers and len(image.layers) != len(image.layer_dirs):
        raise ValueError(
            f"image {image.ref or image.digest!r} lists {len(image.layers)} layers and"
            f" {len(image.layer_dirs)} layer directories"
        )
    for directory in image.layer_dirs:
        if "\x00" in directory or not os.path.isabs(directory):
            raise ValueError(f"an image's layer directory must be an absolute path: {directory!r}")
        normal = os.path.normpath(directory)
        if normal == store or normal.startswith(store.rstrip(os.sep) + os.sep):
            raise ValueError(f"an image's layer directory lies in the layer store: {directory}")
    if image.workdir and not os.path.isabs(image.workdir):
        raise ValueError(f"image {image.ref!r}: WorkingDir {image.workdir!r} is not absolute")
    return image


def record(image: Image) -> dict[str, Any]:
    """What the layer's record keeps of its image: all of it (a small record)."""
    recorded: dict[str, Any] = msgspec.to_builtins(image)
    return recorded


def from_record(name: str, recorded: object) -> Image:
    """The Image a layer's record kept; ValueError naming the layer when it is not one."""
    try:
        return msgspec.convert(recorded, Image)
    except msgspec.ValidationError as exc:
        raise ValueError(f"layer {name!r}: its record's image is not an image's: {exc}") from exc


def same_image(recorded: Image, wanted: Image) -> bool:
    """Whether ``wanted`` is the image the layer was made over: its manifest's digest and its
    layers (the directories may move with the store; the content may not)."""
    return recorded.digest == wanted.digest and recorded.layers == wanted.layers


def start_dir(image: Image) -> str:
    """Where a call starts when it names no cwd: the image's WorkingDir, else ``/``."""
    return os.path.normpath(image.workdir) if image.workdir else "/"


def call_env(image: Image, settings: EnvSettings, env: dict[str, str] | None) -> dict[str, str]:
    """A call's environment in an image: the image's Env, ``[env] set``, then the call's own.
    PATH and HOME as a container runtime gives them when the image sets none (HOME, for an
    image that names a User, is that user's, from the image's /etc/passwd: the worker sets
    it, workers.image_user)."""
    merged = (
        {"PATH": DEFAULT_PATH}
        if image.user.strip()
        else {"PATH": DEFAULT_PATH, "HOME": DEFAULT_HOME}
    )
    for entry in image.env:
        name, sep, value = entry.partition("=")
        if sep and name:
            merged[name] = value
    merged.update(settings.set)
    if env:
        merged.update(env)
    return merged


__all__ = [
    "DEFAULT_HOME",
    "DEFAULT_PATH",
    "call_env",
    "check",
    "from_record",
    "record",
    "same_image",
    "start_dir",
]
