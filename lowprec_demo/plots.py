"""The book's figures, one function each; all take a matplotlib ``ax`` (created when omitted)
and return it.

* :func:`plot_losses`: reference, round-to-nearest and stochastic loss curves on one axes.
* :func:`plot_frozen`: predicted against observed frozen fraction, freeze steps marked.
* :func:`plot_frozen_by_tensor`: the same per tensor (which layers freeze first).
* :func:`plot_freeze_sweep`: predicted against observed freeze step, one point per run.
* :func:`plot_baselines`: the prediction and the baselines that ignore the trajectory against
  the observed frozen fraction.
* :func:`plot_element_agreement`: per step, the fraction of elements whose predicted and
  observed states differ, against what independent masks would give.
* :func:`plot_evidence`: the two side by side, for one run.
* :func:`plot_grid` and :func:`plot_ulp`: what a format's grid looks like.
* :func:`plot_ratio_histogram`: the distribution of update/ULP ratios.

One style for every figure: :func:`use_book_style` (matplotlib's defaults), :data:`STYLES` and
:func:`style` (colour and line style of each variant), :func:`series_style` and
:func:`tensor_styles` (families of curves), :func:`label_lines` (labels at the lines' ends instead
of a legend).

Example:
    >>> ax = plot_ulp(["bf16", "fp16"])
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np

from .formats import get_format
from .prediction import RATIO_BINS, freeze_order
from .results import describe

__all__ = ["COLORS", "LABELS", "PALETTE", "STYLES", "use_book_style", "style", "series_style", "tensor_styles",
           "label_lines", "plot_losses", "plot_frozen", "plot_frozen_by_tensor", "plot_freeze_sweep", "plot_grid",
           "plot_ulp", "plot_ratio_histogram", "provenance_label", "plot_run", "grid_values", "plot_baselines",
           "plot_element_agreement", "plot_evidence", "plot_remedies"]

# One figure style for the whole book. The palette is Okabe and Ito's (2008), which colour-blind
# readers tell apart; every variant also has its own line style, so the figures read in grey.
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
BOOK_RC = {"figure.dpi": 100, "savefig.dpi": 100, "font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10,
           "legend.fontsize": 9, "xtick.labelsize": 9, "ytick.labelsize": 9, "lines.linewidth": 1.8,
           "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True, "grid.color": "0.9",
           "grid.linewidth": 0.6, "legend.frameon": False,
           "axes.prop_cycle": plt.cycler(color=[PALETTE[c] for c in _CYCLE_COLORS[:6]])}


def use_book_style() -> None:
    """Set matplotlib's defaults to the book's figure style (:data:`BOOK_RC`): the Okabe-Ito
    palette as the colour cycle, 1.8-point lines, readable fonts, no top or right spine. The
    chapters call it once at the top; every ``plot_*`` function of this module draws in it."""
    plt.rcParams.update(BOOK_RC)


def style(name: str) -> dict:
    """``color`` and ``ls`` of a variant or curve (:data:`STYLES`), for ``ax.plot(..., **style(name))``.

    Example:
        >>> style("nearest")["color"]
        '#D55E00'
    """
    color, ls = STYLES[name]
    return {"color": color, "ls": ls}


def series_style(i: int) -> dict:
    """``color`` and ``ls`` of the i-th curve of a family (colours first, then line styles), so
    that eight curves differ in colour and more differ in line style as well."""
    n = len(_CYCLE_COLORS)
    return {"color": PALETTE[_CYCLE_COLORS[i % n]], "ls": _CYCLE_STYLES[(i // n) % len(_CYCLE_STYLES)]}


def tensor_styles(names: Iterable[str]) -> dict:
    """One style (:func:`series_style`) per tensor name, by the names' sorted order, so that a
    tensor keeps its colour and line style in every figure drawn from the same list of names
    (pass all of a model's tensor names, then plot any subset)."""
    return {name: series_style(i) for i, name in enumerate(sorted(set(names)))}


def label_lines(ax, fontsize: float = 8, min_gap: float = 0.05, x: Optional[float] = None, **kwargs):
    """Label each labelled line of ``ax`` at its right end, in its own colour, instead of a
    legend; labels closer than ``min_gap`` (a fraction of the axes' height) are pushed apart, so
    none overlaps another. ``x``: where on the x axis to read each line (default its last point).
    Returns the text objects."""
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
    overflow = items[-1][0] - 0.98 if items else 0
    if overflow > 0:
        for k in range(len(items) - 1, -1, -1):
            items[k][0] = min(items[k][0], 0.98 - (len(items) - 1 - k) * min_gap)
    texts = []
    for pos, xv, ln in items:
        texts.append(ax.annotate(ln.get_label(), xy=(1.01, pos), xycoords=("axes fraction", "axes fraction"),
                                 color=ln.get_color(), fontsize=fontsize, va="center", ha="left",
                                 annotation_clip=False, **kwargs))
    return texts


def _reference_name(result) -> str:
    return {"float32": "fp32", "float64": "fp64"}.get(result.config.reference_dtype, result.config.reference_dtype)


def _label(result, variant: str) -> str:
    if variant == "reference":
        return f"{_reference_name(result)} reference"
    return LABELS.get(variant, variant)


def _ax(ax):
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4))
    return ax


