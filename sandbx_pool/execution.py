"""One call on the worker it was given: send it, wait for how it ends, kill if need be.

    send Call --> wait for the first of:
        Result          --> its status, value, error
        kill request    --> stop the worker's group --> the killer's status (bash: with the
                            output until the kill, which its worker answers after SIGTERM)
        worker's exit   --> crashed (with its signal), unless a Result was still on its way

The kill request (token, task, timeout, shutdown, set by whoever decided it) is read from the
call's state, never inferred from how the worker died.

The Call is encoded by ``encode_call`` before a worker is taken: an argument msgpack cannot
carry (a lone surrogate, an integer beyond 64 bits) or a message over the frame limit is an
``error`` outcome of a call that never started, not a worker taken and then stranded.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from asyncio import FIRST_COMPLETED
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from sandbx_pool import tree_usage
from sandbx_pool.call_state import CallState, crash_message
from sandbx_pool.config import CallSettings
from sandbx_pool.journal.store import Journal
from sandbx_pool.logs import logger
from sandbx_pool.outcome import STATUS_OF_KILLER, KilledBy, Outcome, Status
from sandbx_pool.worker_handle import Stopped, Worker, describe_stuck
from sandbx_pool.workers.protocol import MAX_MESSAGE_BYTES, Call, Limits, Usage, encoder

#: A worker's Result and its exit notice travel on different channels, so the exit may be seen
#: first. After a clean exit (the Result was handed to ZeroMQ), wait this long for it; after a
#: crash, only this brief moment, in case it died right after sending.
RESULT_IN_FLIGHT_S = 5.0
CRASH_RESULT_GRACE_S = 0.05

#: The tools whose stop begins with SIGTERM and ``CallSettings.grace_s`` to clean up.
GRACE_TOOLS = frozenset({"bash", "_service"})

#: Largest value a limit may carry: setrlimit takes a signed 64-bit rlim_t in the worker.
MAX_LIMIT = 2**63 - 1

#: Sends one message to the worker of that ZeroMQ identity.
Send = Callable[[bytes, bytes], None]


class Unsendable(ValueError):
    """The call cannot be put on the wire; its message says why, naming the argument."""


def encode_call(call: CallState) -> bytes:
    """The Call message for ``call`` (its context set), checked against what the wire and the
    worker accept. Raises Unsendable."""
    assert call.context is not None
    _check_limits(call.context.limits)
    message = Call(
        tool=call.tool,
        args=call.raw_args,
        context=call.context,
        secret=call.secret,
        stream_output=call.on_output is not None,
    )
    try:
        payload = encoder.encode(message)
    except UnicodeEncodeError as exc:
        reason = f"a string is not valid Unicode ({exc.reason})"
        raise Unsendable(f"cannot encode the call: {reason}") from None
    # msgpack carries integers in 64 bits; msgspec refuses what does not fit, and anything that
    # is not JSON-like data (a set, an object) with TypeError; nesting past its limit raises
    # RecursionError. None of these may reach a worker.
    except (OverflowError, TypeError, ValueError, RecursionError) as exc:
        raise Unsendable(f"cannot encode the call: {exc}") from None
    if len(payload) > MAX_MESSAGE_BYTES:
        raise Unsendable(
            f"the call is {len(payload)} bytes encoded, over the frame limit of"
            f" {MAX_MESSAGE_BYTES} bytes"
        )
    return payload


def _check_limits(limits: Limits) -> None:
    for name in limits.__struct_fields__:
        value = getattr(limits, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
            raise Unsendable(f"limits.{name} must be an integer from 0 to 2**63-1, got {value!r}")


async def execute(
    call: CallState,
    worker: Worker,
    payload: bytes,
    *,
    send: Send,
    settings: CallSettings,
    journal: Journal | None,
) -> Outcome:
    """Run ``call`` on ``worker`` (idle, connected) and return its one outcome. ``payload`` is
    ``encode_call(call)``."""
    dispatch(call, worker, payload, send)
    if journal is not None and worker.pid is not None:
        journal.started(call.call_id, worker.pid)
    timer = None
    if call.timeout_s is not None:
        reason = f"timed out after {call.timeout_s:g} s"
        loop = asyncio.get_running_loop()
        timer = loop.call_later(call.timeout_s, call.request_kill, KilledBy.TIMEOUT, reason)
    try:
        first: set[asyncio.Future[Any]] = {call.result, call.kill_requested, worker.exited}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if timer is not None:
            timer.cancel()
    if not call.result.done() and call.killer is None:
        # The worker's exit notice came first, over another channel. A worker exits 0 only
        # after ZeroMQ took its Result, so that Result is on its way: wait for it. After
        # any other exit a Result is unlikely; still give it a moment.
        clean_exit = worker.exited.result() == 0
        grace = RESULT_IN_FLIGHT_S if clean_exit else CRASH_RESULT_GRACE_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(call.result), grace)
    common: dict[str, Any] = {"started": True, "worker_pid": worker.pid}
    # A stopped Result answers our own SIGTERM: the kill, not the Result, decides the status.
    if call.result.done() and not (call.killer is not None and call.result.result().stopped):
        result = call.result.result()
        status = Status(result.status)
        if status is Status.OUTPUT_LIMIT:
            common["killed_by"] = KilledBy.OUTPUT_LIMIT
        return call.outcome(
            status,
            value=result.value,
            error=result.error,
            error_code=result.error_code,
            limit=result.limit,
            changes=result.changes,
            usage=usage_dict(result.usage),
            **common,
        )
    if call.killer is not None:
        stopped = await stop_worker(call, worker, settings)
        if stopped.quarantined:
            common.update(quarantined=True, wchan=worker.wchan, stuck_pid=worker.stuck_pid)
        else:
            if stopped.warned:
                common["value"] = await partial_value(call, worker, settings)
                if call.result.done():  # tracked by listings: what it changed until then
                    common["changes"] = call.result.result().changes
            common["usage"] = await killed_usage(call, worker, settings)
        return call.outcome(
            STATUS_OF_KILLER[call.killer], killed_by=call.killer, reason=call.reason, **common
        )
    returncode = worker.exited.result()
    assert call.context is not None
    memory = worker.memory_killed and call.context.limits.memory_bytes is not None
    return call.outcome(
        Status.CRASHED,
        error=crash_message(returncode, call.context, memory_killed=memory),
        signal=-returncode if returncode < 0 else None,
        limit="cpu" if returncode == -signal.SIGXCPU else "memory" if memory else None,
        usage=usage_dict(worker.exit_usage),
        **common,
    )


def usage_dict(usage: Usage | None) -> dict[str, Any] | None:
    """Outcome.usage: the wire's Usage as plain data."""
    if usage is None:
        return None
    result: dict[str, Any] = msgspec.to_builtins(usage)
    return result


