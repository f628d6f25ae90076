"""`profile --plot FILE`: peak memory against batch, both modes; plan's prediction as lines,
the measurements as points, out-of-memory runs as crosses on the capacity line, and the
device's capacity marked. Needs matplotlib (the optional `plot` extra)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

from qwen_kvprep.errors import UsageError
from qwen_kvprep.fsutil import atomic_write_bytes

if TYPE_CHECKING:
    from qwen_kvprep.profile.document import ProfileDocument

FORMATS = (".svg", ".png")
INSTALL = "pip install 'qwen-kvprep[plot]'"
_COLOURS = {"unquantized": "tab:blue", "int8": "tab:orange"}
_GIB = 1024**3


class PlotError(UsageError):
    """--plot cannot be honoured (matplotlib missing, an unknown file type)."""


def check_plot_target(path: Path) -> None:
    """Refuse early (before minutes of measuring) what would fail at the end."""
    if path.suffix.lower() not in FORMATS:
        raise PlotError(f"--plot {path}: the file name must end in .svg or .png")
    if not path.absolute().parent.is_dir():
        raise PlotError(f"--plot {path}: the folder {path.absolute().parent} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("--plot needs matplotlib, which is not installed",
                        fix=INSTALL) from None


def write_plot(profile: ProfileDocument, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window (and no display needed)
    import matplotlib.pyplot as plt

    rows = profile["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    capacity = profile["device"].get("total_bytes")
    for mode, colour in _COLOURS.items():
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["batch"])
        predicted = [(r["batch"], r["predicted_bytes"]) for r in mine
                     if r["predicted_bytes"] is not None]
        if predicted:
            ax.plot([b for b, _ in predicted], [v / _GIB for _, v in predicted], "-",
                    color=colour, label=f"{mode} predicted")
        measured = [(r["batch"], r["peak_bytes"]) for r in mine
                    if r["peak_bytes"] is not None and not r["oom"] and not r["error"]]
        if measured:
            ax.plot([b for b, _ in measured], [v / _GIB for _, v in measured], "o",
                    color=colour, label=f"{mode} measured")
        oom = [r["batch"] for r in mine if r["oom"]]
        if oom and capacity:
            ax.plot(oom, [capacity / _GIB] * len(oom), "x", color=colour, markersize=9,
                    label=f"{mode} out of memory")
    if capacity:
        ax.axhline(capacity / _GIB, color="grey", linestyle="--", linewidth=1)
        ax.annotate(f"capacity {capacity / _GIB:.1f} GiB", (0.01, capacity / _GIB),
                    xycoords=("axes fraction", "data"), va="bottom", fontsize=8,
                    color="grey")
    device = profile["device"]
    ax.set_title(
        f"{Path(profile['directory']).name}: peak memory, {profile['prompt_tokens']} + "
        f"{profile['new_tokens']} tokens, {device.get('kind')} ({device.get('name')})",
        fontsize=9,
    )
    ax.set_xlabel("batch size")
    ax.set_xticks(sorted({r["batch"] for r in rows}))
    ax.set_ylabel("peak memory (GiB)")
    values = [v for r in rows for v in (r["peak_bytes"], r["predicted_bytes"]) if v]
    top = max([*values, capacity or 0, 1]) / _GIB
    ax.set_ylim(0, top * 1.12)  # room above the capacity line for its label
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lower().lstrip("."))
    plt.close(fig)
    # like every file qwen-kvprep writes: whole or not at all
    atomic_write_bytes(path, buffer.getvalue())
    return path
