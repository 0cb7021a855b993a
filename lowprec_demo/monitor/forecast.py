"""The freeze watch's forecast: the learning-rate schedule ahead, and from it when each tensor
will stop moving.

The watch measures, in prediction mode, each element's update per unit of learning rate in gaps
of its stored value, ``|d| / (lr gap)``, as a histogram over :data:`EDGES`: a moving average
over about :data:`MEMORY` watched steps, and one over about :data:`RECENT`. An element is frozen
at a later step ``s`` when ``lr_s |d| / (lr gap) < 1/2``: the fraction of a tensor frozen at
step ``s`` is the fraction of its histogram below ``log2(1 / (2 lr_s))``.

Measured, these ratios shrink as training goes on (Adam's ``|m| / sqrt(v)`` falls as the
gradient's noise comes to outweigh its mean), so a histogram taken to stay as it is forecasts
late. The watch also keeps, per tensor, the median of ``log2`` of the ratio at the watched
steps (:class:`RatioTrend`, thinned by doubling to at most :data:`TREND_POINTS` points). The
forecast fits its slope against ``log(step + 1)`` over the later half of the steps seen and
carries the recent histogram along that slope (a fall only: a rise is taken as none). The band
runs from the same with 1.5 times the slope (early) to the histogram of the last
:data:`MEMORY` steps taken to stay as it is (late).

The functions take a :class:`~lowprec_demo.watch.FreezeWatch` (``watch``) and read what it
measured through its public methods; :class:`~lowprec_demo.watch.FreezeWatch` answers
``forecast``, ``forecast_curves`` and ``update_ratios`` with them.

Example:
    >>> lr_schedule([1.0, 1.0, 0.5, 0.25], 1, [0.5], 4)      # a list: the learning rates, scaled
    {1: [0.5], 2: [0.25], 3: [0.125]}
"""

from __future__ import annotations

import copy
import math
import types
import warnings
from typing import Dict, List, Optional

import torch

from lowprec_demo.freeze.prediction import FreezeRecord, freeze_step

__all__ = ["EDGES", "MEMORY", "RECENT", "TREND_POINTS", "BAND_SLOPE", "RatioTrend", "unwrap_scheduler", "check_schedule", "schedule_length", "lr_schedule",
           "fraction_below", "forecast_curves", "schedule_ahead", "update_ratios", "forecast", "freeze_steps"]

# the forecast's histogram of log2(|d| / (lr * gap)): eighths of an octave from 2^-64 to 2^32
EDGES = torch.arange(-64 * 8, 32 * 8 + 1, dtype=torch.float32) / 8
MEMORY = 20              # the forecast's histogram: a moving average over about this many watched steps
RECENT = 4               # the trend's starting histogram: a moving average over about this many watched steps
TREND_POINTS = 256       # the ratio's medians kept per tensor, at most (thinned by doubling)
BAND_SLOPE = 1.5         # the band's early edge: the fitted slope times this


class RatioTrend:
    """Per tensor, the median of ``log2(|d| / (lr gap))`` at the watched steps: the points the
    forecast fits its trend on. At most :data:`TREND_POINTS` points are kept; when full, every
    other one is dropped and from then on only every second (fourth, ...) step is kept, so the
    points stay spread over the whole run at a fixed memory.

    Example:
        >>> t = RatioTrend()
        >>> h = torch.zeros(1, len(EDGES) + 1, dtype=torch.float64); h[0, 520] = 1.0
        >>> t.add(0, h); t.steps, t.values()[0].tolist()
        ([0], [1.0])
    """

    def __init__(self) -> None:
        self.steps: List[int] = []
        self._medians: List[torch.Tensor] = []
        self._stride, self._seen = 1, 0

    def add(self, step: int, hist: torch.Tensor) -> None:
        """Add the point of one watched step from its histogram (tensors, bins) of fractions."""
        self._seen += 1
        if (self._seen - 1) % self._stride:
            return
        idx = (hist.cumsum(1) < 0.5).sum(1).clamp(max=len(EDGES) - 1)
        self.steps.append(step)
        self._medians.append(EDGES[idx.cpu()])      # the upper edge of the median's bin
        if len(self.steps) >= TREND_POINTS:
            self.steps, self._medians = self.steps[::2], self._medians[::2]
            self._stride *= 2

    def nbytes(self) -> int:
        """The memory the points take."""
        return sum(m.numel() * m.element_size() for m in self._medians)

    def values(self) -> torch.Tensor:
        """The medians, ``(points, tensors)``, float32."""
        return torch.stack(self._medians)

    def slopes(self) -> List[float]:
        """Per tensor, the least-squares slope of the median against ``log(step + 1)`` over the
        later half of the steps seen (from half the last step on), in octaves per e-fold of
        steps; 0 where fewer than 3 points have a nonzero ratio, or where the fit rises."""
        if not self.steps:
            return []
        now = self.steps[-1]
        keep = [i for i, t in enumerate(self.steps) if t >= now / 2]
        y = self.values()[keep].double()                        # (points, tensors)
        x = torch.log(torch.tensor([self.steps[i] + 1.0 for i in keep], dtype=torch.float64))
        out = []
        for j in range(y.shape[1]):
            ok = y[:, j] > float(EDGES[0]) + 1     # a zero ratio sits in the first bin: no point
            if int(ok.sum()) < 3:
                out.append(0.0)
                continue
            xj, yj = x[ok], y[ok, j]
            dx = xj - xj.mean()
            den = float((dx * dx).sum())
            out.append(0.0 if den == 0 else min(0.0, float((dx * (yj - yj.mean())).sum()) / den))
        return out


