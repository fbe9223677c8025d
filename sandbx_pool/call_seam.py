"""The one seam through which a feature changes how a call runs on this machine's pool.

    Pool.call --accept--> (driver task) --around--> [ run here:
        killed? --prepare--> the checks (preflight) --admit--> worker --settle--> ]

A feature (change sets, layers and their images, sessions, the network proxy) is a
``CallFeature`` in a module of its own, and overrides only the hooks it needs; the pool holds
them in one ``Features`` and names none of their internals. Each hook, in the order a call
meets it:

* ``accept(call)``: synchronously, when Pool.call accepts the call, before its driver task
  starts and before a cancel token is subscribed (a ValueError refuses the call, nothing
  started). Returns what to do once the call's driver is done (a session's next call may go),
  or None.
* ``around(call, run)``: the call's turn; awaits ``run()`` or returns an outcome of its own
  without running it (a session's turn, a layer's). The first feature's is outermost.
* ``prepare(call)``: before the checks, nothing forked yet: what the call will need made
  (the change sets' directory, the proxy); an outcome refuses the call.
* ``admit(call, payload)``: the checks passed, ``call.context`` is set: the encoded Call, or
  again with the feature's part of the context (a change set's directory), or an outcome that
  refuses the call.
* ``settle(call, outcome)``: the outcome of a call a worker ran, before it is journaled (a
  change set applied or kept aside).
* ``close()``: the pool is closing (synchronous, after its workers are gone).

Features that touch every call without changing how it runs (the journal, the timeline,
OpenTelemetry spans, usage) are not here: call_life.py and call_on_worker.py carry them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from sandbx_pool.outcome import Outcome

if TYPE_CHECKING:
    from sandbx_pool.call_state import CallState

#: A call's run, as ``around`` is handed it.
Run = Callable[[], Awaitable[Outcome]]


class CallFeature:
    """A feature's hooks into a call's run; each one here does nothing."""

    def accept(self, call: CallState) -> Callable[[], None] | None:
        return None

    async def around(self, call: CallState, run: Run) -> Outcome:
        return await run()

    def prepare(self, call: CallState) -> Outcome | None:
        return None

    def admit(self, call: CallState, payload: bytes) -> bytes | Outcome:
        return payload

    async def settle(self, call: CallState, outcome: Outcome) -> Outcome:
        return outcome

    def close(self) -> None:
        return None


class Features:
    """The pool's features, in the order their hooks run (``around``: the first outermost)."""

    def __init__(self, features: Sequence[CallFeature]) -> None:
        self._features = tuple(features)

    def accept(self, call: CallState) -> list[Callable[[], None]]:
        releases = []
        for feature in self._features:
            release = feature.accept(call)
            if release is not None:
                releases.append(release)
        return releases

    async def around(self, call: CallState, run: Run) -> Outcome:
        for feature in reversed(self._features):
            run = _wrapped(feature, call, run)
        return await run()

    def prepare(self, call: CallState) -> Outcome | None:
        for feature in self._features:
            refused = feature.prepare(call)
            if refused is not None:
                return refused
        return None

    def admit(self, call: CallState, payload: bytes) -> bytes | Outcome:
        for feature in self._features:
            admitted = feature.admit(call, payload)
            if isinstance(admitted, Outcome):
                return admitted
            payload = admitted
        return payload

    async def settle(self, call: CallState, outcome: Outcome) -> Outcome:
        for feature in self._features:
            outcome = await feature.settle(call, outcome)
        return outcome

    def close(self) -> None:
        for feature in self._features:
            feature.close()


def _wrapped(feature: CallFeature, call: CallState, run: Run) -> Run:
    async def turn() -> Outcome:
        return await feature.around(call, run)

    return turn


__all__ = ["CallFeature", "Features", "Run"]
