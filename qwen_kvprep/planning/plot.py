"""`plan --plot FILE`: the predicted peaks as two charts, against batch at the first token
count and against the tokens cached at the first batch, both modes, with the line a run's
peak must stay under to fit (the GPU's memory less the CUDA context)."""

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


def write_plan_plot(facts: ModelFacts, plan: PlanResult, gpu_source: str, path: Path) -> Path:
    memory = plan.scenario.gpu_memory_bytes
    limit = (memory - CUDA_CONTEXT_BYTES) / _GIB
    hlines = [(limit, f"fits below {limit:.1f} GiB ({memory / _GIB:.1f} GiB GPU less "
                      f"{CUDA_CONTEXT_BYTES / _GIB:.1f} GiB CUDA context)")]
    t0, b0 = plan.tokens[0], plan.batches[0]

    def panel(title: str, x_label: str, points: Callable[[str], _Points]) -> Panel:
        return Panel(
            title=title,
            x_label=x_label,
            y_label="predicted peak GPU memory (GiB)",
            series=[Series(label, points(mode), colour) for mode, label, colour in _MODES],
            hlines=hlines,
            log_x=True,
        )

    by_batch = panel(
        f"{t0:,} tokens cached", "batch size",
        lambda mode: [(b, plan.row(b, t0).bytes_of(mode) / _GIB) for b in sorted(plan.batches)],
    )
    by_tokens = panel(
        f"batch {b0:,}", "tokens cached",
        lambda mode: [(t, plan.row(b0, t).bytes_of(mode) / _GIB) for t in sorted(plan.tokens)],
    )
    title = f"{facts.path.name}: predicted peak GPU memory ({gpu_source})"
    return write_chart(path, title, [by_batch, by_tokens])