def unwrap_scheduler(scheduler):
    """The torch scheduler behind wrappers that hold one as ``.scheduler`` (accelerate's
    AcceleratedScheduler, as the Hugging Face Trainer passes it); anything else as it is.
    Example: ``unwrap_scheduler(None)`` -> ``None``."""
    while scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) \
            and hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler     # accelerate's AcceleratedScheduler
    return scheduler


def check_schedule(scheduler) -> None:
    """Raise ValueError unless ``scheduler`` is a schedule the forecast can read ahead: None
    (constant), a callable step -> lr, a list of learning rates, or a ``torch.optim.lr_scheduler``
    scheduler other than ``ReduceLROnPlateau``. Example: ``check_schedule([1e-3, 5e-4])`` passes."""
    if scheduler is None or callable(scheduler) and not hasattr(scheduler, "step"):
        return
    if isinstance(scheduler, (list, tuple)):
        if not all(isinstance(x, (int, float)) for x in scheduler):
            raise ValueError("a schedule given as a list must hold one learning rate (a number) per step")
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("ReduceLROnPlateau sets the learning rate from a metric, so it has no schedule to "
                         "forecast from; pass the planned learning rates as a list or a callable step -> lr")
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError(f"scheduler must be a torch.optim.lr_scheduler scheduler, a callable step -> lr, a list of "
                         f"learning rates or None; got {type(scheduler).__name__}, which has no learning-rate schedule")


def schedule_length(scheduler) -> Optional[int]:
    """The run's length in steps where the schedule says it: a list's length, OneCycleLR's
    ``total_steps``, CosineAnnealingLR's ``T_max`` (the steps over which it anneals: a run of
    ``T_max`` optimizer steps, each followed by ``scheduler.step()``, ends where the cosine
    reaches ``eta_min``); else None.
    Example: ``schedule_length([1e-3] * 100)`` -> ``100``."""
    if isinstance(scheduler, (list, tuple)):
        return len(scheduler)
    for attr in ("total_steps", "T_max"):   # OneCycleLR; CosineAnnealingLR
        value = getattr(scheduler, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def lr_schedule(scheduler, t0: int, now: List[float], total: int) -> Dict[int, List[float]]:
    """The learning rate of every param group at every step from ``t0`` (the last watched one,
    whose learning rates were ``now``) to the end of the run, ``total`` steps: constant for
    None; for a list or a callable step -> lr, ``now`` scaled by ``value(s) / value(t0)``; for a
    torch scheduler, a copy of it stepped ahead (the scheduler itself is left as it is).
    Example: ``lr_schedule(None, 8, [0.1], 10)`` -> ``{8: [0.1], 9: [0.1]}``."""
    steps = range(t0, total)
    sched = scheduler
    if sched is None:
        return {s: list(now) for s in steps}
    if isinstance(sched, (list, tuple)) or callable(sched) and not hasattr(sched, "step"):
        value = (lambda s: float(sched[min(s, len(sched) - 1)])) if isinstance(sched, (list, tuple)) else sched
        base = float(value(t0))
        return {s: [lr * float(value(s)) / base if base > 0 else 0.0 for lr in now] for s in steps}
    # a torch scheduler: step a copy of it over a stand-in for the optimizer
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} | {"params": []}
              for g in sched.optimizer.param_groups]
    stand_in = types.SimpleNamespace(param_groups=groups, step=lambda *a, **k: None, _opt_called=True)
    stand_in.step._wrapped_by_lr_sched = True
    clone = copy.deepcopy(sched, memo={id(sched.optimizer): stand_in})
    at = clone.last_epoch            # the step whose learning rate the groups hold now
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if at > t0:                  # the scheduler already stepped past the watched step
            out[t0] = list(now)
        for s in range(at, total):
            if s >= t0:
                out[s] = [float(g["lr"]) for g in groups]
            clone.step()
    return out


