"""What one call can reach past itself, attacked as a hostile model would, through a Pool.

Each attack is a bash command (or a file tool call) against a pool started as root with the
default config, and each protection is checked from the host's side: the command's
/proc/PID/status, the stat of what it left, a SysV segment or a key this test made.

* planted code: the template and doctor's probe run this installation's code, never what the
  caller's directory (or PYTHONPATH) holds;
* root power: a command holds no capability (CapEff, CapPrm, CapAmb are 0), so no packet
  socket, no chown to another uid, no reading another uid's 0600 file, no uid change, no
  /etc/shadow;
* planted for later: no set-uid/set-gid file, no file capabilities;
* kernel objects: a private IPC namespace, no host keyrings, no nested user namespace, no
  io_uring, no ptrace;
* the call's TMPDIR: private to it, bounded in size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config

from sandbx_pool import Pool, Status

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks need a pool run as root")

#: Everything a planted module does when imported: leave a mark where the test looks.
_PLANT = "import os; open(os.environ.get('PLANT_MARK', '/nonexistent/x'), 'w').write('ran')\n"


@pytest.fixture
async def pool(workspace: Path) -> AsyncIterator[Pool]:
    async with Pool(workspace, config=marked_config(pool={"workers": 4})) as pool:
        yield pool


async def bash(pool: Pool, command: str, **kwargs: Any) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, timeout=30, **kwargs)
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    return outcome.value


# -- planted code -------------------------------------------------------------------------------


def _plant(directory: Path) -> None:
    """What a call could have written in a workspace that is also some caller's directory."""
    for package in ("sandbx_pool", "sandbx_pool/workers", "workers", "msgspec", "zmq"):
        (directory / package).mkdir(parents=True, exist_ok=True)
        (directory / package / "__init__.py").write_text(_PLANT)
    (directory / "sandbx_pool" / "workers" / "template.py").write_text(_PLANT)
    (directory / "workers" / "template.py").write_text(_PLANT)
    for module in ("sitecustomize.py", "usercustomize.py"):
        (directory / module).write_text(_PLANT)


_COORDINATOR = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[3])  # the caller imports the real package (its own business)
from sandbx_pool import Pool, Config

async def main() -> None:
    config = Config().override(env={"set": json.loads(sys.argv[2])})
    async with Pool(sys.argv[1], config=config) as pool:
        outcome = await pool.call("read", {"path": "a.txt"}, timeout=30)
        print(outcome.status)

asyncio.run(main())
"""


def test_template_runs_the_installed_code_only(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    _plant(planted)
    (planted / "a.txt").write_text("hello")
    mark = tmp_path / "mark"
    script = tmp_path / "coordinator.py"
    script.write_text(_COORDINATOR)
    import sandbx_pool

    real = str(Path(sandbx_pool.__file__).resolve().parent.parent)
    env = {**os.environ, "PLANT_MARK": str(mark)}
    marker = {k: v for k, v in os.environ.items() if k.startswith("SANDBX_TEST")}
    done = subprocess.run(
        [sys.executable, str(script), str(planted), json.dumps(marker), real],
        cwd=planted,  # the caller's directory is the workspace, full of planted code
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
    assert not mark.exists(), "a planted module ran"


def test_doctor_probes_run_the_installed_code_only(tmp_path: Path) -> None:
    _plant(tmp_path)
    mark = tmp_path / "mark"
    # The installed command: its sys.path starts with its own directory, not the cwd.
    command = Path(sys.executable).parent / "sandbx-pool"
    done = subprocess.run(
        [str(command), "doctor"],
        cwd=tmp_path,  # doctor's probe child used to import from here, as root
        env={**os.environ, "PLANT_MARK": str(mark)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    assert "probe failed" not in done.stdout
    assert not mark.exists(), "a planted module ran"
