"""CancelToken: one switch that stops whichever calls it guards, from any thread."""

from __future__ import annotations

import threading
from collections.abc import Callable

CancelCallback = Callable[[str | None], None]


class CancelToken:
    """Cancel every call made with this token, in flight or future.

    One token may guard several calls (cancel a whole agent turn). ``cancel()`` may be called
    from any thread; the pool's callbacks hop onto its event loop themselves. A token already
    cancelled when a call is made refuses the call before anything is forked.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reason: str | None = None
        self._cancelled = False
        self._callbacks: dict[int, CancelCallback] = {}
        self._next_key = 0

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def reason(self) -> str | None:
        return self._reason

    def cancel(self, reason: str | None = None) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            self._reason = reason
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for callback in callbacks:
            callback(reason)

    def subscribe(self, callback: CancelCallback) -> Callable[[], None]:
        """Call ``callback(reason)`` on cancel, at once if already cancelled.

        Returns the function that unsubscribes it.
        """
        with self._lock:
            if not self._cancelled:
                key = self._next_key
                self._next_key += 1
                self._callbacks[key] = callback
                return lambda: self._forget(key)
        callback(self._reason)
        return lambda: None

    def _forget(self, key: int) -> None:
        with self._lock:
            self._callbacks.pop(key, None)

    def __repr__(self) -> str:
        state = f"cancelled reason={self._reason!r}" if self._cancelled else "active"
        return f"<CancelToken {state} | {len(self._callbacks)} calls>"