def _smooth(values: Sequence[float], window: int) -> np.ndarray:
    v = np.asarray(values, dtype=float)
    if window <= 1 or len(v) < window:
        return v
    kernel = np.ones(window) / window
    head = np.array([v[: i + 1].mean() for i in range(window - 1)])
    return np.concatenate([head, np.convolve(v, kernel, mode="valid")])


def provenance_label(result) -> str:
    """The 'where this came from' line of a stored result, for a figure's title: the line of
    :func:`lowprec_demo.results.describe` (device, date, commit, torch version, steps, seed).

    Example: ``provenance_label(result)`` -> ``"NVIDIA H200, 2026-11-29, commit 1a2b3c4, torch 2.11.0; 1200 steps, seed 0"``."""
    return describe(result)


def plot_losses(result, ax=None, variants: Optional[Iterable[str]] = None, log: bool = True, smooth: int = 1,
                mark_freeze: bool = True, title: Optional[str] = None):
    """Training loss per step of each variant on one axes; the predicted freeze step as a
    dotted line.

    Example: ``plot_losses(run_experiment("quadratic", progress=False))``."""
    ax = _ax(ax)
    for v in variants or result.runs:
        run = result.runs[v]
        ax.plot(_smooth(run.loss, smooth), label=_label(result, v), lw=1.6, **(style(v) if v in STYLES else {}))
    if mark_freeze:
        step = result.predicted_freeze_step()
        if step is not None:
            ax.axvline(step, color=COLORS["predicted"], ls=":", lw=1.4,
                       label=f"predicted freeze (step {step})")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss" + (f" ({smooth}-step mean)" if smooth > 1 else ""))
    ax.set_title(title or f"{result.experiment}: stored weights in {result.format}")
    ax.legend(frameon=False)
    return ax


