"""What is decided of a call before any worker is taken: nothing is forked for a refused call.

    Pool.call(tool, args, ...)
        check_call_arguments   misuse of the API (a wrong type): TypeError / ValueError, raised
    the driver, in order (call_life.CallLife.drive runs it):
        parse_args             bad arguments: ``error``
        lexical_paths          cwd, view and tool paths outside the workspace: ``denied``
        gate                   the policy, and the caller's ``approve``: ``denied``
        call_context           the ExecutionContext: everything the worker needs, nothing shared
        encode_call            an argument the wire cannot carry: ``error``
    --> the encoded Call, ready for the first idle worker (or the outcome that refused it)

Only strings are checked here: the coordinator never touches the workspace's filesystem (a
stat on a hung mount would hang every caller); symlinks are resolved in the worker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from sandbx_pool import image_layer, lexical_paths
from sandbx_pool.call_state import CallState
from sandbx_pool.config import Config
from sandbx_pool.execution import Unsendable, encode_call
from sandbx_pool.gate import Gate
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.workers.protocol import ExecutionContext, Limits, Sandbox
from sandbx_pool.workers.schemas import (
    RUNS_PROGRAMS,
    BashArgs,
    ServiceArgs,
    UnknownTool,
    parse_args,
)

#: The one tool an allow-list lets through the proxy (with_network).
PROXIED_TOOL = "bash"
#: The tools an allow-list lets through the proxy: bash, and a service (sandbx_pool.services),
#: which is a bash command that runs on.
PROXIED_TOOLS = frozenset({PROXIED_TOOL, "_service"})


@dataclass(frozen=True)
class PoolSide:
    """What of the pool a call's checks and context take: its settings, not its state."""

    config: Config
    workspace: str  # the pool's own (a call may name another)
    sandbox: Sandbox | None  # the workers' sandbox, once the pool has started
    gate: Gate
    proxy_socket: str | None = None  # the network proxy's, once a call needed it


