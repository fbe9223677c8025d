"""The timeline page's stylesheet and script (page.py inlines both: the page fetches nothing).

    #timeline-data (JSON: statuses, bars as [lane, start, end, status, id, tool, seconds,
        killed_by, reason, error, pid, node, exit code, quarantined, wchan, limit,
        cpu seconds, peak memory bytes])
        --> legend (a swatch and a count per status) and lane labels
        --> per bar: <rect class="bar"> with a <title> (its call, in words), filled with its
            status's colour (hatched when it has no outcome), outlined when quarantined, and a
            dark mark at the end of a call that was stopped (cancelled, timeout, output limit,
            crashed)
        --> layout(): x and width of every rect at the current zoom, the time axis; called at
            start (zoomed by ``?zoom=N``), on zoom (buttons, ctrl + wheel, around the pointer)
            and on resize; ``?still`` (a PNG) hides the zoom buttons

Text from the journal goes into the DOM through ``textContent`` and ``setAttribute`` of
numbers only: nothing a call wrote is ever parsed as markup. The script marks the body with
``data-bars`` (rects drawn) and ``data-render-ms`` (time to build and lay out) when done, for
whoever checks the page headless.
"""

from __future__ import annotations

from typing import Final

STYLE: Final = """
body{font:13px/1.4 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:12px 16px;
  color:#222;background:#fff}
h1{font-size:18px;margin:0 0 2px}
header p{margin:2px 0;color:#444}
#journal{font-family:ui-monospace,monospace;color:#666;word-break:break-all}
#controls{margin:6px 0}
button{font:inherit;margin-right:4px}
.hint{color:#777;margin-left:8px}
#legend{margin:6px 0 8px;display:flex;flex-wrap:wrap;gap:4px 14px}
.item{display:inline-flex;align-items:center;gap:5px}
.swatch{display:inline-block;width:14px;height:12px;border-radius:2px;box-sizing:border-box}
.swatch.open{background-image:repeating-linear-gradient(45deg,rgba(0,0,0,.35) 0 2px,
  transparent 2px 5px)}
.swatch.quarantined{background:#fff;border:2px solid #b71c1c}
.swatch.stopped{background:linear-gradient(90deg,#ccc 70%,#000 70%)}
#frame{display:flex;border:1px solid #ddd}
#lanes{flex:none;background:#fafafa}
#scroller{flex:1;overflow-x:auto;overflow-y:hidden}
#empty{padding:24px;color:#555;font-size:15px}
#detail{position:fixed;right:12px;bottom:12px;max-width:55%;margin:0;padding:8px 10px;
  background:rgba(255,255,255,.96);border:1px solid #bbb;border-radius:4px;
  font:12px/1.4 ui-monospace,monospace;white-space:pre-wrap;word-break:break-all;display:none}
rect.bar.quarantined{stroke:#b71c1c;stroke-width:2}
rect.bar:hover{stroke:#000;stroke-width:1}
svg text{font-size:11px;fill:#555}
.labels text{fill:#fff;pointer-events:none;font-size:10.5px}
.labels text.s-in_doubt,.labels text.s-no_outcome{fill:#222}
.grid{stroke:#e6e6e6}
"""

