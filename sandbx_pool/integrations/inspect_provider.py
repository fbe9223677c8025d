"""The Inspect AI sandbox provider ``sandbx``: every exec, read and write runs through a Pool.

    Inspect eval
      task_init(config) ----------> one Pool per sandbox config, its journal, a task directory
      sample_init ----------------> a sample directory under it (mktemp -d, through the pool)
        exec(cmd, input, ...) ----> pool.call("bash", {argv, stdin, user}, view=S): no shell
        read_file(file, text) ----> pool.call("read", {path, encoding: "bytes", user}, view=S)
        write_file(file, data) ---> pool.call("write", {path, content_bytes, user}, view=S)
      sample_cleanup -------------> rm -rf the sample directory (through the pool)
      with base=DIR: sample_init makes the sample a layer over DIR (pool.layer), mounted on
      its working directory in every call (layer_at=workdir); sample_cleanup removes it
      with image=REF: sample_init makes the sample a layer over the image (pulled once into
      the pool's image store), the image its ``/`` in every call; sample_cleanup removes it
      task_cleanup ---------------> rm -rf the task directory, close the Pool

Two views, ``SandbxConfig.view``:

* ``"sample"`` (the default): each sample sees its directory S as its ``/``, as a container
  (workers.view): the system read-only (``/usr``, ``/etc`` without root's secrets...), its own
  ``/tmp`` and working directory (``workdir``, ``/work``) read-write, nothing else of the host.
  Every call, file tools included, enters the view, so a path means the same to exec, read_file
  and write_file: relative ones are relative to ``workdir``, absolute ones are the view's. The
  sample runs as uid 0 with no capability (``whoami`` is root, ``user="root"`` works), so file
  modes hold even for it; commands that need root's power (adduser) need ``"host"``.
* ``"host"``: Inspect's local provider's semantics. Relative paths are relative to the sample's
  directory, absolute ones mean the host's (the pool's workspace, ``/`` by default); commands
  keep a container's default capabilities; what keeps a sample in bounds is the user it runs as
  (``user``), or a narrower ``workspace`` (absolute paths outside it are refused).

With ``image`` (any reference ``pool.image`` takes; or a compose file whose one service names
an ``image:``, inspect_compose) each sample is a layer of its own over the image
(sandbx_pool.image_layer): every call sees the image as its ``/``, its programs, its Env, and
starts in its WorkingDir (``workdir`` overrides it); writes stay in the sample's layer. The
image's root is the sample's root, with no capability over the host.

Either way the provider's own housekeeping (making and removing the sample directories) runs
outside any view, with a container's capabilities: it runs fixed commands only.

Inspect's semantics mapped from outcomes, at this one boundary: status ``timeout`` raises
TimeoutError (the worker's whole process group is already dead); ``output_limit``, or a stream
over Inspect's exec limit, raises OutputLimitExceededError; a file error raises the OSError
subclass Inspect names (FileNotFoundError, IsADirectoryError, PermissionError) with the path.
The coordinator never touches the filesystem itself: even the sample directories are made
and removed by workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import posixpath
import shlex
import uuid
from typing import Any, Literal, overload

import msgspec
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import load_config
from sandbx_pool.image_layer import start_dir
from sandbx_pool.images import Image
from sandbx_pool.integrations import inspect_cancel, inspect_compose, inspect_eval
from sandbx_pool.layers import Layer
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.pool import Pool
from sandbx_pool.runtime_dir import owner_is_dead, owner_tag, remove_abandoned
from sandbx_pool.workers.protocol import MAX_MESSAGE_BYTES

#: The pool's output cap: the largest file read_file can return in one message (the rest of a
#: message is framing). Inspect's own read limit (100 MiB) is higher; a file between the two is
#: refused with OutputLimitExceededError naming this cap.
TRANSPORT_BYTES = MAX_MESSAGE_BYTES - 4 * 1024 * 1024

#: Seconds allowed to the provider's own housekeeping calls (mkdir, rm -rf, writes).
HOUSEKEEPING_TIMEOUT_S = 120.0

#: A task's directory under ``root``: ``<prefix><pid>-<start time>-<random>``, so that the
#: next task can tell one whose eval is gone (sandbx_pool.runtime_dir.owner_is_dead).
TASK_DIR_PREFIX = "sandbx-inspect-"

#: How long a task's start waits for the sweep of dead evals' directories.
ABANDONED_SWEEP_S = 10.0

#: The errno names our file tools report (Outcome.error_code) and the exceptions Inspect
#: expects for them.
_FILE_ERRORS: dict[str, type[OSError]] = {
    "ENOENT": FileNotFoundError,
    "EISDIR": IsADirectoryError,
    "EACCES": PermissionError,
    "EPERM": PermissionError,
    "ENOTDIR": NotADirectoryError,
    "EROFS": PermissionError,  # the view's system, or its root: read-only
}

#: Top-level names of a sample's view that are the system's (workers.view), not the sample's.
_SYSTEM_NAMES = frozenset(
    ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "proc", "sys", "dev", "tmp")
)


class SandbxConfig(BaseModel):
    """The provider's settings: ``Task(sandbox=("sandbx", SandbxConfig(...)))``.

    A plain string config is read as the path of a sandbx-pool TOML file (configs/).
    """

    # Frozen and hashable: Inspect uses the config as a key.
    model_config = ConfigDict(frozen=True, extra="forbid")

    #: "sample": each sample sees its own directory as ``/`` (a container's view); "host":
    #: Inspect's local provider's semantics, the host's tree (module docstring).
    view: Literal["sample", "host"] = "sample"
    #: The sample's working directory in its view (view="sample"; None: ``/work``), or in its
    #: image (None: the image's WorkingDir): where relative paths and commands start (and, in a
    #: view, HOME).
    workdir: str | None = None
    workspace: str = "/"  # view="host": what every path is confined to ("/": Inspect's local)
    root: str = "/tmp"  # where each task's directory (holding the sample directories) is made
    user: str | None = None  # who exec, read_file and write_file run as (None: the pool's)
    journal: str | None = None  # the task's journal (None: a fresh one, logged)
    workers: int | None = None  # parallel calls at most (None: the pool's default)
    pool_config: str | None = None  # a sandbx-pool TOML file: env, limits, gate, sandbox
    #: What the samples' calls may do to their files (sandbx_pool.changes): "transactional"
    #: keeps a timed-out or failed exec's writes out of the sample (None: the pool config's).
    changes: Literal["direct", "tracked", "transactional"] | None = None
    #: A directory every sample starts from (a repository at its commit): each sample's
    #: working directory is a layer of its own over it (sandbx_pool.layers), copy-on-write,
    #: DIR never written. view="sample" only; the working directory is then the pool user's.
    base: str | None = None
    #: The samples' network, replacing the pool config's ``[sandbox] network``: true, false or
    #: host patterns (sandbx_pool.allow_list; ``network_hosts`` stays the pool config's). None:
    #: the pool config's.
    network: bool | tuple[str, ...] | None = None
    #: A container image (any reference ``pool.image`` takes: ``oci:DIR:TAG``,
    #: ``HOST/REPO:TAG``...): each sample a layer over it, the image its ``/``.
    image: str | None = None
    #: The image's variables for every exec (a compose service's ``environment``), under the
    #: exec's own.
    env: tuple[tuple[str, str], ...] = ()

    @model_validator(mode="after")
    def _check_workdir(self) -> SandbxConfig:
        workdir = self.workdir
        if workdir is None:
            return self
        normal = posixpath.normpath(workdir)
        top = normal.strip("/").split("/")[0]
        if not workdir.startswith("/") or "\x00" in workdir:
            raise ValueError(f"workdir must be an absolute path: {workdir!r}")
        if self.image is None and top in ("", *_SYSTEM_NAMES):
            raise ValueError(f"workdir must be an absolute path outside the system's: {workdir!r}")
        object.__setattr__(self, "workdir", normal)  # frozen: the normal form, once
        return self

    @property
    def sample_workdir(self) -> str:
        """A sample view's working directory."""
        return self.workdir or "/work"

    @field_validator("base")
    @classmethod
    def _check_base(cls, base: str | None) -> str | None:
        if base is not None and (not base.startswith("/") or "\x00" in base):
            raise ValueError(f"base must be an absolute path, not {base!r}")
        return base


