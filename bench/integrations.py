"""The integrations on images (issue 42): what a trial or a sample costs, against the same
framework's container path where it runs here. ``python -m bench.integrations [--quick]``.

The image is made here, offline: busybox-static with its applets, the host's bash and the
libraries it links, a WorkingDir, committed by buildah as an OCI layout (``oci:DIR:v1``).

* Inspect: a sample's set-up (``sample_init``) and first exec (``true``), on the image
  (``SandbxConfig(image=...)``) against a directory base (``base=DIR``), in alternating rounds;
* mini-swe-agent: an environment's life (made, one ``execute``, closed) on the image, against
  the docker environment's own sequence run by podman (``run -d`` ... ``exec`` ... ``rm -f``);
* Harbor: ``harbor run -a oracle -n 4`` over 4 local tasks on the image, wall time, with
  ``-e sandbx_pool.integrations.harbor:SandbxEnvironment``; Harbor's podman environment
  cannot run here (it needs a compose frontend, and crun refuses its rlimits), so the row
  beside it is the podman sequence a trial needs at the least (run -d, 8 exec, 2 cp, rm -f).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.images_layer import PODMAN_CGROUPS, PODMAN_RUNTIME

#: podman's flags on a machine like this one, and its runtime (bench.images_layer says why).
PODMAN_FLAGS = (
    "--network=none",
    "--ulimit=nofile=1024:1024",
    "--ulimit=nproc=1024:1024",
    *PODMAN_CGROUPS,
)
PODMAN = ("podman", *PODMAN_RUNTIME)
#: Why podman gave no figure (set by _podman_ready), printed in its rows.
PODMAN_UNAVAILABLE: list[str] = []
PODMAN_IMAGE = "localhost/sandbx-bench-integrations:v1"
#: The image podman pulled (removed by its id: it keeps its pulled name beside the tag).
PULLED: list[str] = []


def make_image(root: Path) -> str:
    """The bench's image as an OCI layout under ``root``; its reference."""
    tree = root / "rootfs"
    for name in ("bin", "etc", "tmp", "root", "srv/work", "logs"):
        (tree / name).mkdir(parents=True, exist_ok=True)
    shutil.copy2("/bin/busybox", tree / "bin" / "busybox")
    for applet in _out(["/bin/busybox", "--list"]).split():
        if applet not in ("busybox", "bash"):
            os.symlink("busybox", tree / "bin" / applet)
    bash = os.path.realpath("/bin/bash")
    shutil.copy2(bash, tree / "bin" / "bash")
    listed = subprocess.run(["ldd", bash], capture_output=True, text=True, check=True).stdout
    for line in listed.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            target = tree / path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.realpath(path), target)
    (tree / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    layout = root / "layout"
    container = _out(["buildah", "from", "scratch"]).strip()
    try:
        _out(["buildah", "copy", container, str(tree), "/"])
        _out(["buildah", "config", "--workingdir", "/srv/work", "--env", "PATH=/bin", container])
        _out(["buildah", "commit", "--quiet", container, f"oci:{layout}:v1"])
    finally:
        _out(["buildah", "rm", container])
    return f"oci:{layout}:v1"


def _out(argv: list[str], **kwargs: object) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=True, **kwargs)  # type: ignore[call-overload]
    return str(done.stdout)


def _ms(samples: list[float]) -> str:
    if not samples:
        return f"cannot run here: {PODMAN_UNAVAILABLE[0]}" if PODMAN_UNAVAILABLE else "n/a"
    return f"{statistics.median(samples) * 1000:.0f} ms (n={len(samples)})"


# -- Inspect ---------------------------------------------------------------------------------


async def inspect_rows(ref: str, root: Path, samples: int) -> dict[str, list[float]]:
    from sandbx_pool.integrations.inspect_provider import SandbxConfig, SandbxSandboxEnvironment

    base = root / "base"
    base.mkdir(exist_ok=True)
    (base / "README").write_text("a directory base\n")
    pool_toml = root / "pool.toml"
    pool_toml.write_text(
        f'[images]\nstore = "{root / "images"}"\n\n[workspace]\nlayers = "{root / "layers"}"\n'
    )
    configs = {
        "image": SandbxConfig(
            pool_config=str(pool_toml), image=ref, workers=2, journal=str(root / "j1.jsonl")
        ),
        "directory base": SandbxConfig(
            pool_config=str(pool_toml), base=str(base), workers=2, journal=str(root / "j2.jsonl")
        ),
    }
    found: dict[str, list[float]] = {kind: [] for kind in configs}
    for config in configs.values():
        await SandbxSandboxEnvironment.task_init("bench", config)
    try:
        for round_number in range(samples):
            order = list(configs.items())
            if round_number % 2:
                order.reverse()
            for kind, config in order:
                start = time.perf_counter()
                made = await SandbxSandboxEnvironment.sample_init("bench", config, {})
                result = await made["default"].exec(["true"])
                found[kind].append(time.perf_counter() - start)
                assert result.success, result
                await SandbxSandboxEnvironment.sample_cleanup("bench", config, made, False)
    finally:
        for config in configs.values():
            await SandbxSandboxEnvironment.task_cleanup("bench", config, True)
    return found


# -- mini-swe-agent --------------------------------------------------------------------------


