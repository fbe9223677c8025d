"""A small real image for the integrations' tests: Debian's busybox-static with every applet it
has at the path it names (``busybox --list-full``), users in /etc/passwd, a WorkingDir, written
as an OCI layout by the test itself (no network, no daemon) and referenced as ``oci:DIR:TAG``,
which ``pool.image`` reads like any other reference. ``pool_toml`` keeps the image store and
the layer store in the test's directory, so nothing outlives it.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from conftest import MARKER
from image_tools import require
from oci_images import BUSYBOX, Entry, Layer, have_busybox, write_layout

#: The image's WorkingDir: where a command that names no cwd starts.
WORKDIR = "/srv/work"

PASSWD = b"root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
GROUP = b"root:x:0:\nnogroup:x:65534:\n"


def busybox_userland() -> Layer:
    """/bin/busybox and a symlink to it for each applet, the directories a Linux image has."""
    require("busybox", "busybox-static")
    if not have_busybox():
        raise RuntimeError(f"{BUSYBOX} is not statically linked (Debian's busybox-static is)")
    listed = subprocess.run(
        [BUSYBOX, "--list-full"], capture_output=True, text=True, check=True
    ).stdout.split()
    entries = [
        Entry(directory, "dir", mode=0o755)
        for directory in ("bin", "sbin", "usr", "usr/bin", "usr/sbin", "etc", "root", "srv")
    ]
    entries += [
        Entry("bin/busybox", "file", Path(BUSYBOX).read_bytes(), mode=0o755),
        *(
            Entry(applet, "symlink", target="/bin/busybox")
            for applet in listed
            if "/" in applet and applet != "bin/busybox"
        ),
        Entry("etc/passwd", "file", PASSWD),
        Entry("etc/group", "file", GROUP),
        Entry("etc/os-release", "file", b"NAME=busybox-image\n"),
        Entry("tmp", "dir", mode=0o1777),
        Entry(WORKDIR.lstrip("/"), "dir", mode=0o755),
        Entry(WORKDIR.lstrip("/") + "/README", "file", b"from the image\n"),
    ]
    return Layer(entries)


def write_busybox_image(
    layout: Path, tag: str = "v1", *, extra: list[Entry] | None = None, user: str = ""
) -> str:
    """The busybox image (plus ``extra`` entries as a layer of their own; ``user`` its config's
    User) at ``layout:tag``; its reference."""
    layers = [busybox_userland()]
    if extra:
        layers.append(Layer(extra))
    write_layout(
        layout,
        layers,
        tag=tag,
        env=("PATH=/usr/sbin:/usr/bin:/sbin:/bin", "IMAGE_VAR=from-image"),
        workdir=WORKDIR,
        user=user,
    )
    return f"oci:{layout}:{tag}"


def pool_toml(directory: Path, *, insecure: tuple[str, ...] = (), extra: str = "") -> str:
    """A pool config file keeping the image store and the layers under ``directory`` (and
    ``insecure`` registries pulled over plain HTTP); every command carries the session marker;
    no spare worker is forked."""
    path = directory / "pool.toml"
    path.write_text(
        f'[pool]\nprefork = 0\n\n[images]\nstore = "{directory / "images"}"\n'
        f"insecure = {json.dumps(list(insecure))}\n\n"
        f'[workspace]\nlayers = "{directory / "layers"}"\n\n'
        f'[env.set]\n{MARKER} = "{os.environ[MARKER]}"\n{extra}'
    )
    return str(path)


def host_bash_entries() -> list[Entry]:
    """The host's bash as /bin/bash, with the libraries it links at their paths: an image layer
    for tools that run ``bash`` (Harbor's agents and verifiers do)."""
    bash = os.path.realpath("/bin/bash")
    listed = subprocess.run(["ldd", bash], capture_output=True, text=True, check=True).stdout
    paths = [
        line.split("=>")[-1].split("(")[0].strip()
        for line in listed.splitlines()
        if line.split("=>")[-1].split("(")[0].strip().startswith("/")
    ]
    entries, directories = [Entry("bin/bash", "file", Path(bash).read_bytes(), mode=0o755)], set()
    for path in paths:
        parent = os.path.dirname(path).lstrip("/")
        while parent and parent not in directories:
            directories.add(parent)
            parent = os.path.dirname(parent)
        data = Path(os.path.realpath(path)).read_bytes()
        entries.append(Entry(path.lstrip("/"), "file", data, mode=0o755))
    dirs = [Entry(d, "dir", mode=0o755) for d in sorted(directories)]
    return dirs + entries


def pids_with_argv(*argv: str) -> list[int]:
    """Live processes whose whole argv is ``argv`` (busybox's applets cannot run under another
    argv[0], so a test tags them by an argument: ``sleep 1234567``)."""
    wanted = b"\0".join(a.encode() for a in argv) + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if cmdline == wanted and state != "Z":
            found.append(int(entry))
    return found
