"""The freeze watch's forecast: the learning-rate schedule ahead, and when each tensor will stop.

An element freezes at step ``s`` when ``lr_s |d| / (lr gap) < 1/2``; the watch keeps ``|d| / (lr gap)`` as histograms
over :data:`EDGES` (:class:`RatioHistograms`). The ratios shrink over training (Adam's ``|m| / sqrt(v)`` falls as noise
outweighs the gradient's mean), so the forecast carries the recent histogram along each tensor's fitted trend
(:class:`RatioTrend`, a fall only), with a band from :data:`BAND_SLOPE` times that slope to no trend. A fine-tune in
bf16 starts over half frozen, so an absolute threshold says "0 (0-0)": ``relative`` forecasts per tensor when it
passes most of the way from its least frozen share to all frozen (:func:`passage_steps`), with a band calibrated on
some runs and measured on others.

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

from lowprec_demo.freeze import counts
from lowprec_demo.freeze.records import FreezeRecord, freeze_step

__all__ = ["EDGES", "MEMORY", "RECENT", "TREND_POINTS", "BAND_SLOPE", "RatioTrend", "RatioHistograms",
           "unwrap_scheduler", "check_schedule", "schedule_length", "lr_schedule", "fraction_below", "forecast_curves",
           "schedule_ahead", "update_ratios", "forecast", "freeze_steps", "RELATIVE", "BAND_OCTAVES", "BASE_POINTS",
           "NOISE_POINTS", "started_frozen", "passage_steps"]

# the forecast's histogram of log2(|d| / (lr * gap)): the one binning, eighths of an octave from 2^-64 to 2^32
EDGES = counts.EDGES
MEMORY = 20              # the forecast's histogram: a moving average over about this many watched steps
RECENT = 4               # the trend's starting histogram: a moving average over about this many watched steps
TREND_POINTS = 256       # the ratio's medians kept per tensor, at most (thinned by doubling)
BAND_SLOPE = 1.5         # the band's early edge: the fitted slope times this
# the relative forecast (a fine-tune that starts mostly frozen): see forecast()
RELATIVE = 0.9           # "most of the way": this share of the way from the least frozen share to all frozen
BAND_OCTAVES = (0.5, 2.5)   # the band: the curves with the ratio shifted by +-(a + b / sqrt(elements above the level))
BASE_POINTS = 4          # the least frozen share: of the record's trailing mean over this many watched steps
NOISE_POINTS = 20        # the step-to-step spread of the frozen share: from the last this many watched steps


class RatioTrend:
    """Per tensor, the median of ``log2(|d| / (lr gap))`` at the watched steps, for the trend; at
    most :data:`TREND_POINTS` kept (when full, every other one is dropped and the stride doubled).

    Example:
        >>> t = RatioTrend()
        >>> h = torch.zeros(1, len(EDGES) + 1, dtype=torch.float64); h[0, 520] = 1.0
        >>> t.add(0, h); t.steps, t.values()[0].tolist()
        ([0], [1.0])
    """

    def __init__(self) -> None:
        self.steps: List[int] = []
        self._medians: List[torch.Tensor] = []   # per point, float32 (tensors,)
        self._stride, self._seen = 1, 0

    def add(self, step: int, hist: torch.Tensor) -> None:
        """Add one watched step's point from its histogram (tensors, bins) of fractions."""
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
        """Per tensor, the least-squares slope of the median against ``log(step + 1)`` from half
        the last step on; 0 with fewer than 3 points of nonzero ratio, or where it rises."""
        if not self.steps:
            return []
        keep = [i for i, t in enumerate(self.steps) if t >= self.steps[-1] / 2]
        y = self.values()[keep].double()                        # (points, tensors)
        x = torch.log(torch.tensor([self.steps[i] + 1.0 for i in keep], dtype=torch.float64))
        out = []
        for j in range(y.shape[1]):
            ok = y[:, j] > float(EDGES[0]) + 1     # a zero ratio sits in the first bin: no point
            dx, yj = x[ok] - x[ok].mean(), y[ok, j]
            den = float((dx * dx).sum())
            out.append(0.0 if int(ok.sum()) < 3 or den == 0 else min(0.0, float((dx * (yj - yj.mean())).sum()) / den))
        return out


