"""grep's answer as it is collected, whoever searches (rg or the Python walk): bounded.

Whatever the match count, the answer stays within ``max_results`` items and the call's
``max_output_bytes``; the searcher stops once ``full`` (rg is killed), so a pattern that
matches every line of a large tree costs the first items only, never a huge message.
"""

from __future__ import annotations

from typing import Any

#: grep's max_results when the call gives none.
DEFAULT_MAX_MATCHES = 1000

#: A matching line longer than this is cut: one minified file must not fill the whole answer.
MAX_LINE_CHARS = 500

#: Bytes of framing counted per result besides its strings, roughly what the encoding adds.
RESULT_OVERHEAD = 32


class Collector:
    """The items of one grep (matches, files or counts, by ``mode``) until one more would
    pass ``max_results`` or the byte room; then ``full`` (and the answer ``truncated``)."""

    def __init__(
        self, mode: str, max_results: int, max_bytes: int, context: tuple[int, int] = (0, 0)
    ) -> None:
        self.mode = mode
        self.items: list[dict[str, Any]] = []
        self.max_results = max_results
        self.room = max_bytes
        self.before, self.after = context
        self.full = False

    def _fits(self, cost: int) -> bool:
        if len(self.items) >= self.max_results or cost > self.room:
            self.full = True
            return False
        self.room -= cost
        return True

    def add_match(self, path: str, line: int, text: str, lines: dict[int, str]) -> bool:
        """One match starting on ``line``; ``lines`` holds the file's lines around it, by
        number (only those the context asks for are taken)."""
        item: dict[str, Any] = {"path": path, "line": line, "text": text[:MAX_LINE_CHARS]}
        cost = len(path.encode()) + len(item["text"].encode()) + RESULT_OVERHEAD
        if self.before or self.after:
            # A multiline match spans several lines: its after-context follows its last one.
            last = line + text.count("\n")
            window_before = range(line - self.before, line)
            window_after = range(last + 1, last + 1 + self.after)
            before = [lines[n][:MAX_LINE_CHARS] for n in window_before if n in lines]
            after = [lines[n][:MAX_LINE_CHARS] for n in window_after if n in lines]
            item["before"], item["after"] = before, after
            cost += sum(len(s.encode()) + 2 for s in (*before, *after))
        if not self._fits(cost):
            return False
        self.items.append(item)
        return True

    def add_file(self, path: str) -> bool:
        if not self._fits(len(path.encode()) + RESULT_OVERHEAD):
            return False
        self.items.append({"path": path})
        return True

    def add_count(self, path: str, count: int) -> bool:
        if not self._fits(len(path.encode()) + RESULT_OVERHEAD):
            return False
        self.items.append({"path": path, "count": count})
        return True

    def value(self, skipped: int, engine: str) -> dict[str, Any]:
        """The tool's value: sorted, so that the answer does not depend on rg's threads."""
        if self.mode == "files_with_matches":
            body: dict[str, Any] = {"files": sorted(item["path"] for item in self.items)}
        elif self.mode == "count":
            body = {"counts": sorted(self.items, key=lambda item: item["path"])}
        else:
            body = {"matches": sorted(self.items, key=lambda item: (item["path"], item["line"]))}
        return {**body, "truncated": self.full, "skipped": skipped, "engine": engine}
