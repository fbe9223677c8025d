"""Headless Chromium: a page to a PNG, or to the DOM its script built.

    page.html --chromium --headless ... --screenshot=FILE | --dump-dom--> PNG file | DOM text

Chromium is not a dependency: ``timeline --png`` uses it when it is on PATH (Debian's
``chromium``), and says so when it is not (``ChromiumMissing``). Each run gets a new, empty
profile (``--user-data-dir`` in a temp directory, removed after) and the flags that keep a
headless browser from reaching out: no sync, no component updates, no background networking,
no QUIC. The page itself fetches nothing either (page.py's Content-Security-Policy). As root,
Chromium refuses to start without ``--no-sandbox``; the page is our own file, and its hostile
text is inert data (page.py), so the renderer's sandbox is not what protects anyone here.

The browser leads its own session, so a run past its deadline is ended with its whole process
group (its zygote and renderers), never left behind.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Final

#: Names the browser goes by on PATH, in the order they are tried.
CHROMIUM_NAMES: Final = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

#: How long one headless run may take (a 10,000-call page renders in well under 2 s; a cold
#: start of the browser on a busy machine is most of this).
RUN_TIMEOUT_S: Final = 60.0

#: Every run: headless, no GPU, no sandbox (root), and nothing that talks to the network.
FLAGS: Final = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--hide-scrollbars",
    "--mute-audio",
)


class ChromiumMissing(RuntimeError):
    """No headless browser on PATH."""


class ChromiumFailed(RuntimeError):
    """The browser ran and did not produce what was asked (its stderr's last lines say why)."""


def find_chromium() -> str | None:
    """The path of the first Chromium on PATH, or None."""
    for name in CHROMIUM_NAMES:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


def _run(args: list[str], page: str | os.PathLike[str], timeout_s: float, query: str = "") -> str:
    browser = find_chromium()
    if browser is None:
        raise ChromiumMissing(
            "headless Chromium is not installed (none of "
            + ", ".join(CHROMIUM_NAMES)
            + " is on PATH; on Debian: apt-get install chromium)"
        )
    url = Path(page).resolve().as_uri() + (f"?{query}" if query else "")
    with tempfile.TemporaryDirectory(prefix="sandbx-chromium-") as profile:
        command = [browser, *FLAGS, f"--user-data-dir={profile}", *args, url]
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            start_new_session=True,  # its renderers and zygote go with it on a timeout
        )
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise ChromiumFailed(f"{browser} did not finish within {timeout_s:g} s") from None
        finally:
            # Whatever the browser leaves in its group (a crash handler) goes with the profile.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    if process.returncode != 0:
        tail = " | ".join(err.strip().splitlines()[-3:])
        raise ChromiumFailed(f"{browser} exited with {process.returncode}: {tail}")
    return out


def screenshot(
    page: str | os.PathLike[str],
    png: str | os.PathLike[str],
    *,
    width: int,
    height: int,
    timeout_s: float = RUN_TIMEOUT_S,
) -> None:
    """Render ``page`` in a ``width`` x ``height`` window into the PNG file ``png``."""
    target = Path(png).resolve()
    with contextlib.suppress(FileNotFoundError):
        target.unlink()  # so that a file there afterwards is this run's
    # "?still": the page leaves out its zoom buttons, which a picture cannot press.
    size = f"--window-size={width},{height}"
    _run([f"--screenshot={target}", size], page, timeout_s, query="still")
    if not target.is_file() or target.stat().st_size == 0:
        raise ChromiumFailed(f"the browser wrote no screenshot to {target}")


def dump_dom(
    page: str | os.PathLike[str], *, query: str = "", timeout_s: float = RUN_TIMEOUT_S
) -> str:
    """The page's DOM, serialised, once its scripts have run (what a reader would see);
    ``query``: the URL's, without its ``?``."""
    return _run(["--dump-dom", "--window-size=1400,900"], page, timeout_s, query=query)
