"""What a saved plot shows: its size in pixels, its pixels, and the series drawn on it.

``record_figures`` wraps matplotlib's ``Figure.savefig`` for one test, so the test reads the
figure objects the plotting code built and saved (no seam in the plotting code: what it saves
is what the test reads). For a plot saved by another process, ``same_pixels`` compares its
file with one rendered here, from the same saved data, whose figure the test reads.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.container import BarContainer
from matplotlib.figure import Figure
from PIL import Image


def record_figures(monkeypatch) -> dict[str, Figure]:
    """Every figure saved from now to the test's end, by its file's name (the latest wins)."""
    saved: dict[str, Figure] = {}
    real = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        saved[Path(fname).name] = self
        return real(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG file."""
    with Image.open(path) as image:
        assert image.format == "PNG", path
        return image.size


def same_pixels(a: Path, b: Path) -> bool:
    """Whether two image files show the same picture, pixel for pixel (whatever their metadata)."""
    with Image.open(a) as first, Image.open(b) as second:
        return np.array_equal(np.asarray(first.convert("RGBA")), np.asarray(second.convert("RGBA")))


def bar_series(ax) -> list[tuple[str, list[float]]]:
    """(label, lengths) of each bar series on ``ax``, in drawing order: a horizontal bar's
    length is its width, a vertical one's its height."""
    out = []
    for container in ax.containers:
        if isinstance(container, BarContainer):
            horizontal = container.orientation == "horizontal"
            out.append((container.get_label(),
                        [float(p.get_width() if horizontal else p.get_height()) for p in container.patches]))
    return out


def line_series(ax) -> dict[str, tuple[list[float], list[float]]]:
    """The labelled lines on ``ax`` (legend entries): label -> (x values, y values)."""
    return {line.get_label(): ([float(x) for x in line.get_xdata()], [float(y) for y in line.get_ydata()])
            for line in ax.get_lines() if not line.get_label().startswith("_")}


def tick_labels(ax, axis: str = "y") -> list[str]:
    ticks = ax.get_yticklabels() if axis == "y" else ax.get_xticklabels()
    return [t.get_text() for t in ticks]
