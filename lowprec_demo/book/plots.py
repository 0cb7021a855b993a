"""The book's figures, each drawn on a matplotlib ``ax`` (made when omitted) and returned, in the
style of :mod:`lowprec_demo.common.style` (re-exported here).

Example:
    >>> ax = plot_ulp(["bf16", "fp16"])
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Sequence

import matplotlib.pyplot as plt
import numpy as np

from lowprec_demo.book.results import describe
from lowprec_demo.formats import get_format
from lowprec_demo.freeze import RATIO_BINS, freeze_order
from lowprec_demo.common.style import (COLORS, LABELS, PALETTE, STYLES, label_lines, series_style, style,
                                       tensor_styles, text_color, use_book_style)

__all__ = ["COLORS", "LABELS", "PALETTE", "STYLES", "use_book_style", "style", "series_style", "tensor_styles",
           "label_lines", "plot_losses", "plot_frozen", "plot_frozen_by_tensor", "plot_freeze_sweep", "plot_grid",
           "plot_ulp", "plot_ratio_histogram", "provenance_label", "plot_run", "grid_values", "plot_baselines",
           "plot_element_agreement", "plot_evidence", "plot_remedies"]


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
    """Where a stored result came from, for a figure's title (:func:`~lowprec_demo.book.results.describe`)."""
    return describe(result)


def plot_losses(result, ax=None, variants: Optional[Iterable[str]] = None, log: bool = True, smooth: int = 1,
                mark_freeze: bool = True, title: Optional[str] = None):
    """Training loss per step of each variant; the predicted freeze step as a dotted line."""
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
    ax.set(xlabel="step", ylabel="training loss" + (f" ({smooth}-step mean)" if smooth > 1 else ""),
           title=title or f"{result.experiment}: stored weights in {result.format}")
    ax.legend(frameon=False)
    return ax


def plot_frozen(result, ax=None, threshold: Optional[float] = None, show_sr: bool = True, title: Optional[str] = None):
    """Frozen fraction per step, predicted from the reference run against observed in the
    round-to-nearest run, both freeze steps marked; with ``show_sr`` also the fraction stochastic
    rounding is predicted to leave in place (1 - move fraction) and the observed one."""
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
    # the freeze steps labelled low down, right of their lines (the curves run high by then),
    # the earlier one higher, so the two labels never share a line of text
    marks = [(step, color, name) for step, color, name in (
        (result.predicted_freeze_step(threshold), COLORS["predicted"], "predicted"),
        (result.observed_freeze_step("nearest", threshold) if "nearest" in result.runs else None,
         COLORS["nearest"], "observed")) if step is not None]
    marks.sort(key=lambda m: m[0])
    for k, (step, color, name) in enumerate(marks):
        ax.axvline(step, color=color, ls=":", lw=1.2)
        ax.annotate(f"{name}: step {step}", (step, 0.04 + 0.09 * (len(marks) - 1 - k)),
                    xycoords=("data", "axes fraction"), textcoords="offset points", xytext=(4, 0),
                    color=text_color(color), fontsize=9)
    ax.set(ylim=(-0.02, 1.02), xlabel="step", ylabel="fraction of elements not moved",
           title=title or f"{result.experiment}, {result.format}: frozen fraction (threshold {threshold})")
    ax.legend(frameon=False, fontsize=9, loc="center right")
    return ax


def plot_run(result, axes=None, title: Optional[str] = None, frozen_title: str = "frozen fraction",
             variants: Optional[Iterable[str]] = None, smooth: int = 1, show_sr: bool = True,
             loss_ylim: Optional[tuple] = None, threshold: Optional[float] = None):
    """:func:`plot_losses` beside :func:`plot_frozen` (what the chapters' sliders redraw);
    ``title`` heads the loss panel, ``frozen_title`` the other. Returns the two axes."""
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
    """The observed (round-to-nearest) frozen fraction against the prediction and every baseline,
    each labelled with its mean absolute error and its freeze step."""
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
    ax.set(ylim=(-0.02, 1.02), xlabel="step", ylabel="fraction of elements not moved",
           title=title or f"{result.experiment}, {result.format}: predictors against the observed freeze")
    # six curves with their errors: the legend below the axes, in two columns, off the curves
    ax.legend(frameon=False, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
    return ax


def plot_element_agreement(result, ax=None, title: Optional[str] = None):
    """Per step, the share of elements whose predicted and observed frozen states differ, against
    what independent masks would give, overall and within each tensor and binade."""
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
    ax.set(xlabel="step", ylabel="fraction of elements that disagree",
           title=title or f"{result.experiment}, {result.format}: element by element")
    ax.legend(frameon=False, fontsize=9, loc="best")
    return ax


def plot_evidence(result, axes=None, threshold: Optional[float] = None, title: Optional[str] = None):
    """:func:`plot_baselines` and :func:`plot_element_agreement` side by side; returns the two axes."""
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(12, 4))
    plot_baselines(result, ax=axes[0], threshold=threshold, title=title)
    plot_element_agreement(result, ax=axes[1])
    return axes