async def killed_usage(call: CallState, worker: Worker, settings: CallSettings) -> Any:
    """What a killed call cost: its worker's own figures when it answered the SIGTERM, else
    the template's, which come with its exit notice (the worker is dead by now, so that
    notice follows within a moment; bounded all the same), with what its descendants had
    cost when the SIGKILL went (sandbx_pool.tree_usage says why they are apart)."""
    if call.result.done() and call.result.result().usage is not None:
        return usage_dict(call.result.result().usage)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(worker.exited), settings.kill_wait_s)
    return tree_usage.merge(usage_dict(worker.exit_usage), worker.tree_at_kill)


async def partial_value(call: CallState, worker: Worker, settings: CallSettings) -> Any:
    """After a kill that began with SIGTERM, a bash call's output until then: its worker
    survives the SIGTERM and answers (``Result.stopped``) before its clean exit, which is seen
    on another channel."""
    if not call.result.done():
        # The worker is dead by now: its exit notice follows at once.
        either: set[asyncio.Future[Any]] = {call.result, worker.exited}
        await asyncio.wait(either, timeout=settings.kill_wait_s, return_when=FIRST_COMPLETED)
        if not call.result.done() and worker.exited.done() and worker.exited.result() == 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(call.result), RESULT_IN_FLIGHT_S)
    return call.result.result().value if call.result.done() else None


def dispatch(call: CallState, worker: Worker, payload: bytes, send: Send) -> None:
    """Hand the call (``payload``, encoded) to its worker, and the worker to its call."""
    call.worker = worker
    worker.call = call
    try:
        send(worker.identity, payload)
    except zmq.ZMQError as exc:
        # The worker vanished between Ready and now: its exit notice will end the call.
        logger.warning("cannot send call {} to worker {}: {}", call.call_id, worker.pid, exc)


async def stop_worker(call: CallState, worker: Worker, settings: CallSettings) -> Stopped:
    """Kill the worker's process group, with a grace to clean up where one can be used."""
    # Only a program of the user's (bash) may want to clean up on SIGTERM; our own tools, rg
    # included, hold nothing worth a grace, and a stop must not wait on them (a hung mount).
    grace_s = settings.grace_s if call.tool in GRACE_TOOLS else 0.0
    stopped = await worker.stop(grace_s=grace_s, kill_wait_s=settings.kill_wait_s)
    if stopped.quarantined:
        logger.warning(
            "call {}: worker did not die after SIGKILL: {}", call.call_id, describe_stuck(worker)
        )
    return stopped


__all__ = [
    "CRASH_RESULT_GRACE_S",
    "GRACE_TOOLS",
    "MAX_LIMIT",
    "RESULT_IN_FLIGHT_S",
    "Unsendable",
    "dispatch",
    "encode_call",
    "execute",
    "killed_usage",
    "partial_value",
    "stop_worker",
    "usage_dict",
]
