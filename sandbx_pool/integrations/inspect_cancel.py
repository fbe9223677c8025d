"""Why Inspect AI cancelled a sandbox call, in the few words the journal records.

Inspect stops a sample's work by cancelling anyio cancel scopes. What reaches the provider's
call is a CancelledError naming a scope ("Cancelled via cancel scope 7f88... by <Task ...>", a
391-character repr); the cause lies elsewhere, and is still readable at the moment the cancel
arrives, which is when the provider asks (before its token records the reason: the first
killer wins). Checked in this order; the first that tells wins:

1. The operator interrupted the sample (Inspect's UI, ``inspect ctl``): the active sample's
   ``interrupt_action`` ("score", "error" or "cancel").
2. A limit Inspect enforces by cancelling the sample (the working time limit, limits bridged
   from the sandbox): the active sample's ``limit_exceeded_error``.
3. A time or working time limit reached, the sample's or a scoped ``time_limit()``: the limit
   trees, from the limit closest to the call up to the sample's.
4. Ctrl-C: asyncio's Runner (``asyncio.run``, ``anyio.run``, which is how Inspect runs an eval
   on asyncio) counted a SIGINT, on which it cancelled the main task. Inspect's full-screen
   display (textual) reads Ctrl-C as a key instead, and cancels the worker running the eval.
5. The cancelled scope: the outermost one cancelled between the call and the first shielded
   scope (a cancel spreads down, and each task group it crosses cancels its own scope too).
   Its task group holds the exception that made it cancel (a sibling task in the sample
   raised; or another sample did, and the eval fails on its error); else a scope enclosing the
   sample's own task group means the eval itself was cancelled, and a deadline that passed is
   the solver's own timeout.

Nothing telling, the reason says so in general terms (``GENERIC``).

Most of this is private state of Inspect (``sample_active``, the limit trees) and of anyio (a
task's cancel scope, a task group's exceptions): read in this one module, each read guarded,
so a release that changes them degrades to ``GENERIC``, never to an error on the cancel path.
The tests run a real eval for each cause, so such a change shows as a failing test.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any, Final

import anyio

#: The journal's reason when nothing tells why.
GENERIC: Final = "Inspect cancelled the sample (interrupted, or another part of it failed)"

#: The longest reason written: a line a reader takes in at once.
MAX_REASON: Final = 159

#: How each limit type of Inspect's LimitExceededError reads, and its unit.
_LIMIT_NAMES: Final = {
    "time": ("time limit", " s"),
    "working": ("working time limit", " s"),
    "message": ("message limit", ""),
    "token": ("token limit", ""),
    "turn": ("turn limit", ""),
    "cost": ("cost limit", ""),
}


def cancel_reason() -> str:
    """Why Inspect is cancelling the running task's call, in a few words (module docstring)."""
    for reason in (
        _operator,
        _limit_exceeded,
        _limit_reached,
        _sigint,
        _display_quit,
        _scope_cause,
    ):
        try:
            found = reason()
        except Exception:  # Inspect or anyio changed what we read: say less, never fail here
            continue
        if found is not None:
            return found
    return GENERIC


def _active_sample() -> Any:
    from inspect_ai.log._samples import sample_active

    return sample_active()


def _operator() -> str | None:
    active = _active_sample()
    action = getattr(active, "interrupt_action", None)
    if action is None:
        return None
    return f"Inspect: the sample was interrupted by its operator ({action})"


def _limit_exceeded() -> str | None:
    error = getattr(_active_sample(), "limit_exceeded_error", None)
    return _limit_text(error) if error is not None else None


def _limit_reached() -> str | None:
    from inspect_ai.util._limit import time_limit_tree, working_limit_tree

    for kind, tree in (("time", time_limit_tree), ("working", working_limit_tree)):
        node: Any = tree.get()  # the limit closest to the call; its parents enclose it
        while node is not None:
            if node.limit is not None and node.usage >= node.limit:
                whose = "the sample's" if node.parent is None else "a scoped"
                name, unit = _LIMIT_NAMES[kind]
                return f"Inspect: {whose} {name} ({_number(node.limit)}{unit}) was reached"
            node = node.parent
    return None


def _sigint() -> str | None:
    # asyncio.Runner handles SIGINT with partial(runner._on_sigint, main_task=...): the first
    # cancels the main task and is counted, so Ctrl-C is told apart from any other cancel.
    handler = signal.getsignal(signal.SIGINT)
    runner = getattr(getattr(handler, "func", None), "__self__", None)
    if isinstance(runner, asyncio.Runner) and getattr(runner, "_interrupt_count", 0) > 0:
        return "Inspect: the eval was interrupted (Ctrl-C)"
    return None


