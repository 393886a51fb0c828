"""The tables ``ftrain plan`` prints: Markdown rows, and one estimate's memory columns."""

from __future__ import annotations

from collections.abc import Sequence

from ftrain.planning.memory import TIGHT_FRACTION, MemoryEstimate, gib


def table_lines(rows: Sequence[Sequence[str]], *, text_columns: int = 2) -> list[str]:
    """Markdown rows, the first ``text_columns`` columns left-aligned and the numbers right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append(
            "| "
            + " | ".join(
                c.ljust(w) if i < text_columns else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
            + " |"
        )
        if j == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return lines


def memory_header(memory: int) -> list[str]:
    """The memory columns of the ``ftrain plan`` tables (:func:`memory_cells`)."""
    return [
        "params+grads+optim",
        "activations",
        "backward extra",
        "step extra",
        "overhead",
        "total/rank",
        f"fits {gib(memory)}",
    ]


def memory_cells(e: MemoryEstimate, memory: int) -> list[str]:
    """One estimate's memory columns, and whether it fits in ``memory``."""
    use = e.total_bytes / memory
    fit = "no" if use > 1 else ("tight" if use > TIGHT_FRACTION else "yes")
    return [
        gib(e.model_state_bytes),
        gib(e.activation_bytes),
        gib(e.transient_bytes),
        gib(e.step_transient_bytes),
        gib(e.overhead_bytes),
        gib(e.total_bytes) + ("" if e.phase == "backward" else f" ({e.phase})"),
        f"{fit} ({use:.0%})",
    ]


def gradient_reduce_cell(e: MemoryEstimate) -> str:
    """The ``parallel.gradient_reduce`` mode an FSDP strategy's estimate counts ("-" for the others)."""
    return e.gradient_reduce or "-"
