"""The mini-swe-agent environment, driven by the installed mini-swe-agent itself."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before mini-swe-agent is imported: its start-up banner would clutter the test output.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip("minisweagent", reason="needs the 'mini-swe-agent' extra")

from busybox_image import WORKDIR, pool_toml, write_busybox_image
from conftest import MARKER
from helpers import pids_with, tagged_sleep, unique_tag, wait_until_sync
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from sandbx_pool.integrations.mini_swe_agent import SUBMIT_SENTINEL, SandbxEnvironment
from sandbx_pool.runtime_dir import owner_of, owner_tag, runtime_root

DOTTED = "sandbx_pool.integrations.mini_swe_agent.SandbxEnvironment"


@pytest.fixture
def env(workspace: Path, tmp_path: Path) -> Iterator[SandbxEnvironment]:
    environment = get_environment(
        {
            "environment_class": DOTTED,
            "cwd": str(workspace),
            "timeout": 10,
            "journal": str(tmp_path / "journal.jsonl"),
            "env": {MARKER: os.environ[MARKER]},
        }
    )
    assert isinstance(environment, SandbxEnvironment)
    try:
        yield environment
    finally:
        environment.close()


def test_v2_runs_in_the_workspace_and_reports_output_and_returncode(
    env: SandbxEnvironment, workspace: Path
) -> None:
    result = env.execute({"command": "pwd; cat hello.txt; echo oops >&2; exit 3"})
    assert result == {
        "output": f"{workspace}\nhello\nworld\noops\n",
        "returncode": 3,
        "exception_info": "",
    }
    assert env.execute({"command": "pwd"}, cwd=str(workspace / "src"))["output"].strip() == str(
        workspace / "src"
    )


def test_v2_timeout_is_returned_and_kills_the_tree(env: SandbxEnvironment) -> None:
    tag = unique_tag()
    result = env.execute({"command": f"{tagged_sleep(tag)} & wait"}, timeout=1)
    assert result["returncode"] == -1
    assert "timed out after 1 seconds" in result["exception_info"]
    assert result["extra"]["exception_type"] == "TimeoutExpired"
    assert pids_with(tag) == []


def test_v2_sentinel_raises_submitted_with_the_rest_of_the_output(
    env: SandbxEnvironment,
) -> None:
    with pytest.raises(Submitted) as caught:
        env.execute({"command": f"echo {SUBMIT_SENTINEL}; echo the patch"})
    [message] = caught.value.messages
    assert message["extra"] == {"exit_status": "Submitted", "submission": "the patch\n"}
    # Not after a failing command: the model must see that it failed.
    failed = env.execute({"command": f"echo {SUBMIT_SENTINEL}; exit 1"})
    assert failed["returncode"] == 1


def test_v1_takes_a_string_and_raises_timeouts(env: SandbxEnvironment) -> None:
    assert env.execute("echo v1") == {"output": "v1\n", "returncode": 0}
    with pytest.raises(subprocess.TimeoutExpired):
        env.execute("sleep 30", timeout=1)
    # v1 leaves the sentinel to the agent.
    assert env.execute(f"echo {SUBMIT_SENTINEL}")["returncode"] == 0


def test_default_agent_runs_to_submission(env: SandbxEnvironment, workspace: Path) -> None:
    model = DeterministicModel(
        outputs=[
            make_output("write it", [{"command": "echo fixed > answer.txt"}]),
            make_output("submit", [{"command": f"echo {SUBMIT_SENTINEL}; cat answer.txt"}]),
        ]
    )
    agent = DefaultAgent(
        model, env, system_template="You run commands.", instance_template="{{task}}"
    )
    result = agent.run("fix it")
    assert result["exit_status"] == "Submitted"
    assert result["submission"] == "fixed\n"
    assert (workspace / "answer.txt").read_text() == "fixed\n"


def test_close_leaves_nothing_and_is_idempotent(workspace: Path) -> None:
    environment = SandbxEnvironment(cwd=str(workspace), env={MARKER: os.environ[MARKER]})
    environment.close()
    environment.close()
    assert not environment._thread.is_alive()


def _children() -> set[int]:
    """This test process's live children (the pool's template among them, while it runs)."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found.update(int(pid) for pid in f.read().split())
    return {pid for pid in found if os.path.exists(f"/proc/{pid}")}


