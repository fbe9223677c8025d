"""The seven tools' arguments: the single source of truth for validation and JSON Schemas.

Each tool's arguments are a msgspec Struct. The coordinator converts a call's ``args`` dict to
it before anything is forked (a bad argument is an ``error`` outcome, not a crash), the worker
converts again on its side, and ``tool_schemas()`` derives the JSON Schema an LLM tool
definition needs from the same classes.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


class ToolArgs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    pass


Path = Annotated[
    str, Meta(description="Path relative to the call's cwd, or absolute inside the workspace.")
]


class ReadArgs(ToolArgs):
    """Read a text file, optionally a window of its lines."""

    path: Path
    offset: Annotated[int, Meta(ge=0, description="First line to return, 0-based.")] = 0
    limit: Annotated[int | None, Meta(description="Most lines to return (None: all).")] = None
    # Integrations (Inspect's read_file) need a file's exact bytes: binary, CRLF, invalid UTF-8.
    encoding: Annotated[
        Literal["utf-8", "bytes"],
        Meta(
            description="'bytes': the whole file's raw bytes in `data` (offset and limit must "
            "stay unset; `truncated` past the output cap). 'utf-8': lines of text in `content`."
        ),
    ] = "utf-8"
    # Integrations that run a sample as a user (Inspect's read_file) read as that user too.
    user: Annotated[
        str | None, Meta(description="Read as this user name or uid (the pool must be root).")
    ] = None


class WriteArgs(ToolArgs):
    """Create or replace a file with the given content, atomically."""

    path: Path
    content: Annotated[str, Meta(description="The file's new content.")]
    # Integrations that hold bytes and a sample user (Inspect's write_file).
    content_bytes: Annotated[
        bytes | None,
        Meta(description="The file's exact bytes (base64 in JSON), instead of content (then '')."),
    ] = None
    user: Annotated[
        str | None, Meta(description="Write as this user name or uid (the pool must be root).")
    ] = None

    def __post_init__(self) -> None:
        if self.content_bytes is not None and self.content:
            raise ValueError("give content or content_bytes, not both")


class EditArgs(ToolArgs):
    """Replace an exact string in a file, atomically."""

    path: Path
    old_string: Annotated[str, Meta(min_length=1, description="Exact text to replace.")]
    new_string: Annotated[str, Meta(description="Replacement text.")]
    replace_all: Annotated[
        bool, Meta(description="Replace every occurrence; otherwise old_string must be unique.")
    ] = False


class LsArgs(ToolArgs):
    """List a directory's entries."""

    path: Path = "."


Lines = Annotated[int, Meta(ge=0, le=1000)]


class GrepArgs(ToolArgs):
    """Search file contents with a regular expression (ripgrep's syntax and file rules)."""

    pattern: Annotated[
        str,
        Meta(
            description="Regular expression, ripgrep's syntax (Rust regex); one only Python's "
            "re accepts (look-around, backreferences) works too, more slowly."
        ),
    ]
    path: Path = "."
    glob: Annotated[
        str | None,
        Meta(
            description="Only search files matching this glob, e.g. '*.py' (any depth) or "
            "'src/**/*.ts' (from path); as ripgrep's --glob."
        ),
    ] = None
    ignore_case: Annotated[bool, Meta(description="Match letters in either case.")] = False
    # The bound goes on the int alone: msgspec refuses `ge` on a union with None.
    max_results: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Stop after this many matches, files or counts (default 1000)."),
    ] = None
    respect_gitignore: Annotated[
        bool,
        Meta(
            description="Skip what .gitignore, .ignore and .git/info/exclude exclude "
            "(.git itself is never searched)."
        ),
    ] = True
    output_mode: Annotated[
        Literal["content", "files_with_matches", "count"],
        Meta(
            description="'content': matching lines in `matches`; 'files_with_matches': the "
            "paths in `files`; 'count': `counts`, a {path, count} per file."
        ),
    ] = "content"
    context_before: Annotated[
        Lines | None, Meta(description="Lines before each match, in its `before` (as rg -B).")
    ] = None
    context_after: Annotated[
        Lines | None, Meta(description="Lines after each match, in its `after` (as rg -A).")
    ] = None
    context: Annotated[
        Lines | None,
        Meta(description="Lines before and after each match, unless given apart (as rg -C)."),
    ] = None
    type: Annotated[
        str | None,
        Meta(description="Only files of this ripgrep type, e.g. 'py', 'js', 'rust' (rg -t)."),
    ] = None
    multiline: Annotated[
        bool,
        Meta(description="Let a match span lines ('.' matches a newline too), as rg -U."),
    ] = False
    hidden: Annotated[
        bool, Meta(description="Search hidden files and directories (names starting with '.').")
    ] = False