class _Task:
    """One pool, its journal and its directory, shared by the samples of a task."""

    def __init__(self, settings: SandbxConfig, pool: Pool, directory: str) -> None:
        self.settings = settings
        self.pool = pool
        self.directory = directory
        #: Samples initialised and not yet cleaned up (inspect_eval: the pool admits as many).
        self.samples = 0
        #: image=: the image, found or pulled once by task_init; every sample's layer lies
        #: over it (the reference is not looked up again per sample).
        self.image: Image | None = None
        #: Its User (None: root): who a sample's calls run as when they name none, as docker
        #: runs them; the layers lie over the image with its User cleared, so that
        #: ``user="root"`` is root.
        self.image_user: str | None = None

    @property
    def user(self) -> str | None:
        """Who the samples' calls run as when an exec names no user."""
        return self.settings.user if self.settings.user is not None else self.image_user

    def sample_started(self) -> None:
        self.samples += 1
        if self.settings.workers is None:
            self.pool.admit(self.samples)

    @property
    def journal_path(self) -> str | None:
        return self.pool.journal.path if self.pool.journal is not None else None


_tasks: dict[str, _Task] = {}
_tasks_lock: asyncio.Lock | None = None


def _settings(config: SandboxEnvironmentConfigType | None) -> SandbxConfig:
    if config is None:
        return SandbxConfig()
    if isinstance(config, SandbxConfig):
        return config
    if isinstance(config, str):
        if inspect_compose.is_compose_file(config):
            return SandbxConfig(**inspect_compose.read(config))
        return SandbxConfig(pool_config=config)
    return SandbxConfig.model_validate(config.model_dump())


