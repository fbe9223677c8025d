"""The journal's records: one tagged msgspec Struct per JSON Lines line.

A call leaves, in order::

    {"kind": "intent",  "call_id": ..., "tool": ..., "args": {...}, "cwd": ..., "timeout_s": ...}
    {"kind": "started", "call_id": ..., "pid": ...}          (a worker took the call)
    {"kind": "outcome", "call_id": ..., "status": ..., ...}  (exactly one per intent)

a call in tracked or transactional mode whose change set is applied, an ``applying`` record
between its ``started`` and its outcome (whose ``changes`` lists the paths), and an ``undo``
of it an ``undone`` record,

and, when a coordinator reopens a journal whose previous writer died with calls in flight, one
``in_doubt`` record per intent left without an outcome: the new coordinator reported it (log,
``Journal.interrupted``, the pool's temp-file cleanup), so the next opening reports only the
calls that were in flight at the *latest* crash. The record's name is older than the word's
one meaning (``reader.call_ledger``): it marks an interrupted call as reported, and changes
nothing about whether the call is in doubt.

Every record carries ``v``, the journal format version. Rules from msgspec's schema-evolution
guide: new fields get defaults and go last; a field's type never changes. ``status`` and
``killed_by`` are stored as plain strings, not the enums of ``outcome``, so that a reader built
before a new status existed still parses the line instead of calling it corrupt.

Large arguments are summarised, never copied: a string longer than ``summarize_over_bytes``
(UTF-8) becomes ``{"summary": true, "bytes": N, "sha256": HEX}``. A journal that copied every
write's content would cost as much as the workspace and leak whatever the agent wrote.
"""

from __future__ import annotations

import hashlib
from typing import Any, Final

import msgspec

from sandbx_pool.outcome import Outcome

JOURNAL_VERSION: Final = 1

#: The ``reason`` of an outcome whose call was not run because its intent could not be made
#: durable (disk full, journal removed): nothing happened, so ``run --resume`` runs it again.
JOURNAL_REFUSED: Final = "journal unavailable"

#: The ``reason`` of a ``crashed`` outcome whose call was lost with its Ray node
#: (integrations.ray): ``run --resume`` runs it again, on a live node, unless it may have done
#: a side effect that is not idempotent (then it is in doubt, as after a coordinator crash).
NODE_LOST: Final = "node lost"

#: Tools that may run again whatever happened the first time: the read-only ones, and write,
#: which sets a file's whole content (running it twice leaves what running it once left, unless
#: another call changed that file in between). edit and bash may not: a second run can apply
#: a change twice (an append, a counter) or fail where the first succeeded.
IDEMPOTENT_TOOLS: Final = frozenset({"read", "ls", "grep", "find", "write"})

#: Strings in an outcome's value longer than this many bytes are summarised. Smaller than the
#: argument limit on purpose: the caller already has the value; the journal keeps enough to
#: account for the call (exit code, sizes, a hash to compare), not a second copy of the output.
VALUE_STRING_BYTES: Final = 256

#: A value summary keeps at most this many keys per mapping and descends this deep; a tool that
#: returns a huge mapping must not turn one outcome line into megabytes.
VALUE_MAX_KEYS: Final = 32
VALUE_MAX_DEPTH: Final = 2


class _Keyed(msgspec.Struct, tag_field="kind", frozen=True):
    call_id: str
    time: float


class Record(_Keyed, frozen=True, kw_only=True):
    """Fields every record has. ``time`` is a unix timestamp taken when the event happened.

    Two classes so that every line starts ``{"kind", "call_id", "time", "v", ...}``: msgspec
    puts positional fields first, and ``v`` needs a default, which only kw_only allows here.
    """

    v: int = JOURNAL_VERSION


