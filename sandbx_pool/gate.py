"""The approval gate: asked once the tool and its arguments are known, before anything forks.

Rules come from the config (``[[gate.rules]]``) and are tried in order. The first rule that
matches a call decides: ``deny`` refuses it; ``allow`` stops the rules there (later rules are
not tried). A call no rule matches is allowed by the rules. Then the Python callback given to
``Pool(approve=...)``, if any, is asked: a call runs only when both allow it. A denial names
what refused it (``gate rule 'name' (gate.rules[N])`` or ``the approval callback``), and that
text is the outcome's error, journaled with it.

A rule matches when every field it sets matches:

* ``tool``: a glob over the tool name (``*`` by default: every tool);
* ``path``: a glob over the call's path argument, made relative to the workspace and
  normalised lexically (``./a/../secrets/k`` is ``secrets/k``); it matches as fnmatch does
  (``*`` crosses ``/``) or as find's globs do (``**/`` spans zero or more directories). A call
  without a path argument (bash) never matches a rule that sets ``path``;
* ``command``: a regex searched in bash's command; a call without one never matches.

Everything here is string work on the arguments, like ``confine``: the coordinator never looks
at the workspace, so a symlink inside it (``ln -s secrets s``) can alias a denied path. grep
and find are matched on the directory they search, not on the files below it.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
import re
from collections.abc import Callable

from sandbx_pool.config import GateRule
from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.globs import compile_glob
from sandbx_pool.workers.schemas import ToolArgs

#: The callback: True or None allows; False denies; a string denies with that reason.
#: It runs on the event loop, so it must not block; an exception it raises denies the call.
Approver = Callable[[str, ToolArgs], bool | str | None]


class _CompiledRule:
    def __init__(self, index: int, rule: GateRule) -> None:
        self.rule = rule
        where = f"gate.rules[{index}]"
        self.name = f"gate rule {rule.name!r} ({where})" if rule.name else where
        # GateRule.__post_init__ has checked the regex: a bad one never gets this far.
        self.command = re.compile(rule.command) if rule.command is not None else None
        self.path_regex: re.Pattern[str] | None = None
        if rule.path is not None:
            with contextlib.suppress(ToolError):  # an empty glob: fnmatch alone decides
                self.path_regex = compile_glob(rule.path)[0]

    def matches(self, tool: str, args: ToolArgs, path: str | None) -> bool:
        if not fnmatch.fnmatchcase(tool, self.rule.tool):
            return False
        if self.rule.path is not None and not self._path_matches(path):
            return False
        if self.command is not None:
            command = getattr(args, "command", None)
            if not isinstance(command, str) or not self.command.search(command):
                return False
        return True

    def _path_matches(self, path: str | None) -> bool:
        if path is None or self.rule.path is None:
            return False
        if fnmatch.fnmatchcase(path, self.rule.path):
            return True
        return self.path_regex is not None and self.path_regex.fullmatch(path) is not None


def rule_path(path: str, workspace: str | None, cwd: str | None) -> str:
    """The path a rule's glob sees: relative to the workspace when it is known, normalised."""
    if workspace is not None:
        joined = os.path.normpath(os.path.join(cwd or workspace, path))
        relative = os.path.relpath(joined, workspace)
        # confine has refused anything outside already; keep such a path absolute regardless.
        return joined if relative == ".." or relative.startswith("../") else relative
    return os.path.normpath(path)


class Gate:
    def __init__(self, rules: list[GateRule], approver: Approver | None = None) -> None:
        self._rules = [_CompiledRule(i, rule) for i, rule in enumerate(rules)]
        self._approver = approver

    def denial(
        self,
        tool: str,
        args: ToolArgs,
        *,
        workspace: str | None = None,
        cwd: str | None = None,
    ) -> str | None:
        """Why the call is refused, or None when it may run.

        ``workspace`` and ``cwd`` (absolute, lexically confined) let path rules see the path
        relative to the workspace; without them a rule sees the path as given, normalised.
        """
        raw = getattr(args, "path", None)
        path = rule_path(raw, workspace, cwd) if self._rules and isinstance(raw, str) else None
        for rule in self._rules:
            if rule.matches(tool, args, path):
                if rule.rule.action == "deny":
                    return f"denied by {rule.name}"
                break
        if self._approver is None:
            return None
        try:
            verdict = self._approver(tool, args)
        except Exception as exc:  # a policy that cannot answer must not let the call through
            return f"denied: the approval callback raised {type(exc).__name__}: {exc}"
        if verdict is False:
            return "denied by the approval callback"
        if isinstance(verdict, str):
            return f"denied by the approval callback: {verdict}"
        return None
