"""The batch file of ``sandbx-pool run``: one tool call a line, loaded into typed ``CallSpec``s.

Each non-blank line of CALLS.jsonl is a JSON object::

    {"tool": "read", "args": {"path": "a.txt"}, "timeout": 5, "id": "c1", "cwd": "src",
     "after": ["c0"], "workspace": "episode-7", "changes": "transactional", "session": "ep7"}
    {"tool": "bash", "args": {"command": "pytest"}, "base": "repos/django", "layer": "s-17"}
    {"tool": "bash", "args": {"command": "pytest"}, "image": "swe/django:4.2", "layer": "t-3"}

``tool`` is required; ``args`` defaults to ``{}``; ``timeout`` (seconds) defaults to the
config's ``calls.timeout_s``; ``cwd`` to the workspace root. ``workspace`` names a folder under
the run's workspace root (``--workspace``) that the call is confined to instead of the root; on
a Ray cluster all calls of one workspace run on one node. ``meta`` is anything the file's
author wants to keep with the line (an episode, a step); the runner ignores it. ``changes`` is
the call's change mode (``direct``, ``tracked``, ``transactional``: sandbx_pool.changes; default
``run --changes``, else the config's); it is not part of a derived id. ``network`` is the
call's network (``true``, ``false`` or a list of host patterns: ``Pool.call``'s ``network``,
replacing the config's ``[sandbox] network``), not part of a derived id either. Any other key is
an error, so that a typo ("timout") is not silently ignored. ``session`` runs the call in
that shell session (sandbx_pool.sessions: bash keeps its cd and exports); a session's lines
run in file order (each comes ``after`` the session's previous line), and ``--resume`` finds
each session as the journal left it. ``after`` lists ids of *earlier*
lines that must have finished (whatever their outcome) before this call starts: it orders a
write before the edit of the same file, which parallel lanes would otherwise race.

``layer`` runs the call in the pool's layer of that name (sandbx_pool.layers), made over
``base`` by the first call that needs it (a folder under the workspace root, or an absolute
path), opened as it is when it exists already (a run resumed, or a layer made earlier): many
samples each starting from the same repository, each changing its own copy-on-write layer,
the repository never written. Every line of a layer names the same ``base`` or none; a layer's
calls run one at a time, whatever ``--parallel`` says; ``workspace`` and a ``changes`` other
than direct do not go with ``layer``. The layers stay after the run (``Layer.diff`` lists what
a sample changed; remove them with ``Layer.remove``).

``image`` instead of ``base`` lays the layer over a container image (``Pool.layer``'s
``image``: the image is the call's ``/``): a reference as ``sandbx-pool image pull`` takes it
(a relative ``oci:`` path is from the directory the run starts in), checked here for form and
kept canonical (``images.refs``). Every line of a layer names the same image or none, and no
line of it a ``base``. Each image is found in the store or pulled
once per run, by the first line that needs it; later layers over it take the same one.

``id`` is what ``--resume`` and the journal know the call by. Without one, the id is derived
from the line's content, not its position: ``sha256`` of the canonical JSON of tool, args,
timeout (and cwd when given), plus the occurrence index among identical lines, so that adding
or removing *other* lines keeps the ids of a resumed file valid, and two identical lines stay
two calls.

The whole file is checked before anything runs: a structural problem (bad JSON, no ``tool``,
an unknown tool, ``args`` not an object, a duplicate id, ...) is a ``BatchFileError`` listing
the lines and what is wrong with each. Arguments the tool's schema rejects are *not* file
errors: such a call ends as an ``error`` outcome like any other misuse of a tool, which is
what an evaluation replaying an agent's calls wants to see; they are reported up front as
``warnings`` so that a typo is noticed before a long run rather than after it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from collections.abc import Iterable
from typing import Any, Final

import msgspec

from sandbx_pool import allow_list
from sandbx_pool.config import change_mode
from sandbx_pool.errors import SandbxPoolError
from sandbx_pool.images.refs import parse_ref
from sandbx_pool.layer_store import check_name
from sandbx_pool.sessions import check_id
from sandbx_pool.workers.schemas import TOOL_ARGS, UnknownTool, parse_args

#: The keys a line may have. Anything else is a typo worth stopping for ("timout").
LINE_KEYS: Final = (
    "tool",
    "args",
    "timeout",
    "id",
    "cwd",
    "after",
    "meta",
    "workspace",
    "changes",
    "layer",
    "base",
    "image",
    "session",
    "network",
)

#: Problems listed in a BatchFileError; a file wrong on every line needs no 20,000-line message.
MAX_REPORTED: Final = 20

#: Hex digits of the sha256 kept in a derived id: 64 bits, no collision in any real batch.
ID_HEX_DIGITS: Final = 16


class CallSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One line of a batch file. ``line`` is 1-based."""

    line: int
    call_id: str
    tool: str
    args: dict[str, Any]
    timeout_s: float | None = None
    cwd: str | None = None
    after: tuple[str, ...] = ()
    #: A folder under the run's workspace root (relative, normalised), or None: the root.
    workspace: str | None = None
    #: The call's change mode, or None: the run's.
    changes: str | None = None
    #: The layer the call runs in (sandbx_pool.layers), or None.
    layer: str | None = None
    #: Its base (relative: under the workspace root), as any line of the layer names it.
    base: str | None = None
    #: The image it lies over instead (a canonical reference), as any line of the layer names it.
    image: str | None = None
    #: The shell session it runs in (sandbx_pool.sessions), or None.
    session: str | None = None
    #: The call's network (sandbx_pool.allow_list), or None: the config's.
    network: bool | tuple[str, ...] | None = None


