"""What the image tests share: the tools they need, a tree's listing, the merged view of an
image's layers through a real overlay mount, and ``umoci raw unpack`` of the same image."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: Prints a tree as JSON: per path, its type, mode (setuid/setgid masked: the store strips
#: them), a regular file's sha256 and mtime, a symlink's target, a device's numbers; owners
#: when asked.
LIST_TREE = r"""
import hashlib, json, os, stat, sys
root, owners = sys.argv[1], sys.argv[2] == "1"
out = {}
for directory, dirs, files in os.walk(root):
    for name in dirs + files:
        path = os.path.join(directory, name)
        st = os.lstat(path)
        mode = st.st_mode
        entry = {"type": stat.S_IFMT(mode), "mode": stat.S_IMODE(mode) & ~0o6000}
        if stat.S_ISREG(mode):
            with open(path, "rb") as f:
                entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
            entry["mtime"] = int(st.st_mtime)
        elif stat.S_ISLNK(mode):
            entry["target"] = os.readlink(path)
            del entry["mode"]
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            entry["rdev"] = [os.major(st.st_rdev), os.minor(st.st_rdev)]
        if owners:
            entry["owner"] = [st.st_uid, st.st_gid]
        out[os.path.relpath(path, root)] = entry
print(json.dumps(out, sort_keys=True))
"""


def require(command: str, package: str) -> str:
    """The command's path; a skip (a failure under CI=true) where it is not installed."""
    found = shutil.which(command)
    if found is None:
        message = f"{command} is not installed (Debian package {package})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def list_tree(root: str | Path, *, owners: bool = False) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", LIST_TREE, str(root), "1" if owners else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def merged_tree(
    layer_dirs: tuple[str, ...], scratch: Path, *, owners: bool = False
) -> dict[str, Any]:
    """The image as an overlay of its layers shows it (the mount a layer over an image makes:
    top layer first, ``userxattr``), in a mount namespace of its own (a user namespace too
    when not root), so nothing stays mounted."""
    require("unshare", "util-linux")
    lowers = list(reversed(layer_dirs))
    if len(lowers) == 1:  # a read-only overlay needs two lowers
        empty = scratch / "empty-lower"
        empty.mkdir(exist_ok=True)
        lowers.append(str(empty))
    target = scratch / "merged"
    target.mkdir(exist_ok=True)
    script = (
        f"mount -t overlay overlay -o lowerdir={':'.join(lowers)},userxattr {target}"
        f' && exec {sys.executable} -c "$LIST_TREE" {target} {"1" if owners else "0"}'
    )
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]
    done = subprocess.run(
        [*unshare, "sh", "-c", script],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "LIST_TREE": LIST_TREE},
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def umoci_tree(layout: Path, tag: str, scratch: Path, *, owners: bool = False) -> dict[str, Any]:
    """``umoci raw unpack`` of the image: its layers applied one over the other."""
    require("umoci", "umoci")
    rootfs = scratch / "umoci-rootfs"
    rootless = [] if os.geteuid() == 0 else ["--rootless"]
    subprocess.run(
        ["umoci", "raw", "unpack", *rootless, "--image", f"{layout}:{tag}", str(rootfs)],
        check=True,
        capture_output=True,
    )
    return list_tree(rootfs, owners=owners)