def plot_frozen(result, ax=None, threshold: Optional[float] = None, show_sr: bool = True, title: Optional[str] = None):
    """Fraction of frozen elements per step: predicted from the reference run against observed in
    the round-to-nearest run, both freeze steps marked; optionally the fraction stochastic
    rounding is predicted to leave in place (1 - move fraction) and the observed one.

    Example: ``plot_frozen(result, threshold=0.5)``."""
    ax = _ax(ax)
    threshold = threshold or result.config.threshold
    pred = result.prediction
    ax.plot(pred.overall, color=COLORS["predicted"], lw=3.0, alpha=0.8, label=f"predicted (from {_reference_name(result)} run)")
    if "nearest" in result.runs and result.runs["nearest"].frozen:
        ax.plot(result.runs["nearest"].frozen.overall, lw=1.6, label="observed, round to nearest", **style("observed"))
    if show_sr and pred.move_fraction:
        ax.plot(1 - np.asarray(pred.move_fraction), color=COLORS["stochastic"], lw=3.0, alpha=0.4,
                label="predicted still, stochastic")
        if "stochastic" in result.runs and result.runs["stochastic"].frozen:
            ax.plot(result.runs["stochastic"].frozen.overall, lw=1.2, label="observed still, stochastic",
                    **style("stochastic"))
    ax.axhline(threshold, color="0.6", lw=0.8, ls=":")
    # The freeze steps as vertical lines, labelled low down to the right of their line, where the
    # curves (above the threshold after it) leave room; the two labels on separate heights.
    # Both labelled on the right of their lines (where the curves, frozen by then, run near the
    # top), the earlier one higher, so the two never share a line of text.
    marks = [(step, color, name) for step, color, name in (
        (result.predicted_freeze_step(threshold), COLORS["predicted"], "predicted"),
        (result.observed_freeze_step("nearest", threshold) if "nearest" in result.runs else None,
         COLORS["nearest"], "observed")) if step is not None]
    marks.sort(key=lambda m: m[0])
    for k, (step, color, name) in enumerate(marks):
        ax.axvline(step, color=color, ls=":", lw=1.2)
        ax.annotate(f"{name}: step {step}", (step, 0.04 + 0.09 * (len(marks) - 1 - k)),
                    xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(4, 0),
                    color=color, fontsize=8)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of elements not moved")
    ax.set_title(title or f"{result.experiment}, {result.format}: frozen fraction (threshold {threshold})")
    ax.legend(frameon=False, fontsize=8, loc="center right")
    return ax


def plot_run(result, axes=None, title: Optional[str] = None, frozen_title: str = "frozen fraction",
             variants: Optional[Iterable[str]] = None, smooth: int = 1, show_sr: bool = True,
             loss_ylim: Optional[tuple] = None, threshold: Optional[float] = None):
    """A run at a glance: :func:`plot_losses` beside :func:`plot_frozen`, on two axes (made
    when ``axes`` is None); the chapters' sliders redraw this. ``title`` heads the loss panel,
    ``frozen_title`` the other; ``loss_ylim`` bounds the loss axis. Returns the two axes.

    Example: ``plot_run(run_experiment("quadratic", progress=False), title="bf16, lr 0.1")``."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4))
    plot_losses(result, ax=axes[0], variants=variants, smooth=smooth, title=title)
    if loss_ylim is not None:
        axes[0].set_ylim(*loss_ylim)
    plot_frozen(result, ax=axes[1], threshold=threshold, show_sr=show_sr, title=frozen_title)
    return axes


BASELINE_STYLES = {"schedule": (PALETTE["purple"], (0, (5, 2)), "schedule rule (no trajectory)"),
                   "schedule_fitted": (PALETTE["sky"], "-.", "schedule rule, ratio fitted on the first steps"),
                   "always": (PALETTE["grey"], (0, (1, 1.5)), "always frozen"),
                   "never": (PALETTE["grey"], (0, (3, 1, 1, 1)), "never frozen")}


def plot_baselines(result, ax=None, threshold: Optional[float] = None, title: Optional[str] = None):
    """The observed (round-to-nearest) frozen fraction against the prediction from the reference
    run and every baseline of ``result.baselines``, each labelled with its mean absolute error
    over the run and its freeze step.

    Example: ``plot_baselines(result)``."""
    ax = _ax(ax)
    threshold = threshold or result.config.threshold
    errors = result.predictor_errors(threshold)
    ax.plot(result.runs["nearest"].frozen.overall, color=COLORS["nearest"], lw=3.0, alpha=0.5,
            label=f"observed (freeze step {result.observed_freeze_step('nearest', threshold)})")
    curves = [("fp32", result.prediction.overall, *STYLES["predicted"],
               f"predicted from the {_reference_name(result)} run")]
    curves += [(name, curve, *BASELINE_STYLES.get(name, ("0.4", "--", name))) for name, curve in result.baselines.items()]
    for name, curve, color, ls, label in curves:
        e = errors[name]
        ax.plot(curve, color=color, ls=ls, lw=1.6,
                label=f"{label}: error {e['mean_abs_error']:.3f}, step {e['freeze_step']}")
    ax.axhline(threshold, color="0.6", lw=0.8, ls=":")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of elements not moved")
    ax.set_title(title or f"{result.experiment}, {result.format}: predictors against the observed freeze")
    # six curves with their errors: the legend below the axes, in two columns, off the curves
    ax.legend(frameon=False, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    return ax


def plot_element_agreement(result, ax=None, title: Optional[str] = None):
    """Per step, the fraction of elements whose predicted and observed frozen states differ,
    against the fraction two independent masks with the same frozen fractions would give, overall
    and within each tensor and binade of the weights (when the result has it).

    Example: ``plot_element_agreement(result)``."""
    ax = _ax(ax)
    a = result.element_agreement()
    ax.plot(result.agreement["chance_mismatch"], color=PALETTE["grey"], lw=1.6, ls=(0, (5, 2)),
            label=f"independent masks (mean {a['chance_mismatch']:.3f})")
    if result.agreement.get("stratified_chance_mismatch"):
        ax.plot(result.agreement["stratified_chance_mismatch"], color=PALETTE["black"], lw=1.4, ls=(0, (1, 1.5)),
                label=f"independent within tensor and binade (mean {a['stratified_chance_mismatch']:.3f})")
    ax.plot(result.agreement["element_mismatch"], color=COLORS["predicted"], lw=1.6,
            label=f"prediction against observation (mean {a['element_mismatch']:.3f})")
    ax.set_ylim(bottom=0)
    ax.set_xlabel("step")
    ax.set_ylabel("fraction of elements that disagree")
    ax.set_title(title or f"{result.experiment}, {result.format}: element by element")
    ax.legend(frameon=False, fontsize=8, loc="best")
    return ax


def plot_evidence(result, axes=None, threshold: Optional[float] = None, title: Optional[str] = None):
    """:func:`plot_baselines` and :func:`plot_element_agreement` side by side; returns the two axes.

    Example: ``ax1, ax2 = plot_evidence(result)``."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4))
    plot_baselines(result, ax=axes[0], threshold=threshold, title=title)
    plot_element_agreement(result, ax=axes[1])
    return axes