def mini_rows(ref: str, root: Path, samples: int) -> dict[str, list[float]]:
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    from sandbx_pool.integrations.mini_swe_agent import SandbxEnvironment

    pool_toml = root / "pool.toml"
    found: dict[str, list[float]] = {"sandbx image": [], "podman (docker env's sequence)": []}
    podman = _podman_ready(ref)
    for n in range(samples):
        start = time.perf_counter()
        journal = str(root / f"mini-{n}.jsonl")
        env = SandbxEnvironment(image=ref, pool_config=str(pool_toml), journal=journal)
        assert env.execute({"command": "true"})["returncode"] == 0
        env.close()
        found["sandbx image"].append(time.perf_counter() - start)
        if podman is None:
            start = time.perf_counter()
            name = f"sbx-bench-{os.getpid()}"
            _out([*PODMAN, "run", "-d", "--name", name, *PODMAN_FLAGS, PODMAN_IMAGE,
                  "sleep", "7200"])  # fmt: skip
            _out([*PODMAN, "exec", "-w", "/", name, "bash", "-lc", "true"])
            _out([*PODMAN, "rm", "-f", "-t", "0", name])
            found["podman (docker env's sequence)"].append(time.perf_counter() - start)
    return found


def _podman_ready(ref: str) -> str | None:
    """None when podman runs the image here; else why not."""
    if shutil.which("podman") is None:
        return "podman is not installed"
    try:
        image_id = _out([*PODMAN, "pull", "-q", ref]).split()[-1]
        PULLED[:] = [image_id]
        _out([*PODMAN, "tag", image_id, PODMAN_IMAGE])
        _out([*PODMAN, "run", "--rm", *PODMAN_FLAGS, PODMAN_IMAGE, "true"])
    except subprocess.CalledProcessError as exc:
        reason = (exc.stderr or str(exc)).strip().splitlines()[-1]
        PODMAN_UNAVAILABLE[:] = [reason]
        return reason
    return None


# -- Harbor ----------------------------------------------------------------------------------

SOLVE = "#!/bin/bash\necho 42 > /srv/work/answer\n"
VERIFY = (
    '#!/bin/bash\nif [ "$(cat /srv/work/answer)" = 42 ]; then echo 1; else echo 0; fi'
    " > /logs/verifier/reward.txt\n"
)


def harbor_rows(ref: str, root: Path, runs: int) -> dict[str, list[float]]:
    harbor = Path(sys.executable).parent / "harbor"
    tasks = root / "tasks"
    for n in range(4):
        task = tasks / f"t{n}"
        for sub in ("environment", "solution", "tests"):
            (task / sub).mkdir(parents=True, exist_ok=True)
        (task / "instruction.md").write_text("Write 42.\n")
        (task / "task.toml").write_text(
            f'schema_version = "1.4"\n\n[environment]\ndocker_image = "{ref}"\n'
        )
        (task / "solution" / "solve.sh").write_text(SOLVE)
        (task / "tests" / "test.sh").write_text(VERIFY)
    found: dict[str, list[float]] = {"sandbx, -n 4, 4 tasks": [], "podman, one trial's floor": []}
    for run in range(runs):
        jobs = root / f"jobs{run}"
        start = time.perf_counter()
        _out([str(harbor), "run", "--yes", "-q", "-p", str(tasks), "-a", "oracle", "-n", "4",
              "-e", "sandbx_pool.integrations.harbor:SandbxEnvironment",
              "--ek", f"config={root / 'pool.toml'}", "-o", str(jobs)])  # fmt: skip
        found["sandbx, -n 4, 4 tasks"].append(time.perf_counter() - start)
        results = [json.loads(p.read_text()) for p in jobs.glob("*/*/result.json")]
        rewards = [r["verifier_result"]["rewards"]["reward"] for r in results]
        assert rewards == [1.0] * 4, rewards
        for result in results:  # Harbor's own timing of each trial's phases
            for phase, value in result.items():
                if isinstance(value, dict) and value.get("started_at") and value.get("finished_at"):
                    took = _seconds(value["finished_at"]) - _seconds(value["started_at"])
                    found.setdefault(f"sandbx, a trial's {phase}", []).append(took)
    if _podman_ready(ref) is None:
        for _ in range(runs):
            start = time.perf_counter()
            name = f"sbx-bench-trial-{os.getpid()}"
            _out([*PODMAN, "run", "-d", "--name", name, *PODMAN_FLAGS, PODMAN_IMAGE,
                  "sleep", "7200"])  # fmt: skip
            script = root / "tasks" / "t0" / "solution" / "solve.sh"
            for target in ("/solution/solve.sh", "/tests/test.sh"):
                _out([*PODMAN, "exec", name, "mkdir", "-p", os.path.dirname(target)])
                _out([*PODMAN, "cp", str(script), f"{name}:{target}"])
            for _ in range(6):
                _out([*PODMAN, "exec", name, "bash", "-c", "true"])
            _out([*PODMAN, "rm", "-f", "-t", "0", name])
            found["podman, one trial's floor"].append(time.perf_counter() - start)
    return found


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp).timestamp()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.integrations")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    samples = 4 if args.quick else 20
    root = Path(tempfile.mkdtemp(prefix="sbx-bench-integrations-"))
    try:
        ref = make_image(root)
        (root / "pool.toml").write_text(
            f'[images]\nstore = "{root / "images"}"\n\n[workspace]\nlayers = "{root / "layers"}"\n'
        )
        rows = {
            "Inspect: sample_init + first exec": asyncio.run(inspect_rows(ref, root, samples)),
            "mini-swe-agent: environment made, 1 execute, closed": mini_rows(
                ref, root, max(3, samples // 2)
            ),
            "Harbor: oracle job wall time": harbor_rows(ref, root, 2 if args.quick else 3),
        }
    finally:
        for image in (PODMAN_IMAGE, *PULLED):
            subprocess.run([*PODMAN, "rmi", "-f", image], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
    print("| what | how | median |\n|---|---|---|")
    for what, found in rows.items():
        for how, samples_s in found.items():
            print(f"| {what} | {how} | {_ms(samples_s)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