def _our_temp_dirs() -> set[str]:
    """What this process's pools made under the runtime root and the temp directory (their
    TMPDIR and lock directories are named after their owner, their socket directories say it
    in a file)."""
    return {
        path
        for root in (runtime_root(), tempfile.gettempdir())
        for path in (os.path.join(root, name) for name in os.listdir(root))
        if owner_tag() in os.path.basename(path) or owner_of(path) == owner_tag()
    }


def _run_one_and_drop(workspace: Path, tmp_path: Path, drop: str) -> None:
    environment: list[SandbxEnvironment] = [make_env(workspace, tmp_path)]
    assert environment[0].execute({"command": "echo hi"})["output"] == "hi\n"
    assert _children()  # the pool's template
    if drop == "main thread":
        environment.clear()
        return
    # The last reference dropped on another thread: the collector's finalizer runs there.
    dropper = threading.Thread(target=environment.clear, name="dropper")
    dropper.start()
    dropper.join()


@pytest.mark.parametrize("drop", ["main thread", "another thread"])
def test_a_dropped_environment_leaves_nothing_once_collected(
    workspace: Path, tmp_path: Path, drop: str
) -> None:
    threads, children, temp_dirs = set(threading.enumerate()), _children(), _our_temp_dirs()
    _run_one_and_drop(workspace, tmp_path, drop)
    gc.collect()
    wait_until_sync(
        lambda: set(threading.enumerate()) == threads,
        within_s=10,
        what=f"the environment's threads gone ({threading.enumerate()})",
    )
    wait_until_sync(lambda: _children() == children, what="the pool's processes gone")
    wait_until_sync(lambda: _our_temp_dirs() == temp_dirs, what="the pool's directories gone")


_NEVER_CLOSED = """
import json, os, sys, tempfile
from sandbx_pool.integrations.mini_swe_agent import SandbxEnvironment
from sandbx_pool.runtime_dir import owner_of, owner_tag, runtime_root
environment = SandbxEnvironment(cwd=sys.argv[1], journal=sys.argv[2], env=json.loads(sys.argv[3]))
assert environment.execute({"command": "echo hi"})["output"] == "hi\\n"
roots = (runtime_root(), tempfile.gettempdir())
paths = [os.path.join(r, n) for r in roots for n in os.listdir(r)]
print(json.dumps([p for p in paths if owner_tag() in p or owner_of(p) == owner_tag()]))
"""


def test_an_environment_never_closed_is_released_at_exit(workspace: Path, tmp_path: Path) -> None:
    # Held to the end: the exit, not the collector, releases it, and without an error.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _NEVER_CLOSED,
            str(workspace),
            str(tmp_path / "journal.jsonl"),
            json.dumps({MARKER: os.environ[MARKER]}),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "MSWEA_SILENT_STARTUP": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    made = json.loads(done.stdout)
    assert made  # its socket, TMPDIR and lock directories
    assert not [path for path in made if os.path.exists(path)]


def test_output_is_merged_in_order_and_kept_past_a_timeout(env: SandbxEnvironment) -> None:
    # As LocalEnvironment: stderr into stdout, in the order written...
    assert env.execute({"command": "echo a; echo b >&2; echo c"})["output"] == "a\nb\nc\n"
    # ...and what a command printed before it hung is what tells the model why.
    timed_out = env.execute({"command": "echo partial; sleep 100"}, timeout=1)
    assert timed_out["returncode"] == -1
    assert timed_out["output"] == "partial\n"
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        env.execute("echo partial-v1; sleep 100", timeout=1)
    assert caught.value.output == "partial-v1\n"


def test_a_large_output_keeps_head_and_tail(env: SandbxEnvironment) -> None:
    result = env.execute({"command": "seq 1 3000000"})
    assert result["returncode"] == 0
    assert result["output"].startswith("1\n2\n")
    assert result["output"].endswith("2999999\n3000000\n")
    assert "bytes omitted ...]" in result["output"]


# -- LocalEnvironment's semantics, where the sandbox allows them ----------------------------------


def make_env(workspace: Path, tmp_path: Path, **options: object) -> SandbxEnvironment:
    return SandbxEnvironment(
        workspace=str(workspace),
        journal=str(tmp_path / "journal.jsonl"),
        env={MARKER: os.environ[MARKER]},
        **options,
    )


