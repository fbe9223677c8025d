"""The life of one worker, from the moment the template forked it: one call, then exit.

    connect DEALER -> send Ready -> receive Call -> apply limits -> run the tool
    -> kill whatever the tool left running -> send Result -> exit

The worker makes its own ZeroMQ context here, after the fork: a context never crosses a fork.
It never decides a cancel or a timeout itself: the coordinator kills its process group. The one
kill it decides is an output overflow, which it records in the Result before killing.
"""

from __future__ import annotations

import errno
import gc
import os
import resource
import signal
import traceback
from typing import Any

import msgspec
import zmq

from workers import containment
from workers.errors import LimitExceeded, ToolError
from workers.protocol import (
    MAX_MESSAGE_BYTES,
    Call,
    ExecutionContext,
    Limits,
    Ready,
    Result,
    call_decoder,
    encoder,
)
from workers.schemas import UnknownTool, parse_args
from workers.tools import WORKER_ACTIONS

#: How long a finished worker keeps trying to hand its Result to a coordinator that is gone.
SEND_LINGER_MS = 2000

_RLIMITS: dict[str, tuple[int, str]] = {
    "address_space_bytes": (resource.RLIMIT_AS, "memory"),
    "cpu_seconds": (resource.RLIMIT_CPU, "cpu"),
    "open_files": (resource.RLIMIT_NOFILE, "open_files"),
    "file_size_bytes": (resource.RLIMIT_FSIZE, "file_size"),
}


def apply_limits(limits: Limits) -> None:
    for field, (which, _) in _RLIMITS.items():
        value = getattr(limits, field)
        if value is not None:
            _, hard = resource.getrlimit(which)
            new_hard = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (min(value, new_hard), new_hard))
    if limits.file_size_bytes is not None:
        # A write past the limit should fail with EFBIG (a clear error), not kill us with SIGXFSZ.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def run_call(call: Call) -> Result:
    """Run the tool; every way it can end becomes a Result (never an exception)."""
    ctx: ExecutionContext = call.context
    try:
        apply_limits(ctx.limits)
        args = parse_args(call.tool, call.args, internal=True)
        value: dict[str, Any] = WORKER_ACTIONS[call.tool](args, ctx)
    except (UnknownTool, msgspec.ValidationError) as exc:
        return Result(call_id=ctx.call_id, status="error", error=f"bad arguments: {exc}")
    except LimitExceeded as exc:
        return Result(call_id=ctx.call_id, status="error", error=str(exc), limit=exc.limit)
    except ToolError as exc:
        return Result(call_id=ctx.call_id, status=exc.status, error=str(exc))
    except MemoryError:
        return Result(
            call_id=ctx.call_id,
            status="error",
            error=f"memory limit exceeded ({ctx.limits.address_space_bytes} bytes)",
            limit="memory",
        )
    except OSError as exc:
        if exc.errno == errno.EFBIG:
            message = f"file size limit exceeded ({ctx.limits.file_size_bytes} bytes)"
            return Result(call_id=ctx.call_id, status="error", error=message, limit="file_size")
        if exc.errno == errno.EMFILE:
            message = f"open files limit exceeded ({ctx.limits.open_files})"
            return Result(call_id=ctx.call_id, status="error", error=message, limit="open_files")
        return Result(call_id=ctx.call_id, status="error", error=str(exc))
    except Exception as exc:  # a bug in a tool must still end as an outcome
        detail = "".join(traceback.format_exception_only(exc)).strip()
        return Result(call_id=ctx.call_id, status="error", error=f"internal error: {detail}")
    result = Result(call_id=ctx.call_id, status="ok", value=value)
    if len(encoder.encode(result)) > ctx.max_output_bytes + 4096:
        return Result(
            call_id=ctx.call_id,
            status="output_limit",
            error=f"result exceeds max_output_bytes ({ctx.max_output_bytes})",
        )
    return result


def warm_up() -> None:
    """Rehearse a call while idle, so that its copy-on-write page faults happen before one.

    A forked worker shares the template's pages; the first write to each (reference counts
    included) copies it. A read of our own /proc status walks most of a real call's path:
    decoding, validation, path resolution, the read tool, encoding the Result.
    """
    context = ExecutionContext(call_id="warm-up", workspace="/proc/self", cwd="/proc/self", env={})
    call = call_decoder.decode(
        encoder.encode(Call(tool="read", args={"path": "status"}, context=context))
    )
    encoder.encode(run_call(call))


def serve(token: str, endpoint: str) -> None:
    """Connect, take one call, answer it. Returns when the Result is handed to ZeroMQ."""
    # The coordinator's SIGTERM (bash's grace period) is for the command, not for us: survive it
    # to report what the command did. Python handlers reset on exec, so bash sees the default.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    # One short call: the collector would only copy-on-write the template's pages.
    gc.disable()
    context = zmq.Context(io_threads=1)
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, token.encode())
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    sock.connect(endpoint)
    warm_up()
    sock.send(encoder.encode(Ready(token=token)))
    call = call_decoder.decode(sock.recv())
    result = run_call(call)
    containment.kill_descendants()
    sock.send(encoder.encode(result))
    sock.close()
    context.term()
    os._exit(0)
