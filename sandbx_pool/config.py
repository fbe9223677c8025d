"""Settings: TOML files validated by msgspec, every key with a default.

``configs/default.toml`` documents each key. An unknown key or a wrong type is a ConfigError
naming the key and the file. Command-line flags override the file (``Config.override``).
"""

from __future__ import annotations

import contextlib
import enum
import os
import pwd
import re
import tomllib
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from sandbx_pool import allow_list
from sandbx_pool.errors import ConfigError
from sandbx_pool.workers.hooks_path import TOKEN as HOOKS_PATH
from sandbx_pool.workers.protocol import MAX_MESSAGE_BYTES, Limits, Sandbox

MiB = 1024 * 1024
GiB = 1024 * MiB

#: The widest integer the protocol carries to a worker (msgpack int64, setrlimit's rlim_t).
MAX_INT = 2**63 - 1

#: A Result must fit in one frame: the worker answers ``output_limit`` past max_output_bytes
#: plus 4 KiB of envelope (workers/runtime.py), so a larger setting could only crash calls.
MAX_OUTPUT_BYTES = MAX_MESSAGE_BYTES - 64 * 1024


class JournalPolicy(enum.StrEnum):
    ALWAYS = "always"  # fsync every record before the call goes on
    SIDE_EFFECTS = (
        "side-effects"  # fsync intents of write/edit/bash before dispatch; batch the rest
    )
    BATCH = "batch"  # group-commit everything within group_commit_ms
    OFF = "off"  # write, never fsync (the OS flushes when it likes)


class ChangeMode(enum.StrEnum):
    """What a call may do to the workspace (sandbx_pool.changes)."""

    DIRECT = "direct"  # its writes land as it makes them; nothing is listed
    TRACKED = "tracked"  # the same, through an overlay: the outcome lists what it changed
    TRANSACTIONAL = "transactional"  # its changes land only if it ends ok, without conflict


def change_mode(value: object) -> ChangeMode:
    """``value`` as a ChangeMode; a ValueError naming the three otherwise."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return ChangeMode(value)
    names = ", ".join(repr(str(mode)) for mode in ChangeMode)
    raise ValueError(f"changes must be one of {names}, not {value!r}")


class _Section(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


class WorkspaceSettings(_Section):
    #: direct, tracked or transactional (ChangeMode); a call may choose its own.
    changes: str = "direct"
    #: The layer store (sandbx_pool.layers): "" is the per-user default, layers_dir().
    layers: str = ""
    #: A tracked or transactional call's change set past either is not applied (the call
    #: ends error, CHANGE_SET_TOO_LARGE): the paths it lists, the bytes of files it writes.
    max_change_paths: Annotated[int, Meta(ge=1)] = 100_000
    max_change_bytes: Annotated[int, Meta(ge=1)] = 4 * GiB

    def layers_dir(self) -> str:
        """Where the pool's layers live: ``layers``, or $XDG_DATA_HOME/sandbx-pool/layers
        (~/.local/share/sandbx-pool/layers): kept across pools and reboots, the user's own."""
        if self.layers:
            return os.path.abspath(os.path.expanduser(self.layers))
        data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        return os.path.join(os.path.abspath(data), "sandbx-pool", "layers")

    def __post_init__(self) -> None:
        try:
            change_mode(self.changes)
        except ValueError as exc:
            raise ValueError(f"changes: {str(exc).removeprefix('changes ')}") from None


class PoolSettings(_Section):
    workers: Annotated[int, Meta(ge=1)] | None = None
    prefork: Annotated[int, Meta(ge=0)] | None = None
    close_timeout_s: Annotated[float, Meta(gt=0)] = 5.0
    #: The template rehearses a worker's path, makes its objects immortal and prebuilds the file
    #: tools' Landlock rules before its first fork, and each worker rehearses its call while
    #: idle (less CPU and memory per call, about 0.2 s more at start); the one-shot ``call``
    #: command turns it off.
    warm_up: bool = True


