"""The tools as LLM tool definitions (Anthropic, OpenAI, MCP), from one source of truth.

Names, argument schemas and descriptions all come from ``workers.schemas``: the schema from
``tool_schemas()``, the description from each argument Struct's docstring. ``sandbx-pool schema``
prints these definitions and the MCP server lists exactly the ``mcp`` style, so what a model
is told and what the pool validates cannot drift apart.

A model is shown only what a model should set: the fields that exist for integrations (a
sample's ``user``, an exec's ``argv`` and ``stdin_bytes``, a binary ``content_bytes`` or
``encoding``) are left out of the definitions, and stay in ``tool_schemas()`` (``sandbx-pool
tools --json``) for the programs that use them.
"""

from __future__ import annotations

from typing import Any, Final, Literal, get_args

from sandbx_pool.workers.schemas import TOOL_ARGS, tool_schemas

ToolStyle = Literal["anthropic", "openai", "mcp"]
STYLES: Final[tuple[str, ...]] = get_args(ToolStyle)

#: Arguments that integrations set and models never should: hidden from model-facing definitions.
INTEGRATION_ONLY: Final[dict[str, frozenset[str]]] = {
    "read": frozenset({"encoding", "user"}),
    "write": frozenset({"content_bytes", "user"}),
    "bash": frozenset({"argv", "stdin_bytes", "user"}),
}

_FILE_READER = {"readOnlyHint": True, "openWorldHint": False}

#: MCP tool annotations: hints a client may use to decide what to confirm with its user. They
#: describe the tool in general; the gate (config ``[gate]``) is what actually enforces policy.
MCP_ANNOTATIONS: Final[dict[str, dict[str, bool]]] = {
    "read": _FILE_READER,
    "ls": _FILE_READER,
    "grep": _FILE_READER,
    "find": _FILE_READER,
    "write": {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": True,
        "openWorldHint": False,
    },
    "edit": {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": False,
        "openWorldHint": False,
    },
    "bash": {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": False,
        "openWorldHint": True,
    },
    "service_output": {"readOnlyHint": True, "openWorldHint": False},
    "service_write": {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": False,
        "openWorldHint": False,
    },
    "service_stop": {
        "readOnlyHint": False,
        "destructiveHint": True,
        "idempotentHint": True,
        "openWorldHint": False,
    },
}


def tool_description(name: str) -> str:
    """The tool's one-line description: its argument Struct's docstring."""
    return (TOOL_ARGS[name].__doc__ or name).strip()


def tool_parameters() -> dict[str, dict[str, Any]]:
    """Each tool's JSON Schema as a model sees it: no description (the definitions carry it
    beside), no integration-only property."""
    parameters: dict[str, dict[str, Any]] = {}
    for name, schema in tool_schemas().items():
        hidden = INTEGRATION_ONLY.get(name, frozenset())
        shown = {k: v for k, v in schema.items() if k != "description"}
        shown["properties"] = {
            key: value for key, value in schema.get("properties", {}).items() if key not in hidden
        }
        if "required" in schema:
            shown["required"] = [key for key in schema["required"] if key not in hidden]
        parameters[name] = shown
    return parameters


def tool_definitions(style: ToolStyle) -> list[dict[str, Any]]:
    """Every tool's definition in the shape the given API expects."""
    definitions: list[dict[str, Any]] = []
    for name, parameters in tool_parameters().items():
        description = tool_description(name)
        if style == "anthropic":
            definitions.append(
                {"name": name, "description": description, "input_schema": parameters}
            )
        elif style == "openai":
            function = {"name": name, "description": description, "parameters": parameters}
            definitions.append({"type": "function", "function": function})
        elif style == "mcp":
            definitions.append(
                {
                    "name": name,
                    "description": description,
                    "inputSchema": parameters,
                    "annotations": MCP_ANNOTATIONS[name],
                }
            )
        else:
            raise ValueError(f"unknown tool definition style {style!r} (known: {STYLES})")
    return definitions
