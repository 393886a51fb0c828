"""Rank-0 progress: a redrawn bar on a terminal, concise lines otherwise (logs, CI)."""

from __future__ import annotations

import sys
from typing import Any, TextIO


class Progress:
    def __init__(self, total_steps: int, mode: str = "auto", log_every: int = 10, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "lines"
        self.mode = mode
        self.total = total_steps
        self.log_every = log_every

    def update(self, step: int, m: dict[str, Any]) -> None:
        if self.mode == "off":
            return
        text = (
            f"step {step}/{self.total} loss {m['loss']:.4f} lr {m['lr']:.2e} "
            f"gnorm {m['grad_norm']:.3f} {m['tokens_per_s']:.0f} tok/s {m['step_time_s'] * 1e3:.0f} ms"
        )
        if self.mode == "bar":
            width = 24
            filled = int(width * step / max(1, self.total))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            if step == self.total:
                self.stream.write("\n")
        elif step == 1 or step % self.log_every == 0 or step == self.total:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.mode == "off":
            return
        if self.mode == "bar":
            self.stream.write("\r\x1b[K")
        self.stream.write(text + "\n")
        self.stream.flush()