def plot_frozen_by_tensor(result, ax=None, names: Optional[List[str]] = None, max_tensors: int = 8,
                          observed: bool = True, threshold: Optional[float] = None):
    """Predicted (wide, pale) and observed (thin) frozen fraction of single tensors, labelled at
    their right ends (leave room there); a tensor keeps its style in every figure of a model."""
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
    ax.set(ylim=(-0.02, 1.02), xlabel="step", ylabel="frozen fraction",
           title="per tensor: predicted (wide, pale), observed (thin)")
    label_lines(ax, fontsize=9, min_gap=0.045)
    return ax


def plot_freeze_sweep(rows: Sequence[dict], ax=None, color_by: str = "man_bits", title: Optional[str] = None):
    """Observed against predicted freeze step, one point per row of
    :func:`~lowprec_demo.book.experiments.sweep`; the band is the tolerance max(2 steps, 2 %)."""
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
                fontsize=9, va="top")
    ax.set(xlabel="predicted freeze step (from the high-precision run)",
           ylabel="observed freeze step (round to nearest)", title=title or "freeze step: predicted vs observed")
    ax.legend(frameon=False, fontsize=9)
    return ax


def grid_values(fmt, lo: float, hi: float) -> np.ndarray:
    """Non-negative finite values of ``fmt`` in ``[lo, hi]``, ``"e2m1"`` in [0, 6]: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
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
    """The representable values of ``fmt`` between ``lo`` and ``hi`` as ticks on a number line."""
    ax = _ax(ax)
    v = grid_values(fmt, lo, hi)
    f = get_format(fmt)
    ax.vlines(v, y - 0.35, y + 0.35, color=color or PALETTE["blue"], lw=1.0)
    ax.text(lo, y + 0.42, label or f"{f.name} (E{f.exp_bits}M{f.man_bits}): {len(v)} values in [{lo:g}, {hi:g}]",
            fontsize=9)
    ax.set_xlim(lo, hi)
    ax.set_yticks([])
    ax.set_xlabel("value")
    return ax


def plot_ulp(formats: Sequence, ax=None, lo: float = 1e-4, hi: float = 1e4, relative: bool = False):
    """ULP against magnitude (log-log) for several formats: a staircase doubling at every power
    of two, flat below the smallest normal; ``relative=True`` plots ulp(w)/w."""
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
    ax.set(xlabel="|w|", ylabel="ulp(w) / |w|" if relative else "ulp(w)")
    ax.legend(frameon=False)
    return ax


def plot_ratio_histogram(result, ax=None, fmt: Optional[str] = None):
    """Distribution of ``log2(|d| / gap)`` over the reference's element-steps; RNE freezes left of -1 (half a gap)."""
    ax = _ax(ax)
    rec = result.predictions[get_format(fmt).name] if fmt else result.prediction
    counts = np.asarray(rec.ratio_histogram, dtype=float)
    if counts.sum() == 0:
        return ax
    centers = np.array([RATIO_BINS[0] - 0.5] + [b - 0.5 for b in RATIO_BINS[1:]] + [RATIO_BINS[-1] + 0.5])
    ax.bar(centers, counts / counts.sum(), width=0.9, color=COLORS["predicted"])
    ax.axvline(-1, color=COLORS["nearest"], ls=(0, (5, 2)), lw=1.2, label="half a gap: nearest freezes left of it")
    ax.set(xlabel="log2(|update| / gap)  (leftmost bar: zero updates and ratios below 2^-24)",
           ylabel="fraction of element-steps")
    ax.legend(frameon=False, fontsize=9)
    return ax


def plot_remedies(comparison, ax=None, relative: bool = False, title: Optional[str] = None, legend: bool = True):
    """A :class:`~lowprec_demo.book.remedies.RemedyComparison`: each remedy's final eval
    loss minus the fp32 reference's (``relative``: over it) against its stored bytes per
    parameter; crosses mark round to nearest, the star the reference."""
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
    ax.set(xlabel="bytes stored per parameter (weights, optimizer state, buffers)",
           ylabel=f"final {comparison.metric} - fp32" + (" (relative)" if relative else ""))
    if relative:
        ax.yaxis.set_major_formatter(plt.matplotlib.ticker.PercentFormatter(1.0))
    if legend:
        ax.legend(fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(title or comparison.main.experiment)
    return ax