def test_the_callers_environment_passes_only_when_asked(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBX_CALLERS_SECRET", "s3cret")
    command = {"command": 'echo "[$SANDBX_CALLERS_SECRET]"'}
    with make_env(workspace, tmp_path) as scrubbed:
        assert scrubbed.execute(command)["output"] == "[]\n"
        assert "SANDBX_CALLERS_SECRET" not in scrubbed.get_template_vars()
    with make_env(workspace, tmp_path, pass_env=True) as passing:
        assert passing.execute(command)["output"] == "[s3cret]\n"
        assert passing.get_template_vars()["SANDBX_CALLERS_SECRET"] == "s3cret"


def test_cwd_is_chosen_as_the_local_environment_does(
    workspace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workspace / "src" / "deep").mkdir()
    monkeypatch.chdir(workspace / "src")
    with make_env(workspace, tmp_path) as env:
        # No cwd anywhere: the current directory, not the workspace's root.
        assert env.execute({"command": "pwd"})["output"] == f"{workspace / 'src'}\n"
        # A relative cwd: from the current directory, as subprocess takes it.
        assert env.execute({"command": "pwd"}, cwd="deep")["output"] == (
            f"{workspace / 'src' / 'deep'}\n"
        )
        # Outside the workspace: refused, and said so.
        outside = env.execute({"command": "pwd"}, cwd=str(tmp_path))
    assert outside["returncode"] == -1
    assert "denied" in outside["exception_info"]


def test_a_transactional_environment_keeps_a_timed_out_commands_writes_out(
    workspace: Path, tmp_path: Path
) -> None:
    environment = get_environment(
        {
            "environment_class": DOTTED,
            "cwd": str(workspace),
            "journal": str(tmp_path / "journal.jsonl"),
            "env": {MARKER: os.environ[MARKER]},
            "changes": "transactional",
        }
    )
    try:
        result = environment.execute({"command": "echo half > hello.txt; sleep 100"}, timeout=1)
        assert result["returncode"] == -1
        assert (workspace / "hello.txt").read_text() == "hello\nworld\n"
        assert environment.execute({"command": "echo done > done.txt"})["returncode"] == 0
        assert (workspace / "done.txt").read_text() == "done\n"
    finally:
        environment.close()


# -- shell sessions (sandbx_pool.sessions) -------------------------------------------------------


def test_without_a_session_each_command_starts_afresh(workspace: Path, tmp_path: Path) -> None:
    with make_env(workspace, tmp_path, cwd=str(workspace)) as env:
        env.execute({"command": "cd src; export X=1"})
        assert env.execute({"command": 'pwd; echo "${X-unset}"'})["output"] == (
            f"{workspace}\nunset\n"
        )


def test_a_session_keeps_cd_and_exports_and_a_new_environment_restores_it(
    workspace: Path, tmp_path: Path
) -> None:
    options: dict[str, object] = {"cwd": str(workspace), "session": "episode-1"}
    with make_env(workspace, tmp_path, **options) as env:
        env.execute({"command": "cd src && export X=1"})
        assert env.execute({"command": 'pwd; echo "$X"'})["output"] == f"{workspace / 'src'}\n1\n"
        # A cwd given to execute() moves the session, as a cd would.
        assert env.execute({"command": "pwd"}, cwd=str(workspace))["output"] == f"{workspace}\n"
        env.execute({"command": "cd src"})
    # Same journal, same id: the next environment goes on where this one stopped.
    with make_env(workspace, tmp_path, **options) as again:
        assert again.execute({"command": 'pwd; echo "$X"'})["output"] == (
            f"{workspace / 'src'}\n1\n"
        )


def test_session_true_gives_each_environment_its_own(workspace: Path, tmp_path: Path) -> None:
    with make_env(workspace, tmp_path, cwd=str(workspace), session=True) as one:
        one.execute({"command": "export WHO=one"})
        assert one.execute({"command": 'echo "$WHO"'})["output"] == "one\n"
        assert one.session is not None
    with make_env(workspace, tmp_path, cwd=str(workspace), session=True) as two:
        assert two.session != one.session
        assert two.execute({"command": 'echo "${WHO-none}"'})["output"] == "none\n"


def test_a_bad_session_id_is_refused_at_construction(workspace: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad session id"):
        make_env(workspace, tmp_path, session="a b")


# -- image= : DockerEnvironment's fields, one layer over the image per environment --------------


def _image_env(tmp_path: Path, ref: str, **options: object) -> SandbxEnvironment:
    environment = get_environment(
        {
            "environment_class": DOTTED,
            "image": ref,
            "timeout": 10,
            "pool_config": pool_toml(tmp_path),
            "journal": str(tmp_path / f"journal-{unique_tag()}.jsonl"),
            **options,
        }
    )
    assert isinstance(environment, SandbxEnvironment)
    return environment


def _layers(tmp_path: Path) -> list[str]:
    store = tmp_path / "layers"
    return sorted(os.listdir(store)) if store.exists() else []


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_an_image_environment_runs_in_its_own_layer_removed_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = write_busybox_image(tmp_path / "layout")
    monkeypatch.setenv("FORWARDED", "from-host")
    monkeypatch.setenv("NOT_FORWARDED", "secret")
    one = _image_env(tmp_path, ref, env={"OWN": "set"}, forward_env=["FORWARDED", "ABSENT"])
    two = _image_env(tmp_path, ref)
    try:
        assert len(_layers(tmp_path)) == 2  # one each
        result = one.execute(
            {
                "command": "pwd; cat README; cat /etc/os-release; echo $IMAGE_VAR $OWN $FORWARDED;"
                " echo ${NOT_FORWARDED:-unset} ${ABSENT:-unset}; readlink /proc/$$/exe"
            }
        )
        assert result["returncode"] == 0, result
        assert result["output"].splitlines() == [
            WORKDIR,  # the image's WorkingDir, no cwd given
            "from the image",
            "NAME=busybox-image",  # the image's /etc, not the host's
            "from-image set from-host",
            "unset unset",
            "/bin/busybox",
        ]
        assert one.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        # Writes stay in the environment's layer: the other sees the image as it is.
        assert (
            one.execute({"command": "echo mine > /srv/work/new; echo x >> README"})["returncode"]
            == 0
        )
        assert one.execute({"command": "cat new README"})["output"] == ("mine\nfrom the image\nx\n")
        seen = two.execute({"command": "ls /srv/work; cat README"})
        assert seen["output"] == "README\nfrom the image\n"
        timed_out = one.execute({"command": "sleep 30"}, timeout=1)
        assert timed_out["returncode"] == -1
        assert timed_out["extra"]["exception_type"] == "TimeoutExpired"
        with pytest.raises(Submitted):
            one.execute({"command": f"echo {SUBMIT_SENTINEL}; cat new"})
    finally:
        one.close()
        two.close()
    assert _layers(tmp_path) == []
    # The image stays in the store for the next environment: pulled once.
    assert not os.path.exists(WORKDIR)  # a path of the image's only
    again = _image_env(tmp_path, ref, cwd=WORKDIR)
    try:
        assert again.execute({"command": "pwd; ls"})["output"] == f"{WORKDIR}\nREADME\n"
    finally:
        again.close()
    assert _layers(tmp_path) == []


@pytest.mark.needs("overlayfs layers (pool.layer)")
def test_the_default_agent_submits_from_an_image(tmp_path: Path) -> None:
    ref = write_busybox_image(tmp_path / "layout")
    model = DeterministicModel(
        outputs=[
            make_output("write it", [{"command": "echo fixed > answer.txt"}]),
            make_output("submit", [{"command": f"echo {SUBMIT_SENTINEL}; cat answer.txt"}]),
        ]
    )
    with _image_env(tmp_path, ref, session=True) as env:
        agent = DefaultAgent(
            model, env, system_template="You run commands.", instance_template="{{task}}"
        )
        result = agent.run("fix it")
    assert result["exit_status"] == "Submitted"
    assert result["submission"] == "fixed\n"
    assert _layers(tmp_path) == []


def test_an_image_that_cannot_be_had_is_one_clear_error_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    with pytest.raises(Exception, match="no-such-layout"):
        _image_env(tmp_path, f"oci:{tmp_path / 'no-such-layout'}:v1")
    with pytest.raises(ValueError, match="reference"):
        _image_env(tmp_path, "Not A Ref")
    with pytest.raises(ValueError, match="forward_env"):
        SandbxEnvironment(image="oci:/x:v1", pass_env=True)
    assert _layers(tmp_path) == []
    # Each failed start stopped its loop's thread (and the pool's template: the conftest
    # fixture sees no process left).
    assert not [t for t in threading.enumerate() if t.name == "sandbx-mini-swe-agent"]
