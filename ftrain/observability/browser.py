"""Headless Chromium for the reports (the chaos report, ``ftrain report``): a PNG screenshot of a
page, and the page's DOM after its script ran (what the tests check)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from ftrain.contract.local_files import replace_file

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
HEADLESS_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(html_path: Path, png_path: Path, *, width: int = 1200, height: int = 900, timeout_s: float = 60) -> bool:
    """A PNG of the page at ``png_path``: Chromium writes it in its own private directory, and it
    replaces ``png_path`` whole (:func:`~ftrain.contract.local_files.replace_file`: a link planted
    there in a shared directory is not written through)."""
    browser = find_browser()
    if browser is None:
        return False
    with tempfile.TemporaryDirectory(prefix="ftrain-chromium-") as profile:
        shot = Path(profile) / "shot.png"
        out = subprocess.run(
            [
                browser,
                *HEADLESS_FLAGS,
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                f"--window-size={width},{height}",
                html_path.resolve().as_uri(),
            ],
            capture_output=True,
            timeout=timeout_s,
        )
        if out.returncode != 0 or not shot.is_file():
            return False
        replace_file(png_path, shot.read_bytes())
    return True


def dump_dom(html_path: Path, *, timeout_s: float = 60) -> str:
    """The page's DOM after its script ran, as headless Chromium sees it."""
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError(f"no headless browser found (tried {', '.join(BROWSERS)})")
    with tempfile.TemporaryDirectory(prefix="ftrain-chromium-") as profile:
        out = subprocess.run(
            [browser, *HEADLESS_FLAGS, f"--user-data-dir={profile}", "--dump-dom", html_path.resolve().as_uri()],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    return out.stdout
