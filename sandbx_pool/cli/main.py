"""The ``sandbx-pool`` command: call, run, demo, tools, schema, journal, undo, mcp, image."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import types
import typing
from typing import Any, Final, NoReturn

from sandbx_pool.cli.arguments import positive_float, positive_int
from sandbx_pool.cli.checks import workspace_problem
from sandbx_pool.template_launch import discard_prelaunched, prelaunch
from sandbx_pool.terminal import guarded

# Nothing heavier at the top: a one-shot `call` starts its template before these load
# (main), and each command imports what it needs.

#: Exit codes: ``call`` gives 0 for an ok outcome and 1 for any other; 2 is a usage, config,
#: workspace or journal error (one line on stderr: a journal that cannot be opened, or that
#: another pool is writing); a signal N ends a command with 128 + N. ``call
#: --image`` adds 3 (the image could not be had) and 4 (no layer over it here): cli.image_call.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2

#: ``call``'s ``[pool] warm_up``, whatever the config says: see _cmd_call.
_CALL_WARM_UP: Final = False


def _parse_pairs(tool: str, pairs: list[str]) -> dict[str, Any]:
    """``key=value`` arguments; a value is JSON unless the tool's field of that name is a string."""
    import msgspec

    from sandbx_pool.workers.schemas import TOOL_ARGS

    # The fields' types, not tool_schemas(): building every tool's JSON Schema costs a one-shot
    # call about 12 ms.
    strings = {
        field.encode_name
        for field in msgspec.structs.fields(TOOL_ARGS[tool])
        if _is_string(field.type)
    }
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {pair!r}")
        if key in strings:
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                args[key] = value
    return args