def check_call_arguments(
    timeout: object, cwd: object, env: object, limits: object, call_id: object
) -> None:
    """Misuse of ``Pool.call`` is the caller's bug: a TypeError or ValueError, raised before
    anything is journaled or forked (a tool's bad ``args`` are an outcome instead)."""
    if timeout is not None:
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout must be a number of seconds or None, not {timeout!r}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
    if cwd is not None and not isinstance(cwd, str):
        raise TypeError(f"cwd must be a str or None, not {type(cwd).__name__}")
    if env is not None and not (
        isinstance(env, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
    ):
        raise TypeError("env must be a dict of str to str, or None")
    if limits is not None and not isinstance(limits, Limits):
        raise TypeError(f"limits must be a Limits or None, not {type(limits).__name__}")
    if call_id is not None and not (isinstance(call_id, str) and call_id):
        raise TypeError(f"call_id must be a non-empty str or None, not {call_id!r}")


def prepare(call: CallState, pool: PoolSide) -> bytes | Outcome:
    """The checks in order (see above): the encoded Call, or the outcome that refuses it. Sets
    ``call.context``."""
    try:
        args = parse_args(call.tool, call.raw_args, internal=call.internal)
    except (UnknownTool, msgspec.ValidationError) as exc:
        return call.outcome(Status.ERROR, error=f"bad arguments: {exc}")
    except RecursionError:
        return call.outcome(Status.ERROR, error="bad arguments: nested too deeply")
    # In a view, paths are the view's: its root is the workspace they are confined to.
    base = call.workspace or pool.workspace
    workspace = base if call.view is None else "/"
    try:
        # A layer over an image: the view is the layer's root, made by the pool, not a folder
        # of a workspace (image_layer.py).
        if call.view is not None and call.image is None:
            lexical_paths.check_view(base, call.view)
        cwd = call.cwd if call.cwd is not None else call.start_dir
        call_cwd = lexical_paths.resolve_cwd(workspace, cwd)
    except ValueError as exc:
        return call.outcome(Status.DENIED, error=str(exc))
    # A service runs a command as bash does: the gate judges it as that bash call.
    gated = (
        ("bash", BashArgs(command=args.command))
        if isinstance(args, ServiceArgs)
        else (call.tool, args)
    )
    denial = lexical_paths.denial(workspace, call_cwd, args) or pool.gate.denial(
        *gated, workspace=workspace, cwd=call_cwd
    )
    if denial is not None:
        return call.outcome(Status.DENIED, error=denial)
    call.context = call_context(call, call_cwd, pool)
    try:
        return encode_call(call)
    except Unsendable as exc:
        return call.outcome(Status.ERROR, error=str(exc))


def call_context(call: CallState, cwd: str, pool: PoolSide) -> ExecutionContext:
    """Everything the worker needs for this call, and nothing shared with another call."""
    sandbox = with_network(pool.sandbox or Sandbox(), call, pool.proxy_socket)
    if call.view is not None:
        # The pool's lock directory is not in the view: a write there locks its directory.
        sandbox = msgspec.structs.replace(
            sandbox,
            view=call.view,
            lock_dir=None,
            image=call.image is not None,
            image_user=call.image.user if call.image is not None else "",
        )
    config = pool.config
    env = (
        config.env.for_call(call.env)
        if call.image is None
        else image_layer.call_env(call.image, config.env, call.env)
    )
    return ExecutionContext(
        call_id=call.call_id,
        workspace=(call.workspace or pool.workspace) if call.view is None else "/",
        cwd=cwd,
        env=env,
        limits=call.limits or config.limits.for_workers(),
        max_output_bytes=max_output_bytes(config, call.tool),
        sandbox=sandbox,
        keep_output_bytes=config.calls.keep_output_bytes,
        grace_s=config.calls.grace_s,
        workspace_root=pool.workspace,
        changes_dir=call.changes_dir,
        layer_dir=call.layer_dir,
        layer_base=call.layer_base,
        layer_mount=call.layer_mount,
        session_env=call.session_env,
        layer_image=call.layer_image,
    )


def with_network(sandbox: Sandbox, call: CallState, proxy_socket: str | None) -> Sandbox:
    """The pool's sandbox with this call's network: its own (Pool.call's ``network``) replaces
    the pool's whole, True and False included; an allow-list's gets the proxy's socket.

    Only bash reaches the network through an allow-list: grep's rg has no use for it, and is
    cut off instead (``network = false``: no proxy to register with, and where no network
    namespace can be made, Landlock's TCP rules hold it)."""
    network = call.network
    listed = isinstance(network, tuple) or (network is None and sandbox.network_allow is not None)
    if listed and call.tool not in PROXIED_TOOLS:
        network = False
    if network is not None:
        allow = None if isinstance(network, bool) else network
        sandbox = msgspec.structs.replace(
            sandbox, network=network is not False, network_allow=allow
        )
    if sandbox.network_allow is not None:
        sandbox = msgspec.structs.replace(sandbox, proxy_socket=proxy_socket)
    if call.join_network is not None:
        # A session's service's namespace (sandbx_pool.services): loopback only, shared.
        sandbox = msgspec.structs.replace(
            sandbox,
            network=False,
            network_allow=None,
            join_network=call.join_network,
            loopback=True,
        )
    if call.loopback and not sandbox.network:
        sandbox = msgspec.structs.replace(sandbox, loopback=True)
    return sandbox


def max_output_bytes(config: Config, tool: str) -> int:
    """bash keeps head and tail and is killed only past max_output_bytes (a flood); the other
    tools return whole results, which keep_output_bytes bounds as it bounds bash's."""
    calls = config.calls
    if tool in RUNS_PROGRAMS:
        return calls.max_output_bytes
    return min(calls.max_output_bytes, calls.keep_output_bytes)


__all__ = [
    "PROXIED_TOOL",
    "PROXIED_TOOLS",
    "PoolSide",
    "call_context",
    "check_call_arguments",
    "max_output_bytes",
    "prepare",
    "with_network",
]
