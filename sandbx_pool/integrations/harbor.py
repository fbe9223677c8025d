"""A Harbor environment whose trials are layers over their task's image, every command a call.

    harbor run -p TASKS -a oracle -n 4 -e sandbx_pool.integrations.harbor:SandbxEnvironment \\
        --ek config=pool.toml --ek workers=8

    start(force_build)
      the task's docker_image (any reference pool.image takes), or
      environment/Dockerfile built by buildah (harbor_build: cached by the context's hash)
        --> pool.image(ref): pulled into the pool's image store once
        --> pool.layer(<session>, image=...): this trial's layer, the image as its /
    exec(command, cwd, env, timeout_sec, user)  --> pool.call("bash", workspace=layer,
        network=<the trial's policy>, on_output=<Harbor's callbacks>): one worker per command
    upload_file/dir    --> a tar on the call's stdin, unpacked by the image's tar
    download_file      --> the read tool (bytes), no program of the image's
    download_dir       --> the image's tar, its stdout base64 (a call's output is text)
    stop(delete)       --> the layer removed (kept with --no-delete), the pool closed

One pool per trial, in the trial's process (Harbor's trials of a job share one event loop);
``config`` is a sandbx-pool TOML file: image registries and their credentials, the image
store, limits, ``[sandbox] network_hosts``. The network is the trial's policy, per call:
public (``network = true``), no-network (false) or an allow-list of host names and ``*.``
patterns, reached through the pool's proxy (HTTP(S)_PROXY in the command's environment; a
program that ignores those variables reaches nothing). IP addresses and CIDR ranges in an
allow-list are not supported: the capabilities say so and Harbor refuses such a task before it
starts. No GPUs, TPUs, Windows, compose files, host mounts or stream (SSH) mode: declared so.
A cancelled trial cancels the awaiting ``exec``, which kills the call's whole process tree.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import shlex
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

import msgspec
from harbor.environments.base import (
    BaseEnvironment,
    ExecResult,
    OutputCallback,
    transfer_tar_filter,
)
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.definition import (
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, NetworkPolicy

from sandbx_pool.config import load_config
from sandbx_pool.integrations import harbor_build
from sandbx_pool.layers import Layer
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.output import OutputChunk
from sandbx_pool.pool import Pool
from sandbx_pool.workers.protocol import MAX_MESSAGE_BYTES

#: A command's deadline when Harbor gives none (its agents and verifiers always give one).
DEFAULT_TIMEOUT_S = 24 * 3600.0

#: Seconds for the environment's own calls (uploads, downloads, mkdir).
TRANSFER_TIMEOUT_S = 600.0

#: The largest output a call returns whole (a download's base64 included): what one message
#: of the pool's protocol carries, less its framing.
MAX_OUTPUT_BYTES = MAX_MESSAGE_BYTES - 4 * 1024 * 1024


class SandbxOptions(EnvironmentOptions):
    """``--ek`` kwargs."""

    config: str | None = None  # a sandbx-pool TOML file (registries, store, limits)
    workers: int | None = None  # calls of a trial at once (None: the pool's default)


class SandbxEnvironment(BaseEnvironment):
    """A Harbor trial's environment: a layer of its own over the task's image."""

    options_model = SandbxOptions
    options: SandbxOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._config = load_config(self.options.config).override(
            calls={"max_output_bytes": MAX_OUTPUT_BYTES, "keep_output_bytes": MAX_OUTPUT_BYTES}
        )
        self.pool: Pool | None = None
        self.layer: Layer | None = None
        self.image_ref: str | None = None
        #: The image's User: who a command runs as when Harbor names no user, as ``docker
        #: exec`` runs it (the layer's own calls are root, so that ``user="root"`` can be).
        self.image_user: str | None = None

    @staticmethod
    def type() -> str:
        return "sandbx"

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_wildcard_hostnames=True,
            # A call's network is chosen per call: a new policy holds from the next one.
            dynamic_network_policy=True,
        )

    def _validate_definition(self) -> None:
        require_agent_environment_definition(
            self.environment_dir, docker_image=self.task_env_config.docker_image
        )

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        """Nothing to reconfigure: every call names its network (``_network``)."""

    # -- life ----------------------------------------------------------------------------------

    async def start(self, force_build: bool) -> None:
        prebuilt = should_use_prebuilt_docker_image(
            self.environment_dir,
            docker_image=self.task_env_config.docker_image,
            force_build=force_build,
        )
        if prebuilt:
            assert self.task_env_config.docker_image is not None
            self.image_ref = self.task_env_config.docker_image
        else:
            self.image_ref = await harbor_build.build(
                self.environment_dir,
                self._config,
                timeout_s=self.task_env_config.build_timeout_sec,
            )
        workspace = tempfile.gettempdir()  # lexical only: every call runs in the layer
        pool = Pool(workspace, workers=self.options.workers, config=self._config)
        self.pool = pool
        try:
            await pool.start()
            image = await pool.image(self.image_ref)
            self.image_user = image.user.strip() or None
            as_root = msgspec.structs.replace(image, user="")
            self.layer = await pool.layer(_layer_name(self.session_id), image=as_root)
            await self.ensure_dirs(self._mount_targets(writable_only=True))
            await self._upload_environment_dir_after_start()
        except BaseException:
            await self._release(delete=True)
            raise

    async def stop(self, delete: bool) -> None:
        await self._release(delete=delete)

    async def _release(self, *, delete: bool) -> None:
        pool, layer = self.pool, self.layer
        self.pool = self.layer = None
        if pool is None:
            return
        try:
            if layer is not None and delete:
                await layer.remove()
            elif layer is not None:
                self.logger.info(f"sandbx: kept layer {layer.name} (--no-delete)")
        finally:
            await pool.close()

    # -- commands ------------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        args: dict[str, Any] = {"command": command}
        who = self._resolve_user(user)
        if who is None:
            who = self.image_user
        if who is not None and str(who) not in ("root", "0"):  # calls are root already
            args["user"] = str(who).split(":", 1)[0]  # USER name[:group]: the name's groups
        async with _Stream(self._output_callback()) as stream:
            outcome = await self._call(
                "bash",
                args,
                timeout=float(timeout_sec) if timeout_sec else DEFAULT_TIMEOUT_S,
                cwd=cwd or self.task_env_config.workdir,
                env=self._merge_env(env),
                on_output=stream.put,
            )
        if outcome.status is Status.TIMEOUT:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        value = outcome.value or {}
        if outcome.status is not Status.OK:
            problem = outcome.error or outcome.reason or str(outcome.status)
            return ExecResult(
                stdout=value.get("stdout"),
                stderr=(value.get("stderr") or "") + f"sandbx: {outcome.status}: {problem}\n",
                return_code=-1 if outcome.status is not Status.ERROR else 126,
            )
        return ExecResult(
            stdout=value["stdout"] or None,
            stderr=value["stderr"] or None,
            return_code=int(value["exit_code"]),
        )

    async def _call(self, tool: str, args: dict[str, Any], **options: Any) -> Outcome:
        if self.pool is None or self.layer is None:
            raise RuntimeError("sandbx: the environment is not started")
        return await self.pool.call(
            tool, args, workspace=self.layer, network=self._network(), **options
        )

    def _network(self) -> bool | list[str]:
        policy = self.network_policy
        if policy.network_mode == NetworkMode.NO_NETWORK:
            return False
        if policy.network_mode == NetworkMode.ALLOWLIST:
            return list(policy.allowed_hosts)
        return True

    # -- files ---------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        target = PurePosixPath(target_path)
        data = await asyncio.to_thread(_tar_of, [(Path(source_path), target.name)])
        await self._untar(data, str(target.parent))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        await self._untar(await asyncio.to_thread(_tar_of_dir, Path(source_dir)), target_dir)

    async def _untar(self, data: bytes, target_dir: str) -> None:
        target = shlex.quote(target_dir)
        outcome = await self._call(
            "bash",
            {"command": f"mkdir -p {target} && tar -xf - -C {target}", "stdin_bytes": data},
            timeout=TRANSFER_TIMEOUT_S,
        )
        _check(outcome, f"upload to {target_dir}")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        outcome = await self._call(
            "read", {"path": source_path, "encoding": "bytes"}, timeout=TRANSFER_TIMEOUT_S
        )
        value = _check(outcome, f"download of {source_path}")
        if value.get("truncated"):
            raise RuntimeError(f"sandbx: {source_path} is larger than {MAX_OUTPUT_BYTES} bytes")
        await asyncio.to_thread(_write, Path(target_path), value["data"])

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        source = shlex.quote(source_dir)
        outcome = await self._call(
            "bash",
            {"command": f"tar -cf - -C {source} . | base64"},
            timeout=TRANSFER_TIMEOUT_S,
        )
        value = _check(outcome, f"download of {source_dir}")
        await asyncio.to_thread(_extract, base64.b64decode(value["stdout"]), Path(target_dir))


class _Stream:
    """A call's output handed to Harbor's (async) callbacks in order, as it comes; all of it
    by the time the ``async with`` ends (a cancelled exec stops handing it)."""

    def __init__(self, emit: OutputCallback | None) -> None:
        self.emit = emit
        self.queue: asyncio.Queue[OutputChunk | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    @property
    def put(self) -> Callable[[OutputChunk], None] | None:
        return self.queue.put_nowait if self.emit is not None else None

    async def __aenter__(self) -> _Stream:
        if self.emit is not None:
            self.task = asyncio.get_running_loop().create_task(self._drain())
        return self

    async def __aexit__(self, kind: object, *rest: object) -> None:
        if self.task is None:
            return
        if kind is None:
            self.queue.put_nowait(None)
            await self.task
        else:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _drain(self) -> None:
        assert self.emit is not None
        while (chunk := await self.queue.get()) is not None:
            await self.emit(chunk.display(), chunk.stream)


def _layer_name(session_id: str) -> str:
    """A layer name from Harbor's session id (``task__abc__env``): plain characters only."""
    plain = "".join(c if c.isalnum() or c in "-_" else "-" for c in session_id)
    return f"harbor-{plain}"[:120]


def _tar_of(entries: list[tuple[Path, str]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for path, name in entries:
            tar.add(str(path), arcname=name)
    return buffer.getvalue()


def _tar_of_dir(source: Path) -> bytes:
    """A tar of what ``source`` holds (not ``source`` itself)."""
    return _tar_of([(child, child.name) for child in sorted(source.iterdir())])


def _write(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(data)


def _extract(data: bytes, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        tar.extractall(path=target, filter=transfer_tar_filter)


def _check(outcome: Outcome, what: str) -> dict[str, Any]:
    """The value of a call that must succeed; RuntimeError naming ``what`` otherwise."""
    value = outcome.value or {}
    if outcome.status is not Status.OK or value.get("exit_code", 0) != 0:
        detail = outcome.error or value.get("stderr") or str(outcome.status)
        raise RuntimeError(f"sandbx: {what} failed: {str(detail).strip()}")
    return value


__all__ = ["SandbxEnvironment", "SandbxOptions"]
