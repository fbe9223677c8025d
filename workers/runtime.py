"""The life of one worker, from the moment the template forked it: one call, then exit.

    rehearse -> prepare the confinement -> connect DEALER -> send Ready
    -> (no call for JOIN_WHEN_IDLE_MS: join its own pids cgroup meanwhile) -> receive Call
    -> bash, grep: join its pids cgroup (unless done while idle), cap its processes (pids.max)
    -> a memory limit: join its memory cgroup with it (workers.memory_cgroup)
    -> start measuring (workers.usage) -> confine (workers.sandbox) -> apply limits
    -> run the tool (bash: Output messages as it prints, when the call streams)
    -> kill whatever the tool left running -> what it cost -> send Result -> exit

The worker's ZeroMQ connection (workers.zmtp: a DEALER speaking ZMTP itself, no libzmq context
and so no threads) is made here, after the fork: nothing of it crosses a fork.
It never decides a cancel or a timeout itself: the coordinator kills its process group (a bash
call's worker survives the SIGTERM that comes first and answers with the output so far:
workers.stopping). The one kill it decides is an output flood, which it records in the Result
before killing.
"""

from __future__ import annotations

import _signal
import contextlib
import errno
import gc
import os
import resource
import select
import signal
import traceback
from typing import Any

import msgspec

from sandbx_pool.workers import (
    cgroups,
    containment,
    memory_cgroup,
    overlay,
    sandbox,
    stopping,
    streaming,
    usage,
    zmtp,
)
from sandbx_pool.workers import upper_scan as changes
from sandbx_pool.workers.errors import LimitExceeded, ToolError
from sandbx_pool.workers.protocol import (
    CHANGES_LISTED,
    MAX_MESSAGE_BYTES,
    Call,
    ExecutionContext,
    Limits,
    Ready,
    Result,
    call_decoder,
    encoder,
)
from sandbx_pool.workers.rules import FileRules
from sandbx_pool.workers.schemas import RUNS_PROGRAMS, UnknownTool, parse_args
from sandbx_pool.workers.tools import WORKER_ACTIONS, service
from sandbx_pool.workers.tools.bash import SESSION_KEY

#: Exit status of an idle worker that will never get a call: its template died, or its
#: coordinator hung up or stopped answering.
EXIT_ORPHANED = 75

#: Exit status of a worker the coordinator stopped with SIGTERM (it sends no Result).
EXIT_TERMINATED = 128 + signal.SIGTERM

#: Exit status of a worker that could not hand its Result over (the coordinator stopped reading).
EXIT_UNDELIVERED = 74

#: How long an idle worker waits for its call before it makes and joins its own pids cgroup
#: anyway. Joining a cgroup migrates the process, and a migration waits for an RCU grace
#: period when none ran lately: 5-15 ms measured here, which a bash or grep call that came
#: to a worker not yet in its cgroup paid on its own clock (a grep of 20,000 files: 1.25x
#: rg's time, 1.12x joined while idle; bash "true" 0.3 s after the last call: 17 ms at p50,
#: 8.8 ms joined while idle, 5.6 ms back to back). A worker idle this long serves a pool
#: whose calls are spaced out (an agent between turns): it joins while nobody waits. In a busy
#: pool a worker gets its call sooner, and a busy file tool's worker never joins (about 0.3 ms
#: of CPU, the template's rmdir included, that a read does not need).
JOIN_WHEN_IDLE_MS = 50

#: How long a worker waits on a coordinator that is alive but not answering: to accept its
#: connection, to answer its handshake, to read what it sends, to finish sending a Call.
PEER_TIMEOUT_S = 10.0

_RLIMITS: dict[str, tuple[int, str]] = {
    "address_space_bytes": (resource.RLIMIT_AS, "memory"),
    "cpu_seconds": (resource.RLIMIT_CPU, "cpu"),
    "open_files": (resource.RLIMIT_NOFILE, "open_files"),
    "file_size_bytes": (resource.RLIMIT_FSIZE, "file_size"),
    # Where no memory cgroup binds the call (serve() then clears it): each process's data
    # segment, not its address space, which runtimes that reserve large ranges exceed at once.
    "memory_bytes": (resource.RLIMIT_DATA, "memory"),
}