class RatioHistograms:
    """Per format name, the histograms ``(tensors, bins)`` of ``log2(|d| / (lr gap))`` as fractions,
    moving averages (Adam's ratio varies from step to step) over about :data:`MEMORY` (``long``)
    and :data:`RECENT` (``recent``: the trend's start) watched steps, and their :class:`RatioTrend`."""

    def __init__(self) -> None:
        self.long, self.recent, self.trend = {}, {}, {}

    def add(self, fmt: str, step: int, hist: torch.Tensor) -> None:
        """Add one watched step's histogram (tensors, bins) of counts."""
        hist = hist.double()
        hist = (hist / hist.sum(1, keepdim=True).clamp(min=1)).cpu()
        for store, memory in ((self.long, MEMORY), (self.recent, RECENT)):
            h = store.get(fmt)
            store[fmt] = hist.clone() if h is None else h.mul_(1 - 1 / memory).add_(hist, alpha=1 / memory)
        self.trend.setdefault(fmt, RatioTrend()).add(step, hist)

    def nbytes(self) -> int:
        """The memory the histograms and trend points take."""
        return sum(t.numel() * t.element_size() for t in [*self.long.values(), *self.recent.values()]) \
            + sum(t.nbytes() for t in self.trend.values())


def unwrap_scheduler(scheduler):
    """The torch scheduler behind wrappers holding one as ``.scheduler`` (accelerate's)."""
    while scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) \
            and hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler     # accelerate's AcceleratedScheduler
    return scheduler


def check_schedule(scheduler) -> None:
    """Raise ValueError unless ``scheduler`` can be read ahead: None, a callable step -> lr, a list
    of learning rates, or a torch scheduler but ``ReduceLROnPlateau``."""
    if isinstance(scheduler, (list, tuple)) and not all(isinstance(x, (int, float)) for x in scheduler):
        raise ValueError("a schedule given as a list must hold one learning rate (a number) per step")
    if scheduler is None or isinstance(scheduler, (list, tuple)) or callable(scheduler) and not hasattr(
            scheduler, "step"):
        return
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError("ReduceLROnPlateau sets the learning rate from a metric, so it has no schedule to "
                         "forecast from; pass the planned learning rates as a list or a callable step -> lr")
    if not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        raise ValueError(f"scheduler must be a torch.optim.lr_scheduler scheduler, a callable step -> lr, a list of "
                         f"learning rates or None; got {type(scheduler).__name__}, which has no learning-rate schedule")


