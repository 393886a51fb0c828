"""Rewrite the configuration reference (docs/configuration.md) from the config dataclasses
(``make docs``); ``tests/unit/test_readme.py`` fails when it is stale."""

import re
import sys
from pathlib import Path

from ftrain.cli.config import reference_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
DEFAULT_PATH = "docs/configuration.md"


def render(page: str) -> str:
    body = f"{START}\n{reference_markdown()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: body, page, flags=re.S)


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_PATH)
    path.write_text(render(path.read_text()))