def _key(settings: SandbxConfig) -> str:
    return settings.model_dump_json()


async def _open_task(settings: SandbxConfig) -> _Task:
    if settings.base is not None and settings.view != "sample":
        raise ValueError("sandbx: base= needs view='sample' (each sample's workdir a layer)")
    if settings.image is not None and settings.base is not None:
        raise ValueError("sandbx: image= and base= both name the sample's files: give one")
    # Whole streams (Inspect's exec has its own limit, checked below), not head and tail;
    # stdout and stderr apart, as ExecResult has them (merge_stderr stays off).
    config = load_config(settings.pool_config).override(
        calls={"max_output_bytes": TRANSPORT_BYTES, "keep_output_bytes": TRANSPORT_BYTES}
    )
    # view="host", the local provider's semantics: the host as the samples' filesystem and root
    # over it (Inspect's own suite adds users with adduser; the provider chowns each sample's
    # directory to its user). Commands keep a container's capabilities, not the host's all; a
    # sample given a `user` runs as that user, with none. view="sample": only the provider's
    # housekeeping keeps them; a call in a view never does (workers.sandbox).
    config = config.override(sandbox={"keep_root": True})
    if settings.network is not None:
        network = settings.network
        config = config.override(
            sandbox={"network": network if isinstance(network, bool) else list(network)}
        )
    pool = Pool(
        settings.workspace,
        workers=settings.workers,
        journal=settings.journal,
        config=config,
        changes=settings.changes,
    )
    if settings.workers is None:
        pool.admit(inspect_eval.max_subprocesses() or 0)  # inspect_eval: why
    await pool.start()
    if (settings.view == "sample" or settings.image is not None) and not pool.views:
        await pool.close()
        raise RuntimeError(
            "sandbx: view='sample' (and image=) needs a mount namespace per call (a root pool with"
            " CAP_SYS_ADMIN, or user namespaces: `sandbx-pool doctor` says which this machine"
            " has); use SandbxConfig(view='host') for the local provider's semantics"
        )
    try:
        # An eval killed or interrupted never runs its cleanup: its task's directory (every
        # sample's files) is removed by the next one here, once its owner is gone. In a thread
        # with a deadline: the root may be a mount that hangs, and the loop must not.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.to_thread(remove_abandoned, settings.root, TASK_DIR_PREFIX),
                ABANDONED_SWEEP_S,
            )
        if settings.base is not None or settings.image is not None:
            await _remove_abandoned_layers(pool)
        image = await pool.image(settings.image) if settings.image is not None else None
        template = os.path.join(settings.root, f"{TASK_DIR_PREFIX}{owner_tag()}-XXXXXX")
        made = await _check(pool, ["mktemp", "-d", template], cwd=settings.workspace)
        directory = made.stdout.strip()
        # Traversable, not listable, by the sample user: each sample sees its own directory.
        await _check(pool, ["chmod", "711", directory], cwd=settings.workspace)
    except BaseException:
        await pool.close()
        raise
    if pool.journal is not None:  # once per task; each sample's log names it too
        inspect_eval.announce_journal(pool.journal.path)
    task = _Task(settings, pool, directory)
    if image is not None:
        task.image_user = image.user.strip().split(":", 1)[0] or None
        task.image = msgspec.structs.replace(image, user="")
    return task


