"""One call's life, the same for every pool: intent, run, outcome, durable, whatever happens.

    Pool.call / RayPool.call (checks that raise: misuse, a closed pool)
        |  CallLife made; a CancelToken subscribed to it (token_subscription)
        |  driver task: CallLife.drive(journal, run)
        |      journal intent (durable first for side effects; refused when the disk fails)
        |      killed already? the killer's outcome, nothing run
        |      run()  (Pool: gate, worker, outcome; RayPool: the node's Pool does that)
        |      a driver cancelled by close(): a shutdown outcome; a bug: crashed
        |      journal outcome (Journal.settle: on disk first under policy "always")
        |      its span, if the pool sends any (telemetry.py: queued, never awaited)
        v
    attend(driver, life): the caller's await; its task cancelled -> kill requested, the driver
        finishes (shielded), then the caller gets its own CancelledError back

Every step a call takes on its way (a journal policy, a change set, a network rule) is written
here once, and Pool and RayPool both get it. What differs, how a call is *run*, is the ``run``
coroutine each passes in; what differs in how a kill is *sent* is ``CallLife.request_kill``,
which a subclass extends (RayPool sends its node a cancel; Pool's CallState wakes its driver).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import ChangeMode
from sandbx_pool.journal.records import JOURNAL_REFUSED
from sandbx_pool.journal.store import Journal
from sandbx_pool.journal.writer import JournalWriteError
from sandbx_pool.logs import logger
from sandbx_pool.outcome import STATUS_OF_KILLER, KilledBy, Outcome, Status
from sandbx_pool.telemetry import Telemetry
from sandbx_pool.workers.schemas import SIDE_EFFECT_TOOLS


class CallLife:
    """One call from its intent to its durable outcome: who asked for its kill first, and the
    outcome it ends with. Made on the caller's event loop, and used only there."""

    def __init__(
        self,
        call_id: str,
        tool: str,
        raw_args: Any,
        timeout_s: float | None,
        cwd: str | None = None,
        workspace: str | None = None,
    ) -> None:
        self.call_id = call_id
        self.tool = tool
        self.raw_args = raw_args
        self.timeout_s = timeout_s
        self.cwd = cwd
        #: The absolute workspace the call is confined to (what its intent records).
        self.workspace = workspace
        self.started_at = time.monotonic()
        #: The same moment on the wall clock, for the call's span (telemetry.py).
        self.started_at_ns = time.time_ns()
        self.kill_requested: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.killer: KilledBy | None = None
        self.reason: str | None = None
        #: The call's change mode (sandbx_pool.change_sets), journaled with its intent.
        self.changes = ChangeMode.DIRECT
        #: The layer the call runs in (sandbx_pool.layers), journaled with its intent.
        self.layer_name: str | None = None
        #: The shell session the call runs in (sandbx_pool.sessions), journaled with its intent.
        self.session: str | None = None

    def request_kill(self, killer: KilledBy, reason: str | None = None) -> None:
        """Ask for the call's kill. The first killer wins and is recorded here, before any
        signal is sent: which one fired is never inferred from how the process died."""
        if self.killer is None and not self.kill_requested.done():
            self.killer = killer
            self.reason = reason
            self.kill_requested.set_result(None)

    def outcome(self, status: Status, **fields: Any) -> Outcome:
        return Outcome(
            call_id=self.call_id,
            tool=self.tool,
            status=status,
            duration_s=time.monotonic() - self.started_at,
            **fields,
        )

    def killed_outcome(self, **fields: Any) -> Outcome:
        """The outcome the first killer decided (its status, itself, its reason)."""
        assert self.killer is not None
        return self.outcome(
            STATUS_OF_KILLER[self.killer], killed_by=self.killer, reason=self.reason, **fields
        )

    def journaled_workspace(self) -> str | None:
        """The workspace the intent names: where the call's cwd and paths are."""
        return self.workspace

    def shutdown_fields(self) -> dict[str, Any]:
        """What a call cut off by close() says of how far it got (Pool: its worker)."""
        return {}

    async def drive(
        self,
        journal: Journal | None,
        run: Callable[[], Awaitable[Outcome]],
        telemetry: Telemetry | None = None,
    ) -> Outcome:
        """Journal the intent, ``run()`` the call, journal its one outcome, whatever happens;
        then its span, when ``telemetry`` is on. The caller's task never runs this itself: it
        is the driver task's (see ``attend``)."""
        outcome = await self._intent(journal)
        if outcome is None and self.killer is not None:
            outcome = self.killed_outcome()  # refused: nothing is started for it
        if outcome is None:
            try:
                outcome = await run()
            except asyncio.CancelledError:
                # Only close() cancels a driver, when the call outlived close_timeout_s: it
                # still ends as one outcome, and its caller gets that outcome rather than a hang.
                outcome = self.outcome(
                    Status.CANCELLED,
                    killed_by=KilledBy.SHUTDOWN,
                    reason="pool closed before the call ended",
                    **self.shutdown_fields(),
                )
            except Exception as exc:  # a coordinator bug must still end as exactly one outcome
                logger.exception("call {} failed in the coordinator", self.call_id)
                outcome = self.outcome(Status.CRASHED, error=f"coordinator error: {exc}")
        if journal is not None:
            await journal.settle(outcome)
        if telemetry is not None:
            # After the journal: the span is a copy of what the journal holds. Never a reason
            # for the call to fail (the exporter's faults are its own thread's).
            try:
                telemetry.call_ended(self, outcome)
            except Exception:
                logger.exception("call {}: its span could not be made", self.call_id)
        return outcome

    def journaled_network(self) -> bool | list[str] | None:
        """The call's own network, as its intent records it (None: the pool's)."""
        return None

    async def _intent(self, journal: Journal | None) -> Outcome | None:
        """Journal the intent; the refusal outcome when a side effect could not be journaled."""
        if journal is None:
            return None
        raw = self.raw_args
        try:
            await journal.intent(
                call_id=self.call_id,
                tool=self.tool,
                args=raw if isinstance(raw, dict) else {"<invalid>": repr(raw)},
                cwd=self.cwd or ".",
                timeout_s=self.timeout_s,
                workspace=self.journaled_workspace(),
                changes=None if self.changes is ChangeMode.DIRECT else str(self.changes),
                layer=self.layer_name,
                session=self.session,
                network=self.journaled_network(),
            )
        except JournalWriteError as exc:
            # Fail closed: a side effect never starts without its durable intent. A read-only
            # call has nothing to account for, and runs.
            if self.tool in SIDE_EFFECT_TOOLS:
                return self.outcome(Status.ERROR, error=f"not run: {exc}", reason=JOURNAL_REFUSED)
        return None