def fraction_below(cum: List[float], cutoff: float) -> float:
    """The fraction of a histogram over :data:`EDGES` below ``cutoff``, linear within a bin;
    ``cum`` is the histogram's cumulative fraction, one value per bin (``len(EDGES) + 1``).
    Example: with ``cum[i] = i / len(EDGES)``, ``fraction_below(cum, 0.0)`` -> ``512 / 769``."""
    width = 1 / 8
    pos = (cutoff - float(EDGES[0])) / width        # bin i + 1 spans edges i .. i + 1
    if pos < 0:
        return cum[0]
    i = int(pos)
    if i >= len(EDGES) - 1:      # beyond the last edge: only the elements up to it
        return cum[len(EDGES) - 1]
    lo, hi = cum[i], cum[i + 1]
    return lo + (hi - lo) * (pos - i)


def forecast_curves(watch, fmt=None, total_steps: Optional[int] = None,
                    trend: float = 1.0, schedule: Optional[Dict[int, List[float]]] = None) -> Dict[str, Dict[int, float]]:
    """The forecast frozen fraction of every tensor and ``"overall"`` at every step after the
    last watched one, to the end of the run: ``{name: {step: fraction}}`` (see
    :meth:`FreezeWatch.forecast_curves <lowprec_demo.watch.FreezeWatch.forecast_curves>`).

    The fraction of a tensor frozen at step ``s`` is :func:`fraction_below` of its recent
    histogram at ``log2(0.5 / lr_s) - trend * b * (log(s + 1) - log(c + 1))``, with ``b`` the
    tensor's slope (:meth:`RatioTrend.slopes`) and ``c`` the step the recent histogram stands
    for (1 where ``lr_s <= 0``); overall, the size-weighted mean. ``trend=0``: the histogram of
    the last :data:`MEMORY` watched steps taken to stay as it is (the band's late edge).
    ``schedule``: the learning rates ahead as :func:`lr_schedule` gives them (computed when None;
    :func:`forecast` computes it once for its three curves)."""
    _check_forecast(watch)
    if not trend >= 0.0:
        raise ValueError(f"trend must be a factor >= 0 on the fitted slope, got {trend!r}")
    hist = watch.ratio_histogram(fmt, recent=trend > 0)
    slopes = watch.ratio_trend(fmt).slopes() if trend > 0 else [0.0] * len(watch.tracked)
    # the recent histogram stands for about RECENT - 1 watched steps back
    center = max(0, watch.steps[-1] - (RECENT - 1) * watch.every) if trend > 0 else watch.steps[-1]
    if schedule is None:
        schedule = schedule_ahead(watch, total_steps)
    future = [s for s in sorted(schedule) if s > watch.steps[-1]]
    cum = {}
    out: Dict[str, Dict[int, float]] = {}
    weighted = {s: 0.0 for s in future}
    for j, n in enumerate(watch.tracked):
        c = torch.cumsum(hist[j], 0)
        cum[n] = (c / c[-1].clamp(min=1e-300)).tolist()
        gi = watch.param_group_of(n)
        curve = {}
        b = trend * slopes[j]
        for s in future:
            lr = schedule[s][gi]
            shift = b * (math.log(s + 1) - math.log(center + 1)) if b else 0.0
            curve[s] = 1.0 if lr <= 0 else fraction_below(cum[n], math.log2(0.5 / lr) - shift)
            weighted[s] += curve[s] * watch.sizes[n]
        out[n] = curve
    total_size = sum(watch.sizes[n] for n in watch.tracked)
    out["overall"] = {s: weighted[s] / total_size for s in future}
    return out


def _check_forecast(watch) -> None:
    if watch.mode != "predict":
        raise ValueError("a forecast needs the updates of a float32 run (the watch in prediction mode); this "
                         "watch observes parameters stored in low precision")
    if not watch.steps:
        raise ValueError("nothing watched yet: call forecast after at least one optimizer step")