async def _remove_abandoned_layers(pool: Pool) -> None:
    """The samples' layers of evals whose process is gone (killed: no cleanup ran). Named
    ``<task directory>-sample-<random>`` (sample_init), the task directory naming its owner."""
    store = pool.config.workspace.layers_dir()
    try:
        names = await asyncio.to_thread(os.listdir, store)  # the pool's own directory
    except FileNotFoundError:
        return
    for name in names:
        task_directory = name.rsplit("-sample-", 1)[0]
        if name != task_directory and owner_is_dead(task_directory, TASK_DIR_PREFIX):
            with contextlib.suppress(ValueError):  # open in another pool: not abandoned
                await (await pool.layer(name)).remove()


async def task_for(config: SandboxEnvironmentConfigType | None) -> _Task:
    """The task (pool) for ``config``, opened on first use."""
    global _tasks_lock
    if _tasks_lock is None:
        _tasks_lock = asyncio.Lock()
    settings = _settings(config)
    async with _tasks_lock:
        task = _tasks.get(_key(settings))
        if task is None:
            task = _tasks[_key(settings)] = await _open_task(settings)
        return task


async def _check(
    pool: Pool, argv: list[str], *, cwd: str, user: str | None = None
) -> ExecResult[str]:  # outside any view: the provider's own commands
    """Run a housekeeping command; raise RuntimeError when it does not succeed."""
    result = await _exec(pool, argv, cwd=cwd, user=user, timeout=HOUSEKEEPING_TIMEOUT_S)
    if not result.success:
        raise RuntimeError(f"sandbx: {shlex.join(argv)} failed: {result.stderr.strip()}")
    return result


async def _exec(
    pool: Pool,
    argv: list[str],
    *,
    cwd: str,
    input: str | bytes | None = None,
    env: dict[str, str] | None = None,
    user: str | None = None,
    timeout: float | None = None,  # noqa: ASYNC109 (a kill deadline passed to the pool)
    view: str | None = None,
    **options: Any,
) -> ExecResult[str]:
    if not argv:
        raise ValueError("cmd must name a program")
    args: dict[str, Any] = {"command": shlex.join(argv), "argv": list(argv)}
    if isinstance(input, str):
        args["stdin"] = input
    elif input is not None:
        args["stdin_bytes"] = bytes(input)
    if user is not None:
        args["user"] = user
    outcome = await _call(
        pool, "bash", args, timeout=timeout, cwd=cwd, env=env, view=view, **options
    )
    return _exec_result(outcome, user)


async def _call(pool: Pool, tool: str, args: dict[str, Any], **options: Any) -> Outcome:
    """``pool.call`` stopped with a reader's reason when Inspect cancels the sample.

    The call runs in a task of its own under a token: cancelling the awaiting task directly
    would journal anyio's message (inspect_cancel says why). Cancelled, we cancel the token with
    the reason, wait until the call's processes are dead and its outcome journaled (Inspect's
    cancel scope cancels us again at every await meanwhile), then re-raise.
    """
    token = CancelToken()
    call = asyncio.create_task(pool.call(tool, args, cancel=token, **options))
    try:
        return await asyncio.shield(call)
    except asyncio.CancelledError:
        token.cancel(inspect_cancel.cancel_reason())
        while not call.done():  # bounded by the pool's kill deadlines
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({call})
        raise