def token_subscription(cancel: CancelToken | None, life: CallLife) -> Callable[[], None] | None:
    """Subscribe ``life`` to ``cancel``; returns the unsubscribe. A token already cancelled
    requests the kill at once, so the call is refused before anything is started."""
    if cancel is None:
        return None
    loop = asyncio.get_running_loop()

    def on_cancel(reason: str | None) -> None:
        # cancel() may run on any thread; the call's state belongs to the loop's.
        loop.call_soon_threadsafe(life.request_kill, KilledBy.TOKEN, reason)

    return cancel.subscribe(on_cancel)


async def attend(driver: asyncio.Task[Outcome], life: CallLife) -> Outcome:
    """The caller's wait for its call's driver. Cancelling the caller's task only requests
    the kill: the driver finishes its cleanup, shielded, and the CancelledError is re-raised
    after it, with its original args."""
    try:
        return await asyncio.shield(driver)
    except asyncio.CancelledError as exc:
        reason = str(exc.args[0]) if exc.args else "the awaiting task was cancelled"
        life.request_kill(KilledBy.TASK, reason)
        # Cleanup runs to its end whatever happens to us; our own cancellation follows it.
        # Under anyio a cancelled scope cancels us again at every await, so keep waiting
        # until the driver is done (a short spin, bounded by the kill's own deadlines).
        while not driver.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({driver})
        raise


__all__ = ["CallLife", "attend", "token_subscription"]
