"""Server-side SVG charts for the status page: no JavaScript, no network.

Each function returns one self-contained ``<svg>`` element as text. Time
axes take seconds since the epoch and label them as local clock time.
Values of ``None`` are gaps: a line breaks there rather than bridging it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from html import escape
from typing import Callable, Sequence

AXIS = "#555555"
GRID = "#e3e3e3"
MUTED = "#888888"
FONT = "font-family:DejaVu Sans,Liberation Sans,Arial,sans-serif"


@dataclass(frozen=True)
class Series:
    label: str
    color: str
    xs: Sequence[float]
    ys: Sequence[float | None]


@dataclass(frozen=True)
class Marker:
    """A vertical line at ``x`` (e.g. a drafter roll-out)."""

    x: float
    label: str
    color: str


@dataclass(frozen=True)
class Span:
    """A shaded interval of the x axis (e.g. an open drift alert)."""

    x0: float
    x1: float
    label: str
    color: str


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering ``[lo, hi]``.

    >>> nice_ticks(0.0, 1.0)
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    >>> nice_ticks(3.0, 3.0)
    [3.0]
    """
    if not hi > lo:
        return [lo]
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    n = int(math.floor((hi - first) / step + 1e-9)) + 1
    return [round(first + i * step, 10) for i in range(n)]