class LineProblem(msgspec.Struct, frozen=True):
    line: int
    message: str


class BatchFile(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    calls: list[CallSpec]
    #: Lines whose arguments the tool will refuse (they will end as ``error`` outcomes).
    warnings: list[LineProblem] = msgspec.field(default_factory=list)


class BatchFileError(SandbxPoolError):
    """The batch file is malformed; ``problems`` says which lines and what is wrong."""

    def __init__(self, path: str, problems: list[LineProblem], total: int | None = None) -> None:
        self.path = path
        self.problems = problems
        self.total = len(problems) if total is None else total
        lines = [
            f"{path}:{p.line}: {p.message}" if p.line else f"{path}: {p.message}" for p in problems
        ]
        if self.total > len(problems):
            lines.append(f"... and {self.total - len(problems)} more problem(s)")
        super().__init__("\n".join(lines))


def canonical_json(
    tool: str,
    args: Any,
    timeout_s: float | None,
    cwd: str | None,
    workspace: str | None = None,
    layer: str | None = None,
    session: str | None = None,
) -> str:
    """The form hashed into a derived id: sorted keys, no spaces, timeout as a float."""
    content: dict[str, Any] = {"tool": tool, "args": args, "timeout": timeout_s}
    if cwd is not None:
        content["cwd"] = cwd
    if workspace is not None:  # absent when not given: ids of older files stay the same
        content["workspace"] = workspace
    if layer is not None:
        content["layer"] = layer
    if session is not None:
        content["session"] = session
    return json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def derived_id(canonical: str, occurrence: int) -> str:
    """``<16 hex digits of sha256>-<n>``: the n-th (0-based) line with this content."""
    digest = hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{digest[:ID_HEX_DIGITS]}-{occurrence}"


def load_batch(path: str | os.PathLike[str]) -> BatchFile:
    """Read and check a batch file. Raises BatchFileError, or OSError if it cannot be read."""
    name = os.fspath(path)
    with open(name, "rb") as f:
        return parse_batch(f, name)


def parse_batch(lines: Iterable[bytes | str], path: str = "<calls>") -> BatchFile:
    """Check every line; return the calls in file order, or raise one error listing problems."""
    problems: list[LineProblem] = []
    calls: list[CallSpec] = []
    seen_ids: dict[str, int] = {}
    occurrences: Counter[str] = Counter()
    #: Each session's latest line: the next line of the session comes after it.
    latest: dict[str, str] = {}
    for number, raw in enumerate(lines, start=1):
        try:
            spec = _parse_line(number, raw, occurrences, seen_ids)
        except _BadLine as exc:
            problems.append(LineProblem(number, str(exc)))
            continue
        if spec is not None:
            session = spec.session
            if session is not None:
                # A session's calls run in file order, whichever lane takes them (and a call
                # after one in doubt is held, as its session's state is then unknown).
                previous = latest.get(session)
                if previous is not None and previous not in spec.after:
                    spec = msgspec.structs.replace(spec, after=(*spec.after, previous))
                latest[session] = spec.call_id
            seen_ids[spec.call_id] = number
            calls.append(spec)
    calls = _same_images(calls, problems)  # first: a base it finds is one a line names
    calls = _same_bases(calls, problems)
    if problems:
        raise BatchFileError(path, problems[:MAX_REPORTED], len(problems))
    return BatchFile(path=path, calls=calls, warnings=_argument_warnings(calls))


class _BadLine(Exception):
    pass


def _parse_line(
    number: int, raw: bytes | str, occurrences: Counter[str], seen_ids: dict[str, int]
) -> CallSpec | None:
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _BadLine(f"not UTF-8 (byte {exc.start + 1})") from None
    if not raw.strip():
        return None
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _BadLine(f"bad JSON: {exc.msg} (column {exc.colno})") from None
    except RecursionError:
        raise _BadLine("bad JSON: nested too deeply") from None
    if not isinstance(item, dict):
        raise _BadLine(f"expected a JSON object, got {_json_type(item)}")
    unknown = sorted(set(item) - set(LINE_KEYS))
    if unknown:
        raise _BadLine(f"unknown key {unknown[0]!r} (a line may have: {', '.join(LINE_KEYS)})")
    tool = _tool(item)
    args = item.get("args", {})
    if not isinstance(args, dict):
        raise _BadLine(f'"args" must be an object, got {_json_type(args)}')
    timeout_s = _timeout(item.get("timeout"))
    cwd = item.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise _BadLine(f'"cwd" must be a string, got {_json_type(cwd)}')
    after = _after(item.get("after", []), seen_ids)
    workspace = _workspace(item.get("workspace"))
    session = _session(item.get("session"))
    changes = item.get("changes")
    if changes is not None:
        try:
            change_mode(changes)
        except ValueError as exc:
            raise _BadLine(f'"changes" {str(exc).removeprefix("changes ")}') from None
    layer, base = _layer(item, workspace, changes)
    image = _image(item.get("image"), layer, base)
    network = None
    if item.get("network") is not None:
        try:
            network = allow_list.parse_network(item["network"], '"network"')
        except ValueError as exc:
            raise _BadLine(str(exc)) from None
    if "id" in item:
        call_id = _explicit_id(item["id"])
    else:
        canonical = canonical_json(tool, args, timeout_s, cwd, workspace, layer, session)
        call_id = derived_id(canonical, occurrences[canonical])
        occurrences[canonical] += 1
    if call_id in seen_ids:
        raise _BadLine(f"id {call_id!r} is already used by line {seen_ids[call_id]}")
    return CallSpec(
        line=number,
        call_id=call_id,
        tool=tool,
        args=args,
        timeout_s=timeout_s,
        cwd=cwd,
        after=after,
        workspace=workspace,
        changes=changes,
        layer=layer,
        base=base,
        image=image,
        session=session,
        network=network,
    )


def _session(value: Any) -> str | None:
    if value is None:
        return None
    try:
        return check_id(value)
    except ValueError as exc:
        raise _BadLine(f'"session": {exc}') from None


def _layer(
    item: dict[str, Any], workspace: str | None, changes: Any
) -> tuple[str | None, str | None]:
    """A line's ``layer`` and ``base``, checked lexically (the pool checks the rest)."""
    layer, base = item.get("layer"), item.get("base")
    if layer is None:
        if base is not None:
            raise _BadLine('"base" needs "layer": the layer the call runs in over it')
        return None, None
    try:
        check_name(layer)
    except ValueError as exc:
        raise _BadLine(f'"layer": {exc}') from None
    if workspace is not None:
        raise _BadLine('"workspace" and "layer" do not go together: a layer is a workspace')
    if changes is not None and changes != "direct":
        raise _BadLine(f'"changes" {changes!r} in a layer: its calls are direct into it')
    if base is None:
        return layer, None
    if not isinstance(base, str) or not base or "\x00" in base:
        raise _BadLine(f'"base" must be a non-empty path, got {base!r}')
    if os.path.isabs(base):
        return layer, os.path.normpath(base)
    return layer, _workspace(base) or "."


def _image(value: Any, layer: str | None, base: str | None) -> str | None:
    """A line's ``image``: a reference of the right form, for a layer with no base."""
    if value is None:
        return None
    if layer is None:
        raise _BadLine('"image" needs "layer": the layer the call runs in over it')
    if base is not None:
        raise _BadLine('"base" and "image" do not go together: a layer lies over one of them')
    if not isinstance(value, str):
        raise _BadLine(f'"image" must be an image reference, got {_json_type(value)}')
    try:
        # Canonical: two spellings of one image are one image (``python`` and
        # ``docker.io/library/python:latest``), and a relative ``oci:`` path is the run's.
        return parse_ref(value).canonical
    except ValueError as exc:
        raise _BadLine(f'"image": {exc}') from None


def _same_images(calls: list[CallSpec], problems: list[LineProblem]) -> list[CallSpec]:
    """Every line of a layer with its image (the one its lines name; two are a problem, and
    so is a base on one line and an image on another)."""
    images: dict[str, tuple[str, int]] = {}
    for spec in calls:
        if spec.layer is not None and spec.image is not None:
            known = images.setdefault(spec.layer, (spec.image, spec.line))
            if known[0] != spec.image:
                problems.append(
                    LineProblem(
                        spec.line,
                        f"layer {spec.layer!r} is over image {known[0]!r} (line {known[1]}),"
                        f" not {spec.image!r}",
                    )
                )
    for spec in calls:
        if spec.layer in images and spec.base is not None:
            image, line = images[spec.layer]
            problems.append(
                LineProblem(
                    spec.line,
                    f"layer {spec.layer!r} is over image {image!r} (line {line}), not over"
                    f" {spec.base!r}",
                )
            )
    return [
        msgspec.structs.replace(spec, image=images[spec.layer][0])
        if spec.layer is not None and spec.layer in images
        else spec
        for spec in calls
    ]


def _same_bases(calls: list[CallSpec], problems: list[LineProblem]) -> list[CallSpec]:
    """Every line of a layer with its base (the one its lines name; two are a problem)."""
    bases: dict[str, tuple[str, int]] = {}
    for spec in calls:
        if spec.layer is None or spec.base is None:
            continue
        known = bases.setdefault(spec.layer, (spec.base, spec.line))
        if known[0] != spec.base:
            problems.append(
                LineProblem(
                    spec.line,
                    f"layer {spec.layer!r} is over {known[0]!r} (line {known[1]}), not"
                    f" {spec.base!r}",
                )
            )
    return [
        msgspec.structs.replace(spec, base=bases[spec.layer][0])
        if spec.layer is not None and spec.layer in bases
        else spec
        for spec in calls
    ]


def _workspace(value: Any) -> str | None:
    """A folder under the workspace root, checked lexically (nothing is stat'ed)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise _BadLine(f'"workspace" must be a non-empty string, got {_json_type(value)}')
    name = os.path.normpath(value)
    if os.path.isabs(name) or name == ".." or name.startswith("../"):
        raise _BadLine(f'"workspace" must be a folder under the workspace root, got {value!r}')
    return None if name == "." else name


def _tool(item: dict[str, Any]) -> str:
    if "tool" not in item:
        raise _BadLine('missing "tool"')
    tool = item["tool"]
    if not isinstance(tool, str):
        raise _BadLine(f'"tool" must be a string, got {_json_type(tool)}')
    if tool not in TOOL_ARGS:
        raise _BadLine(f"unknown tool {tool!r} (known: {', '.join(TOOL_ARGS)})")
    return tool


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    # bool is an int to Python but never a number of seconds.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadLine(f'"timeout" must be a number of seconds, got {_json_type(value)}')
    if not math.isfinite(value) or value <= 0:
        raise _BadLine(f'"timeout" must be a positive number of seconds, got {value!r}')
    # A float, so that 5 and 5.0 derive the same id.
    return float(value)


def _explicit_id(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str) or not value.strip():
        raise _BadLine(f'"id" must be a non-empty string or an integer, got {_json_type(value)}')
    return value


def _after(value: Any, seen_ids: dict[str, int]) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _BadLine(f'"after" must be a list of ids, got {_json_type(value)}')
    for dependency in value:
        # Earlier lines only: lanes take calls in file order, so a call never waits on one
        # that no lane has taken yet, and a cycle cannot be written.
        if dependency not in seen_ids:
            raise _BadLine(f'"after": {dependency!r} is not the id of an earlier line')
    return tuple(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})" if len(value) <= 40 else "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"


def _argument_warnings(calls: list[CallSpec]) -> list[LineProblem]:
    warnings = []
    for spec in calls:
        try:
            parse_args(spec.tool, spec.args)
        except (UnknownTool, msgspec.ValidationError) as exc:
            warnings.append(LineProblem(spec.line, f"{spec.tool}: {exc}"))
        except RecursionError:
            warnings.append(LineProblem(spec.line, f"{spec.tool}: arguments nested too deeply"))
    return warnings
