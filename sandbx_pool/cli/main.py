"""The ``sandbx-pool`` command: call, run, demo, tools, schema, journal, mcp."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any, Final

import msgspec

from sandbx_pool.cli.arguments import positive_float, positive_int
from sandbx_pool.cli.checks import workspace_problem
from sandbx_pool.logs import configure_logging
from sandbx_pool.tool_definitions import STYLES, tool_definitions
from sandbx_pool.workers.schemas import TOOL_ARGS, parse_args, tool_schemas

#: Exit codes: ``call`` gives 0 for an ok outcome and 1 for any other; 2 is a usage, config or
#: workspace error (one line on stderr); a signal N ends a command with 128 + N.
EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2


def _parse_pairs(tool: str, pairs: list[str]) -> dict[str, Any]:
    """``key=value`` arguments; a value is JSON unless the schema says the key is a string."""
    properties = tool_schemas().get(tool, {}).get("properties", {})
    args: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"expected key=value, got {pair!r}")
        if _is_string(properties.get(key, {})):
            args[key] = value
        else:
            try:
                args[key] = json.loads(value)
            except json.JSONDecodeError:
                args[key] = value
    return args


def _is_string(schema: dict[str, Any]) -> bool:
    if schema.get("type") == "string":
        return True
    return any(option.get("type") == "string" for option in schema.get("anyOf", []))


def _cmd_tools(args: argparse.Namespace) -> int:
    schemas = tool_schemas()
    if args.json:
        print(json.dumps(schemas, indent=2))
        return 0
    for name, args_type in TOOL_ARGS.items():
        fields = ", ".join(schemas[name].get("properties", {}))
        print(f"{name:6} {(args_type.__doc__ or '').strip()}  ({fields})")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(tool_definitions(args.format), indent=2))
    return 0


def _cmd_call(args: argparse.Namespace) -> int:
    from sandbx_pool.config import load_config
    from sandbx_pool.output import OutputChunk
    from sandbx_pool.pool import Pool
    from sandbx_pool.signals import Stopper, run_until_signalled

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
    config = config.override(pool={"warm_up": False, "prefork": 0})

    def show(chunk: OutputChunk) -> None:
        # On our stderr, both streams: stdout stays the outcome's JSON, for programs.
        sys.stderr.write(chunk.display())
        sys.stderr.flush()

    on_output = show if args.tool == "bash" and not args.no_stream else None

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
    return run(args.workspace, config, args.journal, timeout=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    from sandbx_pool.cli.batch import add_batch_parsers
    from sandbx_pool.cli.doctor import add_doctor_parser
    from sandbx_pool.cli.journal import add_journal_parser

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
    mcp.set_defaults(func=_cmd_mcp)

    add_batch_parsers(commands)
    add_journal_parser(commands)
    add_doctor_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    from sandbx_pool.errors import ConfigError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.verbose - args.quiet, args.log_json)
    except OSError as exc:
        return _usage_error(f"--log-json {args.log_json}: {exc.strerror or exc}")
    try:
        code: int = args.func(args)
        sys.stdout.flush()  # here, so that a reader gone away is met below
    except ConfigError as exc:
        # Bad input is one line naming the file and the key, never a traceback.
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
    sys.exit(main())
