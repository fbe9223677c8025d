"""How a tool reports a result that is not ``ok``: raise one of these; the runtime maps it."""

from __future__ import annotations

from typing import Any


class ToolError(Exception):
    """The tool ran and failed (file not found, old_string not unique...): status ``error``.

    ``code`` is the errno name (``"ENOENT"``) when an OS error is the cause: integrations map it
    to their own exceptions, never the message, which names the caller's path.
    """

    status = "error"

    def __init__(
        self, message: str, *, code: str | None = None, value: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        #: What the tool has to show for itself all the same (bash: the output until the kill).
        self.value = value


class Denied(ToolError):
    """The path resolves outside the workspace (through .. or a symlink): status ``denied``."""

    status = "denied"


class OutputLimitExceeded(ToolError):
    """The tool produced more than max_output_bytes: status ``output_limit``."""

    status = "output_limit"


class LimitExceeded(ToolError):
    """A resource limit (memory, file size...) stopped the tool; ``limit`` names it."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(message)
        self.limit = limit
