"""A freeze watch for your own training: which stored weights cannot move, and when they will stop.

It goes on any model and ``torch.optim`` optimizer, through the optimizer's step hooks::

    watch = lowprec_demo.watch(model, optimizer, formats=("bf16",), scheduler=scheduler, total_steps=T)
    ...                          # train as usual
    watch.summary()              # tensor, size, format, frozen now, since, forecast
    watch.diagnoses()            # what cannot move, and why, in plain words

It follows every element of a tensor of up to ``sample`` and an evenly strided sample of a larger one
(:mod:`~lowprec_demo.freeze.sampling`), so that it costs a small part of a step. Its mode comes from the parameters'
storage. *prediction*, for float32 (or float64) parameters: per format, the fraction of each tensor round to nearest
would leave in place (``q(q(w) + d) == q(w)``), the fraction stochastic rounding would move, and the
``|d| / (lr gap)`` the forecast reads. *observation*, for low-precision parameters (a low-precision dtype, or a
``LowPrecisionOptimizer``'s grid): the fraction the step left bit for bit the same, *frozen* (with a gradient) or
*idle* (without); under AdamW, Adam or SGD also the update the optimizer meant, read from its state
(:mod:`~lowprec_demo.monitor.intended`), for prediction's histograms of the stored format (forecast and plan) and
``expected_record``, the frozen fraction it predicts, and ``kept[fmt]`` (:mod:`~lowprec_demo.monitor.kept`), the share
of it the stored weights took: under a fix (stochastic rounding, Kahan, master copies) a weight far below its gap moves
at few steps, so the frozen share stays high, but the kept share goes from about 0 to about 1. Under FSDP2 one
``all_reduce`` per step adds the counts. Copies, counts, records: :class:`~lowprec_demo.freeze.tracker.FreezeTracker`.

Example:
    >>> import torch, lowprec_demo as lp
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    >>> with lp.watch(model, opt, formats=("bf16",), progress=False) as w:
    ...     for _ in range(3):
    ...         opt.zero_grad(); model(torch.ones(8, 4)).pow(2).mean().backward(); opt.step()
    >>> len(w.record("bf16").overall)
    3
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from lowprec_demo.common.output import progress_bar
from lowprec_demo.formats import FloatFormat, format_of_dtype, get_format
from lowprec_demo.freeze.counts import histograms
from lowprec_demo.freeze.records import FreezeRecord, freeze_step
from lowprec_demo.freeze.sampling import ShardedSample
from lowprec_demo.freeze.tracker import FreezeTracker
from lowprec_demo.monitor import forecast as watch_forecast
from lowprec_demo.monitor.intended import unsupported
from lowprec_demo.monitor.kept import KeptRecord, observe_step
from lowprec_demo.monitor.diagnoses import Diagnosis, diagnose, state_counters
from lowprec_demo.monitor.forecast import RatioHistograms, check_schedule, schedule_length, unwrap_scheduler
from lowprec_demo.monitor.planning import make_plan
from lowprec_demo.monitor.report import WatchReport, jsonable, no_step_yet, report_data, save_report, watch_format
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.optim.plan import CLASSIC_REMEDIES, FreezePlan
from lowprec_demo.rounding import freeze_rule, round_to_grid

__all__ = ["watch", "FreezeWatch", "check_watch_options"]


def _check_count(value, message: str, none: bool = False, bools: bool = False) -> None:
    """Raise ValueError(message) unless ``value`` is a whole number >= 1 (or None, a bool, if allowed)."""
    if (not isinstance(value, int) or (isinstance(value, bool) and not bools) or value < 1) \
            and not (none and value is None):
        raise ValueError(message)


def _inner(optimizer):
    """The optimizer behind wrappers (accelerate's); a LowPrecisionOptimizer, which rounds, is kept."""
    while (not isinstance(optimizer, LowPrecisionOptimizer)
           and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        optimizer = optimizer.optimizer
    return optimizer


UNKNOWN_RUN = 1000     # watched steps taken for a run of unknown length, when deciding to compile up front
COMPILE_STEPS = 2000   # a run with this many watched steps ahead compiles up front whatever its size (see below)
SAMPLE = 1 << 10       # the elements followed per tensor by default (costs and accuracy: :func:`watch`)


def _compile_up_front(old: torch.Tensor, formats: Sequence[FloatFormat], steps_left: Optional[int]) -> bool:
    """Whether to compile the kernel at the first watched step: ``"auto"`` mode compiles once the eager work reaches
    :data:`~lowprec_demo.rounding.round_to_grid.EAGER_BUDGET` elements, on a large model a silent pause part way
    through the run; when the steps left (``None``: :data:`UNKNOWN_RUN`) would reach it, compile now and say so. A run
    of :data:`COMPILE_STEPS` watched steps or more compiles up front too: the eager kernel's fifty-odd calls cost
    milliseconds a step whatever the sample, more over such a run than the compile's seconds."""
    if round_to_grid.get_mode() != "auto" or not any(freeze_rule.fits(old, f) for f in formats):
        return False
    left = UNKNOWN_RUN if steps_left is None else steps_left
    if old.numel() * left <= round_to_grid.EAGER_BUDGET and left < COMPILE_STEPS:
        return False
    print(f"freeze watch: compiling its kernel now, once per process (seconds), for {left:,} watched steps of "
          f"{old.numel():,} elements", file=sys.stderr, flush=True)
    return True


def check_watch_options(formats: Sequence = ("bf16",), every: int = 1, threshold: float = 0.5,
                        total_steps: Optional[int] = None, patience: int = 10, save_every: int = 100, writer=None,
                        sample: Optional[int] = SAMPLE, progress: bool = False) -> List[FloatFormat]:
    """Check :func:`watch`'s options without a model (what a trainer callback does when it is made): one ValueError or
    TypeError naming the value given and the ones allowed; returns the formats."""
    _check_count(every, f"every must be a whole number of steps >= 1, got {every!r}")
    if not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
    _check_count(sample, f"sample must be a whole number of elements per tensor >= 1, or None (all), got "
                         f"{sample!r}", none=True)
    _check_count(patience, f"patience must be a whole number of watched steps >= 1, got {patience!r}", bools=True)
    _check_count(save_every, f"save_every must be a whole number of watched steps >= 1, got {save_every!r}")
    _check_count(total_steps, f"total_steps must be the run's length, a whole number of optimizer steps >= 1, or "
                              f"None; got {total_steps!r}", none=True)
    if writer is not None and not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(f"writer must be a TensorBoard SummaryWriter (anything with add_scalar), got "
                        f"{type(writer).__name__}")
    single = isinstance(formats, (str, FloatFormat, torch.dtype))
    given = [watch_format(f) for f in ([formats] if single else formats)]   # a ValueError names them
    return given


class FreezeWatch:
    """What :func:`watch` returns (the arguments are its own): the hooks, the measurements and the answers. ``mode``
    is ``"predict"`` or ``"observe"``, ``formats`` the records' format names, ``steps`` the optimizer step of every
    watched point (0-based), ``names`` and ``sizes`` the optimizer's non-empty parameters in order (``params`` by
    name, ``group_of`` their param group), ``tracked`` those watched, ``groups`` them by kind (``"vectors"``,
    ``"embeddings"``, ``"matrices"``), ``no_forecast`` why no forecast or plan can be made (None: they can).
    Measured step by step: ``records``, ``idle`` and ``frozen_with_grad`` per tensor, ``lrs``, ``ratios`` (the
    forecast's histograms and trend), ``rows_seen`` (per embedding, the rows with a gradient), ``counters`` (float
    optimizer-state counters: ``{(tensor, key): (value, steps stuck)}``), ``kept`` (observation with the update meant:
    a :class:`~lowprec_demo.monitor.kept.KeptRecord` per format; else empty); ``tracker``: copies and counts."""

    def __init__(self, model: torch.nn.Module, optimizer, formats: Sequence = ("bf16",), scheduler=None,
                 every: int = 1, threshold: float = 0.5, total_steps: Optional[int] = None,
                 patience: int = 10, path=None, save_every: int = 100, writer=None,
                 progress: bool = False, sample: Optional[int] = SAMPLE) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        given = check_watch_options(formats, every, threshold, total_steps, patience, save_every, writer, sample)
        self.optimizer = _inner(optimizer)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        other = getattr(self.optimizer, "_freeze_watch", lambda: None)()
        if other is not None and other._handles and other.optimizer is self.optimizer:
            warnings.warn(f"this {type(self.optimizer).__name__} has a freeze watch attached already: a second one "
                          f"copies and compares every step again; use the first (formats=... covers several formats), "
                          f"or detach() it before watching again", UserWarning, stacklevel=3)
        check_schedule(scheduler)
        self.scheduler = unwrap_scheduler(scheduler)
        self.every, self.threshold, self.patience = every, float(threshold), patience
        self.total_steps = total_steps if total_steps is not None else schedule_length(self.scheduler)
        names = {id(p): n for n, p in model.named_parameters()}
        self.params: Dict[str, torch.nn.Parameter] = {}
        self.group_of: Dict[str, int] = {}   # the index of each one's param group
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the "
                                     f"model's; pass the model whose parameters the optimizer trains")
                if not p.is_floating_point():
                    raise ValueError(f"{names[id(p)]} has dtype {p.dtype}: the watch tracks floating-point parameters "
                                     f"only")
                if p.numel():       # (an empty one: nothing to watch)
                    self.params[names[id(p)]], self.group_of[names[id(p)]] = p, gi
        if not self.params:
            raise ValueError("the optimizer has no parameters to watch")
        if not any(p.requires_grad for p in self.params.values()):
            warnings.warn(f"none of the {len(self.params)} parameters the optimizer holds requires grad, so none "
                          f"will get a gradient and nothing will train: the watch will see every tensor idle. Set "
                          f"requires_grad=True on the ones to train (e.g. model.requires_grad_()), or give the "
                          f"optimizer those that do", UserWarning, stacklevel=3)
        self.names, self.sizes = list(self.params), {n: p.numel() for n, p in self.params.items()}
        # observation: parameters in a low-precision dtype, or on the grid of a LowPrecisionOptimizer
        on_grid = {id(p) for p in self.optimizer.lowprec_params} if isinstance(self.optimizer, LowPrecisionOptimizer) else set()
        stored = {n: get_format(format_of_dtype(p.dtype)) if format_of_dtype(p.dtype) else self.optimizer.fmt
                  for n, p in self.params.items() if format_of_dtype(p.dtype) or id(p) in on_grid}
        self.mode = "observe" if stored else "predict"
        if self.mode == "predict" and not given:
            raise ValueError("give at least one format to predict, e.g. formats=('bf16',)")
        self.tracked = list(stored) if self.mode == "observe" else list(self.names)
        #: the formats stored in (observation) or predicted (prediction)
        self.tracker = FreezeTracker({n: self.params[n] for n in self.tracked}, given, stored_in=stored or None,
                                     sample=sample)
        self.stored_formats: List[FloatFormat] = (list(dict.fromkeys(stored.values())) if stored
                                                  else self.tracker.formats)
        self.records = self.tracker.records
        self.formats = list(self.records)
        # observation: why no forecast can be made (None: it can), and the frozen fraction the meant update predicts
        self.no_forecast = None if self.mode == "predict" else unsupported(self.optimizer) or (
            None if len(self.formats) == 1 else f"a forecast of parameters stored in low precision needs one storage "
            f"format; this watch observes {', '.join(self.formats)}")
        self.expected = {} if self.no_forecast or self.mode == "predict" else {
            f: FreezeRecord(format=f, kind="predicted") for f in self.formats}
        self.kept: Dict[str, KeptRecord] = {f: KeptRecord(f) for f in self.expected}   # (the update meant: known)
        self.steps, self.lrs = [], []          # per watched step: the step, the lr per param group
        self.idle = {n: [] for n in self.tracked}                # per watched step: the fraction with no gradient,
        self.frozen_with_grad = {n: [] for n in self.tracked}    # and the fraction frozen with one
        self.rows_seen: Dict[str, torch.Tensor] = {}
        self._embeddings = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
                            if isinstance(mod, torch.nn.Embedding)} & set(self.tracked)
        self.ratios = RatioHistograms()
        self.sharded = isinstance(self.tracker.sample, ShardedSample)
        self.groups: Dict[str, List[str]] = {}
        for n in self.tracked:
            kind = "vectors" if self.params[n].dim() < 2 else "embeddings" if any(
                k in n for k in ("emb", "wte", "wpe")) else "matrices"
            self.groups.setdefault(kind, []).append(n)
        self.counters: Dict[tuple, tuple] = {}
        self._step = 0
        self.path, self._save_every, self._writer = path, save_every, writer
        self._save_warned = self._compile_checked = False
        self._bar = progress_bar(range(self.total_steps or 0), desc="freeze watch", disable=not progress) \
            if progress else None
        self._handles = [self.optimizer.register_step_pre_hook(self.before_step),
                         self.optimizer.register_step_post_hook(self.after_step)]
        self.optimizer._freeze_watch = weakref.ref(self)     # (one watch per optimizer)

    @torch.no_grad()
    def before_step(self, optimizer=None, args=(), kwargs=None) -> None:
        """Copy the followed elements before a watched step (the step pre-hook; after it, :meth:`after_step`)."""
        if self._step % self.every:
            return
        self.tracker.before_step()
        self._lr_now = [float(g["lr"]) for g in self.optimizer.param_groups]

    @torch.no_grad()
    def after_step(self, optimizer=None, args=(), kwargs=None) -> None:
        """Compare the tracked parameters with their copies: one point of every record."""
        step, self._step = self._step, self._step + 1
        if self._bar is not None and hasattr(self._bar, "update"):
            self._bar.update(1)
        if step % self.every:
            self._watch_counters()
            return
        self.steps.append(step)
        self.lrs.append(self._lr_now)
        names, sample, old, new = self.tracker.compare()
        params = [self.params[n] for n in self.tracked]
        grad = sample.grads(params)
        # rows that had a gradient, in full: an embedding's unused rows
        row_names = [n for n in self._embeddings if self.params[n].grad is not None]
        rows = [sample.row_flags(self.params[n], self.params[n].grad) for n in row_names]
        if self.mode == "observe":     # (with the update meant: the frozen share it predicts, and the kept share)
            rows = observe_step(self, names, sample, params, old, new, grad, rows)
        else:
            rows = self._predict(sample, old, new, grad, self.records, rows)
        for n, seen in zip(row_names, rows):
            seen = seen if seen.dtype == torch.bool else seen > 0
            self.rows_seen[n] = seen if n not in self.rows_seen else self.rows_seen[n] | seen
        self._watch_counters()
        if self._writer is not None:
            for f in self.formats:
                for key, rec in [("frozen", self.records[f])] + [("kept", self.kept.get(f))] * (f in self.kept):
                    self._writer.add_scalar(f"freeze/{f}/{key}", rec.overall[-1], step)
                for group, members in self.groups.items():
                    value = sum(self.records[f].by_tensor[n][-1] * self.sizes[n] for n in members)
                    self._writer.add_scalar(f"freeze/{f}/{group}", value / sum(self.sizes[n] for n in members), step)
        if self._bar is not None and hasattr(self._bar, "set_postfix_str"):
            self._bar.set_postfix_str(", ".join(f"{f} frozen {self.records[f].overall[-1]:.2f}" for f in self.formats))
        if self.path is not None and len(self.steps) % self._save_every == 0:
            self._save_quietly()

    def _predict(self, sample, old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor,
                 records: Dict[str, FreezeRecord], rows=()) -> List[torch.Tensor]:
        """Prediction's point of each format's record for the update ``new - old`` and the forecast's histograms of
        ``|d| / (lr gap)`` (and the idle fractions, into ``self.records``); returns ``rows`` reduced with the counts."""
        same = all(lr == self._lr_now[0] for lr in self._lr_now)    # one learning rate: one value for all
        lrs = torch.tensor(self._lr_now[:1] if same else [self._lr_now[self.group_of[n]] for n in self.tracked],
                           dtype=torch.float64)
        log_lr = torch.log2(lrs.clamp(min=1e-300)).to(torch.float32).to(new.device)
        left = None if self.total_steps is None else -(-max(0, self.total_steps - self.steps[-1]) // self.every)
        compile_now = not self._compile_checked and _compile_up_front(old, self.stored_formats, left)   # the first
        self._compile_checked = True
        per_format, rows = self.tracker.count_predicted(self.tracked, sample, old, new, self.stored_formats, records,
                                                        grad, log_lr.reshape(()) if same else log_lr, rows,
                                                        compile_now)
        for fmt, (bins, _) in zip(self.stored_formats, per_format):
            self.ratios.add(fmt.name, self.steps[-1], histograms(bins))
        if records is self.records:      # (tensor, frozen, gradient) of the first format
            flags = per_format[0][1]
            self._add_idle(*torch.stack([flags[:, :, 0].sum(1), flags[:, 1, 1]]).double().tolist())
        return rows

    def _add_idle(self, idle: List[float], frozen_grad: List[float]) -> None:
        for j, n in enumerate(self.tracked):
            self.idle[n].append(idle[j] / self.tracker.sample.counts[j])
            self.frozen_with_grad[n].append(frozen_grad[j] / self.tracker.sample.counts[j])

    def _watch_counters(self) -> None:
        """Optimizer-state counters (``step``) held in a float format: do they still count?"""
        for key, v in state_counters(self.optimizer, {n: self.params[n] for n in self.tracked}).items():
            last, stuck = self.counters.get(key, (None, 0))
            self.counters[key] = (v, stuck + (last == v))   # (a float, never None)

    def _save_quietly(self) -> None:
        """Save to ``path``; a failure is a warning (once), not the end of the run."""
        try:
            self.save(self.path)
        except OSError as error:
            if not self._save_warned:
                self._save_warned = True
                warnings.warn(f"{error}; training goes on and the watch keeps its measurements: call "
                              f"watch.save(other_path) to write them elsewhere", RuntimeWarning, stacklevel=2)

    def detach(self) -> "FreezeWatch":
        """Remove the hooks (the measurements stay); save the report to ``path`` if given."""
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._bar is not None and hasattr(self._bar, "close"):
            self._bar.close()
        if self.path is not None:
            self._save_quietly()
        return self

    def __enter__(self) -> "FreezeWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def record(self, fmt=None) -> FreezeRecord:
        """The :class:`~lowprec_demo.freeze.records.FreezeRecord` of a format (a name, a FloatFormat or the torch
        dtype that stores it; the first when None)."""
        return self.tracker.record(None if fmt is None else watch_format(fmt))

    def expected_record(self, fmt=None) -> FreezeRecord:
        """Observation: the record (kind ``"predicted"``) of the frozen fraction the update meant predicts by the rule
        ``q(w + d) == w``, watched step by watched step beside :meth:`record`'s observed one."""
        if not self.expected:
            raise ValueError(self.no_forecast or f"expected_record() is observation's (parameters stored in low "
                             f"precision); this watch predicts {', '.join(self.formats)}: record() holds that")
        return self.expected[self.record(fmt).format]

    def frozen_since(self, fmt=None, threshold: Optional[float] = None) -> Dict[str, Optional[int]]:
        """The step from which each tensor and ``"overall"`` stayed at or above the threshold."""
        rec, tau = self.record(fmt), self.threshold if threshold is None else threshold
        found = {name: freeze_step(values, tau) for name, values in [("overall", rec.overall), *rec.by_tensor.items()]}
        return {name: None if i is None else self.steps[i] for name, i in found.items()}

    def forecast(self, fmt=None, threshold: Optional[float] = None, total_steps: Optional[int] = None,
                 curves: bool = False, relative="auto") -> Dict[str, object]:
        """When the model and each tensor will pass the threshold, with a band
        (:func:`lowprec_demo.monitor.forecast.forecast`; ``curves=True`` adds the frozen fraction ahead), computed
        when asked. Where the run started at or above the threshold (a bf16 fine-tune) and no ``threshold`` is given,
        ``relative="auto"``: when each tensor passes 90 % of the way from its least frozen share to all frozen (its band
        held 87 % of held-out cases, 72 % asked at the warmup's end); ``relative=None``: the threshold's always."""
        no_step_yet(self, "forecast()")
        return watch_forecast.forecast(self, fmt, threshold, total_steps, curves, relative)

    def plan(self, fmt=None, budget: float = 1.0, threshold: Optional[float] = None,
             total_steps: Optional[int] = None, kahan_format="auto", remedies=CLASSIC_REMEDIES) -> FreezePlan:
        """A remedy per tensor for ``LowPrecisionOptimizer(..., plan=)``
        (:func:`~lowprec_demo.monitor.planning.make_plan`)."""
        return make_plan(self, fmt, budget, threshold, total_steps, kahan_format, remedies)

    def diagnoses(self) -> List[Diagnosis]:
        """What cannot move, and why (:func:`~lowprec_demo.monitor.diagnoses.diagnose`)."""
        no_step_yet(self, "diagnoses()")
        return diagnose(self)

    def report(self) -> WatchReport:
        """The report as it stands (:class:`~lowprec_demo.monitor.report.WatchReport`: ``summary()``, ``plot()``,
        ``data``), the same as a saved one read back."""
        return WatchReport(jsonable(report_data(self)))

    def summary(self, fmt=None, show: bool = True) -> str:
        """The report's table (:meth:`WatchReport.summary`), printed unless ``show=False``, and returned."""
        return self.report().summary(None if fmt is None else watch_format(fmt), show=show)

    def save(self, path, plan=None) -> None:
        """Write the report to ``path`` as JSON (:func:`lowprec_demo.monitor.report.save_report`), with ``plan`` (a
        FreezePlan or its JSON's path), the plan the run applied, that ``lp.load_watch(path).plan`` gives back."""
        save_report(self, path, plan)


def watch(model: torch.nn.Module, optimizer, formats: Sequence = ("bf16",), scheduler=None, every: int = 1,
          threshold: float = 0.5, total_steps: Optional[int] = None, patience: int = 10, path=None,
          save_every: int = 100, writer=None, progress: bool = False, sample: Optional[int] = SAMPLE) -> FreezeWatch:
    """Watch a training run for weights that cannot move. ``formats``: to predict for float32
    parameters, names or the torch dtypes that store them; ``scheduler``: a torch scheduler, a callable step -> lr, the
    list of learning rates or None (constant); one step in ``every`` watched; ``threshold``: the frozen fraction of a
    freeze step; ``total_steps``: the run's length where the schedule does not say it; ``patience``: watched steps held
    before a diagnosis; ``path``: the report, saved every ``save_every`` watched steps and on ``detach()``; ``writer``:
    a TensorBoard ``SummaryWriter``; ``progress``: a progress bar; ``sample``: the elements followed per tensor at most
    (None: all). Options are checked here, so a mistake ends the call, not a run part way.

    Cost at the defaults (``benchmarks/cpu-2026-12-06-costs.md``, AMD EPYC, one thread), float32 / bf16: x1.05 / 1.12
    a step on a 1.0M GPT, x1.01 / 1.22 on 5.2M Linear (10-22 ms steps), x1.00 / 1.25 on 29.4M; ``every=k`` divides the
    extra by k. Sample 1,024: a tensor's frozen share within 0.6-0.7 % of every element's (mean; max 5.7 %)."""
    return FreezeWatch(model, optimizer, formats, scheduler, every, threshold, total_steps, patience, path,
                       save_every, writer, progress, sample)