class CallSettings(_Section):
    timeout_s: Annotated[float, Meta(gt=0)] | None = None
    # A flood's kill threshold; no more than keep_output_bytes of each stream is ever kept.
    max_output_bytes: Annotated[int, Meta(ge=1024, le=MAX_INT)] = 128 * MiB
    keep_output_bytes: Annotated[int, Meta(ge=1024, le=MAX_OUTPUT_BYTES)] = 1 * MiB
    grace_s: Annotated[float, Meta(ge=0)] = 1.0
    kill_wait_s: Annotated[float, Meta(gt=0)] = 0.5

    def __post_init__(self) -> None:
        # What bash keeps of stdout and of stderr travels in one Result frame, and a command
        # is killed once both together pass max_output_bytes: the smaller bound must fit.
        if min(2 * self.keep_output_bytes, self.max_output_bytes) > MAX_OUTPUT_BYTES:
            raise ValueError(
                f"keep_output_bytes: two streams of {self.keep_output_bytes} bytes do not fit"
                f" in one {MAX_OUTPUT_BYTES}-byte result (lower it, or max_output_bytes)"
            )


class JournalSettings(_Section):
    policy: JournalPolicy = JournalPolicy.SIDE_EFFECTS
    group_commit_ms: Annotated[float, Meta(ge=0)] = 5.0
    summarize_over_bytes: Annotated[int, Meta(ge=64)] = 4096
    #: Journals at the default location (no path given) older than this many days are pruned.
    default_keep_days: Annotated[float, Meta(gt=0)] = 7.0
    #: ...and the oldest of them beyond this many.
    default_keep_count: Annotated[int, Meta(ge=1)] = 100


