"""Line charts for `plan --plot` and `profile --plot`, as SVG drawn here or as PNG.

SVG needs nothing beyond the standard library, so a plot works after a plain
`pip install qwen-kvprep`; PNG is drawn by matplotlib, the optional `plot` extra. Both
draw the same `Panel`s: points joined by lines or shown as markers, and horizontal
reference lines (a device's capacity).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

from qwen_kvprep.errors import UsageError
from qwen_kvprep.fsutil import atomic_write_bytes, check_output_file

FORMATS = (".svg", ".png")
PNG_INSTALL = "pip install 'qwen-kvprep[plot]'"
# matplotlib's tab:blue/tab:orange/grey, so both back-ends look alike.
BLUE, ORANGE, GREY = "#1f77b4", "#ff7f0e", "#7f7f7f"


@dataclass(frozen=True)
class Series:
    label: str
    points: Sequence[tuple[float, float]]
    colour: str
    line: bool = True  # join the points
    marker: str = "dot"  # "dot", "cross" or "none"


@dataclass(frozen=True)
class Panel:
    title: str
    x_label: str
    y_label: str
    series: Sequence[Series]
    hlines: Sequence[tuple[float, str]] = ()  # (y, label)
    x_ticks: Sequence[float] = ()
    log_x: bool = False


class PlotError(UsageError):
    """--plot cannot be honoured (an unknown file type, matplotlib missing for PNG, no
    such folder)."""


@dataclass
class _Frame:
    """Where a panel's data lands on the page."""

    left: float
    top: float
    width: float
    height: float
    x_min: float
    x_max: float
    y_max: float
    log_x: bool
    ticks: list[float] = field(default_factory=list)

    def _fx(self, x: float) -> float:
        return math.log10(x) if self.log_x else x

    def x(self, value: float) -> float:
        lo, hi = self._fx(self.x_min), self._fx(self.x_max)
        span = (hi - lo) or 1.0
        return self.left + (self._fx(value) - lo) / span * self.width

    def y(self, value: float) -> float:
        return self.top + self.height - value / (self.y_max or 1.0) * self.height


def check_target(path: Path, option: str = "--plot") -> None:
    """Refuse early (before any work) what would fail at the end."""
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise PlotError(f"{option} {path}: the file name must end in .svg or .png")
    check_output_file(path, option, PlotError)
    if suffix == ".png":
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise PlotError(
                f"{option} {path}: a PNG needs matplotlib, which is not installed",
                fix=f"write an SVG instead ({path.with_suffix('.svg').name}; no extra "
                f"needed), or {PNG_INSTALL}",
            ) from None


def write_chart(path: Path, title: str, panels: Sequence[Panel]) -> Path:
    """Draw the panels side by side into `path` (.svg or .png), atomically."""
    if path.suffix.lower() == ".png":
        data = _png(title, panels)
    else:
        data = svg(title, panels).encode("utf-8")
    atomic_write_bytes(path, data)
    return path


def _nice_step(top: float) -> float:
    """A step of 1, 2 or 5 times a power of ten giving about five gridlines up to `top`."""
    raw = top / 5 if top > 0 else 1.0
    power = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 5, 10):
        if raw <= m * power:
            return m * power
    return 10 * power


def _num(v: float) -> str:
    if v >= 1000 and float(v).is_integer():
        return f"{v:,.0f}"
    return f"{v:g}"


def _frame(panel: Panel, left: float, top: float, width: float, height: float) -> _Frame:
    xs = [x for s in panel.series for x, _ in s.points]
    ys = [y for s in panel.series for _, y in s.points] + [y for y, _ in panel.hlines]
    x_min, x_max = (min(xs), max(xs)) if xs else (0.0, 1.0)
    log_x = panel.log_x and x_min > 0
    if not log_x and x_min == x_max:
        x_min, x_max = x_min - 1, x_max + 1
    if log_x and x_min == x_max:
        x_min, x_max = x_min / 2, x_max * 2
    y_top = max([*ys, 0.0]) * 1.12 or 1.0  # room above the highest line for its label
    step = _nice_step(y_top)
    y_max = math.ceil(y_top / step) * step
    ticks = [i * step for i in range(round(y_max / step) + 1)]
    return _Frame(left, top, width, height, x_min, x_max, y_max, log_x, ticks)


def _marker(marker: str, colour: str, x: float, y: float, half: float) -> list[str]:
    """The SVG of one marker centred on (x, y), `half` its half-width: on the plot and in
    the legend alike."""
    if marker == "dot":
        return [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}"/>']
    if marker == "cross":
        return [f'<path d="M{x - half:.1f},{y - half:.1f} L{x + half:.1f},{y + half:.1f} '
                f'M{x - half:.1f},{y + half:.1f} L{x + half:.1f},{y - half:.1f}" '
                f'stroke="{colour}" stroke-width="2"/>']
    return []


