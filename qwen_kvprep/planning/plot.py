"""`plan --plot FILE`: the predicted peaks as two charts, against batch at the first token
count and against the tokens cached at the first batch, both modes, with the line a run's
peak must stay under to fit (the GPU's memory less the CUDA context). With several cards
(`--gpus N`), a line per card and mode, each card's own peak, under the same line."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from qwen_kvprep.chart import BLUE, ORANGE, Panel, Series, write_chart
from qwen_kvprep.planning.capacity import PlanResult
from qwen_kvprep.planning.model import ModelFacts
from qwen_kvprep.planning.peak import CUDA_CONTEXT_BYTES

_GIB = 1024**3
_Points = list[tuple[float, float]]
_MODES = (("unquantized", "unquantized cache", BLUE), ("int8", "Int8 cache", ORANGE))
# the cards of one mode share its colour and differ in their marks
_CARD_MARKERS = ("dot", "cross", "none")


def write_plan_plot(facts: ModelFacts, plan: PlanResult, gpu_source: str, path: Path) -> Path:
    memory = plan.scenario.gpu_memory_bytes
    limit = (memory - CUDA_CONTEXT_BYTES) / _GIB
    hlines = [(limit, f"fits below {limit:.1f} GiB ({memory / _GIB:.1f} GiB GPU less "
                      f"{CUDA_CONTEXT_BYTES / _GIB:.1f} GiB CUDA context)")]
    t0, b0 = plan.tokens[0], plan.batches[0]
    gpus = plan.scenario.gpus

    def series(points: Callable[[str, int], _Points]) -> list[Series]:
        if gpus == 1:
            return [Series(label, points(mode, -1), colour) for mode, label, colour in _MODES]
        return [
            Series(f"{label}, card {card.index} ({card.holds()})", points(mode, card.index),
                   colour, marker=_CARD_MARKERS[card.index % len(_CARD_MARKERS)])
            for mode, label, colour in _MODES
            for card in plan.split.cards
        ]

    def panel(title: str, x_label: str, points: Callable[[str, int], _Points]) -> Panel:
        return Panel(
            title=title,
            x_label=x_label,
            y_label="predicted peak GPU memory (GiB)" + (" per card" if gpus > 1 else ""),
            series=series(points),
            hlines=hlines,
            log_x=True,
        )

    def at(batch: int, tokens: int, mode: str, card: int) -> float:
        row = plan.row(batch, tokens)
        return (row.bytes_of(mode) if card < 0 else row.cards_of(mode)[card]) / _GIB

    by_batch = panel(
        f"{t0:,} tokens cached", "batch size",
        lambda mode, card: [(b, at(b, t0, mode, card)) for b in sorted(plan.batches)],
    )
    by_tokens = panel(
        f"batch {b0:,}", "tokens cached",
        lambda mode, card: [(t, at(b0, t, mode, card)) for t in sorted(plan.tokens)],
    )
    cards = "" if gpus == 1 else f" on each of {gpus} cards"
    title = f"{facts.path.name}: predicted peak GPU memory{cards} ({gpu_source})"
    return write_chart(path, title, [by_batch, by_tokens])