def _exec_result(outcome: Outcome, user: str | None) -> ExecResult[str]:
    if outcome.status is Status.TIMEOUT:
        raise TimeoutError(f"command timed out ({outcome.reason})")
    if outcome.status is Status.OUTPUT_LIMIT:
        raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, None)
    if outcome.status is Status.DENIED:
        raise PermissionError(errno.EACCES, outcome.error or "denied")
    if outcome.status is Status.ERROR:
        message = outcome.error or "failed"
        if user is not None and "the worker is not root" in message:
            raise SandboxUserUnsupportedError(message)
        # Unknown user, missing cwd...: the command did not run; say why where it would.
        return ExecResult(success=False, returncode=1, stdout="", stderr=message)
    if outcome.status is not Status.OK or outcome.value is None:
        raise SandboxUnavailableError(f"sandbx: call {outcome.status}: {outcome.error}")
    value = outcome.value
    if value.get("exec_error") in ("EACCES", "EPERM"):
        raise PermissionError(errno.EACCES, value["stderr"].strip())
    limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
    for stream in ("stdout", "stderr"):
        if len(value[stream].encode("utf-8", errors="replace")) > limit:
            tail = value[stream][-limit:]
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, tail)
    code = int(value["exit_code"])
    return ExecResult(
        success=code == 0, returncode=code, stdout=value["stdout"], stderr=value["stderr"]
    )


def _file_error(outcome: Outcome, file: str) -> OSError:
    message = outcome.error or str(outcome.status)
    if outcome.status is Status.DENIED:
        return PermissionError(errno.EACCES, message, file)
    kind = _FILE_ERRORS.get(outcome.error_code or "")
    if kind is not None:
        code = getattr(errno, outcome.error_code or "")
        return kind(code, os.strerror(code), file)
    return OSError(errno.EIO, message, file)


