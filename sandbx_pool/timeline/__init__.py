"""A batch run drawn: every call of a journal as a bar on its worker slot, in one HTML page.

    journal file --journal.reader--> JournalScan --model.build_timeline--> Timeline (bars, lanes)
        --page.render_page--> self-contained HTML --browser.screenshot--> PNG (headless Chromium)

``sandbx-pool journal timeline J -o FILE.html [--png FILE.png]`` and ``run --timeline FILE.html``
call ``write_timeline``. Nothing here is imported by a pool: it reads a journal, like the rest
of ``sandbx-pool journal``, and never changes one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from sandbx_pool.journal.reader import JournalScan
from sandbx_pool.timeline.browser import ChromiumFailed, ChromiumMissing, screenshot
from sandbx_pool.timeline.model import Bar, Timeline, build_timeline
from sandbx_pool.timeline.page import PNG_WIDTH_PX, page_height, render_page


def write_timeline(
    scan: JournalScan,
    html_path: str | os.PathLike[str] | None = None,
    png_path: str | os.PathLike[str] | None = None,
) -> Timeline:
    """Write ``scan``'s timeline as an HTML page and/or a PNG of it.

    The page is written whole to a temp file beside ``html_path``, then renamed: a reader never
    opens half a page. A PNG without a page renders from a temp page removed after.
    ChromiumMissing / ChromiumFailed (the PNG only; the page is written first); ValueError
    naming an output that is the journal itself, or both outputs one file (a typo that would
    replace the journal with a page, or the page with a picture)."""
    outputs = [os.fspath(p) for p in (html_path, png_path) if p is not None]
    for output in outputs:
        if same_file(output, scan.path):
            raise ValueError(f"{output} is the journal itself: name another file to write")
    if len(outputs) == 2 and same_file(*outputs):
        raise ValueError(f"{outputs[0]}: the page and the PNG must be two files")
    timeline = build_timeline(scan)
    text = render_page(timeline)
    if html_path is not None:
        _write_whole(os.fspath(html_path), text)
    if png_path is not None:
        page = os.fspath(html_path) if html_path is not None else None
        if page is None:
            page = os.fspath(png_path) + ".tmp.html"
            _write_whole(page, text)
        try:
            screenshot(page, png_path, width=PNG_WIDTH_PX, height=page_height(timeline))
        finally:
            if html_path is None:
                os.unlink(page)
    return timeline


def same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file: one path, or links to one inode."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False  # one of them does not exist yet: not the same file


def _write_whole(path: str, text: str) -> None:
    # A name of its own, made exclusively: a predictable one in a shared directory (/tmp)
    # could be a link someone else left, and the page would be written through it.
    fd, temp = tempfile.mkstemp(prefix=os.path.basename(path) + ".tmp-", dir=_folder(path))
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # the page's mode as open() would have made it
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise


def _umask() -> int:
    """This process's umask, read rather than set and reset (another thread may be creating)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _folder(path: str) -> str:
    return os.path.dirname(os.path.abspath(path))


__all__ = [
    "Bar",
    "ChromiumFailed",
    "ChromiumMissing",
    "Timeline",
    "build_timeline",
    "same_file",
    "write_timeline",
]