#: Limits set as soft values only (see apply_limits), relaxed once the tool is done.
_SOFT_ONLY = (resource.RLIMIT_AS, resource.RLIMIT_DATA)


#: bash itself killed by one of these signals ran into that limit (its commands inherit ours).
_LIMIT_SIGNALS: dict[int, tuple[str, str]] = {
    signal.SIGXCPU: ("cpu_seconds", "cpu"),
    signal.SIGXFSZ: ("file_size_bytes", "file_size"),
}


class CpuLimitExceeded(BaseException):
    """Raised in the tool by our SIGXCPU handler; a BaseException, so no tool swallows it."""


def _on_sigxcpu(signum: int, frame: object) -> None:
    # A worker that is its PID namespace's init ignores SIGXCPU's default action (the kernel
    # protects a namespace's init), so without a handler it would run on to the SIGKILL of the
    # hard limit, and its outcome could not say why. Python checks signals even inside a long
    # regex match, so this stops a runaway grep too.
    raise CpuLimitExceeded


def apply_limits(limits: Limits) -> None:
    for field, (which, _) in _RLIMITS.items():
        value = getattr(limits, field)
        if value is not None:
            _, hard = resource.getrlimit(which)
            if which in _SOFT_ONLY:
                # The soft limit only, so that relax_limits() can give the worker back the
                # room it needs to build and send the Result after the tool used it all up.
                new_hard = hard
            else:
                # CPU: the hard limit a second later, so that SIGXCPU (the soft limit, which
                # names the cause) comes first; at soft == hard the kernel sends SIGKILL.
                wanted = value + 1 if which == resource.RLIMIT_CPU else value
                new_hard = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
            soft = value if new_hard == resource.RLIM_INFINITY else min(value, new_hard)
            resource.setrlimit(which, (soft, new_hard))
    if limits.file_size_bytes is not None:
        # A write past the limit should fail with EFBIG (a clear error), not kill us with SIGXFSZ.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    if limits.cpu_seconds is not None:
        signal.signal(signal.SIGXCPU, _on_sigxcpu)


def relax_limits(limits: Limits) -> None:
    """Once the tool is done: nothing the worker does to answer may trip the call's limits."""
    for which, value in (
        (resource.RLIMIT_AS, limits.address_space_bytes),
        (resource.RLIMIT_DATA, limits.memory_bytes),
    ):
        if value is not None:
            _, hard = resource.getrlimit(which)
            resource.setrlimit(which, (hard, hard))
    if limits.cpu_seconds is not None:
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)


