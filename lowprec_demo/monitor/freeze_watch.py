"""A freeze watch for your own training: which stored weights cannot move, and when they will stop.

It goes on any model and ``torch.optim`` optimizer, through the optimizer's step hooks::

    watch = lowprec_demo.watch(model, optimizer, formats=("bf16",), scheduler=scheduler, total_steps=T)
    ...                          # train as usual
    watch.summary()              # tensor, size, format, frozen now, since, forecast
    watch.diagnoses()            # what cannot move, and why, in plain words

It follows every element of a tensor of up to ``sample`` and an evenly strided sample of a larger one
(:mod:`~lowprec_demo.monitor.sampling`), so that it costs a small part of a step. Its mode comes from the parameters'
storage. *prediction*, for float32 (or float64) parameters: per format, the fraction of each tensor round to nearest
would leave in place (``q(q(w) + d) == q(w)``), the fraction stochastic rounding would move, and the
``|d| / (lr gap)`` the forecast reads. *observation*, for low-precision parameters (a low-precision dtype, or a
``LowPrecisionOptimizer``'s grid): the fraction the step left bit for bit the same, *frozen* (with a gradient) or
*idle* (without); under AdamW, Adam or SGD also the update the optimizer meant, read from its state
(:mod:`~lowprec_demo.monitor.intended`), for prediction's histograms of the stored format (forecast and plan) and
``expected_record``, the frozen fraction it predicts. Under FSDP2 one ``all_reduce`` per step adds the counts.

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

import warnings
from typing import Dict, List, Optional, Sequence

import torch

from lowprec_demo.common.output import progress_bar
from lowprec_demo.formats import FloatFormat, format_of_dtype, get_format
from lowprec_demo.freeze.records import FreezeRecord, freeze_step
from lowprec_demo.monitor import forecast as watch_forecast
from lowprec_demo.monitor import sampling
from lowprec_demo.monitor.intended import intended_update, unsupported
from lowprec_demo.monitor.counting import (add_point, compile_up_front, observed_counts, predicted_counts,
                                           state_counters)
from lowprec_demo.monitor.diagnoses import Diagnosis, diagnose
from lowprec_demo.monitor.forecast import RatioHistograms, RatioTrend, check_schedule, schedule_length, unwrap_scheduler
from lowprec_demo.monitor.report import WatchReport, jsonable, report_data, save_report, watch_format
from lowprec_demo.optim import sharding
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.optim.plan import CLASSIC_REMEDIES, FreezePlan, make_plan

__all__ = ["watch", "FreezeWatch"]


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


class FreezeWatch:
    """What :func:`watch` returns (the arguments are its own): the hooks, the measurements and the answers. ``mode``
    is ``"predict"`` or ``"observe"``, ``formats`` the records' format names, ``steps`` the optimizer step of every
    watched point (0-based), ``names`` and ``sizes`` the optimizer's non-empty parameters in order, ``no_forecast``
    why no forecast or plan can be made (None: they can)."""

    def __init__(self, model: torch.nn.Module, optimizer, formats: Sequence = ("bf16",), scheduler=None,
                 every: int = 1, threshold: float = 0.5, total_steps: Optional[int] = None,
                 patience: int = 10, path=None, save_every: int = 100, writer=None,
                 progress: bool = False, sample: Optional[int] = 1 << 14) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
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
        self.formats_given = [watch_format(f) for f in ([formats] if single else formats)]   # a ValueError names them
        self.optimizer = _inner(optimizer)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_schedule(scheduler)
        self.scheduler = unwrap_scheduler(scheduler)
        self.every, self.threshold, self.patience = every, float(threshold), patience
        self.total_steps = total_steps if total_steps is not None else schedule_length(self.scheduler)
        names = {id(p): n for n, p in model.named_parameters()}
        self._params: Dict[str, torch.nn.Parameter] = {}
        self._group: Dict[str, int] = {}   # the index of each one's param group
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the "
                                     f"model's; pass the model whose parameters the optimizer trains")
                if not p.is_floating_point():
                    raise ValueError(f"{names[id(p)]} has dtype {p.dtype}: the watch tracks floating-point parameters "
                                     f"only")
                if p.numel():       # (an empty one: nothing to watch)
                    self._params[names[id(p)]], self._group[names[id(p)]] = p, gi
        if not self._params:
            raise ValueError("the optimizer has no parameters to watch")
        if not any(p.requires_grad for p in self._params.values()):
            warnings.warn(f"none of the {len(self._params)} parameters the optimizer holds requires grad, so none "
                          f"will get a gradient and nothing will train: the watch will see every tensor idle. Set "
                          f"requires_grad=True on the ones to train (e.g. model.requires_grad_()), or give the "
                          f"optimizer those that do", UserWarning, stacklevel=3)
        self.names, self.sizes = list(self._params), {n: p.numel() for n, p in self._params.items()}
        # observation: parameters in a low-precision dtype, or on the grid of a LowPrecisionOptimizer
        on_grid = {id(p) for p in self.optimizer.lowprec_params} if isinstance(self.optimizer, LowPrecisionOptimizer) else set()
        self._formats = {n: get_format(format_of_dtype(p.dtype)) if format_of_dtype(p.dtype) else self.optimizer.fmt
                         for n, p in self._params.items() if format_of_dtype(p.dtype) or id(p) in on_grid}
        self.mode = "observe" if self._formats else "predict"
        if self.mode == "predict" and not self.formats_given:
            raise ValueError("give at least one format to predict, e.g. formats=('bf16',)")
        self.tracked = list(self._formats) if self.mode == "observe" else list(self.names)
        self.formats = list(dict.fromkeys(f.name for f in self._formats.values())) if self.mode == "observe" else [
            f.name for f in self.formats_given]
        self.records = {f: FreezeRecord(format=f, kind="predicted" if self.mode == "predict" else "observed")
                        for f in self.formats}
        # observation: why no forecast can be made (None: it can), and the frozen fraction the meant update predicts
        self.no_forecast = None if self.mode == "predict" else unsupported(self.optimizer) or (
            None if len(self.formats) == 1 else f"a forecast of parameters stored in low precision needs one storage "
            f"format; this watch observes {', '.join(self.formats)}")
        self.expected = {} if self.no_forecast or self.mode == "predict" else {
            f: FreezeRecord(format=f, kind="predicted") for f in self.formats}
        self.steps, self.lrs = [], []          # per watched step: the step, the lr per param group
        self.idle = {n: [] for n in self.tracked}                # per watched step: the fraction with no gradient,
        self.frozen_with_grad = {n: [] for n in self.tracked}    # and the fraction frozen with one
        self._rows_seen: Dict[str, torch.Tensor] = {}
        self._embeddings = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
                            if isinstance(mod, torch.nn.Embedding)} & set(self.tracked)
        self._ratios = RatioHistograms()
        self._before = self._after = None      # the followed elements before and after a step
        followed = [self._params[n] for n in self.tracked]
        self.sharded = sharding.any_sharded(followed)     # FSDP2's DTensor parameters
        self._plan = (sampling.ShardedSamplePlan if self.sharded else sampling.SamplePlan)(followed, sample)
        self._groups: Dict[str, List[str]] = {}
        for n in self.tracked:
            kind = "vectors" if self._params[n].dim() < 2 else "embeddings" if any(
                k in n for k in ("emb", "wte", "wpe")) else "matrices"
            self._groups.setdefault(kind, []).append(n)
        self._step, self._state_values, self._stuck_counters = 0, {}, {}
        self.path, self.save_every, self.writer = path, save_every, writer
        self._save_warned = self._compile_checked = False
        self._bar = progress_bar(range(self.total_steps or 0), desc="freeze watch", disable=not progress) \
            if progress else None
        self._handles = [self.optimizer.register_step_pre_hook(self.before_step),
                         self.optimizer.register_step_post_hook(self.after_step)]

    @torch.no_grad()
    def before_step(self, optimizer=None, args=(), kwargs=None) -> None:
        """Copy the followed elements before a watched step (the step pre-hook; after it, :meth:`after_step`)."""
        if self._step % self.every:
            return
        self._before = self._plan.gather_params([self._params[n] for n in self.tracked], self._before)   # a copy
        self._lr_now = [float(g["lr"]) for g in self.optimizer.param_groups]

    @torch.no_grad()
    def after_step(self, optimizer=None, args=(), kwargs=None) -> None:
        """Compare the tracked parameters with their copies: one point of every record."""
        step, self._step = self._step, self._step + 1
        if self._bar is not None and hasattr(self._bar, "update"):
            self._bar.update(1)
        if step % self.every:
            self._watch_counters(step)
            return
        self.steps.append(step)
        self.lrs.append(self._lr_now)
        plan, params = self._plan, [self._params[n] for n in self.tracked]
        new = self._after = plan.gather_params(params, self._after)   # a copy, into the buffer of the last step
        grad = plan.grads(params)
        # rows that had a gradient, in full: an embedding's unused rows
        row_names = [n for n in self._embeddings if self._params[n].grad is not None]
        rows = [plan.row_flags(self._params[n], self._params[n].grad) for n in row_names]
        if self.mode == "observe":
            parts, *rows = plan.reduce([observed_counts(plan, self._before, new, grad), *rows])
            self._add_rows(row_names, rows)
            idle, same, frozen_grad = parts.tolist()                  # one transfer
            self._add_idle(idle, frozen_grad)
            names = list(dict.fromkeys(self._formats[n].name for n in self.tracked))
            self._append(self.records, {f: [(n, same[j], plan.counts[j], None) for j, n in enumerate(self.tracked)
                                            if self._formats[n].name == f] for f in names})
            if self.expected:      # the update meant, by prediction's rule at the stored weights
                old = self._before.float()
                d = intended_update(self.optimizer, plan, params, [self._lr_now[self._group[n]] for n in self.tracked],
                                    old, grad)
                self._predict(plan, old, (old.double() + d).float(), grad.float(), self.stored_formats(), self.expected)
        else:
            rows = self._predict(plan, self._before, new, grad, self.formats_given, self.records, rows)
            self._add_rows(row_names, rows)
        self._watch_counters(step)
        if self.writer is not None:
            for f in self.formats:
                self.writer.add_scalar(f"freeze/{f}/frozen", self.records[f].overall[-1], step)
                for group, members in self._groups.items():
                    value = sum(self.records[f].by_tensor[n][-1] * self.sizes[n] for n in members)
                    self.writer.add_scalar(f"freeze/{f}/{group}", value / sum(self.sizes[n] for n in members), step)
        if self._bar is not None and hasattr(self._bar, "set_postfix_str"):
            self._bar.set_postfix_str(", ".join(f"{f} frozen {self.records[f].overall[-1]:.2f}" for f in self.formats))
        if self.path is not None and len(self.steps) % self.save_every == 0:
            self._save_quietly()

    def _save_quietly(self) -> None:
        """Save to ``path``; a failure is a warning (once), not the end of the run."""
        try:
            self.save(self.path)
        except OSError as error:
            if not self._save_warned:
                self._save_warned = True
                warnings.warn(f"{error}; training goes on and the watch keeps its measurements: call "
                              f"watch.save(other_path) to write them elsewhere", RuntimeWarning, stacklevel=2)

    def _add_rows(self, names: List[str], rows: List[torch.Tensor]) -> None:
        for n, seen in zip(names, rows):
            seen = seen if seen.dtype == torch.bool else seen > 0
            self._rows_seen[n] = seen if n not in self._rows_seen else self._rows_seen[n] | seen

    def _add_idle(self, idle: List[float], frozen_grad: List[float]) -> None:
        for j, n in enumerate(self.tracked):
            self.idle[n].append(idle[j] / self._plan.counts[j])
            self.frozen_with_grad[n].append(frozen_grad[j] / self._plan.counts[j])

    def _predict(self, plan: "sampling.SamplePlan", old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor,
                 formats: List[FloatFormat], records: Dict[str, FreezeRecord], rows=()) -> List[torch.Tensor]:
        """Prediction's point of each format's record for the update ``new - old``, the forecast's histograms (and the
        idle fractions, into ``self.records``); returns ``rows`` reduced with the counts."""
        same = all(lr == self._lr_now[0] for lr in self._lr_now)    # one learning rate: one value for all
        lrs = torch.tensor(self._lr_now[:1] if same else [self._lr_now[self._group[n]] for n in self.tracked],
                           dtype=torch.float64)
        log_lr = torch.log2(lrs.clamp(min=1e-300)).to(torch.float32).to(new.device)
        left = None if self.total_steps is None else -(-max(0, self.total_steps - self.steps[-1]) // self.every)
        compile_now = not self._compile_checked and compile_up_front(old, formats, left)   # at the first
        self._compile_checked = True
        local = predicted_counts(plan, old, new, grad, formats, log_lr.reshape(()) if same else log_lr, compile_now)
        reduced = plan.reduce(local + list(rows))    # sharded: the counts of every process added, one all_reduce
        sums = []
        for i, fmt in enumerate(formats):
            hist, flags, moved_sums = reduced[3 * i:3 * i + 3]     # flags: (tensor, frozen, gradient)
            self._ratios.add(fmt.name, self.steps[-1], hist)
            sums.append(torch.stack([flags[:, 1].sum(1).double(), flags[:, 1, 1].double(),
                                     flags[:, :, 0].sum(1).double(), moved_sums]))
        values = torch.stack(sums).tolist()  # one transfer
        if records is self.records:
            self._add_idle(values[0][2], values[0][1])
        self._append(records, {fmt.name: [(n, frozen[j], plan.counts[j], moved[j]) for j, n in enumerate(self.tracked)]
                               for fmt, (frozen, _, _, moved) in zip(formats, values)})
        return reduced[len(local):]

    def _append(self, records: Dict[str, FreezeRecord], rows: Dict[str, list]) -> None:
        for f, items in rows.items():
            add_point(records[f], items, self.sizes, moves=records[f].kind == "predicted")

    def _watch_counters(self, step: int) -> None:
        """Optimizer-state counters (``step``) held in a float format: do they still count?"""
        for key, v in state_counters(self.optimizer, {n: self._params[n] for n in self.tracked}).items():
            if self._state_values.get(key) == v:   # (a float, never None)
                self._stuck_counters[key] = self._stuck_counters.get(key, 0) + 1
            self._state_values[key] = v

    def held_bytes(self) -> int:
        """The memory kept from step to step: copies of the followed elements, histograms, flags."""
        tensors = [t for t in (self._before, self._after) if t is not None] + list(self._rows_seen.values()) \
            + [self._plan.tensor_id]
        return sum(t.numel() * t.element_size() for t in tensors) + self._ratios.nbytes()

    def detach(self) -> "FreezeWatch":
        """Remove the hooks (the measurements stay); save the report to ``path`` if given."""
        for h in self._handles:
            h.remove()
        self._handles, self._before = [], None
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
        """The :class:`~lowprec_demo.freeze.records.FreezeRecord` of a format (the first when None)."""
        name = self.formats[0] if fmt is None else watch_format(fmt).name
        if name not in self.records:
            raise KeyError(f"no record for {name}; this watch records: {', '.join(self.formats)}")
        return self.records[name]

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

    def param_group_of(self, name: str) -> int:
        """The index of the param group that holds ``name``."""
        return self._group[name]

    def shape_of(self, name: str) -> tuple:
        """The shape of ``name`` (the whole tensor's, when sharded)."""
        return tuple(self._params[name].shape)

    def optimizer_state(self, name: str) -> dict:
        """The optimizer's state of ``name`` (``{}`` before its first step)."""
        return self.optimizer.state.get(self._params[name], {})

    def stored_formats(self) -> List[FloatFormat]:
        """The formats stored in (observation) or predicted (prediction)."""
        return list(dict.fromkeys(self._formats.values())) if self.mode == "observe" else self.formats_given

    def ratio_histogram(self, fmt=None, recent: bool = False) -> torch.Tensor:
        """A copy of the moving-average histogram ``(tensors, bins)`` (``recent``: the short one)."""
        return (self._ratios.recent if recent else self._ratios.long)[self.record(fmt).format].clone()

    def ratio_trend(self, fmt=None) -> RatioTrend:
        """The ratio's medians per tensor at the watched steps, for the forecast's trend."""
        return self._ratios.trend[self.record(fmt).format]

    def rows_with_gradient(self) -> Dict[str, torch.Tensor]:
        """Per embedding, one flag per row: had it a gradient on a watched step."""
        return dict(self._rows_seen)

    def counters(self) -> Dict[tuple, tuple]:
        """Float optimizer-state counters (Adam's ``step``): ``{(tensor, key): (value, steps stuck)}``."""
        return {k: (v, self._stuck_counters.get(k, 0)) for k, v in self._state_values.items()}

    def forecast_curves(self, fmt=None, total_steps: Optional[int] = None,
                        trend: float = 1.0) -> Dict[str, Dict[int, float]]:
        """:func:`lowprec_demo.monitor.forecast.forecast_curves`."""
        return watch_forecast.forecast_curves(self, fmt, total_steps, trend)

    def update_ratios(self, fmt=None, q: float = 0.5) -> Dict[str, float]:
        """:func:`lowprec_demo.monitor.forecast.update_ratios`."""
        return watch_forecast.update_ratios(self, fmt, q)

    def forecast(self, fmt=None, threshold: Optional[float] = None,
                 total_steps: Optional[int] = None) -> Dict[str, object]:
        """:func:`lowprec_demo.monitor.forecast.forecast`, computed when asked (not in the loop)."""
        return watch_forecast.forecast(self, fmt, threshold, total_steps)

    def plan(self, fmt=None, budget: float = 1.0, threshold: Optional[float] = None,
             total_steps: Optional[int] = None, kahan_format="auto", remedies=CLASSIC_REMEDIES) -> FreezePlan:
        """A remedy per tensor for ``LowPrecisionOptimizer(..., plan=)``: :func:`~lowprec_demo.optim.plan.make_plan`."""
        return make_plan(self, fmt, budget, threshold, total_steps, kahan_format, remedies)

    def groups(self) -> Dict[str, List[str]]:
        """Tensors by kind: ``"vectors"`` (1-d), ``"embeddings"`` (named emb, wte, wpe), ``"matrices"``."""
        return {kind: list(members) for kind, members in self._groups.items()}

    def diagnoses(self) -> List[Diagnosis]:
        """What cannot move, and why (:func:`~lowprec_demo.monitor.diagnoses.diagnose`)."""
        return diagnose(self)

    def to_dict(self) -> dict:
        """:func:`lowprec_demo.monitor.report.report_data`."""
        return report_data(self)

    def save(self, path) -> None:
        """:func:`lowprec_demo.monitor.report.save_report`."""
        save_report(self, path)

    def summary(self, fmt=None, show: bool = True) -> str:
        """The table of :meth:`WatchReport.summary`, printed unless ``show=False``, and returned."""
        return WatchReport(jsonable(self.to_dict())).summary(None if fmt is None else watch_format(fmt), show=show)

    def plot(self, fmt=None, ax=None):
        """The frozen fraction of each group over the steps, the forecast dashed."""
        return WatchReport(jsonable(self.to_dict())).plot(None if fmt is None else watch_format(fmt), ax=ax)


def watch(model: torch.nn.Module, optimizer, formats: Sequence = ("bf16",), scheduler=None, every: int = 1,
          threshold: float = 0.5, total_steps: Optional[int] = None, patience: int = 10, path=None,
          save_every: int = 100, writer=None, progress: bool = False, sample: Optional[int] = 1 << 14) -> FreezeWatch:
    """Watch a training run for weights that cannot move. ``formats``: to predict for float32
    parameters, names or the torch dtypes that store them; ``scheduler``: a torch scheduler, a callable step -> lr, the
    list of learning rates or None (constant); one step in ``every`` watched; ``threshold``: the frozen fraction of a
    freeze step; ``total_steps``: the run's length where the schedule does not say it; ``patience``: watched steps held
    before a diagnosis; ``path``: the report, saved every ``save_every`` watched steps and on ``detach()``; ``writer``:
    a TensorBoard ``SummaryWriter``; ``progress``: a progress bar; ``sample``: the elements followed per tensor at most
    (None: all). Options are checked here, so a mistake ends the call, not a run part way."""
    return FreezeWatch(model, optimizer, formats, scheduler, every, threshold, total_steps, patience, path,
                       save_every, writer, progress, sample)
