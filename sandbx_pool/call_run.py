"""One call's run on this machine's pool: the part of its life (call_life.py) that needs a worker.

    CallLife.drive --run()--> CallRunner.run(call)
        features' around (a session's turn, a layer's: call_seam.py)
            killed already?             --> the killer's outcome, nothing forked
            features' prepare           --> what the call needs made (change sets, proxy)
            the checks (preflight.py)   --> denied / error, nothing forked
            features' admit             --> the Call encoded with their part of its context
            pool closing?               --> killed (shutdown)
            Fleet.acquire               --> a worker (or killed while it waited)
            Fleet.execute               --> the outcome (call_on_worker.py)
            features' settle            --> the outcome, its change set applied or kept aside
        <-- the outcome, which CallLife journals

The pool's own questions (is the workspace a directory; the temp files a crash left) and the
features' own actions (apply or undo a change set, make or diff a layer) run here too, through
``internal``: a worker confined as a call's, with no feature's hooks around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from sandbx_pool import preflight
from sandbx_pool.call_on_worker import Unsendable, encode_call
from sandbx_pool.call_seam import Features
from sandbx_pool.call_state import CallState
from sandbx_pool.config import CallSettings
from sandbx_pool.errors import WorkersFailToStart
from sandbx_pool.fleet import Fleet
from sandbx_pool.journal.store import Journal
from sandbx_pool.outcome import KilledBy, Outcome, Status


class CallRunner:
    """Runs calls on the pool's fleet, its features' hooks around each."""

    def __init__(
        self,
        fleet: Fleet,
        features: Features,
        settings: CallSettings,
        side: Callable[[], preflight.PoolSide],
        accepting: Callable[[], bool],
        changes_root: Callable[[], str],
    ) -> None:
        self.fleet = fleet
        self.features = features
        self.settings = settings
        #: The pool as the checks see it, read at each call (the sandbox grows as it starts).
        self.side = side
        #: Whether the pool still runs calls (open, its template alive).
        self.accepting = accepting
        #: The change sets' directory, writable for the coordinator's own actions on them.
        self.changes_root = changes_root
        #: The pool's journal, once it is open (None: calls are not journaled).
        self.journal: Journal | None = None

    async def run(self, call: CallState) -> Outcome:
        """The call's run, from its first feature's turn to its settled outcome."""
        return await self.features.around(call, lambda: self._run_here(call))

    async def _run_here(self, call: CallState) -> Outcome:
        # Checks that need no process, in order: nothing is forked for a refused call.
        if call.killer is not None:
            return call.killed_outcome()
        refused = self.features.prepare(call)
        if refused is not None:
            return refused
        payload = preflight.prepare(call, self.side())
        if isinstance(payload, Outcome):
            return payload
        admitted = self.features.admit(call, payload)
        if isinstance(admitted, Outcome):
            return admitted
        if not self.accepting():
            call.request_kill(KilledBy.SHUTDOWN, "pool closing")
        try:
            worker = await self.fleet.acquire(call)
        except WorkersFailToStart as exc:
            return call.outcome(Status.ERROR, error=str(exc))
        if worker is None:
            return call.killed_outcome()
        outcome = await self.fleet.execute(call, worker, admitted, self.settings, self.journal)
        return await self.features.settle(call, outcome)

    async def internal(
        self,
        call_id: str,
        tool: str,
        args: dict[str, Any],
        workspace: str,
        layer: tuple[str, str | None] | None = None,
        read_only: tuple[str, ...] | None = None,
        image: tuple[str, ...] | None = None,
    ) -> Outcome:
        """Run one of the coordinator's own actions on a worker confined to ``workspace``,
        the change sets' directory writable besides; or, for a layer's (``layer``: its
        directory and base, mounted; ``read_only``: paths readable besides), nothing more."""
        call = CallState(call_id, tool, args, None, workspace=workspace)
        if layer is not None:
            call.layer_dir, call.layer_base = layer
            call.layer_image = image
        context = preflight.call_context(call, workspace, self.side())
        box = context.sandbox
        if read_only is None:
            box = msgspec.structs.replace(box, writable=(*box.writable, self.changes_root()))
        else:
            box = msgspec.structs.replace(box, read_only=(*box.read_only, *read_only))
        call.context = msgspec.structs.replace(context, workspace=workspace, sandbox=box)
        return await self.chore(call)

    async def chore(self, call: CallState, *, journaled: bool = True) -> Outcome:
        """Run ``call`` (its context set) on a worker, no feature's hook around it: the
        pool's own question, or a feature's action. Not ``journaled``: nothing of it is."""
        try:
            payload = encode_call(call)
            worker = await self.fleet.acquire(call)
        except (WorkersFailToStart, Unsendable) as exc:
            return call.outcome(Status.ERROR, error=str(exc))
        if worker is None:
            return call.killed_outcome()
        journal = self.journal if journaled else None
        return await self.fleet.execute(call, worker, payload, self.settings, journal)


__all__ = ["CallRunner"]