class IntentRecord(Record, tag="intent", frozen=True, kw_only=True):
    """A call is about to be dispatched. ``args`` is already summarised."""

    tool: str
    args: dict[str, Any]
    cwd: str
    timeout_s: float | None = None
    #: The pool's workspace, which ``cwd`` is relative to (absent in journals written before
    #: it was recorded).
    workspace: str | None = None
    #: The call's change mode (sandbx_pool.changes); absent: direct.
    changes: str | None = None
    #: The layer the call ran in (sandbx_pool.layers; ``workspace`` is its root); absent: none.
    layer: str | None = None
    #: The shell session the call ran in (sandbx_pool.sessions); absent: none.
    session: str | None = None
    #: The call's network when it had one of its own (Pool.call's ``network``); absent: the
    #: pool's config's.
    network: bool | list[str] | None = None


class StartedRecord(Record, tag="started", frozen=True, kw_only=True):
    """A worker (``pid``) received the call: from here its action may have happened."""

    pid: int


class OutcomeRecord(Record, tag="outcome", frozen=True, kw_only=True):
    """How the call ended; mirrors ``Outcome`` with the value replaced by a bounded summary."""

    tool: str
    status: str
    killed_by: str | None = None
    reason: str | None = None
    signal: int | None = None
    duration_s: float = 0.0
    error: str | None = None
    started: bool = False
    worker_pid: int | None = None
    limit: str | None = None
    quarantined: bool = False
    value_summary: dict[str, Any] | None = None
    wchan: str | None = None
    stuck_pid: int | None = None
    #: The Ray node the call ran on (integrations.ray); absent on one machine.
    node: str | None = None
    #: What the call did to the workspace (tracked, transactional): Outcome.changes.
    changes: list[dict[str, Any]] | None = None
    #: A session's call: the session's state after it (Outcome.session), restored from the
    #: latest such record when a pool opens the journal again.
    session: dict[str, Any] | None = None
    #: The hosts the network proxy refused the call (an allow-list): value["network_denied"].
    network_denied: list[str] | None = None
    #: An applied change set's images.json, hashed (Outcome.images_sha256): what undo checks.
    images_sha256: str | None = None
    #: What the call's process tree cost (Outcome.usage); absent: it never started, or its
    #: journal was written before usage was recorded.
    usage: dict[str, Any] | None = None

    @classmethod
    def from_outcome(cls, outcome: Outcome, *, time: float, limit: int) -> OutcomeRecord:
        return cls(
            call_id=outcome.call_id,
            time=time,
            tool=outcome.tool,
            status=str(outcome.status),
            killed_by=None if outcome.killed_by is None else str(outcome.killed_by),
            reason=clip(outcome.reason, limit),
            signal=outcome.signal,
            duration_s=outcome.duration_s,
            error=clip(outcome.error, limit),
            started=outcome.started,
            worker_pid=outcome.worker_pid,
            limit=outcome.limit,
            quarantined=outcome.quarantined,
            value_summary=summarize_value(outcome.value),
            wchan=outcome.wchan,
            stuck_pid=outcome.stuck_pid,
            node=outcome.node,
            changes=outcome.changes,
            session=outcome.session,
            network_denied=_denied(outcome.value),
            images_sha256=outcome.images_sha256,
            usage=outcome.usage,
        )


def _denied(value: dict[str, Any] | None) -> list[str] | None:
    """The outcome's ``network_denied``, kept whole (the proxy bounds it) past the summary."""
    denied = value.get("network_denied") if value is not None else None
    return [str(host) for host in denied] if isinstance(denied, list) else None


class InDoubtRecord(Record, tag="in_doubt", frozen=True, kw_only=True):
    """Written at open for each intent the previous coordinator left without an outcome."""

    tool: str


class ApplyingRecord(Record, tag="applying", frozen=True, kw_only=True):
    """A call's change set is about to be applied to the workspace (sandbx_pool.changes):
    durable before the first path is touched. Without a later outcome, the apply may be half
    done; the next coordinator finishes it. ``status``: the call's, as it ended."""

    tool: str
    workspace: str
    status: str


class UndoneRecord(Record, tag="undone", frozen=True, kw_only=True):
    """``undo`` put back what call ``call_id`` changed: ``paths``."""

    paths: list[str]


JournalRecord = (
    IntentRecord | StartedRecord | OutcomeRecord | InDoubtRecord | ApplyingRecord | UndoneRecord
)