class TelemetrySettings(_Section):
    """OpenTelemetry (sandbx_pool.telemetry): off unless ``otlp_endpoint`` is set."""

    #: The collector's base URL, ``http://host:4318``: spans go to ``<it>/v1/traces``.
    otlp_endpoint: str | None = None
    #: One export's deadline; a dead collector costs spans, never a call's time.
    export_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 2.0
    #: The ``service.name`` of every span.
    service_name: Annotated[str, Meta(min_length=1)] = "sandbx-pool"

    def __post_init__(self) -> None:
        if self.otlp_endpoint is None:
            return
        parsed = urlsplit(self.otlp_endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(
                f"otlp_endpoint: {self.otlp_endpoint!r} is not an http(s)://host:port URL"
            )
        try:
            parsed.port  # noqa: B018 (it raises for a port out of range or not a number)
        except ValueError:
            raise ValueError(f"otlp_endpoint: {self.otlp_endpoint!r}: not a valid port") from None
        if parsed.query or parsed.fragment:
            raise ValueError(
                f"otlp_endpoint: {self.otlp_endpoint!r}: a base URL, without ? or #"
                " (/v1/traces is appended)"
            )


class EnvSettings(_Section):
    allow: list[str] = msgspec.field(default_factory=lambda: ["PATH", "HOME", "LANG", "TERM"])
    set: dict[str, str] = msgspec.field(default_factory=dict)

    def for_call(self, env: dict[str, str] | None) -> dict[str, str]:
        """A call's scrubbed environment: the allowlist from ours, ``set``, then the call's."""
        ours = {name: os.environ.get(name) for name in self.allow}
        scrubbed = {name: value for name, value in ours.items() if value is not None}
        scrubbed.setdefault("PATH", os.defpath)
        scrubbed.update(self.set)
        if env:
            scrubbed.update(env)
        return scrubbed


class LimitSettings(_Section):
    # In MiB here, in bytes on the wire: the byte count must still fit in 63 bits.
    address_space_mb: Annotated[int, Meta(ge=16, le=MAX_INT // MiB)] | None = None
    cpu_s: Annotated[int, Meta(ge=1)] | None = None
    open_files: Annotated[int, Meta(ge=16)] | None = None
    file_size_mb: Annotated[int, Meta(ge=1, le=MAX_INT // MiB)] | None = None
    #: Processes and threads one call may have at once (a pids cgroup per worker); 0: none.
    processes: Annotated[int, Meta(ge=0, le=MAX_INT)] = 1024
    #: Memory one call's whole process tree may hold: its memory cgroup's limit (the call ends
    #: crashed, limit "memory", when the kernel kills for it), else RLIMIT_DATA in each
    #: process (``sandbx-pool doctor`` says which). None: no limit.
    memory_mb: Annotated[int, Meta(ge=16, le=MAX_INT // MiB)] | None = None

    def for_workers(self) -> Limits:
        """What each Call carries unless the call brings its own limits: bytes, not MiB."""
        return Limits(
            address_space_bytes=_mib(self.address_space_mb),
            cpu_seconds=self.cpu_s,
            open_files=self.open_files,
            file_size_bytes=_mib(self.file_size_mb),
            processes=self.processes or None,
            memory_bytes=_mib(self.memory_mb),
        )


def _mib(value: int | None) -> int | None:
    return None if value is None else value * 1024 * 1024


class GateRule(_Section):
    """One approval rule; the first rule that matches a call decides."""

    action: Annotated[str, Meta(pattern="^(allow|deny)$")]
    tool: str = "*"
    path: str | None = None
    command: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        # Found when the config is loaded, naming the rule, not at the first bash call it meets.
        if self.command is not None:
            try:
                re.compile(self.command)
            except re.error as exc:
                named = f" in rule {self.name!r}" if self.name else ""
                raise ValueError(f"invalid command regex {self.command!r}{named}: {exc}") from None


class GateSettings(_Section):
    rules: list[GateRule] = msgspec.field(default_factory=list)


class SandboxFilesystem(enum.StrEnum):
    WORKSPACE = "workspace"  # Landlock: workspace, TMPDIR, `writable` rw; system dirs ro
    HOST = "host"  # no filesystem rules (the file tools' own path checks remain)


AbsolutePath = Annotated[str, Meta(pattern="^/")]

#: What a call may not change unless the config says otherwise: a git hook or a git config
#: (core.hooksPath, core.fsmonitor, aliases...) planted in the workspace runs at the user's next
#: git command, outside any sandbox; so does a ``.git/commondir``, which makes git take its
#: config and hooks from whatever directory it names; so does a hook in the directory
#: ``core.hooksPath`` names (``{core.hooksPath}``, read by the worker at each call:
#: workers.hooks_path), a husky hook and a pre-commit configuration's local hook.
DEFAULT_PROTECTED = (
    ".git/hooks/**",
    ".git/config",
    ".git/commondir",
    HOOKS_PATH,
    ".husky/**",
    ".pre-commit-config.yaml",
)


class SandboxSettings(_Section):
    """How each worker confines the call it runs (workers/sandbox.py)."""

    filesystem: SandboxFilesystem = SandboxFilesystem.WORKSPACE
    read_only: list[AbsolutePath] = msgspec.field(default_factory=list)
    writable: list[AbsolutePath] = msgspec.field(default_factory=list)
    #: true: the host's network; false: none (a network namespace of the call's own, or
    #: Landlock's TCP rules); a list of host patterns: only those, through the pool's proxy
    #: (sandbx_pool.allow_list, sandbx_pool.proxy).
    network: bool | list[str] = True
    #: Names the proxy resolves itself, to these addresses (a local mirror; no DNS asked).
    network_hosts: dict[str, str] = msgspec.field(default_factory=dict)
    run_as: str | None = None
    #: Globs relative to the workspace that no call may change (an empty list: none).
    protected: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_PROTECTED))
    #: Size of each call's private TMPDIR, in MiB.
    tmp_size_mb: Annotated[int, Meta(ge=1, le=1 << 20)] = 512
    #: Commands and file tools keep a container's default capabilities, commands see root's
    #: secrets (not by default: all are capless, so file modes hold against them).
    keep_root: bool = False
    #: A pool without root makes each worker in a user namespace of its own, where the kernel
    #: allows (workers.containment.UserNamespaces); false: never, the fallbacks instead.
    user_namespaces: bool = True

    def __post_init__(self) -> None:
        # Checked (and made canonical) when the config is loaded, naming the bad pattern.
        network = allow_list.parse_network(self.network)
        self.network = network if isinstance(network, bool) else list(network)
        self.network_hosts = allow_list.parse_hosts(self.network_hosts)

    def user(self) -> tuple[int, int, tuple[int, ...]] | None:
        """``run_as`` as (uid, gid, groups); a ConfigError if unknown or if we are not root."""
        if self.run_as is None:
            return None
        try:
            entry = pwd.getpwnam(self.run_as)
        except KeyError:
            raise ConfigError(f"sandbox.run_as: unknown user {self.run_as!r}") from None
        if os.geteuid() != 0:
            raise ConfigError(f"sandbox.run_as = {self.run_as!r} needs the pool to run as root")
        groups = tuple(os.getgrouplist(self.run_as, entry.pw_gid))
        return entry.pw_uid, entry.pw_gid, groups

    def for_workers(self, *, tmp_root: str | None, hidden: tuple[str, ...]) -> Sandbox:
        """What each Call carries: these settings, plus where TMPDIRs go and what to hide."""
        user = self.user()
        return Sandbox(
            filesystem=self.filesystem.value,
            read_only=tuple(self.read_only),
            writable=tuple(self.writable),
            network=self.network is not False,
            network_allow=None if isinstance(self.network, bool) else tuple(self.network),
            tmp_root=tmp_root,
            hidden=hidden,
            uid=user[0] if user else None,
            gid=user[1] if user else None,
            groups=user[2] if user else (),
            protected=tuple(self.protected),
            tmp_size_mb=self.tmp_size_mb,
            keep_root=self.keep_root,
        )


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def parse_size(value: object) -> int:
    """Bytes from an integer or ``"20G"``/``"512MiB"``/``"1.5T"`` (powers of 1024); ValueError
    naming the value otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_INT:
        return value
    match = _SIZE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a size (bytes, or a number with K, M, G or T)")
    scale = 1024 ** " KMGT".index(match[2].upper() or " ")
    return min(int(float(match[1]) * scale), MAX_INT)


class ImageSettings(_Section):
    """Container images (sandbx_pool.images): where they are stored, how large the store may
    grow, which registries are reached without TLS verification."""

    #: The image store: "" is $XDG_DATA_HOME/sandbx-pool/images (~/.local/share/...).
    store: str = ""
    #: Past this (bytes, or "20G"), the least recently used images' layers are evicted after a
    #: pull; never those of an image a layer uses. None: never.
    max_size: int | str | None = None
    #: ``HOST:PORT`` of registries pulled from over plain HTTP or an untrusted certificate.
    insecure: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_size is not None:
            try:
                self.max_size = parse_size(self.max_size)
            except ValueError as exc:
                raise ValueError(f"max_size: {exc}") from None

    def store_dir(self) -> str:
        if self.store:
            return os.path.abspath(os.path.expanduser(self.store))
        data = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
        return os.path.join(os.path.abspath(data), "sandbx-pool", "images")

    def max_bytes(self) -> int | None:
        return None if self.max_size is None else parse_size(self.max_size)


class Config(_Section):
    pool: PoolSettings = msgspec.field(default_factory=PoolSettings)
    calls: CallSettings = msgspec.field(default_factory=CallSettings)
    journal: JournalSettings = msgspec.field(default_factory=JournalSettings)
    env: EnvSettings = msgspec.field(default_factory=EnvSettings)
    limits: LimitSettings = msgspec.field(default_factory=LimitSettings)
    gate: GateSettings = msgspec.field(default_factory=GateSettings)
    sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)
    workspace: WorkspaceSettings = msgspec.field(default_factory=WorkspaceSettings)
    telemetry: TelemetrySettings = msgspec.field(default_factory=TelemetrySettings)
    images: ImageSettings = msgspec.field(default_factory=ImageSettings)

    def workers(self) -> int:
        if self.pool.workers is not None:
            return self.pool.workers
        return max(4, 2 * (os.cpu_count() or 1))

    def override(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys replaced: ``config.override(pool={"workers": 8})``."""
        data = msgspec.to_builtins(self)
        for section, values in sections.items():
            data[section].update({k: v for k, v in values.items() if v is not None})
        return _convert(data, "<override>")


def _too_wide(data: Any, key: str = "") -> str | None:
    """The first key holding an integer the protocol cannot carry, if any (TOML's are 64-bit
    signed already; an override or a dict given in Python is not bounded at all)."""
    if isinstance(data, dict):
        for name, value in data.items():
            found = _too_wide(value, f"{key}.{name}" if key else str(name))
            if found is not None:
                return found
    elif isinstance(data, list):
        for index, value in enumerate(data):
            found = _too_wide(value, f"{key}[{index}]")
            if found is not None:
                return found
    elif isinstance(data, int) and not isinstance(data, bool) and abs(data) > MAX_INT:
        return key
    return None


def _convert(data: Any, source: str) -> Config:
    wide = _too_wide(data)
    if wide is not None:
        raise ConfigError(f"{source}: {wide}: an integer beyond 2**63-1")
    try:
        return msgspec.convert(data, Config)
    except msgspec.ValidationError as exc:
        message = str(exc)
        match = re.search(r" - at `\$\.(.+)`$", message)
        if match:
            key = match.group(1)
            message = message[: match.start()]
            # A section's own check (__post_init__) names its key first: "key: why".
            if field := re.match(r"([a-z_]+): ", message):
                key, message = f"{key}.{field.group(1)}", message[field.end() :]
            raise ConfigError(f"{source}: {key}: {message}") from None
        raise ConfigError(f"{source}: {message}") from None


def load_config(path: str | os.PathLike[str] | None) -> Config:
    """Read a TOML file into a Config; None gives the defaults."""
    if path is None:
        return Config()
    source = os.fspath(path)
    try:
        with open(source, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 (byte {exc.start + 1})") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    return _convert(data, source)
