"""What the Inspect provider learns from, and leaves in, the eval that runs it.

* Concurrency: Inspect bounds an eval's samples (``max_samples``) and subprocesses
  (``max_subprocesses``) itself; the provider's pool must not be a narrower bound of its own
  (a 2-core default of 4 workers ran 24 samples of ``sleep 1.5`` in 9.2 s, not 1.65 s). So a
  pool given no ``workers`` admits at least ``max_subprocesses`` calls from the start, and one
  more for each sample alive (samples alive never exceed ``max_samples``, however Inspect
  retunes it during the eval).
* The journal: printed once per task, as a warning through the standard ``logging`` module,
  which Inspect shows on its console and records (loguru's ``sandbx_pool`` logs stay off in a
  library, so they would print nothing); and each sample's transcript gets an info event naming
  it, so the eval log says where every call of the sample is recorded.
* Cancel reasons: a sample stopped by Inspect cancels the task awaiting the call, with an anyio
  message ("Cancelled via cancel scope 7f88...") that says nothing to a reader of the journal.
  The provider cancels its calls through a token instead, with a reason inspect_cancel reads
  from the eval (a limit, the operator, Ctrl-C, another task's error).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Final

from inspect_ai.log import transcript

#: The source named on the transcript events the provider writes.
EVENT_SOURCE: Final = "sandbx"


def max_subprocesses() -> int | None:
    """The eval's ``max_subprocesses`` (Inspect's default when none was given), if readable."""
    try:
        from inspect_ai.util._subprocess import max_subprocesses_context_var
    except ImportError:  # a private name: an Inspect without it just gets no hint
        return None
    return max_subprocesses_context_var.get()


def announce_journal(path: str) -> None:
    """Say once, where an eval's user looks, which journal records the task's calls."""
    logging.getLogger("sandbx_pool.inspect").warning("sandbx: task journal %s", path)


def record_journal(path: str) -> None:
    """Name the journal in the running sample's transcript (part of the eval log)."""
    with contextlib.suppress(Exception):  # no sample running (a direct test call): no log
        transcript().info({"sandbx_journal": path}, source=EVENT_SOURCE)