def _is_string(annotation: Any) -> bool:
    """``str``, alone, optional, in a union or annotated with constraints."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (typing.Annotated, typing.Union, types.UnionType):
        return any(_is_string(member) for member in typing.get_args(annotation))
    return False


def _cmd_tools(args: argparse.Namespace) -> int:
    from sandbx_pool.workers.schemas import TOOL_ARGS, tool_schemas

    schemas = tool_schemas()
    if args.json:
        print(json.dumps(schemas, indent=2))
        return 0
    for name, args_type in TOOL_ARGS.items():
        fields = ", ".join(schemas[name].get("properties", {}))
        print(f"{name:6} {(args_type.__doc__ or '').strip()}  ({fields})")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from sandbx_pool.tool_definitions import tool_definitions

    print(json.dumps(tool_definitions(args.format), indent=2))
    return 0


def _cmd_call(args: argparse.Namespace) -> int:
    import msgspec

    from sandbx_pool.config import load_config
    from sandbx_pool.output import OutputChunk
    from sandbx_pool.pool import Pool
    from sandbx_pool.signals import Stopper, run_until_signalled
    from sandbx_pool.workers.schemas import parse_args

    try:
        tool_args = _parse_pairs(args.tool, args.pairs)
        parse_args(args.tool, tool_args)  # a typo in an argument is usage: no pool for it
    except (ValueError, msgspec.ValidationError) as exc:
        return _usage_error(f"call {args.tool}: {exc}")
    config = load_config(args.config)  # a ConfigError here exits 2 (main), before any process
    problem = workspace_problem(args.workspace)
    if problem is not None:
        return _usage_error(f"call: {problem}")
    # One call: a warmed-up template and spare workers would cost more than they save.
    config = config.override(pool={"warm_up": _CALL_WARM_UP, "prefork": 0})

    def show(chunk: OutputChunk) -> None:
        # On our stderr, both streams: stdout stays the outcome's JSON, for programs.
        sys.stderr.write(chunk.display())
        sys.stderr.flush()

    on_output = show if args.tool == "bash" and not args.no_stream else None
    if args.image is not None:
        from sandbx_pool.cli.image_call import check_ref, run_in_image

        problem = check_ref(args.image)
        if problem is not None:
            return _usage_error(f"call: --image: {problem}")
        return run_in_image(args, tool_args, config, on_output)

    async def one_call(stopper: Stopper) -> int:
        pool = stopper.watch(Pool(args.workspace, journal=args.journal, config=config))
        async with pool:
            outcome = await pool.call(
                args.tool, tool_args, timeout=args.timeout, on_output=on_output
            )
        printed = outcome.to_dict()
        if pool.journal is not None:
            printed["journal"] = pool.journal.path  # where this call's record is
        print(json.dumps(printed, indent=2))
        # A script's `if sandbx-pool call ...` means "did it work": anything but ok is 1.
        return EXIT_OK if outcome.status == "ok" else EXIT_FAILED

    return run_until_signalled(one_call)


def _cmd_undo(args: argparse.Namespace) -> int:
    """Put back what a tracked or transactional call changed: 0 done, 1 refused because a
    path changed since (UndoConflict), 2 nothing to undo (unknown id, direct mode, J.d gone)."""
    from sandbx_pool.config import load_config
    from sandbx_pool.errors import UndoConflict
    from sandbx_pool.pool import Pool
    from sandbx_pool.signals import Stopper, run_until_signalled

    config = load_config(args.config)
    problem = workspace_problem(args.workspace)
    if problem is not None:
        return _usage_error(f"undo: {problem}")
    if not os.path.isfile(args.journal):
        return _usage_error(f"undo: --journal {args.journal}: no such journal")
    config = config.override(pool={"warm_up": False, "prefork": 0})

    async def undo(stopper: Stopper) -> int:
        pool = stopper.watch(Pool(args.workspace, journal=args.journal, config=config))
        async with pool:
            try:
                paths = await pool.undo(args.call_id)
            except UndoConflict as exc:
                print(f"sandbx-pool undo: {exc}", file=sys.stderr)
                return EXIT_FAILED
            except ValueError as exc:
                return _usage_error(f"undo: {exc}")
        print(json.dumps({"call_id": args.call_id, "undone": paths}, indent=2))
        return EXIT_OK

    return run_until_signalled(undo)


def _cmd_mcp(args: argparse.Namespace) -> int:
    from sandbx_pool.config import load_config

    config = load_config(args.config)  # a ConfigError here exits 2 (main)
    config = config.override(pool={"workers": args.workers})
    problem = workspace_problem(args.workspace)
    if problem is not None:
        return _usage_error(f"mcp: {problem}")
    try:
        # The MCP SDK is an extra, imported only for this command.
        from sandbx_pool.integrations.mcp import run
    except ImportError as exc:
        return _usage_error(
            f"mcp: the MCP SDK is not installed ({exc}); pip install 'sandbx-pool[mcp]'"
        )
    session = args.session
    if session is not None:
        from sandbx_pool.sessions import check_id

        try:
            check_id(session)
        except ValueError as exc:
            return _usage_error(f"mcp: --session: {exc}")
    return run(args.workspace, config, args.journal, timeout=args.timeout, session=session)


def _cmd_doctor(args: argparse.Namespace) -> int:
    # Imported here: its probes load much of the worker side, which no other command needs.
    from sandbx_pool.cli.doctor import run

    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from sandbx_pool.cli.batch import add_batch_parsers
    from sandbx_pool.cli.image import add_image_parser
    from sandbx_pool.cli.journal import add_journal_parser
    from sandbx_pool.tool_definitions import STYLES
    from sandbx_pool.workers.schemas import TOOL_ARGS

    parser = argparse.ArgumentParser(
        prog="sandbx-pool",
        description="Run agent tool calls in disposable, killable worker processes.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="less log output")
    parser.add_argument("--log-json", metavar="FILE", help="also write structured logs here")
    commands = parser.add_subparsers(dest="command", required=True)

    call = commands.add_parser("call", help="run one tool call, print its outcome as JSON")
    call.add_argument("tool", choices=sorted(TOOL_ARGS))
    call.add_argument("pairs", nargs="*", metavar="key=value")
    call.add_argument("--workspace", default=".")
    call.add_argument("--timeout", type=positive_float, metavar="S")
    call.add_argument("--journal")
    call.add_argument("--config")
    call.add_argument(
        "--image",
        metavar="REF",
        help="run the call in a fresh layer over this container image (its / is the image's;"
        " pulled into the image store if need be), removed after",
    )
    call.add_argument(
        "--no-stream",
        action="store_true",
        help="bash: do not print the command's output to stderr as it runs",
    )
    call.set_defaults(func=_cmd_call)

    tools = commands.add_parser("tools", help="list the tools and their arguments")
    tools.add_argument("--json", action="store_true", help="print their JSON Schemas")
    tools.set_defaults(func=_cmd_tools)

    schema = commands.add_parser("schema", help="tool definitions for an LLM API")
    schema.add_argument("--format", choices=STYLES, default="anthropic")
    schema.set_defaults(func=_cmd_schema)

    mcp = commands.add_parser("mcp", help="serve the tools to an MCP client on stdin/stdout")
    mcp.add_argument("--workspace", required=True, help="directory every path is confined to")
    mcp.add_argument("--config", metavar="FILE", help="TOML settings")
    mcp.add_argument("--journal", metavar="PATH", help="journal file (default: a new one)")
    mcp.add_argument(
        "--workers", type=positive_int, metavar="N", help="calls in flight at most (pool.workers)"
    )
    mcp.add_argument(
        "--timeout",
        type=positive_float,
        metavar="S",
        help="deadline of every call, in seconds (default: calls.timeout_s, else 600)",
    )
    mcp.add_argument(
        "--session",
        nargs="?",
        const="mcp",
        metavar="ID",
        help="run every call in one shell session (bash keeps cd and exports; default id: mcp,"
        " restored from --journal)",
    )
    mcp.set_defaults(func=_cmd_mcp)

    add_batch_parsers(commands)
    add_journal_parser(commands)
    add_image_parser(commands)
    undo = commands.add_parser("undo", help="put back what a tracked or transactional call changed")
    undo.add_argument("call_id", metavar="CALL_ID")
    undo.add_argument("--journal", required=True, metavar="PATH", help="the call's journal")
    undo.add_argument("--workspace", required=True, help="the call's workspace")
    undo.add_argument("--config", metavar="FILE", help="TOML settings")
    undo.set_defaults(func=_cmd_undo)
    doctor = commands.add_parser("doctor", help="show which protections this machine enforces")
    doctor.add_argument("--json", action="store_true", help="print the checks as JSON")
    doctor.add_argument(
        "--config", metavar="FILE", help="TOML settings ([sandbox] user_namespaces) to probe with"
    )
    doctor.set_defaults(func=_cmd_doctor)
    return parser


def entry() -> NoReturn:
    """The ``sandbx-pool`` program: ``main``, then exit.

    After ``call``, without the interpreter's teardown: by then the pool is closed (its
    processes reaped, its journal synced and closed) and our streams are flushed here, so the
    teardown (freeing every module's objects, 30-50 ms) would only delay a one-shot call's
    exit. Any other command exits the usual way: it may hold what an atexit handler closes."""
    code = main()
    if _command_of(sys.argv[1:]) != "call":
        sys.exit(code)
    if "loguru" in sys.modules:
        from sandbx_pool.logs import logger

        logger.remove()  # flushes and closes --log-json's file
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # a reader gone away: nothing left to tell it
        pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    if _command_of(arguments) == "call":
        # Its template's interpreter imports while we do (two cores): a one-shot call waits
        # for the slower of the two, not their sum (sandbx_pool.template_launch).
        prelaunch(warm_up=_CALL_WARM_UP)
    try:
        # Everything the command prints to a terminal shows control characters escaped: a
        # call's output and ids are not allowed to drive the operator's terminal (terminal).
        with guarded():
            return _main(arguments)
    finally:
        discard_prelaunched()  # when the command ended before a pool took it


def _command_of(argv: list[str]) -> str | None:
    """The subcommand in ``argv``, from a glance at it before any parsing (None if unsure)."""
    words = iter(argv)
    for word in words:
        if word == "--log-json":
            next(words, None)  # its value
        elif not word.startswith("-"):
            return word
    return None


def _main(argv: list[str]) -> int:
    from sandbx_pool.errors import ConfigError, JournalError, JournalLocked, WorkspaceError
    from sandbx_pool.logs import configure_logging

    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras and args.command == "call" and not any(word.startswith("-") for word in extras):
        # `call read --workspace W path=x`: argparse ends `key=value ...` at the first option,
        # and takes what follows it for unknown arguments. They are more pairs.
        args.pairs += extras
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    try:
        configure_logging(args.verbose - args.quiet, args.log_json)
    except OSError as exc:
        return _usage_error(f"--log-json {args.log_json}: {exc.strerror or exc}")
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, so that a reader gone away is met below
    except (ConfigError, JournalError, JournalLocked, WorkspaceError) as exc:
        # Bad input is one line naming the file and the key, never a traceback; so is a
        # --journal whose directory is not writable, or that another pool holds.
        return _usage_error(f"{args.command}: {exc}")
    except BrokenPipeError:
        # `sandbx-pool journal stats | head`: the reader has what it wanted. Point stdout at
        # /dev/null so that the interpreter's own flush at exit cannot fail again, and end
        # as a killed-by-SIGPIPE writer would.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    return code


def _usage_error(message: str) -> int:
    """Print ``message`` on one line and return the usage exit status, 2."""
    print(f"sandbx-pool {message}".replace("\n", " "), file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    entry()
