"""Section images_layer: layers over a container image (``pool.layer(name, image=...)``).

The images are made here, offline, as an image store unpacks them: a busybox-static layer
(Debian's ``busybox``), two small layers over it, and 37 more for the 40-layer one. Rows:

* a fresh layer over the 3-layer image, first call (bash ``true``) answered, and the same over
  the 40-layer image (the issue's goal: at most 30 ms for the first);
* bash ``true`` p50 in a layer over the image, in a layer over a plain directory, and in the
  pool's own workspace, in alternating rounds (goal: the image layer at most +1 ms over the
  plain layer);
* 16 forks of a layer over the image (a GRPO group), total, and a first call in each of the
  16, two at a time (the pool's workers), total;
* the peers: ``podman run --rm IMG true`` and ``podman exec CTR true`` of the same tree
  (``podman import`` of the merged layers, offline); where podman cannot run a container
  here, the row says why instead of a figure. And bubblewrap per command over the merged
  tree, the floor of a namespace sandbox built per command.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Layer, Pool
from sandbx_pool.images import Image

ROUNDS = 4
FORKS = 16
APPLETS = ("sh", "true", "sleep", "cat", "ls", "echo")
PODMAN_IMAGE = "localhost/sandbx-bench-image:3"
#: What podman needs on a machine like this one: its default rlimits are above this host's
#: hard ones, and a cgroup v1/v2 hybrid makes crun refuse any cgroup (runc, Debian's, runs
#: there: PODMAN_RUNTIME).
PODMAN_FLAGS = (
    "--network=none",
    "--ulimit=nofile=1024:1024",
    "--ulimit=nproc=1024:1024",
)


@dataclass
class ImagesLayerResult:
    first_call_3: Samples = field(default_factory=Samples)
    first_call_40: Samples = field(default_factory=Samples)
    true_image: Samples = field(default_factory=Samples)
    true_layer: Samples = field(default_factory=Samples)
    true_plain: Samples = field(default_factory=Samples)
    forks_16: Samples = field(default_factory=Samples)
    forks_16_called: Samples = field(default_factory=Samples)
    podman_run: Samples = field(default_factory=Samples)
    podman_exec: Samples = field(default_factory=Samples)
    bwrap_true: Samples = field(default_factory=Samples)
    #: Why podman gave no figure here (None: it did).
    podman_unavailable: str | None = None


def make_image(root: Path, layers: int) -> Image:
    """``layers`` layer directories, bottom first: busybox, then small ones."""
    dirs = []
    base = root / "l000"
    (base / "bin").mkdir(parents=True)
    shutil.copy2(shutil.which("busybox") or "/bin/busybox", base / "bin" / "busybox")
    for applet in APPLETS:
        os.symlink("busybox", base / "bin" / applet)
    for name in ("etc", "tmp", "root", "work"):
        (base / name).mkdir()
    (base / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    dirs.append(base)
    for index in range(1, layers):
        layer = root / f"l{index:03d}"
        (layer / "work").mkdir(parents=True)
        (layer / "work" / f"file{index:03d}").write_text(f"{index}\n")
        dirs.append(layer)
    return Image(
        ref=f"bench:{layers}",
        digest="sha256:" + f"{layers:064x}",
        layers=tuple("sha256:" + f"{layers:032x}{i:032x}" for i in range(layers)),
        env=("PATH=/bin",),
        workdir="/work",
        layer_dirs=tuple(str(d) for d in dirs),
    )


def run(ws: BenchWorkspace, *, samples: int) -> ImagesLayerResult:
    return asyncio.run(_run(ws, samples))


async def _true_ns(pool: Pool, where: Layer | None) -> int:
    start = time.perf_counter_ns()
    outcome = await pool.call("bash", {"command": "true"}, workspace=where)
    elapsed = time.perf_counter_ns() - start
    assert outcome.ok, outcome
    return elapsed


async def _run(ws: BenchWorkspace, samples: int) -> ImagesLayerResult:
    result = ImagesLayerResult()
    area = ws.workspace / "images-layer-bench"
    three = await asyncio.to_thread(make_image, area / "image3", 3)
    forty = await asyncio.to_thread(make_image, area / "image40", 40)
    plain_base = area / "plain"
    plain_base.mkdir()
    (plain_base / "file").write_text("x\n")
    config = ws.config(pool={"workers": 2}, workspace={"layers": str(area / "store")})
    async with Pool(plain_base, config=config, journal=ws.journal("images_layer")) as pool:
        warm = await pool.layer("warm", image=three)
        plain = await pool.layer("plain", base=plain_base)
        await _true_ns(pool, warm)
        fresh = ((three, result.first_call_3, "a"), (forty, result.first_call_40, "b"))
        for image, into, prefix in fresh:
            for n in range(samples):
                start = time.perf_counter_ns()
                layer = await pool.layer(f"{prefix}{n}", image=image)
                outcome = await pool.call("bash", {"command": "true"}, workspace=layer)
                into.add(time.perf_counter_ns() - start)
                assert outcome.ok, outcome
                await layer.remove()
        per_round = max(1, samples // ROUNDS)
        for round_number in range(ROUNDS):
            order = [
                (warm, result.true_image),
                (plain, result.true_layer),
                (None, result.true_plain),
            ]
            if round_number % 2:
                order.reverse()
            for where, into in order:
                for _ in range(per_round):
                    into.add(await _true_ns(pool, where))
        await pool.call("bash", {"command": "echo changed > /work/state"}, workspace=warm)
        for group in range(max(2, samples // 20)):
            start = time.perf_counter_ns()
            forks = [await warm.fork(f"g{group}-{i}") for i in range(FORKS)]
            result.forks_16.add(time.perf_counter_ns() - start)
            start = time.perf_counter_ns()
            answered = await asyncio.gather(
                *(pool.call("bash", {"command": "cat /work/state"}, workspace=f) for f in forks)
            )
            result.forks_16_called.add(time.perf_counter_ns() - start)
            assert all(o.ok for o in answered), answered
            for fork in forks:
                await fork.remove()
        await warm.remove()
        await plain.remove()
    await asyncio.to_thread(_podman, three, area, samples, result)
    await asyncio.to_thread(shutil.rmtree, area)
    logger.info("images_layer: {} fresh layers over a 3-layer image", result.first_call_3.count)
    return result


def _podman(image: Image, area: Path, samples: int, result: ImagesLayerResult) -> None:
    """``podman run --rm`` and ``podman exec`` of the same tree (its layers merged, imported)."""
    merged = area / "merged"
    merged.mkdir()
    for layer in image.layer_dirs:  # these layers only add files: merging is copying in order
        subprocess.run(["cp", "-a", f"{layer}/.", str(merged)], check=True)
    _bwrap(merged, samples, result)
    if shutil.which("podman") is None:
        result.podman_unavailable = "podman is not installed"
        return
    tar = subprocess.Popen(["tar", "-C", str(merged), "-c", "."], stdout=subprocess.PIPE)
    imported = subprocess.run(
        ["podman", "import", "-", PODMAN_IMAGE], stdin=tar.stdout, capture_output=True, check=False
    )
    tar.wait()
    if imported.returncode != 0:
        result.podman_unavailable = _first_line(imported.stderr)
        return
    name = f"sandbx-bench-{os.getpid()}"
    try:
        probe = _podman_run("run", "--rm", *PODMAN_FLAGS, *PODMAN_CGROUPS, PODMAN_IMAGE, "true")
        if probe.returncode != 0:
            result.podman_unavailable = _first_line(probe.stderr)
            return
        for _ in range(samples):
            start = time.perf_counter_ns()
            _podman_run(
                "run", "--rm", *PODMAN_FLAGS, *PODMAN_CGROUPS, PODMAN_IMAGE, "true", check=True
            )
            result.podman_run.add(time.perf_counter_ns() - start)
        flags = (*PODMAN_FLAGS, *PODMAN_CGROUPS)
        _podman_run("run", "-d", "--name", name, *flags, PODMAN_IMAGE, "sleep", "3600", check=True)
        for _ in range(samples):
            start = time.perf_counter_ns()
            _podman_run("exec", name, "true", check=True)
            result.podman_exec.add(time.perf_counter_ns() - start)
    finally:
        _podman_run("rm", "-f", "-t", "0", name)
        _podman_run("rmi", "-f", PODMAN_IMAGE)


def _bwrap(merged: Path, samples: int, result: ImagesLayerResult) -> None:
    """bubblewrap per command over the merged tree: the floor of a sandbox made per command
    in C (no copy-on-write of the image, no journal, no worker kept ahead)."""
    if shutil.which("bwrap") is None:
        return
    argv = ["bwrap", "--bind", str(merged), "/", "--proc", "/proc", "--dev", "/dev",
            "--unshare-all", "--die-with-parent", "--new-session", "/bin/true"]  # fmt: skip
    for _ in range(samples):
        start = time.perf_counter_ns()
        subprocess.run(argv, check=True, capture_output=True)
        result.bwrap_true.add(time.perf_counter_ns() - start)


#: podman's runtime: runc where it is installed (crun, podman's default, refuses any container
#: on a cgroup v1/v2 hybrid: "cgroups in hybrid mode not supported").
#: crun runs only without cgroups there (which runc refuses).
PODMAN_RUNTIME = ("--runtime=runc",) if shutil.which("runc") else ()
PODMAN_CGROUPS = () if PODMAN_RUNTIME else ("--cgroups=disabled",)


def _podman_run(*args: str, check: bool = False) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["podman", *PODMAN_RUNTIME, *args], capture_output=True, check=check, timeout=120
    )


def _first_line(stderr: bytes) -> str:
    lines = [line for line in stderr.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "failed"


def render(result: ImagesLayerResult, table: object, ms: object) -> str:
    """The section's Markdown (``table`` and ``ms``: bench.report's helpers)."""
    assert callable(table)
    assert callable(ms)

    def row(name: str, samples: Samples) -> tuple[str, str, str, str]:
        return (name, str(samples.count), ms(samples.p50), ms(samples.p95))

    rows = [
        row("fresh layer over a 3-layer image, first call answered", result.first_call_3),
        row("fresh layer over a 40-layer image, first call answered", result.first_call_40),
        row("bash `true`, in a layer over the image", result.true_image),
        row("bash `true`, in a layer over a directory", result.true_layer),
        row("bash `true`, in the pool's workspace", result.true_plain),
        row(f"{FORKS} forks of a layer over the image, total", result.forks_16),
        row(f"a first call in each of the {FORKS} forks, total", result.forks_16_called),
    ]
    if result.bwrap_true.count:
        rows.append(row("`bwrap ... true` over the merged tree (no layer)", result.bwrap_true))
    if result.podman_unavailable is None:
        rows.append(row("`podman run --rm IMG true` (the 3-layer image)", result.podman_run))
        rows.append(row("`podman exec CTR true`", result.podman_exec))
    else:
        rows.append(("`podman run --rm` / `podman exec`", "0", "n/a", "n/a"))
    text = (
        "## Layers over a container image\n\n"
        + str(table(("row", "n", "p50", "p95"), rows, "lrrr"))
        + "\n\nGoals (issue 41): a fresh layer's first call at most 30 ms; bash `true` in an"
        " image layer at most +1 ms over a plain layer."
    )
    if result.podman_unavailable is not None:
        text += f" podman ran no container here: `{result.podman_unavailable}`."
    return text
