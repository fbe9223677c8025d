"""The approval gate: asked once the tool and its arguments are known, before anything forks.

Rules come from the config (``[[gate.rules]]``); the first rule that matches a call decides.
A Python callback on the Pool is asked after the rules. A denial names what refused it, and
that name reaches the outcome and the journal.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

from sandbx_pool.config import GateRule
from workers.schemas import ToolArgs

#: The callback: True or None allows; False denies; a string denies with that reason.
Approver = Callable[[str, ToolArgs], bool | str | None]


class _CompiledRule:
    def __init__(self, index: int, rule: GateRule) -> None:
        self.rule = rule
        self.name = rule.name or f"gate.rules[{index}]"
        self.command = re.compile(rule.command) if rule.command is not None else None

    def matches(self, tool: str, args: ToolArgs) -> bool:
        if not fnmatch.fnmatchcase(tool, self.rule.tool):
            return False
        if self.rule.path is not None:
            path = getattr(args, "path", None)
            if not isinstance(path, str) or not fnmatch.fnmatchcase(path, self.rule.path):
                return False
        if self.command is not None:
            command = getattr(args, "command", None)
            if not isinstance(command, str) or not self.command.search(command):
                return False
        return True


class Gate:
    def __init__(self, rules: list[GateRule], approver: Approver | None = None) -> None:
        self._rules = [_CompiledRule(i, rule) for i, rule in enumerate(rules)]
        self._approver = approver

    def denial(self, tool: str, args: ToolArgs) -> str | None:
        """Why the call is refused, or None when it may run."""
        for rule in self._rules:
            if rule.matches(tool, args):
                if rule.rule.action == "deny":
                    return f"denied by {rule.name}"
                break
        if self._approver is not None:
            verdict = self._approver(tool, args)
            if verdict is False:
                return "denied by the approval callback"
            if isinstance(verdict, str):
                return f"denied by the approval callback: {verdict}"
        return None