def _svg_panel(panel: Panel, f: _Frame) -> list[str]:
    out: list[str] = []
    e = escape
    right, bottom = f.left + f.width, f.top + f.height
    for t in f.ticks:  # y grid and labels
        y = f.y(t)
        out.append(f'<line x1="{f.left:.1f}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text x="{f.left - 6:.1f}" y="{y + 4:.1f}" text-anchor="end">'
                   f"{e(_num(round(t, 6)))}</text>")
    xticks = list(panel.x_ticks) or sorted({x for s in panel.series for x, _ in s.points})
    for t in xticks:
        x = f.x(t)
        out.append(f'<line x1="{x:.1f}" y1="{bottom:.1f}" x2="{x:.1f}" y2="{bottom + 4:.1f}" '
                   'stroke="#333"/>')
        out.append(f'<text x="{x:.1f}" y="{bottom + 17:.1f}" text-anchor="middle">'
                   f"{e(_num(t))}</text>")
    out.append(f'<rect x="{f.left:.1f}" y="{f.top:.1f}" width="{f.width:.1f}" '
               f'height="{f.height:.1f}" fill="none" stroke="#333"/>')
    for y_value, label in panel.hlines:
        y = f.y(y_value)
        out.append(f'<line x1="{f.left:.1f}" y1="{y:.1f}" x2="{right:.1f}" y2="{y:.1f}" '
                   f'stroke="{GREY}" stroke-dasharray="6,4"/>')
        out.append(f'<text x="{f.left + 4:.1f}" y="{y - 4:.1f}" fill="{GREY}">{e(label)}</text>')
    for s in panel.series:
        pts = [(f.x(x), f.y(y)) for x, y in s.points]
        if s.line and len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{s.colour}" '
                       'stroke-width="2"/>')
        for x, y in pts:
            out.extend(_marker(s.marker, s.colour, x, y, 5))
    mid = f.left + f.width / 2
    out.append(f'<text x="{mid:.1f}" y="{f.top - 10:.1f}" text-anchor="middle" '
               f'font-weight="bold">{e(panel.title)}</text>')
    out.append(f'<text x="{mid:.1f}" y="{bottom + 36:.1f}" text-anchor="middle">'
               f"{e(panel.x_label)}</text>")
    ymid = f.top + f.height / 2
    out.append(f'<text x="{f.left - 48:.1f}" y="{ymid:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 {f.left - 48:.1f} {ymid:.1f})">{e(panel.y_label)}</text>')
    # legend, top left inside the frame
    ly = f.top + 16
    for s in panel.series:
        lx = f.left + 10
        if s.line:
            out.append(f'<line x1="{lx:.1f}" y1="{ly - 4:.1f}" x2="{lx + 18:.1f}" '
                       f'y2="{ly - 4:.1f}" stroke="{s.colour}" stroke-width="2"/>')
        out.extend(_marker(s.marker, s.colour, lx + 9, ly - 4, 4))
        out.append(f'<text x="{lx + 24:.1f}" y="{ly:.1f}">{e(s.label)}</text>')
        ly += 16
    return out


def svg(title: str, panels: Sequence[Panel]) -> str:
    """The chart as an SVG document."""
    panel_w, panel_h, margin_l, margin_r, head, foot = 420.0, 300.0, 70.0, 20.0, 56.0, 50.0
    width = len(panels) * (margin_l + panel_w + margin_r)
    height = head + panel_h + foot
    body: list[str] = []
    for i, panel in enumerate(panels):
        left = i * (margin_l + panel_w + margin_r) + margin_l
        body += _svg_panel(panel, _frame(panel, left, head, panel_w, panel_h))
    return "\n".join([
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="11">',
        f"<title>{escape(title)}</title>",
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{width / 2:.1f}" y="18" text-anchor="middle" font-size="13">'
        f"{escape(title)}</text>",
        *body,
        "</svg>",
        "",
    ])


def _png(title: str, panels: Sequence[Panel]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window (and no display needed)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        for s in panel.series:
            style = ("-" if s.line else "") + {"dot": "o", "cross": "x", "none": ""}[s.marker]
            ax.plot([x for x, _ in s.points], [y for _, y in s.points], style or "-",
                    color=s.colour, label=s.label, markersize=9 if s.marker == "cross" else 5)
        for y, label in panel.hlines:
            ax.axhline(y, color=GREY, linestyle="--", linewidth=1)
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), va="bottom",
                        fontsize=8, color=GREY)
        if panel.log_x:
            ax.set_xscale("log")
        ticks = list(panel.x_ticks) or sorted({x for s in panel.series for x, _ in s.points})
        ax.set_xticks(ticks)
        ax.set_xticklabels([_num(t) for t in ticks])
        ax.minorticks_off()
        ys = [y for s in panel.series for _, y in s.points] + [y for y, _ in panel.hlines]
        ax.set_ylim(0, max([*ys, 1e-9]) * 1.12)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel(panel.x_label)
        ax.set_ylabel(panel.y_label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return buffer.getvalue()
