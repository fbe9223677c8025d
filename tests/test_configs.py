"""The shipped config files: loadable, complete, equal to the defaults where they say so."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec
import pytest

from sandbx_pool.cli.batch import effective_config
from sandbx_pool.cli.main import build_parser
from sandbx_pool.config import Config, JournalPolicy, load_config
from sandbx_pool.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT = CONFIGS / "default.toml"
BATCH_EVAL = CONFIGS / "batch-eval.toml"


def sections(text: str) -> dict[str, str]:
    """The text under each ``[section]`` header (``[[x.y]]`` examples stay in their section)."""
    found: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        header = re.match(r"^\[(\w+)\]\s*$", line)
        if header:
            current = header.group(1)
            found[current] = ""
        elif current:
            found[current] += line + "\n"
    return found


def test_default_toml_is_exactly_the_defaults() -> None:
    assert load_config(DEFAULT) == Config()


def test_default_toml_documents_every_setting() -> None:
    text = DEFAULT.read_text()
    blocks = sections(text)
    for section in msgspec.structs.fields(Config):
        assert section.name in blocks, f"[{section.name}] is missing from {DEFAULT.name}"
        block = blocks[section.name]
        settings = msgspec.structs.fields(section.type)
        for setting in settings:
            # Set, or commented out when its default is "none" (TOML has no null).
            pattern = rf"^#?\s*{setting.name}\s*="
            assert re.search(pattern, block, re.MULTILINE), (
                f"{section.name}.{setting.name} is not documented in {DEFAULT.name}"
            )
        # Each setting is explained by a comment, not just listed.
        assert block.count("#") >= len(settings)


def test_default_toml_commented_keys_are_valid_when_uncommented() -> None:
    # The examples users uncomment must load: same keys, right types.
    text = DEFAULT.read_text()
    uncommented = re.sub(r"^# (\w+ = .*?)([ \t]+#.*)?$", r"\1", text, flags=re.MULTILINE)
    uncommented = uncommented.replace("rules = []\n", "")
    uncommented = re.sub(r"^# (\[\[gate\.rules\]\])$", r"\1", uncommented, flags=re.MULTILINE)
    config = msgspec.convert(tomllib.loads(uncommented), Config)
    assert config.pool.workers is not None
    assert config.limits.cpu_s is not None
    assert [rule.action for rule in config.gate.rules] == ["deny", "deny"]


def test_batch_eval_is_tuned_for_unattended_runs() -> None:
    config = load_config(BATCH_EVAL)
    # Nothing may hang a run forever or flood it.
    assert config.calls.timeout_s is not None
    assert config.limits.address_space_mb is not None
    assert config.limits.file_size_mb is not None
    # What --resume and in-doubt reporting rely on is still journaled durably.
    assert config.journal.policy is JournalPolicy.SIDE_EFFECTS
    assert config.pool.workers is not None


@pytest.mark.parametrize(
    ("content", "key"),
    [
        ("[pool]\nworkerz = 3\n", "workerz"),
        ("[calls]\ntimeout_s = 'soon'\n", "calls.timeout_s"),
        ("[journal]\npolicy = 'sometimes'\n", "journal.policy"),
        ("[pool]\nworkers = 0\n", "pool.workers"),
        # Beyond what a frame carries back, or a worker's setrlimit takes.
        ("[calls]\nkeep_output_bytes = 41943040\n", "calls.keep_output_bytes"),
        ("[limits]\ncpu_s = 99999999999999999999999\n", "limits.cpu_s"),
        ("[limits]\naddress_space_mb = 9223372036854775807\n", "limits.address_space_mb"),
    ],
)
def test_a_bad_key_or_value_names_the_key_and_the_file(
    tmp_path: Path, content: str, key: str
) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(content)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(path) in str(caught.value)
    assert key in str(caught.value)


def test_command_line_flags_override_the_file() -> None:
    parser = build_parser()
    args = parser.parse_args(["run", "calls.jsonl", "--config", str(BATCH_EVAL), "--parallel", "3"])
    config = effective_config(args)
    assert config.pool.workers == 3
    assert config.workers() == 3
    # Everything the flags do not touch comes from the file.
    assert config.calls.timeout_s == load_config(BATCH_EVAL).calls.timeout_s

    # A flag not given leaves the file's value.
    args = parser.parse_args(["run", "calls.jsonl", "--config", str(BATCH_EVAL)])
    assert effective_config(args).pool.workers == load_config(BATCH_EVAL).pool.workers

    # No file: the defaults, still overridden by the flags.
    args = parser.parse_args(["run", "calls.jsonl", "--parallel", "2"])
    assert effective_config(args) == Config().override(pool={"workers": 2})