def plot_frozen_by_tensor(result, ax=None, names: Optional[List[str]] = None, max_tensors: int = 8,
                          observed: bool = True, threshold: Optional[float] = None):
    """Predicted (wide, pale) and observed (thin) frozen fraction of individual tensors, each
    labelled at its right end. A tensor keeps its colour and line style in every figure of the
    same model (:func:`tensor_styles` over all the model's tensor names); leave room on the right
    of the axes for the labels.

    Example: ``plot_frozen_by_tensor(result, max_tensors=6)``."""
    ax = _ax(ax)
    threshold = threshold or result.config.threshold
    pred = result.prediction
    if names is None:
        names = [name for name, _ in freeze_order(pred, threshold)]
        if len(names) > max_tensors:  # first and last to freeze, and some in between
            idx = np.unique(np.linspace(0, len(names) - 1, max_tensors).round().astype(int))
            names = [names[i] for i in idx]
    obs = result.runs.get("nearest")
    styles = tensor_styles(pred.by_tensor)
    for name in names:
        st = styles[name]
        ax.plot(pred.tensor_steps(name), pred.by_tensor[name], color=st["color"], lw=3.5, alpha=0.35, label=name)
        if observed and obs is not None and obs.frozen and name in obs.frozen.by_tensor:
            ax.plot(obs.frozen.tensor_steps(name), obs.frozen.by_tensor[name], color=st["color"], ls=st["ls"],
                    lw=1.4, label="_observed " + name)
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("step")
    ax.set_ylabel("frozen fraction")
    ax.set_title("per tensor: predicted (wide, pale), observed (thin)")
    label_lines(ax, fontsize=7, min_gap=0.045)
    return ax