def _encode_fallback(obj: Any) -> Any:
    # Arguments and values come from callers and tools; an object JSON cannot hold (a Path, a
    # set, something exotic) must not make a record unwritable. Its bounded repr is enough to
    # account for the call.
    if isinstance(obj, set | frozenset):
        return sorted(obj, key=repr)
    return clip(repr(obj), 200)


#: Built once: msgspec encoders and decoders are cheap to use and comparatively costly to make.
encoder: Final = msgspec.json.Encoder(enc_hook=_encode_fallback)
decoder: Final = msgspec.json.Decoder(JournalRecord)


def digest(data: str | bytes) -> dict[str, Any]:
    """The summary that stands in for a large string: its size and its sha256."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return {"summary": True, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}


def is_digest(value: Any) -> bool:
    return isinstance(value, dict) and value.get("summary") is True and "sha256" in value


def _too_long(text: str, limit: int) -> bool:
    # UTF-8 takes 1 to 4 bytes a character, so most strings are decided without encoding them.
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


#: Containers nested deeper than this in a call's arguments are journaled as ``NESTED_TOO_DEEP``.
#: Arguments are journaled before they are validated (a refused call has an intent too), on the
#: writer thread: a model's argument nested 100,000 deep must cost its call a note, not kill the
#: writer with a RecursionError (every later intent would then wait for it forever). No tool's
#: arguments come near this depth.
MAX_ARGS_DEPTH: Final = 32
NESTED_TOO_DEEP: Final = {"summary": True, "nested_too_deeply": True}


def summarize(value: Any, limit: int, depth: int = 0) -> Any:
    """``value`` with every string over ``limit`` UTF-8 bytes replaced by its digest.

    Descends into dicts, lists and tuples (at most ``MAX_ARGS_DEPTH`` levels); everything else
    is returned as is.
    """
    if isinstance(value, str):
        return digest(value) if _too_long(value, limit) else value
    if isinstance(value, bytes | bytearray):
        return digest(bytes(value)) if len(value) > limit else bytes(value)
    if isinstance(value, dict | list | tuple) and depth >= MAX_ARGS_DEPTH:
        return dict(NESTED_TOO_DEEP)
    if isinstance(value, dict):
        return {key: summarize(item, limit, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [summarize(item, limit, depth + 1) for item in value]
    return value


def summarize_value(
    value: dict[str, Any] | None, *, string_limit: int = VALUE_STRING_BYTES
) -> dict[str, Any] | None:
    """A bounded summary of a tool's value, for the outcome record.

    Small scalars are kept, long strings become digests, lists become ``{"items": N}`` and
    nested mappings are kept down to ``VALUE_MAX_DEPTH``. A mapping with more than
    ``VALUE_MAX_KEYS`` keys keeps the first ones and counts the rest in ``"omitted_keys"``.
    """
    if value is None:
        return None
    return _summarize_mapping(value, string_limit, depth=1)


def _summarize_mapping(mapping: dict[Any, Any], string_limit: int, depth: int) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for index, (key, item) in enumerate(mapping.items()):
        if index == VALUE_MAX_KEYS:
            result["omitted_keys"] = len(mapping) - VALUE_MAX_KEYS
            break
        result[str(key)] = _summarize_item(item, string_limit, depth)
    return result


def _summarize_item(item: Any, string_limit: int, depth: int) -> Any:
    if item is None or isinstance(item, bool | int | float):
        return item
    if isinstance(item, str | bytes | bytearray):
        return summarize(item, string_limit)
    if isinstance(item, list | tuple | set | frozenset):
        return {"items": len(item)}
    if isinstance(item, dict):
        if depth >= VALUE_MAX_DEPTH:
            return {"keys": len(item)}
        return _summarize_mapping(item, string_limit, depth + 1)
    return {"type": type(item).__name__}


def clip(text: str | None, limit: int) -> str | None:
    """``text`` cut to ``limit`` characters, saying how long it was (errors can be tracebacks)."""
    if text is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text)} characters in all]"
