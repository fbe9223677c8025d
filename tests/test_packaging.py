"""What users install: the sdist carries the whole project, a wheel built from it runs every tool.

The layout holds without a link: ``workers/`` is installed as ``sandbx_pool.workers`` by
pyproject.toml's ``package-dir``, never as a top-level ``workers`` (which would clash with a
user's own module of that name, or be shadowed by a folder of it in the current directory).
Built without isolation, with this environment's setuptools, so the test needs no network.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
from pathlib import Path

import loguru
import msgspec
import pip
import pytest
import zmq

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(600)


def _build(kind: str, source: Path, out: Path) -> Path:
    """Build an sdist or a wheel of ``source`` into ``out`` with setuptools' own backend."""
    hook = f"build_{kind}"
    code = f"import sys; from setuptools import build_meta as b; print(b.{hook}(sys.argv[1]))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=source, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # From a clean copy of the tracked files: what a clone holds, nothing this checkout made.
    source = tmp_path_factory.mktemp("source")
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        target = source / os.fsdecode(name)
        target.parent.mkdir(parents=True, exist_ok=True)
        if (REPO / os.fsdecode(name)).exists():
            target.write_bytes((REPO / os.fsdecode(name)).read_bytes())
    return _build("sdist", source, tmp_path_factory.mktemp("sdist"))


@pytest.fixture(scope="module")
def installed(sdist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A new environment with the wheel built from the sdist; its dependencies are this one's."""
    unpacked = tmp_path_factory.mktemp("unpacked")
    with tarfile.open(sdist) as archive:
        archive.extractall(unpacked, filter="data")
    (tree,) = unpacked.iterdir()
    wheel = _build("wheel", tree, tmp_path_factory.mktemp("wheel"))
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    # Its dependencies (pyzmq, msgspec, loguru; pip to install with) from where this environment
    # has them: plain paths, so that this environment's editable install of the checkout (a
    # .pth hook) is not loaded there. rg is a binary beside the interpreter, as its wheel puts it.
    homes = {str(Path(module.__file__).parent.parent) for module in (msgspec, zmq, loguru, pip)}
    (site / "deps.pth").write_text("".join(f"{home}\n" for home in sorted(homes)))
    rg = Path(sysconfig.get_path("scripts")) / "rg"
    if rg.exists():
        shutil.copy2(rg, venv / "bin" / "rg")
    # pip comes through deps.pth too; run by the new interpreter, it writes that one into the
    # scripts' shebangs. --ignore-installed: it must never uninstall the checkout's editable
    # install, which it sees through deps.pth.
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-index", "--ignore-installed", str(wheel)],
        check=True,
    )  # fmt: skip
    return venv


def test_the_sdist_carries_the_whole_project(sdist: Path) -> None:
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    tracked = set(
        subprocess.run(
            ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split()
    )
    missing = sorted(
        name for name in tracked if not name.startswith(("bench/results/",)) and name not in names
    )
    assert missing == [], f"tracked files the sdist leaves out: {missing[:20]}"


def test_no_symlink_holds_the_layout() -> None:
    listed = subprocess.run(
        ["git", "ls-files", "-s"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    links = [line.split("\t", 1)[1] for line in listed if line.startswith("120000")]
    assert links == []


def test_every_package_folder_is_installed() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapping = config["package-dir"]
    on_disk = set()
    for package, folder in mapping.items():
        for init in (REPO / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO / folder)
            on_disk.add(".".join([package, *relative.parts]))
    assert on_disk == listed


def _cli(venv: Path, *argv: str, cwd: Path) -> dict[str, object]:
    done = subprocess.run(
        [str(venv / "bin" / "sandbx-pool"), *argv], cwd=cwd, capture_output=True, text=True
    )
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-2000:])
    outcome: dict[str, object] = json.loads(done.stdout)
    return outcome


def test_a_wheel_built_from_the_sdist_runs_every_tool(installed: Path, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "notes.txt").write_text("alpha\nneedle here\n")
    calls = [
        ("read", ["path=notes.txt"]),
        ("write", ["path=new.txt", "content=fresh"]),
        ("edit", ["path=new.txt", "old_string=fresh", "new_string=edited"]),
        ("ls", []),
        ("grep", ["pattern=needle"]),
        ("find", ["pattern=*.txt"]),
        ("bash", ["command=cat new.txt"]),
    ]
    for tool, args in calls:
        outcome = _cli(installed, "call", tool, *args, "--workspace", str(ws), cwd=tmp_path)
        assert outcome["status"] == "ok", outcome
    assert (ws / "new.txt").read_text() == "edited"
    # It ran the installed copy, not this checkout.
    where = subprocess.run(
        [str(installed / "bin" / "python"), "-I", "-c",
         "import sandbx_pool.workers.protocol as p; print(p.__file__)"],
        capture_output=True, text=True, check=True, cwd=tmp_path,
    ).stdout  # fmt: skip
    assert where.startswith(str(installed)), where


def test_no_top_level_workers_module_is_installed(installed: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [str(installed / "bin" / "python"), "-I", "-c", "import workers"],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode != 0
    assert "No module named 'workers'" in done.stderr


def _tracked_copy(target: Path) -> Path:
    """The tracked files of this checkout, as a fresh clone holds them, under ``target``."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = REPO / os.fsdecode(name)
        if source.exists():
            (target / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            (target / os.fsdecode(name)).write_bytes(source.read_bytes())
    return target


def test_the_build_prints_no_packaging_warning(tmp_path: Path) -> None:
    # What pip shows a new user on `make demo`: setuptools' deprecation banners are noise that
    # reads like a broken install.
    source = _tracked_copy(tmp_path / "source")
    code = (
        "import sys; from setuptools import build_meta as b;"
        " b.prepare_metadata_for_build_wheel(sys.argv[1])"
    )
    (tmp_path / "meta").mkdir()
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "meta")],
        cwd=source,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Warning" not in done.stderr, done.stderr


def test_make_demo_installs_only_what_the_demo_needs_and_says_so(tmp_path: Path) -> None:
    # A fresh clone: no .venv. `make -n` prints the commands without running them.
    source = _tracked_copy(tmp_path / "clone")
    done = subprocess.run(["make", "-n", "demo"], cwd=source, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    commands = done.stdout
    assert "pip install" in commands
    assert "[dev]" not in commands, commands  # the integrations, Ray, mypy: not the demo's
    assert "make demo: first use: installing" in commands
    assert "about 20 s" in commands