def plot_freeze_sweep(rows: Sequence[dict], ax=None, color_by: str = "man_bits", title: Optional[str] = None):
    """Observed against predicted freeze step, one point per run (rows as returned by
    :func:`lowprec_demo.experiments.sweep`), on the diagonal where the prediction holds; the
    shaded band is the tolerance max(2 steps, 2 % of the run).

    Example: ``plot_freeze_sweep(sweep("quadratic", man_bits=[3, 5, 7]))``."""
    ax = _ax(ax)
    pts = [r for r in rows if r.get("predicted") is not None and r.get("observed") is not None]
    if pts:
        hi = max(max(r["predicted"], r["observed"]) for r in pts) * 1.08 + 2
        xs = np.linspace(0, hi, 200)
        steps = max(r.get("steps", 0) for r in pts)
        tol = max(2, 0.02 * steps)
        ax.fill_between(xs, xs - tol, xs + tol, color="0.85", label=f"tolerance ±{tol:g} steps")
        ax.plot(xs, xs, color="0.4", lw=0.8)
        values = sorted({r.get(color_by) for r in pts}, key=lambda v: (v is None, v))
        markers = "osD^vP*X"
        for i, v in enumerate(values):
            sel = [r for r in pts if r.get(color_by) == v]
            ax.scatter([r["predicted"] for r in sel], [r["observed"] for r in sel], color=series_style(i)["color"],
                       marker=markers[i % len(markers)], s=32, zorder=3, label=f"{color_by} = {v}")
        ax.set_xlim(0, hi)
        ax.set_ylim(0, hi)
    missing = [r for r in rows if r.get("predicted") is None or r.get("observed") is None]
    if missing:
        ax.text(0.02, 0.96, f"{len(missing)} run(s) without a freeze step", transform=ax.transAxes,
                fontsize=8, va="top")
    ax.set_xlabel("predicted freeze step (from the high-precision run)")
    ax.set_ylabel("observed freeze step (round to nearest)")
    ax.set_title(title or "freeze step: predicted vs observed")
    ax.legend(frameon=False, fontsize=8)
    return ax


def grid_values(fmt, lo: float, hi: float) -> np.ndarray:
    """All non-negative finite values of ``fmt`` in ``[lo, hi]`` (exact, from the definition).

    Example:
        >>> grid_values("e2m1", 0, 6).tolist()
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    """
    f = get_format(fmt)
    values = [0.0]
    values += [k * f.smallest_subnormal for k in range(1, 2**f.man_bits)]
    for e in range(f.e_min, f.e_max + 1):
        for k in range(2**f.man_bits):
            v = (1 + k / 2**f.man_bits) * 2.0**e
            if v <= f.max:
                values.append(v)
            if v > hi:
                break
        if 2.0**e > hi:
            break
    v = np.array(sorted(set(values)))
    return v[(v >= lo) & (v <= hi)]


def plot_grid(fmt, lo: float = 0.0, hi: float = 4.0, ax=None, y: float = 0.0, color: Optional[str] = None,
              label: Optional[str] = None):
    """The representable values of ``fmt`` between ``lo`` and ``hi`` as ticks on a number line.

    Example: ``plot_grid("e4m3", 0, 8)``."""
    ax = _ax(ax)
    v = grid_values(fmt, lo, hi)
    f = get_format(fmt)
    ax.vlines(v, y - 0.35, y + 0.35, color=color or PALETTE["blue"], lw=1.0)
    ax.text(lo, y + 0.42, label or f"{f.name} (E{f.exp_bits}M{f.man_bits}): {len(v)} values in [{lo:g}, {hi:g}]",
            fontsize=8)
    ax.set_xlim(lo, hi)
    ax.set_yticks([])
    ax.set_xlabel("value")
    return ax


