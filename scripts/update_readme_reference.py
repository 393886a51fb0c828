"""Rewrite the README's configuration reference from the config dataclasses (``make docs``)."""

import re
import sys
from pathlib import Path

from ftrain.cli.config import reference_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def render(readme: str) -> str:
    body = f"{START}\n{reference_markdown()}\n{END}"
    return re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: body, readme, flags=re.S)


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "README.md")
    path.write_text(render(path.read_text()))