class FindArgs(ToolArgs):
    """Find paths matching a glob (``**`` matches any number of directories)."""

    pattern: Annotated[str, Meta(description="Glob relative to path, e.g. '**/*.py'.")]
    path: Path = "."
    hidden: Annotated[
        bool, Meta(description="List hidden files and directories (names starting with '.').")
    ] = False
    respect_gitignore: Annotated[
        bool,
        Meta(
            description="Leave out what .gitignore, .ignore and .git/info/exclude exclude "
            "(.git itself is never listed)."
        ),
    ] = True


class BashArgs(ToolArgs):
    """Run a shell command with bash -c in a scrubbed environment."""

    # Required unless argv is given (then it defaults to shlex.join(argv)): the schema cannot
    # say "one of", so __post_init__ does.
    command: Annotated[str, Meta(description="The command line.")] = ""
    # For integrations that hold an argv (Inspect's exec): run it without a shell. ``command``
    # is then shlex.join(argv), so the gate, the journal and a reader all see what runs.
    argv: Annotated[
        list[str] | None,
        Meta(description="Run this argv directly, no shell (command: shlex.join(argv) or '')."),
    ] = None
    stdin: Annotated[str | None, Meta(description="Text for the command's stdin.")] = None
    stdin_bytes: Annotated[
        bytes | None, Meta(description="Bytes for stdin (base64 in JSON); not with stdin.")
    ] = None
    user: Annotated[
        str | None, Meta(description="Run as this user name or uid (the pool must be root).")
    ] = None
    merge_stderr: Annotated[
        bool,
        Meta(description="Send stderr into stdout's pipe, keeping their order; stderr is ''."),
    ] = False
    # Answered by the coordinator (sandbx_pool.service_tools): the command starts as a service
    # and the value names it; no worker ever runs a bash call with it set.
    background: Annotated[
        bool,
        Meta(
            description="Start the command as a background service that outlives this call (a"
            " server, a watcher, a REPL): the result names it at once; read it with"
            " service_output, type into it with service_write, end it with service_stop."
        ),
    ] = False

    def __post_init__(self) -> None:
        if self.background and (
            self.argv is not None
            or self.stdin is not None
            or self.stdin_bytes is not None
            or self.user is not None
            or self.merge_stderr
        ):
            raise ValueError("background takes a command alone (no argv, stdin, user, merge)")
        if self.argv is not None:
            if not self.argv:
                raise ValueError("argv must not be empty")
            if not self.command:
                self.command = shlex.join(self.argv)
            elif self.command != shlex.join(self.argv):
                raise ValueError("command must be shlex.join(argv) when argv is given")
        elif not self.command:
            raise ValueError("give command (or argv)")
        if self.stdin is not None and self.stdin_bytes is not None:
            raise ValueError("give stdin or stdin_bytes, not both")


ServiceName = Annotated[
    str, Meta(description="The service's name, as bash's background call returned it.")
]


class ServiceOutputArgs(ToolArgs):
    """Read a background command's output (bash background=true), its status and exit code."""

    service: ServiceName
    since: Annotated[
        int,
        Meta(ge=0, description="Byte offset to read from: 0 for all, the last answer's next."),
    ] = 0


class ServiceWriteArgs(ToolArgs):
    """Type text into a background command's stdin (or terminal): an answer to its prompt."""

    service: ServiceName
    data: Annotated[
        str, Meta(description="The text; end it with a newline when the program reads lines.")
    ]


class ServiceStopArgs(ToolArgs):
    """Stop a background command and everything it started; says how it ended."""

    service: ServiceName


#: Tools the coordinator answers itself, about the services a bash call started in the
#: background (sandbx_pool.service_tools): no worker runs them.
SERVICE_TOOL_ARGS: dict[str, type[ToolArgs]] = {
    "service_output": ServiceOutputArgs,
    "service_write": ServiceWriteArgs,
    "service_stop": ServiceStopArgs,
}

TOOL_ARGS: dict[str, type[ToolArgs]] = {
    "read": ReadArgs,
    "write": WriteArgs,
    "edit": EditArgs,
    "ls": LsArgs,
    "grep": GrepArgs,
    "find": FindArgs,
    "bash": BashArgs,
    **SERVICE_TOOL_ARGS,
}


class RemoveTempsArgs(ToolArgs):
    """Internal: remove the temp files interrupted writes left next to these paths."""

    paths: list[str]


class CheckWorkspaceArgs(ToolArgs):
    """Internal: whether the call's workspace is a directory (Pool.start asks once)."""


