"""The timeline as one self-contained HTML page: inline CSS, inline JS, SVG built in the browser.

    Timeline (model.py) --page_data--> compact JSON (offsets from the first start, a status
        index, the hover facts) --escaped into <script type="application/json">--> render_page
        --> the page's script: JSON.parse, one <rect> (and its <title>) per bar, an axis, a
        legend; zoom (buttons, ctrl+wheel) lays the rects out again, the scroller scrolls

Everything in a journal that came from a call (ids, tool names, reasons, errors) is text a model
may have written to attack whoever reads it. It reaches the page only as JSON inside a
non-executed script element, with ``<``, ``>`` and ``&`` written as ``\\u003c``... so that no
``</script>`` can end it, and the page's script puts it into the DOM with ``textContent``
only, never as markup. The page's Content-Security-Policy allows no fetch at all and runs only
the page's own script (by its hash): an injected handler would not run even if one got in.

Drawing in the browser rather than writing 10,000 ``<rect>`` elements here keeps the file about
100 bytes a call, and lets zoom recompute positions rather than scale the text with the bars.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from typing import Any, Final

from sandbx_pool.timeline.model import IN_DOUBT, NO_OUTCOME, Timeline
from sandbx_pool.timeline.script import SCRIPT, STYLE

#: Each status's colour and the word its bars say; in the contract's order, then the two
#: states of a call without an outcome. A status this table lacks (a newer journal) is drawn
#: in ``OTHER_COLOUR`` and named as it is written.
STATUSES: Final = (
    ("ok", "#43a047", "ok"),
    ("error", "#fb8c00", "error"),
    ("denied", "#8e24aa", "denied"),
    ("cancelled", "#546e7a", "cancelled"),
    ("timeout", "#e53935", "timeout"),
    ("output_limit", "#d81b60", "output limit"),
    ("crashed", "#212121", "crashed"),
    (IN_DOUBT, "#fdd835", "in doubt"),
    (NO_OUTCOME, "#bdbdbd", "no outcome"),
)
OTHER_COLOUR: Final = "#8d6e63"

#: Pixels: a lane's height, the gap under it, the room above the lanes (header, legend, axis;
#: a picture has no zoom buttons) and below.
ROW_PX: Final = 16
GAP_PX: Final = 4
TOP_PX: Final = 140
BOTTOM_PX: Final = 24

#: The page's width when rendered to a PNG (the timeline fits it at zoom 1).
PNG_WIDTH_PX: Final = 1400

#: A PNG taller than this is cut (a run with hundreds of lanes): Chromium's screenshots of
#: very tall windows fail, and such a picture is read by scrolling the page anyway.
PNG_MAX_HEIGHT_PX: Final = 4000


def page_data(timeline: Timeline) -> dict[str, Any]:
    """What the page's script draws: statuses, then one short list a bar (see SCRIPT)."""
    known = [name for name, _, _ in STATUSES]
    names = known + sorted({bar.status for bar in timeline.bars} - set(known))
    styles = {name: (colour, label) for name, colour, label in STATUSES}
    index = {name: i for i, name in enumerate(names)}
    t0 = timeline.start
    bars = [
        [
            bar.lane,
            round(bar.start - t0, 6),
            round(bar.end - t0, 6),
            index[bar.status],
            bar.call_id,
            bar.tool,
            bar.duration_s,
            bar.killed_by,
            bar.reason,
            bar.error,
            bar.worker_pid,
            bar.node,
            bar.exit_code,
            bar.quarantined,
            bar.wchan,
            bar.limit,
            bar.cpu_s,
            bar.max_rss_bytes,
        ]
        for bar in timeline.bars
    ]
    return {
        "path": timeline.path,
        "start": t0,
        "span": max(timeline.end - t0, 0.0),
        "lanes": timeline.lanes,
        "statuses": [
            {
                "name": name,
                "colour": styles.get(name, (OTHER_COLOUR, name))[0],
                "label": styles.get(name, (OTHER_COLOUR, name))[1],
            }
            for name in names
        ],
        "counts": timeline.counts(),
        "torn_tail": timeline.torn_tail,
        "corrupt_lines": timeline.corrupt_lines,
        "bars": bars,
    }


def script_json(data: Any) -> str:
    """``data`` as JSON that cannot end the script element holding it, nor start a comment
    or markup there: every ``<``, ``>`` and ``&`` escaped (U+2028/9 too, for old parsers)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in (
        ("<", "\\u003c"),
        (">", "\\u003e"),
        ("&", "\\u0026"),
        ("\u2028", "\\u2028"),
        ("\u2029", "\\u2029"),
    ):
        text = text.replace(char, escape)
    return text


def page_height(timeline: Timeline) -> int:
    """The height in pixels that shows every lane at once (the PNG's window)."""
    lanes = max(timeline.lanes, 1)
    return min(TOP_PX + lanes * (ROW_PX + GAP_PX) + BOTTOM_PX, PNG_MAX_HEIGHT_PX)


def render_page(timeline: Timeline) -> str:
    """The whole page, as text to write to a ``.html`` file."""
    digest = hashlib.sha256(SCRIPT.encode()).digest()
    script_hash = "sha256-" + base64.b64encode(digest).decode()
    policy = (
        "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
        f"script-src '{script_hash}'; base-uri 'none'; form-action 'none'"
    )
    title = html.escape(f"sandbx-pool timeline: {timeline.path}")
    summary = html.escape(_summary(timeline))
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{policy}">\n'
        f"<title>{title}</title>\n<style>{STYLE}</style></head>\n<body>\n"
        "<header><h1>sandbx-pool timeline</h1>"
        f'<p id="journal">{html.escape(timeline.path)}</p>'
        f'<p id="summary">{summary}</p></header>\n'
        '<div id="controls"><button id="zoom-in" type="button">zoom in</button>'
        '<button id="zoom-out" type="button">zoom out</button>'
        '<button id="zoom-fit" type="button">fit</button>'
        '<span class="hint">ctrl + wheel zooms; scroll to move; hover a bar for its call'
        "</span></div>\n"
        '<div id="legend"></div>\n'
        '<div id="frame"><svg id="lanes" xmlns="http://www.w3.org/2000/svg"></svg>'
        '<div id="scroller"><svg id="chart" xmlns="http://www.w3.org/2000/svg"></svg>'
        "</div></div>\n"
        '<pre id="detail"></pre>\n'
        f'<script type="application/json" id="timeline-data">{script_json(page_data(timeline))}'
        "</script>\n"
        f"<script>{SCRIPT}</script>\n</body></html>\n"
    )


def _summary(timeline: Timeline) -> str:
    """One line for people and for a page whose script did not run."""
    if not timeline.bars:
        return "This journal is empty: it holds no calls."
    counts = timeline.counts()
    parts = ", ".join(f"{counts[name]} {label}" for name, _, label in STATUSES if name in counts)
    others = sorted(set(counts) - {name for name, _, _ in STATUSES})
    parts += "".join(f", {counts[name]} {name}" for name in others)
    span = timeline.end - timeline.start
    calls = f"{len(timeline.bars)} call{'s' if len(timeline.bars) != 1 else ''}"
    slots = f"{timeline.lanes} worker slot{'s' if timeline.lanes != 1 else ''}"
    text = f"{calls} on {slots} over {span:.2f} s: {parts}."
    if timeline.torn_tail:
        text += " The journal's last line is torn (a killed run): drawn up to it."
    if timeline.corrupt_lines:
        text += f" {timeline.corrupt_lines} corrupt line(s) skipped."
    return text