def plot_ulp(formats: Sequence, ax=None, lo: float = 1e-4, hi: float = 1e4, relative: bool = False):
    """ULP against magnitude (log-log) for several formats: a staircase doubling at every power
    of two, flat below the smallest normal; ``relative=True`` plots ulp(w)/w instead.

    Example: ``plot_ulp(["bf16", "fp16", "e4m3", "e5m2"])``."""
    ax = _ax(ax)
    w = np.geomspace(lo, hi, 4000)
    for i, name in enumerate(formats):
        f = get_format(name)
        mask = w <= f.max
        e = np.maximum(np.floor(np.log2(w[mask])), f.e_min)
        u = 2.0 ** (e - f.man_bits)
        ax.plot(w[mask], u / w[mask] if relative else u, label=f.name, lw=1.6, **series_style(i))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|w|")
    ax.set_ylabel("ulp(w) / |w|" if relative else "ulp(w)")
    ax.legend(frameon=False)
    return ax


def plot_ratio_histogram(result, ax=None, fmt: Optional[str] = None):
    """Distribution of ``log2(|update| / gap)`` over all elements and steps of the reference run;
    the freeze threshold of round-to-nearest sits at -1 (half a gap).

    Example: ``plot_ratio_histogram(result)``."""
    ax = _ax(ax)
    rec = result.predictions[get_format(fmt).name] if fmt else result.prediction
    counts = np.asarray(rec.ratio_histogram, dtype=float)
    if counts.sum() == 0:
        return ax
    centers = np.array([RATIO_BINS[0] - 0.5] + [b - 0.5 for b in RATIO_BINS[1:]] + [RATIO_BINS[-1] + 0.5])
    ax.bar(centers, counts / counts.sum(), width=0.9, color=COLORS["predicted"])
    ax.axvline(-1, color=COLORS["nearest"], ls=(0, (5, 2)), lw=1.2, label="half a gap: nearest freezes left of it")
    ax.set_xlabel("log2(|update| / gap)  (leftmost bar: zero updates and ratios below 2^-24)")
    ax.set_ylabel("fraction of element-steps")
    ax.legend(frameon=False, fontsize=8)
    return ax


def plot_remedies(comparison, ax=None, relative: bool = False, title: Optional[str] = None, legend: bool = True):
    """The remedies of a :class:`lowprec_demo.remedies.RemedyComparison`: final evaluation loss
    minus the fp32 reference's (or, with ``relative``, over it) against the bytes each stores per
    parameter, one point per remedy. Remedies that store the same bytes sit side by side around
    their value; crosses mark those that keep round to nearest, the star the reference."""
    ax = _ax(ax)
    rows = comparison.rows()
    key = "relative" if relative else "gap"
    def color(name):   # one colour per remedy, whatever the panel; few-bit SR in sky blue
        if name == "fp32":
            return PALETTE["black"]
        if name in COLORS:
            return COLORS[name]
        return PALETTE["sky"]
    groups: dict = {}
    for r in rows:
        groups.setdefault(r["bytes"], []).append(r)
    for r in rows:
        same = groups[r["bytes"]]
        x = r["bytes"] + 0.14 * (same.index(r) - (len(same) - 1) / 2)
        marker = "*" if r["remedy"] == "fp32" else ("X" if r["remedy"] in ("nearest", "nearest_state", "floor") else "o")
        ax.scatter(x, r[key], marker=marker, s=90 if marker == "*" else 45, color=color(r["remedy"]),
                   edgecolors="black", linewidths=0.4, label=r["label"], zorder=3)
    ax.axhline(0, color="0.6", lw=0.8)
    ticks = []
    for b in sorted(groups):        # no two tick labels closer than a third of a byte
        if not ticks or b - ticks[-1] >= 0.34:
            ticks.append(b)
    ax.set_xticks(ticks, [f"{b:g}" for b in ticks])
    ax.set_xlabel("bytes stored per parameter (weights, optimizer state, buffers)")
    ax.set_ylabel(f"final {comparison.metric} - fp32" + (" (relative)" if relative else ""))
    if relative:
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
    if legend:
        ax.legend(fontsize=7, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or comparison.main.experiment)
    return ax
