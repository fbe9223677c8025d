"""``pool.call(..., view=V)``: a call that sees the directory V as its ``/`` (workers.view).

Commands and file tools alike: V's own directories read-write, the system read-only, nothing
else of the host (not even through a symlink), no capability even with ``keep_root``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from conftest import marked_config

from sandbx_pool import Pool, Status

pytestmark = pytest.mark.needs("mount namespaces")  # root, or user namespaces

SECRET = "a file of the host's"


@pytest.fixture
def view(tmp_path: Path) -> Path:
    """V with its own /tmp and /work; a host file beside it, in the workspace."""
    (tmp_path / "secret").write_text(SECRET)
    root = tmp_path / "v"
    (root / "work").mkdir(parents=True)
    (root / "tmp").mkdir(mode=0o1777)
    return root


@pytest_asyncio.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    # keep_root: a view's calls must be capless all the same.
    config = marked_config(pool={"workers": 2, "prefork": 0}, sandbox={"keep_root": True})
    async with Pool(tmp_path, config=config) as p:
        yield p


async def _bash(pool: Pool, view: Path, command: str) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, cwd="/work", view=str(view))
    assert outcome.status is Status.OK, outcome.error
    assert outcome.value is not None
    return outcome.value


async def test_commands_see_their_own_directories_and_the_system_read_only(
    pool: Pool, view: Path, tmp_path: Path
) -> None:
    value = await _bash(
        pool,
        view,
        "pwd; touch /work/w /tmp/t && echo wrote; ls /etc/passwd;"
        f"cat {tmp_path}/secret; touch /usr/x /x /etc/x; grep CapEff /proc/self/status",
    )
    assert value["stdout"].splitlines() == [
        "/work",
        "wrote",
        "/etc/passwd",
        "CapEff:\t0000000000000000",
    ]
    assert f"{tmp_path}/secret: No such file or directory" in value["stderr"]
    assert value["stderr"].count("Read-only file system") == 3
    assert sorted(os.listdir(view / "work")) == ["w"]
    assert sorted(os.listdir(view / "tmp")) == ["t"]


async def test_file_tools_see_the_paths_commands_see(pool: Pool, view: Path) -> None:
    await _bash(pool, view, "echo from-bash > /tmp/x; echo locked > /work/l; chmod -r /work/l")
    read = await pool.call("read", {"path": "/tmp/x"}, cwd="/work", view=str(view))
    assert read.value is not None
    assert read.value["content"] == "from-bash\n"
    wrote = await pool.call(
        "write", {"path": "y", "content": "from-tool"}, cwd="/work", view=str(view)
    )
    assert wrote.status is Status.OK
    assert (await _bash(pool, view, "cat /work/y"))["stdout"] == "from-tool"
    # A capless uid 0: the mode it set holds against its own file tools too.
    locked = await pool.call("read", {"path": "l"}, cwd="/work", view=str(view))
    assert (locked.status, locked.error_code) == (Status.ERROR, "EACCES")
    etc = await pool.call("write", {"path": "/etc/x", "content": ""}, cwd="/work", view=str(view))
    assert (etc.status, etc.error_code) == (Status.ERROR, "EROFS")


async def test_a_symlink_leads_a_file_tool_nowhere_outside_the_view(
    pool: Pool, view: Path, tmp_path: Path
) -> None:
    (view / "work" / "absolute").symlink_to(tmp_path / "secret")
    (view / "work" / "relative").symlink_to("../../secret")
    for link in ("absolute", "relative"):
        outcome = await pool.call("read", {"path": link}, cwd="/work", view=str(view))
        assert outcome.status is not Status.OK, link
        assert SECRET not in str(outcome.value)


@pytest.mark.parametrize("where", ["/etc", "relative", "workspace", "/.."])
async def test_a_view_must_be_inside_the_workspace(pool: Pool, tmp_path: Path, where: str) -> None:
    view = {"workspace": str(tmp_path), "/..": f"{tmp_path}/v/../.."}.get(where, where)
    outcome = await pool.call("bash", {"command": "true"}, view=view)
    assert (outcome.status, outcome.started) == (Status.DENIED, False)