def schedule_ahead(watch, total_steps: Optional[int] = None) -> Dict[int, List[float]]:
    """The learning rates per param group from the last watched step to the end of the run
    (:func:`lr_schedule` of the watch's scheduler), the run's length from ``total_steps`` or the
    watch's."""
    _check_forecast(watch)
    total = total_steps if total_steps is not None else watch.total_steps
    if total is None:
        raise ValueError("the forecast needs the run's length: give total_steps to watch() or forecast(), or a "
                         "schedule that knows it (a list of learning rates, OneCycleLR, CosineAnnealingLR)")
    return lr_schedule(watch.scheduler, watch.steps[-1], watch.lrs[-1], total)


def update_ratios(watch, fmt=None, q: float = 0.5) -> Dict[str, float]:
    """Per tensor, the ``q`` quantile of ``|d| / (lr gap)`` in the watch's histogram: the upper
    edge ``2^EDGES[i]`` of the bin where the cumulative fraction reaches ``q`` (0 in the first
    bin). Example: a tensor whose updates are all 4 gaps per unit of learning rate -> ``4.0``."""
    if watch.mode != "predict" or not watch.steps:
        raise ValueError("update ratios are measured in prediction mode, after at least one watched step")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    hist = watch.ratio_histogram(fmt)
    out = {}
    for j, n in enumerate(watch.tracked):
        c = torch.cumsum(hist[j], 0)
        i = int(torch.searchsorted(c / c[-1].clamp(min=1e-300), torch.tensor(q, dtype=c.dtype)))
        out[n] = 0.0 if i == 0 else 2.0 ** float(EDGES[min(i, len(EDGES) - 1)])
    return out


def forecast(watch, fmt=None, threshold: Optional[float] = None,
             total_steps: Optional[int] = None, curves: bool = False) -> Dict[str, object]:
    """The step at which the whole model and each tensor will pass the threshold (the watch's
    own when None), with a band: :func:`freeze_steps` over the measured points and
    :func:`forecast_curves` with the fitted trend (the step), 1.5 times it and none (the band's
    edges, the earlier as ``"low"``; the step always lies in it).
    ``{"overall": step, "low": step, "high": step, "by_tensor": {name: {"step", "low", "high"}}}``,
    each step None where the threshold is not passed within the schedule (a band edge of None:
    not within the run). ``curves=True`` adds ``"curves"``: the forecast curves with the fitted
    trend, those of :func:`forecast_curves` (the schedule ahead is computed once for all)."""
    tau = watch.threshold if threshold is None else threshold
    if not 0.0 < tau <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {tau!r}")
    rec = watch.record(fmt)
    schedule = schedule_ahead(watch, total_steps)
    ahead = [forecast_curves(watch, fmt, total_steps, trend, schedule) for trend in (1.0, BAND_SLOPE, 0.0)]
    point, early, late = (freeze_steps(watch, rec, c, tau) for c in ahead)

    def banded(a, b, c) -> Dict[str, Optional[int]]:
        inf = float("inf")
        edges = [inf if x is None else x for x in (a, b, c)]
        lo, hi = min(edges), max(edges)
        return {"step": a, "low": None if lo == inf else int(lo), "high": None if hi == inf else int(hi)}

    overall = banded(point["overall"], early["overall"], late["overall"])
    out = {"overall": overall["step"], "low": overall["low"], "high": overall["high"],
           "by_tensor": {n: banded(point["by_tensor"][n], early["by_tensor"][n], late["by_tensor"][n])
                         for n in watch.tracked}}
    if curves:
        out["curves"] = ahead[0]
    return out


def freeze_steps(watch, rec: FreezeRecord, curves: Dict[str, Dict[int, float]], tau: float) -> Dict[str, object]:
    """The first step from which the frozen fraction stays at or above ``tau`` to the end of the
    run, over the record's measured points (at ``watch.steps``) followed by the curves ahead,
    overall and per tracked tensor; None where it does not happen.
    Example: points 0.2, 0.6 at steps 0, 1 and ``{2: 0.4, 3: 0.7}`` ahead, ``tau = 0.5`` -> 3."""

    def step_of(past: List[float], ahead: Dict[int, float]) -> Optional[int]:
        points = list(zip(watch.steps, past)) + sorted(ahead.items())
        i = freeze_step([v for _, v in points], tau)
        return None if i is None else points[i][0]

    return {"overall": step_of(rec.overall, curves["overall"]),
            "by_tensor": {n: step_of(rec.by_tensor[n], curves[n]) for n in watch.tracked}}