SCRIPT: Final = r"""
(function () {
  "use strict";
  var began = performance.now();
  var data = JSON.parse(document.getElementById("timeline-data").textContent);
  var NS = "http://www.w3.org/2000/svg";
  var ROW = 16, GAP = 4, AXIS = 22, LABELS = 58, MAX_WIDTH = 8000000;
  var LABEL_PX = 70, MAX_LABELS = 1500;
  var STOPPED = {cancelled: 1, timeout: 1, output_limit: 1, crashed: 1};
  var OPEN = {in_doubt: 1, no_outcome: 1};
  var chart = document.getElementById("chart"), lanesSvg = document.getElementById("lanes");
  var scroller = document.getElementById("scroller"), detail = document.getElementById("detail");
  var statuses = data.statuses, bars = data.bars, span = data.span > 0 ? data.span : 1e-3;
  var lanes = Math.max(data.lanes, 1), height = AXIS + lanes * (ROW + GAP) + 4;

  function el(name, attrs, parent) {
    var node = document.createElementNS(NS, name);
    for (var key in attrs) node.setAttribute(key, attrs[key]);
    if (parent) parent.appendChild(node);
    return node;
  }
  function secs(x) { return x < 10 ? x.toFixed(3) + " s" : x.toFixed(1) + " s"; }

  function describe(b) {
    var s = statuses[b[3]], lines = [b[4] + " \u00b7 " + b[5] + " \u00b7 " + s.label];
    var took = b[6] != null ? secs(b[6]) : secs(b[2] - b[1]) + " until the journal stops";
    lines.push(took + ", from +" + secs(b[1]) + ", slot " + (b[0] + 1));
    if (b[7]) lines.push("killed_by: " + b[7]);
    if (b[8]) lines.push("reason: " + b[8]);
    if (b[9]) lines.push("error: " + b[9]);
    if (b[15]) lines.push("limit: " + b[15]);
    if (b[13]) lines.push("quarantined: its worker did not die" +
                          (b[14] ? " (stuck in " + b[14] + ")" : ""));
    var facts = [];
    if (b[10] != null) facts.push("worker pid " + b[10]);
    if (b[11]) facts.push("node " + b[11]);
    if (b[12] != null) facts.push("exit code " + b[12]);
    if (facts.length) lines.push(facts.join(" \u00b7 "));
    if (b[16] != null) lines.push("cpu " + secs(b[16]) + " \u00b7 peak memory " +
                                  (b[17] / 1048576).toFixed(1) + " MiB");
    return lines.join("\n");
  }

  // The legend: every status with its colour, its word and its count.
  var legend = document.getElementById("legend");
  function legendItem(text, swatchClass, colour) {
    var item = document.createElement("span"), swatch = document.createElement("span");
    item.className = "item";
    swatch.className = "swatch " + swatchClass;
    if (colour) swatch.style.backgroundColor = colour;
    item.appendChild(swatch);
    item.appendChild(document.createTextNode(text));
    legend.appendChild(item);
    return item;
  }
  statuses.forEach(function (s) {
    var item = legendItem(s.label + " (" + (data.counts[s.name] || 0) + ")",
                          OPEN[s.name] ? "open" : "", s.colour);
    item.setAttribute("data-status", s.name);
  });
  legendItem("quarantined (outlined)", "quarantined");
  legendItem("stopped (dark end mark)", "stopped");

  if (/[?&]still\b/.test(location.search)) document.getElementById("controls").hidden = true;

  if (!bars.length) {
    var empty = document.createElement("p");
    empty.id = "empty";
    empty.textContent = "This journal is empty: it holds no calls.";
    document.getElementById("frame").replaceWith(empty);
    document.getElementById("controls").hidden = true;
    document.body.setAttribute("data-bars", "0");
    document.body.setAttribute("data-render-ms", String(Math.round(performance.now() - began)));
    return;
  }

  // Hatching for calls without an outcome, one pattern per such status's colour.
  var defs = el("defs", {}, chart), fills = [];
  statuses.forEach(function (s, i) {
    if (!OPEN[s.name]) { fills.push(s.colour); return; }
    var p = el("pattern", {id: "hatch" + i, width: 6, height: 6,
                           patternUnits: "userSpaceOnUse", patternTransform: "rotate(45)"}, defs);
    el("rect", {width: 6, height: 6, fill: s.colour}, p);
    el("rect", {width: 2, height: 6, fill: "rgba(0,0,0,0.35)"}, p);
    fills.push("url(#hatch" + i + ")");
  });

  lanesSvg.setAttribute("width", LABELS);
  lanesSvg.setAttribute("height", height);
  for (var lane = 0; lane < lanes; lane++) {
    var label = el("text", {x: 6, y: AXIS + lane * (ROW + GAP) + ROW - 4}, lanesSvg);
    label.textContent = "slot " + (lane + 1);
  }

  var grid = el("g", {}, chart), labels = el("g", {"class": "labels"});
  var layer = document.createDocumentFragment();
  var rects = new Array(bars.length), marks = [];
  for (var i = 0; i < bars.length; i++) {
    var b = bars[i], name = statuses[b[3]].name;
    var r = document.createElementNS(NS, "rect");
    r.setAttribute("y", AXIS + b[0] * (ROW + GAP));
    r.setAttribute("height", ROW);
    r.setAttribute("fill", fills[b[3]]);
    r.setAttribute("class", "bar" + (b[13] ? " quarantined" : ""));
    r.setAttribute("data-i", i);
    r.setAttribute("data-status", name);
    var title = document.createElementNS(NS, "title");
    title.textContent = describe(b);
    r.appendChild(title);
    layer.appendChild(r);
    rects[i] = r;
    if (STOPPED[name]) {
      var m = document.createElementNS(NS, "rect");
      m.setAttribute("y", AXIS + b[0] * (ROW + GAP));
      m.setAttribute("height", ROW);
      m.setAttribute("width", 2);
      m.setAttribute("fill", "#000");
      m.setAttribute("class", "mark");
      m.setAttribute("pointer-events", "none");
      layer.appendChild(m);
      marks.push([i, m]);
    }
  }
  chart.appendChild(layer);
  chart.appendChild(labels);

  var zoom = 1;
  function scale() { return zoom * Math.max(scroller.clientWidth - 12, 200) / span; }
  function niceStep(raw) {
    var p = Math.pow(10, Math.floor(Math.log10(raw))), f = raw / p;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
  }
  function axis(k, width) {
    while (grid.firstChild) grid.removeChild(grid.firstChild);
    var step = niceStep(110 / k), digits = Math.max(0, -Math.floor(Math.log10(step)));
    for (var t = 0; t * k <= width; t += step) {
      var x = Math.round(t * k) + 0.5;
      el("line", {x1: x, x2: x, y1: AXIS - 6, y2: height, "class": "grid"}, grid);
      var tick = el("text", {x: x + 3, y: AXIS - 9}, grid);
      tick.textContent = "+" + t.toFixed(digits) + " s";
    }
  }
  function layout() {
    var k = scale(), width = Math.ceil(span * k) + 12;
    chart.setAttribute("width", width);
    chart.setAttribute("height", height);
    while (labels.firstChild) labels.removeChild(labels.firstChild);
    var named = 0;
    for (var i = 0; i < bars.length; i++) {
      var b = bars[i], w = (b[2] - b[1]) * k;
      // A pixel of white between bars that follow each other on a slot.
      w = w > 3 ? w - 1 : Math.max(w, 1);
      rects[i].setAttribute("x", (b[1] * k).toFixed(2));
      rects[i].setAttribute("width", w.toFixed(2));
      if (w >= LABEL_PX && named < MAX_LABELS) {
        // Wide enough to say what it is: its id, tool and status, cut to fit.
        var text = el("text", {x: (b[1] * k + 4).toFixed(2),
                               y: AXIS + b[0] * (ROW + GAP) + ROW - 4,
                               "class": "label s-" + statuses[b[3]].name}, labels);
        var words = b[4] + " " + b[5] + " " + statuses[b[3]].label;
        var fits = Math.floor((w - 8) / 6.2);
        text.textContent = words.length > fits ?
          words.slice(0, Math.max(fits - 1, 1)) + "\u2026" : words;
        named++;
      }
    }
    for (var j = 0; j < marks.length; j++) {
      var e = bars[marks[j][0]], end = Math.max(e[2] * k, e[1] * k + 1);
      marks[j][1].setAttribute("x", (end - 2).toFixed(2));
    }
    axis(k, width);
  }
  function zoomTo(factor, atX) {
    var before = scale(), at = atX == null ? scroller.clientWidth / 2 : atX;
    var t = (scroller.scrollLeft + at) / before;
    var most = MAX_WIDTH / (before / zoom) / span;
    zoom = Math.min(Math.max(zoom * factor, 1), most);
    layout();
    scroller.scrollLeft = t * scale() - at;
  }
  document.getElementById("zoom-in").addEventListener("click", function () { zoomTo(2); });
  document.getElementById("zoom-out").addEventListener("click", function () { zoomTo(0.5); });
  document.getElementById("zoom-fit").addEventListener("click", function () {
    zoom = 1; layout(); scroller.scrollLeft = 0;
  });
  scroller.addEventListener("wheel", function (event) {
    if (!event.ctrlKey) return;
    event.preventDefault();
    var box = scroller.getBoundingClientRect();
    zoomTo(event.deltaY < 0 ? 1.25 : 0.8, event.clientX - box.left);
  }, {passive: false});
  window.addEventListener("resize", layout);
  chart.addEventListener("mouseover", function (event) {
    var target = event.target;
    if (!(target instanceof SVGRectElement) || !target.hasAttribute("data-i")) return;
    detail.textContent = describe(bars[Number(target.getAttribute("data-i"))]);
    detail.style.display = "block";
  });
  chart.addEventListener("mouseleave", function () { detail.style.display = "none"; });

  // ?zoom=N opens the page zoomed in N times (a link to a close look; and how it is tested).
  var asked = /[?&]zoom=(\d+(?:\.\d+)?)/.exec(location.search);
  if (asked) zoom = Math.min(Math.max(Number(asked[1]), 1), MAX_WIDTH / span / scale());
  layout();
  document.body.setAttribute("data-zoom", String(zoom));
  document.body.setAttribute("data-bars", String(rects.length));
  document.body.setAttribute("data-render-ms", String(Math.round(performance.now() - began)));
})();
"""