@sandboxenv(name="sandbx")
class SandbxSandboxEnvironment(SandboxEnvironment):
    """One sample's view of its task's pool: its own directory, every call a worker."""

    def __init__(self, task: _Task, directory: str, layer: Layer | None = None) -> None:
        super().__init__()
        self.task = task
        #: base=DIR: the sample's own layer, mounted on its working directory in every call.
        self.layer = layer
        settings = task.settings
        #: The sample's directory on the host: its view's root (view="sample"), or its working
        #: directory (view="host"); "" for a sample in an image (its layer is all it has).
        self.directory = directory
        self.view = directory if settings.view == "sample" and directory else None
        #: Where commands start and relative paths lead, as the sample's calls see it.
        self.workdir = settings.sample_workdir if self.view is not None else directory
        self._in_layer: dict[str, Any] = {}
        if layer is not None and layer.image is not None:  # the image is the call's /
            self._in_layer = {"workspace": layer}
            self.workdir = settings.workdir or start_dir(layer.image)
        elif layer is not None:
            self._in_layer = {"workspace": layer, "layer_at": settings.sample_workdir}

    # -- lifecycle (class methods Inspect calls) -------------------------------------------

    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        await task_for(config)

    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        task = await task_for(config)
        root = task.settings.workspace
        if task.settings.image is not None:
            # A layer over the image, named as the base's are (abandoned ones are found).
            name = f"{os.path.basename(task.directory)}-sample-{uuid.uuid4().hex[:12]}"
            over_image = await task.pool.layer(name, image=task.image)
            task.sample_started()
            if task.journal_path is not None:
                inspect_eval.record_journal(task.journal_path)
            return {"default": cls(task, "", over_image)}
        made = await _check(
            task.pool, ["mktemp", "-d", os.path.join(task.directory, "sample-XXXXXX")], cwd=root
        )
        directory = made.stdout.strip()
        task.sample_started()
        if task.journal_path is not None:
            inspect_eval.record_journal(task.journal_path)
        owned = directory
        if task.settings.view == "sample":
            # The view's root, read-only in the view, traversable by a sample `user`; its own
            # directories: /tmp (sticky, as any /tmp) and the working directory.
            owned = directory + task.settings.sample_workdir
            script = 'chmod 755 "$1" && mkdir -p "$1/tmp" "$2" && chmod 1777 "$1/tmp"'
            await _check(task.pool, ["sh", "-c", script, "sh", directory, owned], cwd=root)
        layer = None
        if task.settings.base is not None:
            # The layer is named after the sample's directory, unique on this machine.
            name = f"{os.path.basename(task.directory)}-{os.path.basename(directory)}"
            layer = await task.pool.layer(name, base=task.settings.base)
        elif task.settings.user is not None:
            await _check(task.pool, ["chown", "--", task.settings.user, owned], cwd=root)
        return {"default": cls(task, directory, layer)}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for environment in environments.values():
            sample = environment.as_type(SandbxSandboxEnvironment)
            sample.task.samples -= 1
            if sample.layer is not None:
                await sample.layer.remove()
            if not sample.directory:
                continue
            await _check(
                sample.task.pool,
                ["rm", "-rf", "--", sample.directory],
                cwd=sample.task.settings.workspace,
            )

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool
    ) -> None:
        task = _tasks.pop(_key(_settings(config)), None)
        if task is None:
            return
        try:
            if cleanup:
                await _check(
                    task.pool, ["rm", "-rf", "--", task.directory], cwd=task.settings.workspace
                )
            else:
                logger.info("sandbx: left task directory {}", task.directory)
        finally:
            # Whatever happened, no worker outlives the task.
            await task.pool.close()

    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """Nothing to do: a task's workers die with its process (the template's parent-death
        signal), and its directory goes with task_cleanup."""

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return SandbxConfig(**config)

    # -- the three operations --------------------------------------------------------------

    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,  # noqa: ASYNC109 (Inspect's signature)
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        # timeout_retry is not honoured: re-running a command with side effects is the
        # caller's decision. concurrency: the pool's worker count already bounds it.
        if self.view is not None:
            env = {"HOME": self.workdir, **(env or {})}
        elif self.task.settings.env:
            env = {**dict(self.task.settings.env), **(env or {})}
        return await _exec(
            self.task.pool,
            cmd,
            cwd=self._path(cwd) if cwd is not None else self.workdir,
            input=input,
            env=env,
            user=user if user is not None else self.task.user,
            timeout=timeout,
            view=self.view,
            **self._in_layer,
        )

    async def write_file(self, file: str, contents: str | bytes) -> None:
        data = contents.encode("utf-8") if isinstance(contents, str) else bytes(contents)
        args: dict[str, Any] = {"path": self._path(file), "content": "", "content_bytes": data}
        if self.task.user is not None:
            args["user"] = self.task.user
        outcome = await _call(
            self.task.pool,
            "write",
            args,
            timeout=HOUSEKEEPING_TIMEOUT_S,
            cwd=self.workdir,
            view=self.view,
            **self._in_layer,
        )
        if outcome.status is Status.TIMEOUT:
            raise TimeoutError(f"writing {file} timed out")
        if outcome.status is not Status.OK:
            raise _file_error(outcome, file)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        args: dict[str, Any] = {"path": self._path(file), "encoding": "bytes"}
        if self.task.user is not None:
            args["user"] = self.task.user  # as exec and write_file: file modes hold
        outcome = await _call(
            self.task.pool,
            "read",
            args,
            timeout=HOUSEKEEPING_TIMEOUT_S,
            cwd=self.workdir,
            view=self.view,
            **self._in_layer,
        )
        if outcome.status is Status.TIMEOUT:
            raise TimeoutError(f"reading {file} timed out")
        if outcome.status is Status.OUTPUT_LIMIT:
            raise OutputLimitExceededError(f"{TRANSPORT_BYTES} bytes", None)
        if outcome.status is not Status.OK or outcome.value is None:
            raise _file_error(outcome, file)
        if outcome.value["size"] > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        if outcome.value["truncated"]:
            raise OutputLimitExceededError(f"{TRANSPORT_BYTES} bytes", None)
        data: bytes = outcome.value["data"]
        # newline="" semantics: CRLF stays as it is; invalid UTF-8 raises UnicodeDecodeError.
        return data.decode("utf-8") if text else data

    def _path(self, path: str) -> str:
        """A path as the sample sees it: relative ones to its working directory, absolute ones
        as they are (the view's, or with view="host" the host's, as Inspect's local provider)."""
        return os.path.join(self.workdir, path)
