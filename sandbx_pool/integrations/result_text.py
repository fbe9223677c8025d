"""A tool's value as the plain text a model reads best (the MCP server's ``content``).

JSON is what programs want (it goes alongside, as ``structuredContent``); a model reads a file
as a file, a command's output as a terminal shows it, and a list as lines. A JSON string full of
escaped ``\\n`` costs it tokens and accuracy. So each tool's value becomes text here:

    bash    stdout, then "[stderr]" and stderr when there is any, then "[exit code N]"
    read    the file's lines as they are
    grep    path:line:text lines (or paths, or path:count)
    find    one path a line;  ls: one entry a line, "/" after a directory, "@" after a symlink
    write   "wrote N bytes to PATH";  edit: "N replacement(s) in PATH"

Anything cut short says so on a last line in brackets, with how to see more.
"""

from __future__ import annotations

import json
from typing import Any, Final

#: What each entry type of ``ls`` gets after its name (as ``ls -F`` marks them).
_LS_MARK: Final = {"dir": "/", "symlink": "@", "file": "", "other": ""}


def result_text(tool: str, value: dict[str, Any], args: dict[str, Any] | None = None) -> str:
    """The text of an ``ok`` outcome's value; ``args`` (the call's) name the path involved."""
    args = args or {}
    render = _RENDER.get(tool)
    return render(value, args) if render is not None else _json(value)


def bash_output(value: dict[str, Any]) -> str:
    """A bash value's stdout, then its stderr after a "[stderr]" line when there is any."""
    stdout = str(value.get("stdout", ""))
    stderr = str(value.get("stderr", ""))
    if not stderr:
        return stdout
    return stdout + _line_break(stdout) + "[stderr]\n" + stderr


def _bash(value: dict[str, Any], args: dict[str, Any]) -> str:
    if "service" in value:  # background=true: it started and runs on (service_tools)
        return _service_state(value, started=True)
    text = bash_output(value)
    status = f"[exit code {value.get('exit_code')}"
    if value.get("signal"):
        status += f", killed by signal {value['signal']}"
    text += _line_break(text) + status + "]"
    if value.get("omitted_bytes"):
        text += f"\n[{value['omitted_bytes']} bytes of output omitted from the middle]"
    return text


def _read(value: dict[str, Any], args: dict[str, Any]) -> str:
    content = str(value.get("content", ""))
    if value.get("truncated"):
        lines = value.get("lines")
        content += (
            _line_break(content) + f"[truncated at the output limit after {lines} lines;"
            " read on with offset]"
        )
    return content


def _grep(value: dict[str, Any], args: dict[str, Any]) -> str:
    if "matches" in value:
        lines = [f"{m['path']}:{m['line']}:{m['text']}" for m in value["matches"]]
    elif "files" in value:
        lines = [str(path) for path in value["files"]]
    elif "counts" in value:
        lines = [f"{c['path']}:{c['count']}" for c in value["counts"]]
    else:
        return _json(value)
    if not lines:
        lines = ["[no matches]"]
    return _with_truncation(lines, value)


def _find(value: dict[str, Any], args: dict[str, Any]) -> str:
    lines = [str(path) for path in value.get("paths", [])] or ["[no paths match]"]
    return _with_truncation(lines, value)


def _ls(value: dict[str, Any], args: dict[str, Any]) -> str:
    lines = [
        f"{e['name']}{_LS_MARK.get(e.get('type', ''), '')}" for e in value.get("entries", [])
    ] or ["[empty directory]"]
    return _with_truncation(lines, value)


def _write(value: dict[str, Any], args: dict[str, Any]) -> str:
    verb = "created" if value.get("created") else "wrote"
    return f"{verb} {value.get('bytes')} bytes to {args.get('path', 'the file')}"


def _edit(value: dict[str, Any], args: dict[str, Any]) -> str:
    count = value.get("replacements")
    noun = "replacement" if count == 1 else "replacements"
    return f"{count} {noun} in {args.get('path', 'the file')}"


def _with_truncation(lines: list[str], value: dict[str, Any]) -> str:
    if value.get("truncated"):
        total = value.get("total")
        more = f" of {total}" if total is not None else ""
        lines.append(f"[truncated: {len(lines)}{more} shown; narrow the path or pattern]")
    return "\n".join(lines)


def _service_state(value: dict[str, Any], *, started: bool = False) -> str:
    name, status = value.get("service"), value.get("status")
    if status == "running":
        said = f"[service {name} running"
        said += "; read it with service_output, stop it with service_stop]" if started else "]"
        return said
    code = value.get("exit_code")
    return f"[service {name} {status}" + ("]" if code is None else f", exit code {code}]")


def _service_output(value: dict[str, Any], args: dict[str, Any]) -> str:
    text = str(value.get("output", ""))
    return text + _line_break(text) + _service_state(value) + f" [next: {value.get('next')}]"


def _service_write(value: dict[str, Any], args: dict[str, Any]) -> str:
    return f"[{value.get('written')} bytes written] " + _service_state(value)


def _service_stop(value: dict[str, Any], args: dict[str, Any]) -> str:
    return _service_state(value)


def _line_break(text: str) -> str:
    return "\n" if text and not text.endswith("\n") else ""


def _json(value: dict[str, Any]) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


_RENDER: Final = {
    "bash": _bash,
    "read": _read,
    "grep": _grep,
    "find": _find,
    "ls": _ls,
    "write": _write,
    "edit": _edit,
    "service_output": _service_output,
    "service_write": _service_write,
    "service_stop": _service_stop,
}