def run_call(call: Call) -> Result:
    """Run the tool; every way it can end becomes a Result (never an exception)."""
    ctx: ExecutionContext = call.context
    try:
        apply_limits(ctx.limits)
        try:
            args = parse_args(call.tool, call.args, internal=True)
            value: dict[str, Any] = WORKER_ACTIONS[call.tool](args, ctx)
        finally:
            # Before anything else allocates: building the Result and sending it must not fail
            # under a limit the tool used up.
            relax_limits(ctx.limits)
    except (UnknownTool, msgspec.ValidationError) as exc:
        return Result(call_id=ctx.call_id, status="error", error=f"bad arguments: {exc}")
    except LimitExceeded as exc:
        return Result(call_id=ctx.call_id, status="error", error=str(exc), limit=exc.limit)
    except ToolError as exc:
        return Result(
            call_id=ctx.call_id,
            status=exc.status,
            value=exc.value,
            error=str(exc),
            error_code=exc.code,
        )
    except MemoryError:
        bound = ctx.limits.memory_bytes or ctx.limits.address_space_bytes
        return Result(
            call_id=ctx.call_id,
            status="error",
            error=f"memory limit exceeded ({bound} bytes)",
            limit="memory",
        )
    except CpuLimitExceeded:
        # "crashed", as when SIGXCPU ends a worker that is not a namespace's init: the tool was
        # stopped in the middle, not finished with an error.
        return Result(
            call_id=ctx.call_id,
            status="crashed",
            error=f"CPU time limit exceeded ({ctx.limits.cpu_seconds} s)",
            limit="cpu",
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
    limit = None
    if call.tool == "bash" and value.get("signal") in _LIMIT_SIGNALS:
        field, name = _LIMIT_SIGNALS[value["signal"]]
        limit = name if getattr(ctx.limits, field) is not None else None
    # A session's bash call: the state its shell left travels beside the value, not in it.
    shell = value.pop(SESSION_KEY, None) if call.tool == "bash" else None
    result = Result(call_id=ctx.call_id, status="ok", value=value, limit=limit, session=shell)
    if len(encoder.encode(result)) > ctx.max_output_bytes + 4096:
        return Result(
            call_id=ctx.call_id,
            status="output_limit",
            error=f"result exceeds max_output_bytes ({ctx.max_output_bytes})",
        )
    return result


def rehearse_call() -> None:
    """Walk most of a real call's path (decoding, validation, path resolution, the read tool,
    encoding the Result) with a read of our own /proc status.

    Twice useful. The template rehearses many times before its first fork, so that CPython
    has specialized this code (rewriting its bytecode in place) once, for every worker.
    Each worker rehearses once while idle: a forked worker shares the template's pages and
    the first write to each (reference counts included) copies it, so its copy-on-write faults
    are paid before a call rather than during one.
    """
    context = ExecutionContext(call_id="warm-up", workspace="/proc/self", cwd="/proc/self", env={})
    call = call_decoder.decode(
        encoder.encode(Call(tool="read", args={"path": "status"}, context=context))
    )
    encoder.encode(run_call(call))


def _cap_processes(path: str, processes: int | None, joined: bool) -> None:
    """Join the worker's pids cgroup (unless it did while idle) and set the call's limit on it
    (None: no limit, "max")."""
    try:
        if not joined:
            cgroups.enter(path)
        cgroups.cap(path, processes)
    except OSError as exc:
        what = (
            "join the call's pids cgroup"
            if processes is None
            else f"apply the process limit ({processes})"
        )
        raise sandbox.SandboxError(f"cannot {what}: {exc}") from exc


def _join_while_idle(path: str) -> bool:
    """Make and join the worker's own pids cgroup before its call comes; False if that failed
    (the call, if it runs programs, tries again and fails visibly if it must)."""
    try:
        cgroups.enter(path)
    except OSError:
        return False
    return True


def _wait_for_call(
    connection: zmtp.Dealer, template_pidfd: int, pids_cgroup: str | None
) -> tuple[bytes, bool]:
    """The Call's bytes once they come, and whether the worker joined ``pids_cgroup`` while it
    waited (JOIN_WHEN_IDLE_MS); exits if the template dies first."""
    waiting = select.poll()
    waiting.register(connection.fileno(), select.POLLIN)
    waiting.register(template_pidfd, select.POLLIN)
    joined = False
    idle_ms = JOIN_WHEN_IDLE_MS if pids_cgroup is not None else None
    while True:
        ready = {fd for fd, _ in waiting.poll(idle_ms)}
        if not ready and idle_ms is not None and pids_cgroup is not None:
            # Idle long enough: the join's grace period is nobody's wait now. A call that comes
            # meanwhile waits in the socket until it is done.
            joined, idle_ms = _join_while_idle(pids_cgroup), None
            continue
        if template_pidfd in ready:
            os._exit(EXIT_ORPHANED)
        if connection.fileno() in ready:
            payload = connection.recv(timeout_s=PEER_TIMEOUT_S)
            if payload is not None:
                return payload, joined


def _keep_changes_apart(call: Call, prepared: sandbox.Prepared) -> bool:
    """Tracked and transactional mode: the call sees its workspace through its overlay
    (workers.overlay); True. The template's file rules hold the workspace's own directory,
    which the overlay now covers: the call builds its rules on what it sees. False: no overlay
    here, and the call is tracked by listings instead (``changes_scan``, not in a view);
    otherwise the OverlayError refuses the call."""
    ctx = call.context
    try:
        overlay.enter(ctx)
    except overlay.OverlayError:
        if ctx.changes_scan and ctx.sandbox.view is None:
            # Said where the coordinator looks, before the tool runs: a worker killed before
            # it answers leaves an empty upper directory that means "not known", not "none".
            with contextlib.suppress(OSError):
                os.close(
                    os.open(os.path.join(ctx.changes_dir or "", CHANGES_LISTED), os.O_CREAT, 0o600)
                )
            return False
        raise
    if prepared.file_rules is not None:
        prepared.file_rules.close()
        prepared.file_rules = None
    return True


def _enter_layer(call: Call, prepared: sandbox.Prepared) -> None:
    """A call in a layer: its workspace becomes the layer's overlay (workers.overlay), before
    anything else of the confinement, which then builds its rules on what the call sees. The
    template's file rules hold the pool's own workspace: not this one."""
    overlay.enter_layer(
        call.context, resolve=call.tool == "_layer_open", image_only=call.tool == "_layer_diff"
    )
    if prepared.file_rules is not None:
        prepared.file_rules.close()
        prepared.file_rules = None


def serve(
    token: str,
    endpoint: str,
    template_pidfd: int,
    file_rules: FileRules | None = None,
    *,
    pids_cgroup: str | None = None,
    memory: memory_cgroup.WorkerMemory | None = None,
    measure: bool = True,
    rehearse: bool = True,
) -> None:
    """Connect, take one call, answer it, exit.

    ``template_pidfd`` becomes readable when the template exits: an idle worker whose template
    is gone (PDEATHSIG covers that too, this is the second line) exits instead of waiting for a
    call that can never come. ``file_rules`` is the file tools' Landlock ruleset, built once by
    the template (workers.rules). ``pids_cgroup``: the cgroup this worker makes and joins, while
    idle or for a call that runs programs, whose pids.max the call's ``Limits.processes`` sets
    (None: no pids controller is writable here, and the limit is not enforced; ``sandbx-pool
    doctor`` says so). ``memory``: where a call's memory limit binds this worker (None:
    RLIMIT_DATA instead). ``measure``: answer with what the call cost (workers.usage; False
    only for the benchmark that weighs it). ``rehearse``: walk the
    call's path once before connecting (False for a light template's workers: see there).
    """
    # The coordinator's SIGTERM (bash's grace period) is for the command, not for us: survive it,
    # let the command end, and answer with its output so far (workers.stopping). Python
    # handlers reset on exec, so bash sees the default.
    # _signal, not signal: see workers.template.Template.become_worker.
    stop = stopping.current = stopping.StopRequest()
    _signal.signal(signal.SIGTERM, stop.on_signal)
    # One short call: the collector would only copy-on-write the template's pages.
    gc.disable()
    # Both before connecting: the rehearsal's and the ruleset's copy-on-write faults are paid
    # while idle, and a connection is only made once the worker can take a call at once.
    if rehearse:
        rehearse_call()
    prepared = sandbox.prepare(file_rules, with_rehearsal=rehearse)
    try:
        connection = zmtp.connect(
            endpoint, token.encode(), max_message_bytes=MAX_MESSAGE_BYTES, timeout_s=PEER_TIMEOUT_S
        )
        connection.handshake(timeout_s=PEER_TIMEOUT_S)
        connection.send(encoder.encode(Ready(token=token)), timeout_s=PEER_TIMEOUT_S)
        payload, joined = _wait_for_call(connection, template_pidfd, pids_cgroup)
    except zmtp.ProtocolError:
        raise  # a bug on one side or the other: let the traceback show it
    except (ConnectionError, TimeoutError):
        # The coordinator is gone, closing, or not answering: no call will come (it learns
        # of our exit from the template).
        os._exit(EXIT_ORPHANED)
    call = call_decoder.decode(payload)
    runs_programs = call.tool in RUNS_PROGRAMS
    if call.stream_output:
        streaming.current = streaming.OutputSink(
            lambda message: connection.send(message, timeout_s=PEER_TIMEOUT_S),
            call_id=call.context.call_id,
            secret=call.secret,
        )
    if call.tool == "_service":  # it reads what the caller writes while it runs
        service.connection = connection
        service.open_terminal(call.args)
    processes = call.context.limits.processes
    memory_bytes = call.context.limits.memory_bytes
    confinement = meter = None
    try:
        if runs_programs and pids_cgroup is not None:
            # Before confine(): from then on the worker may not write to cgroupfs (Landlock
            # grants /sys read-only), and neither may anything the tool starts. Only a tool
            # that runs programs can fork: the others join no cgroup for their call (~0.3 ms
            # of a read's CPU each, measured). With no limit too: without a PID namespace, the
            # cgroup is where what the command left is found (kill_others below).
            _cap_processes(pids_cgroup, processes, joined)
            joined = True
        elif (
            runs_programs
            and processes is not None
            and containment.in_own_user_namespace()
            and containment.nproc_counts_per_user_namespace()
        ):
            # No pids cgroup (a pool without root rarely has one delegated), but a user
            # namespace of its own, where RLIMIT_NPROC counts this call's tasks only. The
            # outcome cannot name the limit then: nothing records a fork it refused.
            containment.limit_processes_in_own_user_namespace(processes)
        try:
            call, meter = usage.begin(call, memory, joined, measure=measure)
        except OSError as exc:
            limit = f"apply the memory limit ({memory_bytes} bytes)"
            raise sandbox.SandboxError(f"cannot {limit}: {exc}") from exc
        if runs_programs and (call.context.layer_dir or call.context.changes_dir):
            sandbox.enter_prepared_mounts(call)
        if call.context.layer_dir is not None:
            _enter_layer(call, prepared)
        listed = call.context.changes_dir is not None and not _keep_changes_apart(call, prepared)
        confinement = sandbox.confine(call, prepared, runs_programs=runs_programs)
    except (sandbox.SandboxError, overlay.OverlayError) as exc:
        code = exc.code if isinstance(exc, overlay.OverlayError) else None
        result = Result(
            call_id=call.context.call_id, status="error", error=str(exc), error_code=code
        )
    else:
        before = changes.listing(call.context.workspace) if listed else None
        result = run_call(confinement.call)
        if before is not None:
            found = changes.compare(before, changes.listing(call.context.workspace))
            result = msgspec.structs.replace(result, changes=changes.listed(found, True))
        if (
            runs_programs
            and processes is not None
            and pids_cgroup is not None
            and result.limit is None
            and cgroups.limit_was_hit(pids_cgroup)
        ):
            # The command ran on with some forks refused (bash says "fork: Resource
            # temporarily unavailable"): the outcome names the limit, as for the rlimits.
            result = msgspec.structs.replace(result, limit="processes")
    if runs_programs:  # the other tools start nothing
        if pids_cgroup is not None and not containment.in_own_pid_namespace():
            cgroups.kill_others(pids_cgroup)
        containment.kill_descendants()
        denied = confinement.network_denied() if confinement is not None else None
        if denied:
            value = {**(result.value or {}), "network_denied": denied}
            result = msgspec.structs.replace(result, value=value)
    if measure or (meter is not None and memory_bytes is not None):
        meter = meter or usage.Meter(None)
        result = usage.with_usage(result, meter, memory_bytes, measure=measure)
    if stop.at is not None:
        if not runs_programs or result.value is None:
            # The coordinator is stopping this call and has no use for a Result without
            # output: what it waits for is our exit, so skip the answer.
            if confinement is not None:
                confinement.release()
            os._exit(EXIT_TERMINATED)
        # The command's output until the stop: the coordinator's kill decides the status.
        result = msgspec.structs.replace(result, stopped=True)
    # The secret proves to the coordinator that this Result comes from the worker it chose.
    answer = encoder.encode(msgspec.structs.replace(result, secret=call.secret))
    try:
        connection.send(answer, timeout_s=PEER_TIMEOUT_S)
    except OSError:
        # The coordinator is gone, or stopped reading: nobody will read this Result. Say so
        # in the exit status (a clean exit tells the coordinator the Result is on its way).
        os._exit(EXIT_UNDELIVERED)
    finally:
        if confinement is not None:
            confinement.release()
    # Exiting closes the connection; what the kernel holds of the Result still reaches the
    # coordinator, which reads it before it sees the connection end.
    os._exit(0)
