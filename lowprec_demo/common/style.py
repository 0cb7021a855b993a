"""One style for every figure the package draws: a colour and line style per variant
(:data:`STYLES`, :func:`style`), families of curves (:func:`series_style`, :func:`tensor_styles`),
labels at the lines' ends (:func:`label_lines`) and matplotlib's defaults (:func:`use_book_style`).
"""

from __future__ import annotations

from typing import Iterable, Optional

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["COLORS", "LABELS", "PALETTE", "STYLES", "BOOK_RC", "use_book_style", "style", "series_style",
           "tensor_styles", "label_lines", "text_color", "TEXT_SHADES"]

# Okabe and Ito's palette, which colour-blind readers tell apart; each variant also has a line style, to read in grey.
PALETTE = {"black": "#000000", "orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73", "yellow": "#F0E442",
           "blue": "#0072B2", "vermillion": "#D55E00", "purple": "#CC79A7", "grey": "#999999"}
STYLES = {   # variant or curve -> (colour, line style)
    "reference": (PALETTE["black"], "-"),
    "nearest": (PALETTE["vermillion"], (0, (5, 2))),
    "stochastic": (PALETTE["blue"], "-."),
    "kahan": (PALETTE["green"], (0, (1, 1.5))),
    "kahan_lp": (PALETTE["green"], (0, (3, 1, 1, 1, 1, 1))),
    "master": (PALETTE["purple"], (0, (8, 2))),
    "nearest_state": (PALETTE["vermillion"], (0, (1, 1.5))),
    "stochastic_state": (PALETTE["blue"], (0, (1, 1.5))),
    "plan": (PALETTE["orange"], (0, (6, 1.5, 1, 1.5))),
    "floor": (PALETTE["grey"], (0, (2, 2))),
    "predicted": (PALETTE["orange"], "-"),
    "observed": (PALETTE["vermillion"], (0, (5, 2))),
}
COLORS = {name: color for name, (color, _) in STYLES.items()}
LABELS = {"reference": "fp32 reference", "nearest": "round to nearest", "stochastic": "stochastic rounding",
          "kahan": "nearest + Kahan", "kahan_lp": "nearest + Kahan (bf16 buffer)", "master": "fp32 master copy",
          "nearest_state": "nearest, bf16 optimizer state", "stochastic_state": "stochastic, bf16 optimizer state",
          "plan": "freeze plan", "floor": "floor"}
# Colours, then line styles, for families of curves (per tensor, per format, per seed).
_CYCLE_COLORS = ("blue", "vermillion", "green", "orange", "purple", "sky", "black", "yellow")
_CYCLE_STYLES = ("-", (0, (5, 2)), (0, (1, 1.5)), (0, (6, 1.5, 1, 1.5)))
# Figures are at most 7 inches wide (700 CSS pixels at 100 dpi, the page's output column), so that
# text of 9 points and more reads at the body's small print (tools/check_book.py checks the width).
BOOK_RC = {"figure.dpi": 100, "savefig.dpi": 100, "font.size": 10.5, "axes.titlesize": 11, "axes.labelsize": 10.5,
           "legend.fontsize": 10, "xtick.labelsize": 10, "ytick.labelsize": 10, "figure.figsize": (7.0, 3.6), "lines.linewidth": 1.8,
           "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.color": "0.9",
           "grid.linewidth": 0.6, "legend.frameon": False,
           "axes.prop_cycle": plt.cycler(color=[PALETTE[c] for c in _CYCLE_COLORS[:6]])}


def use_book_style() -> None:
    """Set matplotlib's defaults to the book's style (:data:`BOOK_RC`); the chapters call it once.
    In a notebook, figures are also shown as PNGs of twice the pixels at the same size ("retina"),
    sharp on the page at any zoom."""
    plt.rcParams.update(BOOK_RC)
    try:
        from IPython import get_ipython
        from matplotlib_inline.backend_inline import set_matplotlib_formats
    except ImportError:
        return
    if get_ipython() is not None:
        set_matplotlib_formats("retina")