def schedule_length(scheduler) -> Optional[int]:
    """The run's length where the schedule says it: a list's length, OneCycleLR's ``total_steps``,
    CosineAnnealingLR's ``T_max`` (its cosine reaches ``eta_min`` after that many steps); else None."""
    if isinstance(scheduler, (list, tuple)):
        return len(scheduler)
    for attr in ("total_steps", "T_max"):   # OneCycleLR; CosineAnnealingLR
        value = getattr(scheduler, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def lr_schedule(scheduler, t0: int, now: List[float], total: int) -> Dict[int, List[float]]:
    """Each param group's learning rate at each step from ``t0`` (rates ``now``) to ``total``: constant for None;
    ``now`` scaled by ``value(s) / value(t0)`` for a list or a callable; for a torch scheduler, a copy stepped ahead."""
    steps, sched = range(t0, total), scheduler
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
    out = {t0: list(now)} if at > t0 else {}    # (the scheduler already stepped past the watched step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(at, total):
            if s >= t0:
                out[s] = [float(g["lr"]) for g in groups]
            clone.step()
    return out


def fraction_below(cum: List[float], cutoff: float) -> float:
    """The fraction below ``cutoff`` of cumulative fractions ``cum`` over :data:`EDGES`, linear in a bin."""
    pos = (cutoff - float(EDGES[0])) / (1 / 8)        # bin i + 1 spans edges i .. i + 1
    if pos < 0:
        return cum[0]
    i = int(pos)
    if i >= len(EDGES) - 1:      # beyond the last edge: only the elements up to it
        return cum[len(EDGES) - 1]
    return cum[i] + (cum[i + 1] - cum[i]) * (pos - i)


def forecast_curves(watch, fmt=None, total_steps: Optional[int] = None, trend: float = 1.0,
                    schedule: Optional[Dict[int, List[float]]] = None,
                    offsets: Optional[List[float]] = None) -> Dict[str, Dict[int, float]]:
    """The forecast frozen fraction ``{name: {step: fraction}}`` of every tensor and ``"overall"`` (size-weighted) at
    every step after the last watched one: :func:`fraction_below` of the recent histogram at ``log2(0.5 / lr_s) - trend
    * b * (log(s + 1) - log(c + 1))``, ``b`` the tensor's slope and ``c`` the step the histogram stands for (1 where
    ``lr_s <= 0``). ``trend=0``: the :data:`MEMORY` histogram as it is. ``schedule``: :func:`schedule_ahead`'s.
    ``offsets``: per tracked tensor, octaves added to that cutoff (the relative forecast's band)."""
    _check_forecast(watch)
    if not trend >= 0.0:
        raise ValueError(f"trend must be a factor >= 0 on the fitted slope, got {trend!r}")
    f = watch.record(fmt).format
    hist = (watch.ratios.recent if trend > 0 else watch.ratios.long)[f]
    slopes = watch.ratios.trend[f].slopes() if trend > 0 else [0.0] * len(watch.tracked)
    # the recent histogram stands for about RECENT - 1 watched steps back
    center = max(0, watch.steps[-1] - (RECENT - 1) * watch.every) if trend > 0 else watch.steps[-1]
    schedule = schedule_ahead(watch, total_steps) if schedule is None else schedule
    future = [s for s in sorted(schedule) if s > watch.steps[-1]]
    out: Dict[str, Dict[int, float]] = {}
    for j, n in enumerate(watch.tracked):
        c = torch.cumsum(hist[j], 0)
        cum, gi, b = (c / c[-1].clamp(min=1e-300)).tolist(), watch.group_of[n], trend * slopes[j]
        shift = {s: b * (math.log(s + 1) - math.log(center + 1)) - (offsets[j] if offsets else 0.0) for s in future}
        out[n] = {s: 1.0 if schedule[s][gi] <= 0 else fraction_below(cum, math.log2(0.5 / schedule[s][gi]) - shift[s])
                  for s in future}
    total_size = sum(watch.sizes[n] for n in watch.tracked)
    out["overall"] = {s: sum(out[n][s] * watch.sizes[n] for n in watch.tracked) / total_size for s in future}
    return out


def _check_forecast(watch) -> None:
    if watch.no_forecast:     # observation under an optimizer whose state the watch does not read
        raise ValueError(watch.no_forecast)
    if not watch.steps:
        raise ValueError("nothing watched yet: call forecast after at least one optimizer step")


def schedule_ahead(watch, total_steps: Optional[int] = None) -> Dict[int, List[float]]:
    """:func:`lr_schedule` of the watch's scheduler from its last watched step to the run's end."""
    _check_forecast(watch)
    total = total_steps if total_steps is not None else watch.total_steps
    if total is None:
        raise ValueError("the forecast needs the run's length: give total_steps to watch() or forecast(), or a "
                         "schedule that knows it (a list of learning rates, OneCycleLR, CosineAnnealingLR)")
    return lr_schedule(watch.scheduler, watch.steps[-1], watch.lrs[-1], total)


def update_ratios(watch, fmt=None, q: float = 0.5) -> Dict[str, float]:
    """Per tensor, the ``q`` quantile of ``|d| / (lr gap)``: the upper edge of the bin where the
    histogram's cumulative fraction reaches ``q`` (0 in the first); it freezes below lr ``1 / (2 ratio)``."""
    _check_forecast(watch)
    if not 0.0 < q < 1.0:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    out, hist = {}, watch.ratios.long[watch.record(fmt).format]
    for j, n in enumerate(watch.tracked):
        c = torch.cumsum(hist[j], 0)
        i = int(torch.searchsorted(c / c[-1].clamp(min=1e-300), torch.tensor(q, dtype=c.dtype)))
        out[n] = 0.0 if i == 0 else 2.0 ** float(EDGES[min(i, len(EDGES) - 1)])
    return out


def forecast(watch, fmt=None, threshold: Optional[float] = None, total_steps: Optional[int] = None,
             curves: bool = False, relative=None) -> Dict[str, object]:
    """The step at which the model and each tensor will pass a frozen share, with a band. ``{"overall", "low",
    "high", "by_tensor": {name: {"step", "low", "high"}}}``, None where not within the run; ``curves=True`` adds the
    curves (:func:`forecast_curves`). Costs a few milliseconds per tensor and step ahead, when asked.

    ``threshold`` (the watch's when None): an absolute share; :func:`freeze_steps` over the measured points and the
    curves with the fitted trend, the band from those with :data:`BAND_SLOPE` times it and with none.

    ``relative`` (in (0, 1]; ``"auto"``: :data:`RELATIVE` where :func:`started_frozen`, else as ``threshold``): per
    tensor the level ``base + relative * (1 - base)``, ``base`` its least frozen share (the record's trailing mean over
    :data:`BASE_POINTS` watched steps, or the curve ahead), as :func:`passage_steps` gives it: the median step from
    which the measured share stays at or above the level to the end, the band from :data:`BAND_OCTAVES`. Adds
    ``"relative"``, ``"level"`` and ``"base"`` (overall and per tensor). For a bf16 fine-tune that starts over half
    frozen, where every absolute forecast reads "0 (0-0)". Measured (``benchmarks/forecast_finetune.py``, the book's
    300-step GPT fine-tune, relative 0.9): the band held the observed step for 87 % (634 of 728) of the held-out
    (tensor or model, run, asked-at step) cases still to come when asked (8 runs: other seeds, peak rates 1e-5 to 2e-4,
    another pretraining; asked at steps 15, 45, 90, 150), 90 % (245 of 273) on the 4 design runs; median width 47
    steps, median error of the step 11. Asked at the end of the warmup (step 15) it held 72 %, from step 45 on 83-99 %:
    ask after the first tenth of the run. With the watch following 1,024 elements per tensor (``sample=1024``): 87 %
    (636 of 728) held-out, a wider band (median 64 steps)."""
    if relative == "auto":
        relative = RELATIVE if threshold is None and started_frozen(watch, fmt) else None
    if relative is not None:
        if threshold is not None:
            raise ValueError(f"give threshold (an absolute frozen share) or relative (a share of the way from the "
                             f"least frozen share to all frozen), not both; got threshold={threshold!r}, "
                             f"relative={relative!r}")
        if isinstance(relative, bool) or not isinstance(relative, (int, float)) or not 0.0 < relative <= 1.0:
            raise ValueError(f"relative must be a share of the way in (0, 1] or 'auto', got {relative!r}")
    tau = watch.threshold if threshold is None else threshold
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0.0 < tau <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {tau!r}")
    rec, schedule = watch.record(fmt), schedule_ahead(watch, total_steps)
    if relative is not None:
        out, point = passage_steps(watch, fmt, float(relative), total_steps, schedule)
        return {**out, "curves": point} if curves else out
    ahead = [forecast_curves(watch, fmt, total_steps, trend, schedule) for trend in (1.0, BAND_SLOPE, 0.0)]
    point, early, late = (freeze_steps(watch, rec, c, tau) for c in ahead)

    def banded(*steps) -> Dict[str, Optional[int]]:    # an edge of None: not within the run
        known = [int(x) for x in steps if x is not None]
        return {"step": steps[0], "low": min(known, default=None), "high": None if None in steps else max(known)}

    overall = banded(point["overall"], early["overall"], late["overall"])
    by_tensor = {n: banded(point["by_tensor"][n], early["by_tensor"][n], late["by_tensor"][n]) for n in watch.tracked}
    out = {"overall": overall["step"], "low": overall["low"], "high": overall["high"], "by_tensor": by_tensor}
    return {**out, "curves": ahead[0]} if curves else out


def started_frozen(watch, fmt=None) -> bool:
    """Whether the model's frozen share has stayed at or above the watch's threshold since one of its first
    :data:`BASE_POINTS` watched steps (a bf16 fine-tune at a fine-tuning rate), where the absolute forecast says only
    "0 (0-0)" or so."""
    i = freeze_step(watch.record(fmt).overall, watch.threshold)
    return i is not None and i < BASE_POINTS


def _spread(values: List[float], n: int) -> float:
    """The step-to-step spread of a frozen share measured on ``n`` elements over the binomial one's (>= 1): from the
    mean squared difference of the last :data:`NOISE_POINTS` points (a slow trend adds little)."""
    x = values[-NOISE_POINTS:]
    binomial = sum(v * (1 - v) for v in x) / max(1, len(x)) / n
    if len(x) < 3 or binomial <= 0:
        return 1.0
    return max(1.0, math.sqrt(sum((b - a) ** 2 for a, b in zip(x, x[1:])) / (2 * (len(x) - 1)) / binomial))


def _below(share: float, level: float, n: int, spread: float) -> float:
    """The chance that a step leaves fewer than ``level`` of ``n`` elements frozen when ``share`` are on average: the
    moving count, normal with the binomial variance times ``spread ** 2``, reaches ``floor(n (1 - level)) + 1``."""
    first = math.floor(n * (1 - level) + 1e-9) + 1
    mean, var = n * (1 - share), spread * spread * n * share * (1 - share)
    if var <= 0:
        return 1.0 if mean >= first else 0.0
    return 0.5 * math.erfc((first - 0.5 - mean) / math.sqrt(2 * var))


def _median(steps: List[int], past: List[float], future: List[int], dips: List[float], level: float,
            q: float = 0.5) -> Optional[int]:
    """The first step ``s`` with P(no point from ``s`` on below ``level``) >= q, the measured ``past`` known, the
    points ahead below it with the chances ``dips`` (independent); None: not within the run."""
    clear = [1.0] * (len(future) + 1)      # clear[i]: no point from future[i] on below the level
    for i in range(len(future) - 1, -1, -1):
        clear[i] = clear[i + 1] * (1 - dips[i])
    last_dip = max((i for i, v in enumerate(past) if not v >= level), default=-1)
    if clear[0] >= q and last_dip + 1 < len(past):
        return steps[last_dip + 1]
    return next((s for s, c in zip(future, clear) if c >= q), None)


def passage_steps(watch, fmt, relative: float, total_steps: Optional[int] = None,
                  schedule: Optional[Dict[int, List[float]]] = None) -> tuple:
    """:func:`forecast`'s relative forecast, and the curves ahead. The sources of error it bands: the share's
    step-to-step noise (binomial on the followed elements times the spread it had over the last
    :data:`NOISE_POINTS` watched steps: when the last dip below the level comes, the median taken), and the
    ratio's tail the level sits in, resolved by few elements (``m``: those above the level; with the ratio trend's
    noise and the histogram's eighth-octave bins): the band's curves shift the ratio by ``a + b / sqrt(m)`` octaves
    (:data:`BAND_OCTAVES`, calibrated on the design runs). The schedule is read ahead exactly."""
    rec, counts = watch.record(fmt), dict(zip(watch.tracked, watch.tracker.sample.counts))
    counts["overall"] = sum(counts.values())
    point = forecast_curves(watch, fmt, total_steps, schedule=schedule)
    levels = {}
    for n in ["overall", *watch.tracked]:
        past = rec.overall if n == "overall" else rec.by_tensor[n]
        k = min(BASE_POINTS, len(past))
        base = min([sum(past[i - k + 1:i + 1]) / k for i in range(k - 1, len(past))] + list(point[n].values()))
        levels[n] = (base, min(1.0, base + relative * (1 - base)))
    a, b = BAND_OCTAVES
    delta = [a + b / math.sqrt(max(0.25, counts[n] * (1 - levels[n][1]))) for n in watch.tracked]
    ahead = [point] + [forecast_curves(watch, fmt, total_steps, schedule=schedule, offsets=[sign * d for d in delta])
                       for sign in (1.0, -1.0)]
    rows = {}
    for n in ["overall", *watch.tracked]:
        past = rec.overall if n == "overall" else rec.by_tensor[n]
        (base, level), spread = levels[n], _spread(past, counts[n])
        edges = []
        for curve in ahead:
            future = [s for s in sorted(curve[n]) if s % watch.every == 0]      # the watched steps ahead
            edges.append(_median(watch.steps, past, future, [_below(curve[n][s], level, counts[n], spread)
                                                             for s in future], level))
        known = [x for x in edges if x is not None]
        rows[n] = {"step": edges[0], "low": min(known, default=None), "high": None if None in edges else max(known),
                   "level": level, "base": base}
    whole = rows.pop("overall")
    return {"overall": whole["step"], "low": whole["low"], "high": whole["high"], "relative": relative,
            "level": whole["level"], "base": whole["base"], "by_tensor": rows}, point


def freeze_steps(watch, rec: FreezeRecord, curves: Dict[str, Dict[int, float]], tau: float) -> Dict[str, object]:
    """The freeze step (:func:`~lowprec_demo.freeze.records.freeze_step`) over the record's points
    followed by the curves ahead, overall and per tensor."""

    def step_of(past: List[float], ahead: Dict[int, float]) -> Optional[int]:
        points = list(zip(watch.steps, past)) + sorted(ahead.items())
        i = freeze_step([v for _, v in points], tau)
        return None if i is None else points[i][0]

    return {"overall": step_of(rec.overall, curves["overall"]),
            "by_tensor": {n: step_of(rec.by_tensor[n], curves[n]) for n in watch.tracked}}
