"""Headless Chromium for the reports (the chaos report, ``ftrain report``): a PNG screenshot of a
page, and the page's DOM after its script ran (what the tests check)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

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
    browser = find_browser()
    if browser is None:
        return False
    with tempfile.TemporaryDirectory(prefix="ftrain-chromium-") as profile:
        out = subprocess.run(
            [
                browser,
                *HEADLESS_FLAGS,
                f"--user-data-dir={profile}",
                f"--screenshot={png_path}",
                f"--window-size={width},{height}",
                html_path.resolve().as_uri(),
            ],
            capture_output=True,
            timeout=timeout_s,
        )
    return out.returncode == 0 and png_path.exists()


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