def style(name: str) -> dict:
    """``color`` and ``ls`` of a variant or curve (:data:`STYLES`), for ``ax.plot(..., **style(name))``.

    Example:
        >>> style("nearest")["color"]
        '#D55E00'
    """
    color, ls = STYLES[name]
    return {"color": color, "ls": ls}


def series_style(i: int) -> dict:
    """``color`` and ``ls`` of the i-th curve of a family: eight colours, then line styles too."""
    n = len(_CYCLE_COLORS)
    return {"color": PALETTE[_CYCLE_COLORS[i % n]], "ls": _CYCLE_STYLES[(i // n) % len(_CYCLE_STYLES)]}


def tensor_styles(names: Iterable[str]) -> dict:
    """One :func:`series_style` per tensor name in sorted order: given all of a model's names, a
    tensor keeps its style in every figure of any subset."""
    return {name: series_style(i) for i, name in enumerate(sorted(set(names)))}


# Most of the palette is too light to read as text on white (orange 2.2:1, purple 3.1:1); text in those
# colours is drawn in a darker shade of the same hue, at least 4.5:1 (the WCAG minimum for text).
TEXT_SHADES = {PALETTE["orange"]: "#9A6700", PALETTE["yellow"]: "#7A7000", PALETTE["sky"]: "#1F6E9C",
               PALETTE["grey"]: "#6B6B6B", PALETTE["vermillion"]: "#B04E00", PALETTE["green"]: "#00785A",
               PALETTE["purple"]: "#A24E80"}


def text_color(color) -> str:
    """The colour to write a label of a ``color`` line in: a darker shade of the palette's light
    colours (:data:`TEXT_SHADES`), any other colour as it is.

    Example:
        >>> text_color("#E69F00")
        '#9A6700'
    """
    key = color.upper() if isinstance(color, str) and color.startswith("#") else color
    return TEXT_SHADES.get(key, color)


def label_lines(ax, fontsize: float = 10, min_gap: float = 0.05, x: Optional[float] = None, **kwargs):
    """Label each labelled line of ``ax`` at its right end (or at ``x``), in its colour, instead of
    a legend; labels closer than ``min_gap`` (of the axes' height) are pushed apart. Returns them."""
    lines = [ln for ln in ax.get_lines() if ln.get_label() and not ln.get_label().startswith("_")]
    if not lines:
        return []
    y0, y1 = ax.get_ylim()
    log = ax.get_yscale() == "log"
    tf = (lambda v: np.log10(v)) if log else (lambda v: v)
    span = (tf(y1) - tf(y0)) or 1.0
    items = []
    for ln in lines:
        xs = np.asarray(ln.get_xdata(), dtype=float)
        ys = np.asarray(ln.get_ydata(), dtype=float)
        ok = np.isfinite(xs) & np.isfinite(ys) & ((ys > 0) if log else True)
        if not ok.any():
            continue
        xs, ys = xs[ok], ys[ok]
        i = len(xs) - 1 if x is None else int(np.argmin(np.abs(xs - x)))
        items.append([(tf(ys[i]) - tf(y0)) / span, xs[i], ln])
    items.sort(key=lambda t: t[0])
    for k in range(1, len(items)):      # push upwards, then pull the stack back inside the axes
        items[k][0] = max(items[k][0], items[k - 1][0] + min_gap)
    if items and items[-1][0] > 0.98:
        for k in range(len(items) - 1, -1, -1):
            items[k][0] = min(items[k][0], 0.98 - (len(items) - 1 - k) * min_gap)
    return [ax.annotate(ln.get_label(), xy=(1.01, pos), xycoords=("axes fraction", "axes fraction"),
                        color=text_color(ln.get_color()), fontsize=fontsize, va="center", ha="left", annotation_clip=False,
                        **kwargs) for pos, _, ln in items]
