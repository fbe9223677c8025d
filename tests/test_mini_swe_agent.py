"""The mini-swe-agent environment, driven by the installed mini-swe-agent itself."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before mini-swe-agent is imported: its start-up banner would clutter the test output.
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip("minisweagent", reason="needs the 'mini-swe-agent' extra")

from conftest import MARKER
from helpers import pids_with, tagged_sleep, unique_tag
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments import get_environment
from minisweagent.exceptions import Submitted
from minisweagent.models.test_models import DeterministicModel, make_output

from sandbx_pool.integrations.mini_swe_agent import SUBMIT_SENTINEL, SandbxEnvironment

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
