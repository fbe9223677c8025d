"""``sandbx-pool image``: pull, ls, rm and prune the image store (sandbx_pool.images).

    image pull REF              find REF in the store or pull it; one line: ref, digest, size
    image ls [--json]           the store's images, most recently used first
    image rm REF                remove REF, and its layers no other image has
    image prune [--max-size S]  evict least recently used images down to S (default 0: all
                                but the pinned), and whatever no image names

Exit status: 0 done; 1 the store refused (a pull failed, an image in use, not in the store);
2 a usage error (a malformed reference or size, a bad config), one line on stderr each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec

from sandbx_pool.config import load_config, parse_size
from sandbx_pool.errors import ImageError
from sandbx_pool.images.store import ImageStore, StoredImage

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def human(size: int) -> str:
    """1536 -> ``1.5 KiB``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def _fail(args: argparse.Namespace, message: str, code: int) -> int:
    print(f"sandbx-pool image {args.image_command}: {message}".replace("\n", " "), file=sys.stderr)
    return code


def _store(args: argparse.Namespace) -> ImageStore:
    return ImageStore.from_config(load_config(args.config))


def _pull(args: argparse.Namespace, store: ImageStore) -> int:
    image = store.image(args.ref)
    print(f"{image.ref}  {image.digest}  {len(image.layers)} layers  {human(image.size)}")
    return EXIT_OK


def _as_json(stored: StoredImage) -> dict[str, Any]:
    fields: dict[str, Any] = msgspec.to_builtins(stored.image)
    return {**fields, "last_used": stored.last_used, "disk": stored.disk, "pinned": stored.pinned}


def _ls(args: argparse.Namespace, store: ImageStore) -> int:
    listed = store.list()
    if args.json:
        print(json.dumps([_as_json(s) for s in listed], indent=2))
        return EXIT_OK
    now = time.time()
    for stored in listed:
        image = stored.image
        age = max(0, int(now - stored.last_used))
        used = (
            f"{age // 86400}d"
            if age >= 86400
            else f"{age // 3600}h"
            if age >= 3600
            else f"{age // 60}m"
        )
        pinned = "  pinned" if stored.pinned else ""
        print(
            f"{image.ref}  {image.digest[:19]}  {len(image.layers)} layers  "
            f"{human(image.size)}  used {used} ago{pinned}"
        )
    print(f"{_count(len(listed), 'image')}, {human(store.disk_usage())} on disk in {store.root}")
    return EXIT_OK


def _rm(args: argparse.Namespace, store: ImageStore) -> int:
    if not store.remove(args.ref):
        return _fail(args, f"{args.ref}: not in the store", EXIT_FAILED)
    print(f"removed {args.ref}")
    return EXIT_OK


def _prune(args: argparse.Namespace, store: ImageStore) -> int:
    pruned = store.prune(args.max_size)
    for ref in pruned.images:
        print(f"evicted {ref}")
    print(
        f"{_count(len(pruned.images), 'image')}, {_count(len(pruned.layers), 'layer')} removed,"
        f" {human(pruned.freed)} freed; {human(store.disk_usage())} left"
    )
    return EXIT_OK


_ACTIONS = {"pull": _pull, "ls": _ls, "rm": _rm, "prune": _prune}


def _cmd_image(args: argparse.Namespace) -> int:
    try:
        store = _store(args)
        return _ACTIONS[args.image_command](args, store)
    except ValueError as exc:  # a malformed reference
        return _fail(args, str(exc), EXIT_USAGE)
    except ImageError as exc:
        return _fail(args, str(exc), EXIT_FAILED)
    except OSError as exc:
        return _fail(args, f"the image store: {exc}", EXIT_FAILED)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_image_parser(commands: Any) -> None:
    image = commands.add_parser("image", help="pull, list, remove and prune container images")
    image.set_defaults(func=_cmd_image)
    actions = image.add_subparsers(dest="image_command", required=True)
    config = argparse.ArgumentParser(add_help=False)
    config.add_argument("--config", metavar="FILE", help="TOML settings ([images] store...)")
    pull = actions.add_parser("pull", parents=[config], help="pull REF into the store")
    pull.add_argument("ref", metavar="REF")
    ls = actions.add_parser("ls", parents=[config], help="list the store's images")
    ls.add_argument("--json", action="store_true", help="print them as JSON")
    rm = actions.add_parser("rm", parents=[config], help="remove REF from the store")
    rm.add_argument("ref", metavar="REF")
    prune = actions.add_parser("prune", parents=[config], help="evict least recently used images")
    prune.add_argument(
        "--max-size", type=_size, default=0, metavar="SIZE",
        help="keep at most this much disk (bytes, or 20G; default 0: all but pinned images)",
    )  # fmt: skip