def _display_quit() -> str | None:
    # The terminal is in raw mode under the full-screen display: Ctrl-C is no signal, but the
    # key Inspect binds to cancelling the textual worker that runs the eval (the only cancel
    # of that worker Inspect issues).
    worker_module = sys.modules.get("textual.worker")  # not loaded: no such display
    if worker_module is None:
        return None
    try:
        worker = worker_module.get_current_worker()
    except worker_module.NoActiveWorker:
        return None
    return "Inspect: the eval was interrupted (Ctrl-C)" if worker.is_cancelled else None


def _scope_cause() -> str | None:
    chain = _scope_chain()
    cancelled = [index for index, scope in enumerate(chain) if scope.cancel_called]
    if not cancelled:
        return None
    origin = chain[cancelled[-1]]
    tg = getattr(_active_sample(), "tg", None)
    sample_scope = getattr(tg, "cancel_scope", None)
    outside = any(scope is sample_scope for scope in chain[: cancelled[-1]])
    error = _task_group_error(origin, tg)
    if error is not None:
        from inspect_ai.util import LimitExceededError

        if isinstance(error, LimitExceededError):
            return _limit_text(error)
        prefix = (
            "Inspect: the eval stopped on an error elsewhere: "
            if outside
            else "Inspect: another part of the sample raised "
        )
        return prefix + _shorten(_exception_text(error), MAX_REASON - len(prefix))
    if outside:
        return "Inspect: the eval was cancelled"
    if origin.deadline <= anyio.current_time():
        return "Inspect: a timeout in the solver expired (a cancel scope's deadline)"
    return None


def _scope_chain() -> list[Any]:
    """The current task's cancel scopes, innermost first, up to the first shielded one."""
    from anyio._backends._asyncio import _task_states

    state = _task_states.get(asyncio.current_task())  # type: ignore[arg-type]
    scope: Any = state.cancel_scope if state is not None else None
    chain = []
    while scope is not None:
        chain.append(scope)
        if scope.shield:  # a cancel from further out does not cross it
            break
        scope = scope._parent_scope
    return chain


def _task_group_error(origin: Any, sample_tg: Any) -> BaseException | None:
    """The first exception held by the task group whose scope ``origin`` is."""
    from anyio.abc import TaskGroup

    candidates = [sample_tg] if sample_tg is not None else []
    host = getattr(origin, "_host_task", None)
    if host is not None:
        # The group lives in a frame of the task that entered it: as ``tg`` in ``async with
        # create_task_group() as tg``, or as ``self`` in its __aexit__ while it waits.
        for frame in _frames(host):
            candidates += [v for v in frame.f_locals.values() if isinstance(v, TaskGroup)]
    for group in candidates:
        if getattr(group, "cancel_scope", None) is origin:
            for error in getattr(group, "_exceptions", ()):
                leaf = _leaf(error)
                if not isinstance(leaf, asyncio.CancelledError):
                    return leaf
    return None


def _frames(task: asyncio.Task[Any]) -> Iterator[FrameType]:
    """The frames of ``task``'s await chain, outermost first when suspended."""
    if task is asyncio.current_task():
        frame: FrameType | None = sys._getframe()
        while frame is not None:  # running: each awaiting coroutine is its caller
            yield frame
            frame = frame.f_back
        return
    awaitable: Any = task.get_coro()
    while awaitable is not None:  # suspended: each coroutine names what it awaits
        frame = getattr(awaitable, "cr_frame", None) or getattr(awaitable, "gi_frame", None)
        if frame is not None:
            yield frame
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "gi_yieldfrom", None)


def _leaf(error: BaseException) -> BaseException:
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


def _limit_text(error: Any) -> str:
    """A LimitExceededError's reason: its limit is the sample's unless it has a parent limit."""
    kind = str(getattr(error, "type", ""))
    if kind in _LIMIT_NAMES and getattr(error, "limit", None) is not None:
        name, unit = _LIMIT_NAMES[kind]
        scoped = getattr(getattr(error, "source", None), "parent", None) is not None
        whose = "a scoped" if scoped else "the sample's"
        return f"Inspect: {whose} {name} ({_number(error.limit)}{unit}) was reached"
    prefix = "Inspect: a limit was reached: "
    return prefix + _shorten(str(getattr(error, "message", kind)), MAX_REASON - len(prefix))


def _exception_text(error: BaseException) -> str:
    message = " ".join(str(error).split())  # one line, whatever the message's layout
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."
