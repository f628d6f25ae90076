"""`profile --plot FILE`: peak memory against batch, both modes; plan's prediction as lines,
the measurements as points, out-of-memory runs as crosses on the capacity line, and the
device's capacity marked. An SVG needs nothing more than qwen-kvprep; a PNG needs
matplotlib (the optional `plot` extra), see qwen_kvprep/chart.py."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from qwen_kvprep.chart import BLUE, ORANGE, Panel, PlotError, Series, check_target, write_chart

if TYPE_CHECKING:
    from qwen_kvprep.profile.document import ProfileDocument

__all__ = ["PlotError", "check_plot_target", "write_plot"]

_COLOURS = {"unquantized": BLUE, "int8": ORANGE}
_GIB = 1024**3


def check_plot_target(path: Path) -> None:
    """Refuse early (before minutes of measuring) what would fail at the end."""
    check_target(path)


def write_plot(profile: ProfileDocument, path: Path) -> Path:
    rows = profile["rows"]
    capacity = profile["device"].get("total_bytes")
    series: list[Series] = []
    # on a CPU the points are the process's resident memory, the lines plan's GPU allocator
    # prediction: the legend says which is which
    rss = profile.get("peak_measure", "cuda_allocator") != "cuda_allocator"
    predicted_name, measured_name = (
        ("predicted (GPU allocator)", "measured (process RSS)") if rss
        else ("predicted", "measured"))
    for mode, colour in _COLOURS.items():
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
        predicted = [(r["batch"], r["predicted_bytes"] / _GIB) for r in mine
                     if r["predicted_bytes"] is not None]
        if predicted:
            series.append(Series(f"{mode} {predicted_name}", predicted, colour, marker="none"))
        measured = [(r["batch"], r["peak_bytes"] / _GIB) for r in mine
                    if r["peak_bytes"] is not None and not r["oom"] and not r["error"]]
        if measured:
            series.append(Series(f"{mode} {measured_name}", measured, colour, line=False))
        oom = [r["batch"] for r in mine if r["oom"]]
        if oom and capacity:
            series.append(Series(f"{mode} out of memory", [(b, capacity / _GIB) for b in oom],
                                 colour, line=False, marker="cross"))
    hlines = [(capacity / _GIB, f"capacity {capacity / _GIB:.1f} GiB")] if capacity else []
    device = profile["device"]
    panel = Panel(
        title=f"{profile['prompt_tokens']} + {profile['new_tokens']} tokens, "
        f"{device.get('kind')} ({device.get('name')})",
        x_label="batch size",
        y_label="peak memory (GiB)",
        series=series,
        hlines=hlines,
        x_ticks=sorted({r["batch"] for r in rows}),
    )
    title = f"{Path(profile['directory']).name}: peak memory against batch"
    return write_chart(path, title, [panel])