class ApplyChangesArgs(ToolArgs):
    """Internal: scan a call's overlay upper directory and, with ``apply``, apply it to the
    workspace (workers.tools.changes). ``taken``: paths other calls applied since this call
    started, each with that call's id (a conflict)."""

    call_id: str
    upper: str
    images: str
    objects: str
    apply: bool
    taken: dict[str, str] = {}
    #: Where the change list is written (J.d), out of band: workers.tools.changes says why.
    report: str = ""
    #: [workspace] max_change_paths and max_change_bytes (None: unbounded).
    max_paths: int | None = None
    max_bytes: int | None = None


class UndoChangesArgs(ToolArgs):
    """Internal: put back the pre-images of an applied change set."""

    images: str
    objects: str
    #: The sha256 of images.json as journaled with the call's outcome (None: none was).
    images_sha256: str | None = None
    #: Where the paths undone are written (J.d), out of band as an apply's change list.
    report: str = ""


class LayerOpenArgs(ToolArgs):
    """Internal: the probe run in a new layer, mounted (workers.tools.layers)."""


class LayerDiffArgs(ToolArgs):
    """Internal: scan a layer's upper directory against its base, the call's workspace."""

    upper: str


class ServiceArgs(ToolArgs):
    """Internal: a long-lived ``bash -c COMMAND`` (sandbx_pool.services): output streamed,
    stdin (or a terminal) fed by the coordinator, no result until it ends."""

    command: str
    tty: bool = False
    cols: int = 80
    rows: int = 24

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("give command")
        if not (0 < self.cols < 65536 and 0 < self.rows < 65536):
            raise ValueError("cols and rows must be from 1 to 65535")


#: Actions only the coordinator asks for (journal recovery, change sets); no caller can name
#: them.
#: The actions that read and write the workspace for the coordinator: confined like the file
#: tools, with root's secrets left out by Landlock whatever else masks them (workers.sandbox).
CHANGE_ACTIONS = frozenset({"_apply_changes", "_undo_changes"})

INTERNAL_TOOL_ARGS: dict[str, type[ToolArgs]] = {
    "_remove_temps": RemoveTempsArgs,
    "_check_workspace": CheckWorkspaceArgs,
    "_apply_changes": ApplyChangesArgs,
    "_undo_changes": UndoChangesArgs,
    "_layer_open": LayerOpenArgs,
    "_layer_diff": LayerDiffArgs,
    "_service": ServiceArgs,
}

#: Tools whose effects outlive the call: their journal intent is made durable before they run.
SIDE_EFFECT_TOOLS = frozenset({"write", "edit", "bash", "_service", "service_write"})

#: Tools that start programs. Only these get the confinement steps that bound what an exec'd
#: program can do (workers.sandbox.confine), and a SIGTERM and grace period before SIGKILL
#: when they are stopped: the others run only our own code, which holds nothing to clean up.
RUNS_PROGRAMS = frozenset({"bash", "grep", "_service"})

#: Tools that run a program (rg) which must follow no symlink in the workspace, whatever a
#: parallel call swaps in: their mount namespace binds it with symlinks refused
#: (workers.sandbox), which they check before they run it.
FOLLOW_NO_SYMLINKS = frozenset({"grep"})


class UnknownTool(ValueError):
    pass


def parse_args(tool: str, args: Any, *, internal: bool = False) -> ToolArgs:
    """Validate ``args`` for ``tool``; raise UnknownTool or msgspec.ValidationError.

    ``internal`` also admits the coordinator's own actions (only the worker side passes it).
    """
    try:
        args_type = (
            TOOL_ARGS[tool] if tool in TOOL_ARGS or not internal else INTERNAL_TOOL_ARGS[tool]
        )
    except KeyError:
        known = ", ".join(TOOL_ARGS)
        raise UnknownTool(f"unknown tool {tool!r} (known: {known})") from None
    if not isinstance(args, dict):
        raise msgspec.ValidationError(f"arguments must be an object, got {type(args).__name__}")
    return msgspec.convert(args, args_type)


def tool_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of each tool's arguments, self-contained (no $ref)."""
    schemas: dict[str, dict[str, Any]] = {}
    for name, args_type in TOOL_ARGS.items():
        # schema_components returns a $ref per type plus the definitions; the definition is
        # the schema itself (the argument Structs nest no other Struct, so it has no $ref).
        _, components = msgspec.json.schema_components([args_type], ref_template="{name}")
        inline = dict(components[args_type.__name__])
        inline.pop("title", None)
        schemas[name] = inline
    return schemas