def time_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Tick times on whole seconds, minutes or hours covering ``[lo, hi]``."""
    span = max(hi - lo, 1e-9)
    steps = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
    step = next((s for s in steps if span / s <= count), steps[-1])
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) // step) + 1)]


def clock_label(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _fmt(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


class Frame:
    """Maps data coordinates to the plot area of a ``width`` × ``height`` SVG."""

    def __init__(self, width: int, height: int, x_range: tuple[float, float], y_range: tuple[float, float],
                 left: int = 56, right: int = 14, top: int = 44, bottom: int = 28) -> None:
        self.width, self.height = width, height
        self.x0, self.x1 = left, width - right
        self.y0, self.y1 = height - bottom, top  # pixel y of the bottom and the top of the plot
        self.xr = x_range if x_range[1] > x_range[0] else (x_range[0] - 1.0, x_range[0] + 1.0)
        self.yr = y_range if y_range[1] > y_range[0] else (y_range[0] - 1.0, y_range[0] + 1.0)

    def px(self, x: float) -> float:
        return self.x0 + (x - self.xr[0]) / (self.xr[1] - self.xr[0]) * (self.x1 - self.x0)

    def py(self, y: float) -> float:
        return self.y0 - (y - self.yr[0]) / (self.yr[1] - self.yr[0]) * (self.y0 - self.y1)

    def open(self, title: str, chart_id: str) -> list[str]:
        return [f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{escape(chart_id)}" '
                f'width="{self.width}" height="{self.height}" viewBox="0 0 {self.width} {self.height}" '
                f'style="{FONT}">',
                f'<rect width="{self.width}" height="{self.height}" fill="#ffffff"/>',
                f'<text x="8" y="18" font-size="13" font-weight="bold" fill="#222">{escape(title)}</text>']

    def time_axis(self) -> list[str]:
        out = []
        for t in time_ticks(*self.xr):
            x = self.px(t)
            out.append(f'<line x1="{x:.1f}" y1="{self.y1}" x2="{x:.1f}" y2="{self.y0}" stroke="{GRID}"/>')
            out.append(f'<text x="{x:.1f}" y="{self.y0 + 16}" font-size="10" fill="{AXIS}" '
                       f'text-anchor="middle">{clock_label(t)}</text>')
        return out

    def value_axis(self, label: str = "", fmt: Callable[[float], str] = _fmt) -> list[str]:
        out = []
        for v in nice_ticks(*self.yr):
            y = self.py(v)
            out.append(f'<line x1="{self.x0}" y1="{y:.1f}" x2="{self.x1}" y2="{y:.1f}" stroke="{GRID}"/>')
            out.append(f'<text x="{self.x0 - 5}" y="{y + 3.5:.1f}" font-size="10" fill="{AXIS}" '
                       f'text-anchor="end">{escape(fmt(v))}</text>')
        out.append(f'<rect x="{self.x0}" y="{self.y1}" width="{self.x1 - self.x0}" height="{self.y0 - self.y1}" '
                   f'fill="none" stroke="{AXIS}" stroke-width="1"/>')
        if label:
            cy = (self.y0 + self.y1) / 2
            out.append(f'<text x="12" y="{cy:.1f}" font-size="10" fill="{AXIS}" text-anchor="middle" '
                       f'transform="rotate(-90 12 {cy:.1f})">{escape(label)}</text>')
        return out

    def legend(self, items: Sequence[tuple[str, str]]) -> list[str]:
        """Swatches in a row between the title and the plot."""
        out, x = [], float(self.x0)
        for label, color in items:
            out.append(f'<rect x="{x:.0f}" y="25" width="10" height="10" fill="{color}"/>'
                       f'<text x="{x + 13:.0f}" y="34" font-size="10" fill="#333">{escape(label)}</text>')
            x += 6.2 * len(label) + 24
        return out

    def markers(self, markers: Sequence[Marker], spans: Sequence[Span]) -> list[str]:
        out = []
        for s in spans:
            a, b = max(self.px(s.x0), self.x0), min(self.px(s.x1), self.x1)
            if b > a:
                out.append(f'<rect x="{a:.1f}" y="{self.y1}" width="{b - a:.1f}" height="{self.y0 - self.y1}" '
                           f'fill="{s.color}" fill-opacity="0.18"><title>{escape(s.label)}</title></rect>')
        for m in markers:
            x = self.px(m.x)
            if self.x0 <= x <= self.x1:
                out.append(f'<line x1="{x:.1f}" y1="{self.y1}" x2="{x:.1f}" y2="{self.y0}" stroke="{m.color}" '
                           f'stroke-width="1.5" stroke-dasharray="4 3"/>'
                           f'<text x="{x + 3:.1f}" y="{self.y1 + 11}" font-size="10" fill="{m.color}">'
                           f'{escape(m.label)}</text>')
        return out

    def empty(self, message: str) -> list[str]:
        return [f'<text x="{(self.x0 + self.x1) / 2:.0f}" y="{(self.y0 + self.y1) / 2:.0f}" font-size="12" '
                f'fill="{MUTED}" text-anchor="middle">{escape(message)}</text>']


def ink(fill: str) -> str:
    """Black or white text, whichever reads better on ``fill`` (``#rrggbb``).

    >>> ink("#ffffb2"), ink("#800026")
    ('#111111', '#ffffff')
    """
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#111111" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "#ffffff"


def _segments(xs: Sequence[float], ys: Sequence[float | None],
              bridge: bool = False) -> list[list[tuple[float, float]]]:
    """Runs of consecutive points with a value (one run of them all with ``bridge``)."""
    if bridge:
        run = [(x, y) for x, y in zip(xs, ys) if y is not None]
        return [run] if run else []
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys):
        if y is None:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append((x, y))
    return [r for r in runs if r]


def line_chart(title: str, chart_id: str, series: Sequence[Series], x_range: tuple[float, float], *,
               y_range: tuple[float, float] | None = None, y_label: str = "", reference: float | None = None,
               markers: Sequence[Marker] = (), spans: Sequence[Span] = (), width: int = 600,
               height: int = 220, empty: str = "no data yet", bridge_gaps: bool = False) -> str:
    """Lines over time; ``reference`` draws a dashed horizontal line (e.g. speedup 1).
    ``bridge_gaps`` joins the points on either side of a missing value (a
    measurement that had to wait) instead of breaking the line (no data)."""
    values = [y for s in series for y in s.ys if y is not None]
    if y_range is None:
        lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
        if reference is not None:
            lo, hi = min(lo, reference), max(hi, reference)
        pad = 0.08 * (hi - lo) if hi > lo else max(abs(hi) * 0.1, 0.5)
        y_range = (max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad)
    f = Frame(width, height, x_range, y_range)
    out = f.open(title, chart_id) + f.value_axis(y_label) + f.time_axis() + f.markers(markers, spans)
    if reference is not None:
        y = f.py(reference)
        out.append(f'<line x1="{f.x0}" y1="{y:.1f}" x2="{f.x1}" y2="{y:.1f}" stroke="{AXIS}" '
                   f'stroke-dasharray="2 3"/>')
    if not values:
        out += f.empty(empty)
    for s in series:
        for run in _segments(s.xs, s.ys, bridge_gaps):
            if len(run) == 1:
                (x, y), = run
                out.append(f'<circle cx="{f.px(x):.1f}" cy="{f.py(y):.1f}" r="2.5" fill="{s.color}"/>')
                continue
            pts = " ".join(f"{f.px(x):.1f},{f.py(y):.1f}" for x, y in run)
            out.append(f'<polyline points="{pts}" fill="none" stroke="{s.color}" stroke-width="2.5" '
                       f'stroke-linejoin="round"><title>{escape(s.label)}</title></polyline>')
    out += f.legend([(s.label, s.color) for s in series])
    out.append("</svg>")
    return "\n".join(out)


def stacked_chart(title: str, chart_id: str, xs: Sequence[float], layers: Sequence[tuple[str, str]],
                  shares: Sequence[Sequence[float] | None], x_range: tuple[float, float], *,
                  markers: Sequence[Marker] = (), spans: Sequence[Span] = (), width: int = 600,
                  height: int = 220, empty: str = "no data yet") -> str:
    """Shares stacked to 1 over time: ``shares[i][j]`` is layer ``j`` at ``xs[i]``
    (``None``: no value at that sample; the neighbours are joined)."""
    f = Frame(width, height, x_range, (0.0, 1.0))
    out = f.open(title, chart_id) + f.value_axis("share", lambda v: f"{v:.0%}") + f.time_axis()
    runs = _segments(xs, [0.0 if s is not None else None for s in shares], bridge=True)
    index = {x: i for i, x in enumerate(xs)}
    if not runs:
        out += f.empty(empty)
    for run in runs:
        rows = [shares[index[x]] for x, _ in run]
        if len(run) == 1:  # one sample: a thin column
            x = run[0][0]
            run = [(x - 0.5, 0.0), (x + 0.5, 0.0)]
            rows = rows * 2
        below = [0.0] * len(run)
        for j, (label, color) in enumerate(layers):
            above = [b + (r[j] if j < len(r) else 0.0) for b, r in zip(below, rows)]
            if max(a - b for a, b in zip(above, below)) > 0:
                top = " ".join(f"{f.px(x):.1f},{f.py(a):.1f}" for (x, _), a in zip(run, above))
                bottom = " ".join(f"{f.px(x):.1f},{f.py(b):.1f}" for (x, _), b in reversed(list(zip(run, below))))
                out.append(f'<polygon points="{top} {bottom}" fill="{color}"><title>{escape(label)}</title></polygon>')
            below = above
    out += f.markers(markers, spans)
    out += f.legend(list(layers))
    out.append("</svg>")
    return "\n".join(out)


def heatmap(title: str, chart_id: str, row_labels: Sequence[str], col_labels: Sequence[str],
            values: Sequence[Sequence[float]], texts: Sequence[Sequence[str]], color: Callable[[float], str], *,
            x_label: str = "", y_label: str = "", highlight: tuple[int, int] | None = None,
            legend: Sequence[tuple[str, str]] = (), width: int = 420, height: int = 300,
            empty: str = "no plan yet") -> str:
    """A grid of coloured cells, rows bottom-up (row 0 at the bottom), with a text per cell."""
    f = Frame(width, height, (0.0, float(len(col_labels))), (0.0, float(len(row_labels))), left=56, bottom=42)
    out = f.open(title, chart_id)
    if not row_labels:
        out += f.empty(empty)
    cw = (f.x1 - f.x0) / max(len(col_labels), 1)
    ch = (f.y0 - f.y1) / max(len(row_labels), 1)
    font = max(7, min(11, int(min(cw / 4.2, ch * 0.8))))
    for r, row in enumerate(values):
        y = f.py(r + 1)
        for c, v in enumerate(row):
            x = f.px(c)
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{cw:.1f}" height="{ch:.1f}" fill="{color(v)}" '
                       f'stroke="#ffffff" stroke-width="1"><title>batch {escape(row_labels[r])}, context '
                       f'{escape(col_labels[c])}: {escape(texts[r][c])}</title></rect>')
            if ch >= 9:
                out.append(f'<text x="{x + cw / 2:.1f}" y="{y + ch / 2 + font / 2.8:.1f}" font-size="{font}" '
                           f'fill="{ink(color(v))}" text-anchor="middle">{escape(texts[r][c])}</text>')
    if highlight is not None:
        r, c = highlight
        out.append(f'<rect x="{f.px(c):.1f}" y="{f.py(r + 1):.1f}" width="{cw:.1f}" height="{ch:.1f}" '
                   f'fill="none" stroke="#000000" stroke-width="2.5"><title>current load</title></rect>')
    step_r = max(1, math.ceil(len(row_labels) * 11 / max(f.y0 - f.y1, 1)))
    for r, label in enumerate(row_labels):
        if r % step_r == 0:
            out.append(f'<text x="{f.x0 - 4}" y="{f.py(r + 0.5) + 3.5:.1f}" font-size="9" fill="{AXIS}" '
                       f'text-anchor="end">{escape(label)}</text>')
    for c, label in enumerate(col_labels):
        out.append(f'<text x="{f.px(c + 0.5):.1f}" y="{f.y0 + 12}" font-size="9" fill="{AXIS}" '
                   f'text-anchor="middle">{escape(label)}</text>')
    if x_label:
        out.append(f'<text x="{(f.x0 + f.x1) / 2:.0f}" y="{f.y0 + 28}" font-size="10" fill="{AXIS}" '
                   f'text-anchor="middle">{escape(x_label)}</text>')
    if y_label:
        cy = (f.y0 + f.y1) / 2
        out.append(f'<text x="10" y="{cy:.1f}" font-size="10" fill="{AXIS}" text-anchor="middle" '
                   f'transform="rotate(-90 10 {cy:.1f})">{escape(y_label)}</text>')
    out += f.legend(legend)
    out.append("</svg>")
    return "\n".join(out)


@dataclass(frozen=True)
class Bar:
    lane: int
    x0: float
    x1: float
    color: str
    label: str


@dataclass(frozen=True)
class Point:
    lane: int
    x: float
    color: str
    label: str


def _bar_rows(bars: Sequence[Bar]) -> list[int]:
    """A row within its lane for every bar, so that bars of a lane never overlap.

    >>> _bar_rows([Bar(0, 0, 5, "#000000", "a"), Bar(0, 3, 8, "#000000", "b"), Bar(0, 6, 9, "#000000", "c"),
    ...            Bar(1, 0, 9, "#000000", "d")])
    [0, 1, 0, 0]
    """
    rows = [0] * len(bars)
    ends: dict[int, list[float]] = {}  # lane -> end of the last bar in each row
    for i in sorted(range(len(bars)), key=lambda i: bars[i].x0):
        b = bars[i]
        lane_ends = ends.setdefault(b.lane, [])
        row = next((r for r, end in enumerate(lane_ends) if end <= b.x0), len(lane_ends))
        if row == len(lane_ends):
            lane_ends.append(b.x1)
        lane_ends[row] = b.x1
        rows[i] = row
    return rows


def timeline(title: str, chart_id: str, lanes: Sequence[str], bars: Sequence[Bar], points: Sequence[Point],
             x_range: tuple[float, float], *, legend: Sequence[tuple[str, str]] = (), width: int = 1200,
             empty: str = "no events yet") -> str:
    """Events per lane over time: diamonds (instants) in a lane's top row,
    bars (intervals) in as many rows below as they need not to overlap."""
    point_h, bar_h = 22, 17
    rows = _bar_rows(bars)
    bar_rows = [1 + max((r for b, r in zip(bars, rows) if b.lane == i), default=0) for i in range(len(lanes))]
    tops = [0]
    for n in bar_rows:
        tops.append(tops[-1] + point_h + n * bar_h)
    f = Frame(width, 44 + 28 + max(tops[-1], 40), x_range, (0.0, 1.0), left=150)
    out = f.open(title, chart_id) + f.time_axis()
    out.append(f'<rect x="{f.x0}" y="{f.y1}" width="{f.x1 - f.x0}" height="{f.y0 - f.y1}" fill="none" '
               f'stroke="{AXIS}"/>')
    if not lanes:
        out += f.empty(empty)
    for i, label in enumerate(lanes):
        y = f.y1 + (tops[i] + tops[i + 1]) / 2
        out.append(f'<text x="{f.x0 - 6}" y="{y + 3.5:.1f}" font-size="10" fill="#333" text-anchor="end">'
                   f'{escape(label)}</text>')
        if i:
            out.append(f'<line x1="{f.x0}" y1="{f.y1 + tops[i]}" x2="{f.x1}" y2="{f.y1 + tops[i]}" stroke="{GRID}"/>')
    for b, row in zip(bars, rows):
        a, z = max(f.px(b.x0), f.x0), min(f.px(b.x1), f.x1)
        if z < a:
            continue
        z = max(z, a + 3)
        y = f.y1 + tops[b.lane] + point_h + row * bar_h
        out.append(f'<rect x="{a:.1f}" y="{y:.1f}" width="{z - a:.1f}" height="{bar_h - 3}" fill="{b.color}" '
                   f'rx="2"><title>{escape(b.label)}</title></rect>')
        out.append(f'<text x="{a + 3:.1f}" y="{y + 10.5:.1f}" font-size="10" fill="{ink(b.color)}">'
                   f'{escape(b.label)}</text>')
    for p in points:
        x = f.px(p.x)
        if not f.x0 - 1 <= x <= f.x1 + 1:
            continue
        y = f.y1 + tops[p.lane] + point_h / 2
        out.append(f'<path d="M{x:.1f},{y - 7:.1f} L{x + 6:.1f},{y:.1f} L{x:.1f},{y + 7:.1f} L{x - 6:.1f},{y:.1f} Z" '
                   f'fill="{p.color}"><title>{escape(p.label)}</title></path>')
        anchor, dx = ("end", -9) if x > f.x1 - 160 else ("start", 9)
        out.append(f'<text x="{x + dx:.1f}" y="{y + 3.5:.1f}" font-size="10" fill="#222" text-anchor="{anchor}">'
                   f'{escape(p.label)}</text>')
    out += f.legend(legend)
    out.append("</svg>")
    return "\n".join(out)
