"""A freeze watch for your own training: which stored weights cannot move, and when they will stop.

Put it on any model and ``torch.optim`` optimizer in one line; the training loop stays as it is::

    watch = lowprec_demo.watch(model, optimizer, formats=("bf16",), scheduler=scheduler, total_steps=T)
    ...                                   # train as usual
    watch.summary()                       # a table: tensor, size, format, frozen now, since, forecast
    watch.diagnoses()                     # what cannot move, and why, in plain words

It attaches through the optimizer's step hooks (``register_step_pre_hook`` and
``register_step_post_hook``): before a watched step it copies the parameters it follows (the only
snapshot it holds), after it compares. It follows every element of a tensor of up to ``sample``
elements (16,384 by default) and an evenly strided ``sample`` of a larger one, the same elements
at every step, so that its cost stays a small part of a training step however large the model: the
fractions of a large tensor are then estimates, within a few tenths of a percentage point. It answers in one of two ways, chosen by how the
parameters are stored:

*prediction*, when they are float32 (or float64): for every format in ``formats``, the fraction of
each tensor that round to nearest would have left in place, by the rule of chapter 2
(``q(q(w) + d) == q(w)`` for the update ``d`` just applied), the fraction stochastic rounding
would move (``min(1, |d|/gap)``), and the distribution of ``|d| / (lr gap)``, from which
:meth:`FreezeWatch.forecast` tells, for the rest of the learning-rate schedule, when each tensor
and the whole model will pass the threshold;

*observation*, when they are stored in a low-precision dtype (``torch.bfloat16``, ``torch.float16``,
``torch.float8_e4m3fn``, ``torch.float8_e5m2``) or kept on a grid by
:class:`~lowprec_demo.optimizer.LowPrecisionOptimizer`: the fraction of each tensor that is bit for
bit the same after the step, and of those the elements whose gradient was not zero (*frozen*)
and those that had none (*idle*).

On FSDP2's sharded parameters (``fully_shard``) each process follows the watched elements of its
own blocks and one ``all_reduce`` per watched step adds the counts, so that every process holds
the report one process would (:mod:`lowprec_demo.sharding`); ``save`` writes from rank 0 only.

``every=k`` watches one step in k; ``detach()`` removes the hooks (the watch is also a context
manager). ``save(path)`` writes the report as JSON, atomically, and ``python -m lowprec_demo
report PATH`` prints it again.

The forecast lives in :mod:`lowprec_demo.watch_forecast`, the diagnoses in
:mod:`lowprec_demo.watch_diagnoses` and the saved report in :mod:`lowprec_demo.watch_report`;
this module holds the hooks and the measurements, answers through them, and re-exports their
public names.

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

import math
import sys
import warnings
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

import torch

from lowprec_demo.rounding import kernels
from lowprec_demo.monitor import sampling
from lowprec_demo.optim import sharding
from lowprec_demo.monitor import forecast as watch_forecast
from lowprec_demo.formats import DTYPE_FORMATS, FloatFormat, format_of_dtype, get_format
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.freeze.prediction import FreezeRecord, freeze_step
from lowprec_demo.common.output import atomic_write_json
from lowprec_demo.optim.plan import FreezePlan, make_plan
from lowprec_demo.rounding.rule import watch_code
from lowprec_demo.rounding.core import move_probability, update_ulp_ratio, would_freeze
from lowprec_demo.common.output import progress_bar
from lowprec_demo.monitor.diagnoses import DIAGNOSIS_KINDS, Diagnosis, diagnose
from lowprec_demo.monitor.forecast import EDGES, check_schedule, schedule_length, unwrap_scheduler
from lowprec_demo.monitor.forecast import MEMORY as _MEMORY  # the forecast histogram's moving average, kept in after_step
from lowprec_demo.monitor.forecast import RECENT as _RECENT, RatioTrend
from lowprec_demo.monitor.report import WatchReport, jsonable, load_watch, watch_format

# (Diagnosis, DIAGNOSIS_KINDS, WatchReport, load_watch, DTYPE_FORMATS and format_of_dtype are
# importable from here too; each is documented in the module that defines it)
__all__ = ["watch", "FreezeWatch"]

UNKNOWN_RUN = 1000     # watched steps taken for a run of unknown length, when deciding to compile up front


def _inner(optimizer):
    """The torch optimizer behind wrappers that hold one as ``.optimizer`` (accelerate's
    AcceleratedOptimizer, as the Hugging Face Trainer passes it); a LowPrecisionOptimizer is
    kept, since it does the rounding."""
    while (not isinstance(optimizer, LowPrecisionOptimizer)
           and isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer)):
        optimizer = optimizer.optimizer
    return optimizer


class FreezeWatch:
    """What :func:`watch` returns: the hooks, the measurements, and the answers. See the module
    docstring; the arguments are those of :func:`watch`.

    Attributes:
        mode: ``"predict"`` (float32 parameters: what each format would do) or ``"observe"``
            (parameters stored in a low-precision format: what happened).
        formats: the formats of the records, by name.
        steps: the optimizer step of every watched point (0-based).
        names, sizes: the optimizer's non-empty parameters by name, in order, and their sizes.
    """

    def __init__(self, model: torch.nn.Module, optimizer, formats: Sequence = ("bf16",), scheduler=None,
                 every: int = 1, threshold: float = 0.5, total_steps: Optional[int] = None,
                 patience: int = 10, path=None, save_every: int = 100, writer=None,
                 progress: bool = False, sample: Optional[int] = 1 << 14) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"every must be a whole number of steps >= 1, got {every!r}")
        if not isinstance(threshold, (int, float)) or not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if sample is not None and (isinstance(sample, bool) or not isinstance(sample, int) or sample < 1):
            raise ValueError(f"sample must be a whole number of elements per tensor >= 1, or None (all), got {sample!r}")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be a whole number of watched steps >= 1, got {patience!r}")
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(f"save_every must be a whole number of watched steps >= 1, got {save_every!r}")
        if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                        or total_steps < 1):
            raise ValueError(f"total_steps must be the run's length, a whole number of optimizer steps >= 1, or "
                             f"None; got {total_steps!r}")
        if writer is not None and not callable(getattr(writer, "add_scalar", None)):
            raise TypeError(f"writer must be a TensorBoard SummaryWriter (anything with add_scalar), got "
                            f"{type(writer).__name__}")
        if isinstance(formats, (str, FloatFormat, torch.dtype)):
            formats = [formats]
        # names, FloatFormats or torch dtypes; a ValueError names the valid formats
        self.formats_given = [watch_format(f) for f in formats]
        self.optimizer = _inner(optimizer)
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_schedule(scheduler)
        self.scheduler = unwrap_scheduler(scheduler)
        self.every, self.threshold, self.patience = every, float(threshold), patience
        self.total_steps = total_steps if total_steps is not None else schedule_length(self.scheduler)

        names = {id(p): n for n, p in model.named_parameters()}
        self._params: Dict[str, torch.nn.Parameter] = {}
        self._group: Dict[str, int] = {}
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in names:
                    raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of the "
                                     f"model's; pass the model whose parameters the optimizer trains")
                if not p.is_floating_point():
                    raise ValueError(f"{names[id(p)]} has dtype {p.dtype}: the watch tracks floating-point parameters "
                                     f"only")
                if p.numel() == 0:       # nothing to watch
                    continue
                self._params[names[id(p)]] = p
                self._group[names[id(p)]] = gi
        if not self._params:
            raise ValueError("the optimizer has no parameters to watch")
        if not any(p.requires_grad for p in self._params.values()):
            warnings.warn(f"none of the {len(self._params)} parameters the optimizer holds requires grad, so none "
                          f"will get a gradient and nothing will train: the watch will see every tensor idle. Set "
                          f"requires_grad=True on the ones to train (e.g. model.requires_grad_()), or give the "
                          f"optimizer those that do", UserWarning, stacklevel=3)
        self.names = list(self._params)
        self.sizes = {n: p.numel() for n, p in self._params.items()}

        # observation: parameters in a low-precision dtype, or on the grid of a LowPrecisionOptimizer
        stored = {}
        on_grid = {id(p) for p in self.optimizer.lowprec_params} if isinstance(self.optimizer, LowPrecisionOptimizer) else set()
        for n, p in self._params.items():
            if format_of_dtype(p.dtype):
                stored[n] = get_format(format_of_dtype(p.dtype))
            elif id(p) in on_grid:
                stored[n] = self.optimizer.fmt
        self.mode = "observe" if stored else "predict"
        if self.mode == "observe":
            self._formats = stored
            self.tracked = list(stored)
        else:
            if not self.formats_given:
                raise ValueError("give at least one format to predict, e.g. formats=('bf16',)")
            self._formats = {}
            self.tracked = list(self.names)
        names_of = [f.name for f in self.formats_given] if self.mode == "predict" else list(
            dict.fromkeys(f.name for f in stored.values()))
        self.formats = names_of
        self.records = {f: FreezeRecord(format=f, kind="predicted" if self.mode == "predict" else "observed")
                        for f in self.formats}
        self.steps: List[int] = []
        self.lrs: List[List[float]] = []                  # per watched step, per param group
        self.idle: Dict[str, List[float]] = {n: [] for n in self.tracked}       # no gradient
        self.frozen_with_grad: Dict[str, List[float]] = {n: [] for n in self.tracked}
        self._rows_seen: Dict[str, torch.Tensor] = {}
        self._embeddings = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules()
                            if isinstance(mod, torch.nn.Embedding)} & set(self.tracked)
        self._hist: Dict[str, torch.Tensor] = {}        # per format: (tensors, bins), a moving average
        self._recent: Dict[str, torch.Tensor] = {}      # the same over fewer steps: the trend's start
        self._trend: Dict[str, RatioTrend] = {}          # per format: the ratio's median per tensor over the run
        self._before: Optional[torch.Tensor] = None
        self._after: Optional[torch.Tensor] = None
        followed = [self._params[n] for n in self.tracked]
        # FSDP2 (DTensor parameters): each process follows its pieces, the counts added over processes
        self.sharded = sharding.any_sharded(followed)
        self._plan = (sampling.ShardedSamplePlan if self.sharded else sampling.SamplePlan)(followed, sample)
        self._groups = self._group_tensors()
        self._step = 0
        self._state_values: Dict[tuple, float] = {}
        self._stuck_counters: Dict[tuple, int] = {}
        self.path, self.save_every, self.writer = path, save_every, writer
        self._save_warned = False
        self._compile_checked = False
        self._bar = progress_bar(range(self.total_steps or 0), desc="freeze watch", disable=not progress) \
            if progress else None
        self._handles = [self.optimizer.register_step_pre_hook(self.before_step),
                         self.optimizer.register_step_post_hook(self.after_step)]

    # ---- hooks ---------------------------------------------------------------------------------

    def _watched(self) -> bool:
        return self._step % self.every == 0

    @torch.no_grad()
    def before_step(self, optimizer=None, args=(), kwargs=None) -> None:
        """Copy the tracked parameters before a watched step. The optimizer's step pre-hook
        calls it; call it (and :meth:`after_step`) yourself only around a step the hooks do not
        see."""
        if not self._watched():
            return
        self._before = self._plan.gather_params([self._params[n] for n in self.tracked], self._before)   # a copy
        self._lr_now = [float(g["lr"]) for g in self.optimizer.param_groups]

    @torch.no_grad()
    def after_step(self, optimizer=None, args=(), kwargs=None) -> None:
        """Compare the tracked parameters with their copies and add one point to every record
        (the optimizer's step post-hook calls it)."""
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
        counted = self._plan.counts
        if self.mode == "observe":
            has_grad = grad != 0
            same = new == self._before
            parts = torch.stack([plan.per_tensor(c) for c in (~has_grad, same, same & has_grad)])
            parts, *rows = plan.reduce([parts, *rows])    # (sharded: the counts of every process added)
            self._add_rows(row_names, rows)
            values = parts.tolist()                  # one transfer
            for j, n in enumerate(self.tracked):
                self.idle[n].append(values[0][j] / counted[j])
                self.frozen_with_grad[n].append(values[2][j] / counted[j])
            names = list(dict.fromkeys(self._formats[n].name for n in self.tracked))
            self._append({f: [(n, values[1][j], counted[j], None) for j, n in enumerate(self.tracked)
                              if self._formats[n].name == f] for f in names})
        else:
            self._predict(plan, self._before, new, grad, row_names, rows)
        self._watch_counters(step)
        if self.writer is not None:
            for f in self.formats:
                self.writer.add_scalar(f"freeze/{f}/frozen", self.records[f].overall[-1], step)
                for group, members in self._groups.items():
                    n_all = sum(self.sizes[n] for n in members)
                    value = sum(self.records[f].by_tensor[n][-1] * self.sizes[n] for n in members) / n_all
                    self.writer.add_scalar(f"freeze/{f}/{group}", value, step)
        if self._bar is not None and hasattr(self._bar, "set_postfix_str"):
            self._bar.set_postfix_str(", ".join(f"{f} frozen {self.records[f].overall[-1]:.2f}" for f in self.formats))
        if self.path is not None and len(self.steps) % self.save_every == 0:
            self._save_quietly()

    def _save_quietly(self) -> None:
        """Save to ``path`` during training or on detach: a report that cannot be written is a
        warning (once), not the end of the run; the measurements stay, for ``save`` elsewhere."""
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

    def _predict(self, plan: "sampling.SamplePlan", old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor,
                 row_names: List[str], rows: List[torch.Tensor]) -> None:
        """Prediction mode's point of every record, from the rule at ``q(old)``: per format one
        pass writes the codes of :func:`lowprec_demo.freeze_rule.watch_code` (tensor, bin of
        ``log2(|d| / (lr gap))``, frozen, gradient) and the move probabilities; one bincount of
        the codes gives every tensor's histogram and counts, a running sum its moves."""
        n_tensors, bins = len(plan.counts), len(EDGES) + 1
        same = all(lr == self._lr_now[0] for lr in self._lr_now)    # one learning rate: one value for all
        lrs = torch.tensor(self._lr_now[:1] if same else [self._lr_now[self._group[n]] for n in self.tracked],
                           dtype=torch.float64)
        log_lr = torch.log2(lrs.clamp(min=1e-300)).to(torch.float32).to(new.device)
        log_lr = log_lr.reshape(()) if same else log_lr
        local = []
        compile_now = self._compile_up_front(old)
        for fmt in self.formats_given:
            if kernels.fits(old, fmt):
                previous = kernels.set_mode("on") if compile_now else None
                try:
                    code, moves = kernels.watch_code(old, new, grad, plan.tensor_id, log_lr, fmt, float(EDGES[0]), bins)
                finally:
                    if previous is not None:
                        kernels.set_mode(previous)
            else:   # the same rule through the public functions
                update = new - old
                code = watch_code(would_freeze(old, update, fmt), update_ulp_ratio(old, update, fmt).float(), grad,
                                  plan.tensor_id, log_lr, float(EDGES[0]), bins)
                moves = move_probability(old, update, fmt)
            counts = torch.bincount(code, minlength=n_tensors * bins * 4).view(n_tensors, bins, 2, 2)
            # per tensor: the histogram, the (frozen, gradient) flags and the moves
            local += [counts.sum((2, 3)), counts.sum(1), plan.per_tensor(moves)]
        reduced = plan.reduce(local + rows)    # sharded: the counts of every process added, one all_reduce
        local = reduced[:len(local)]
        self._add_rows(row_names, reduced[len(local):])
        rows, sums = {}, []
        for i, fmt in enumerate(self.formats_given):
            hist, flags, moved_sums = local[3 * i:3 * i + 3]
            hist = hist.double()
            hist /= hist.sum(1, keepdim=True).clamp(min=1)
            hist = hist.cpu()
            for store, memory in ((self._hist, _MEMORY), (self._recent, _RECENT)):
                h = store.get(fmt.name)     # moving averages: Adam's ratio varies from step to step
                store[fmt.name] = hist.clone() if h is None else h.mul_(1 - 1 / memory).add_(hist, alpha=1 / memory)
            self._trend.setdefault(fmt.name, RatioTrend()).add(self.steps[-1], hist)
            # flags: (tensor, frozen, gradient)
            sums.append(torch.stack([flags[:, 1].sum(1).double(), flags[:, 1, 1].double(), flags[:, :, 0].sum(1).double(),
                                     moved_sums]))
        values = torch.stack(sums).tolist()  # one transfer
        counted = plan.counts
        for i, fmt in enumerate(self.formats_given):
            frozen, frozen_grad, idle, moved = values[i]
            if i == 0:
                for j, n in enumerate(self.tracked):
                    self.idle[n].append(idle[j] / counted[j])
                    self.frozen_with_grad[n].append(frozen_grad[j] / counted[j])
            rows[fmt.name] = [(n, frozen[j], counted[j], moved[j]) for j, n in enumerate(self.tracked)]
        self._append(rows)

    def _compile_up_front(self, old: torch.Tensor) -> bool:
        """At the first watched step of prediction mode, in the kernels' ``"auto"`` mode: whether
        to compile the watch's kernel now. ``"auto"`` compiles a kernel once its eager work
        reaches :data:`~lowprec_demo.kernels.EAGER_BUDGET` elements, which on a large model comes
        part way through the run, a pause of seconds with no word; when this run's watched
        elements (per watched step, times the watched steps left, or :data:`UNKNOWN_RUN` of them
        when the run's length is unknown) would reach it, the kernel is compiled at the first
        step instead, and one line on stderr says so."""
        if self._compile_checked:
            return False
        self._compile_checked = True
        if kernels.get_mode() != "auto" or not any(kernels.fits(old, f) for f in self.formats_given):
            return False
        left = UNKNOWN_RUN if self.total_steps is None else -(-max(0, self.total_steps - self.steps[-1]) // self.every)
        if old.numel() * left <= kernels.EAGER_BUDGET:
            return False
        if old.device.type not in kernels.status()["kernels"]["watch_code"]["compiled"]:
            print(f"freeze watch: compiling its kernel now, once per process (seconds): {left:,} watched steps of "
                  f"{old.numel():,} elements would compile it part way through the run", file=sys.stderr, flush=True)
        return True

    def _append(self, rows: Dict[str, list]) -> None:
        """One point of every record: per tensor the fraction of its followed elements, overall
        the size-weighted sum (exact where a tensor is followed in full)."""
        for f, items in rows.items():
            rec = self.records[f]
            total = sum(self.sizes[n] for n, *_ in items)
            held = moved = 0.0
            for n, frozen, counted, move in items:
                if n not in rec.by_tensor:
                    rec.by_tensor[n], rec.sizes[n] = [], self.sizes[n]
                rec.by_tensor[n].append(frozen / counted)
                scale = self.sizes[n] / counted
                held += frozen * scale
                if move is not None:
                    moved += move * scale
            rec.overall.append(held / total if total else math.nan)
            if self.mode == "predict":
                rec.move_fraction.append(moved / total if total else math.nan)

    def _watch_counters(self, step: int) -> None:
        """Optimizer-state counters (``step``) held in a float format: do they still count?"""
        found = [((n, key), value) for n in self.tracked
                 for key, value in self.optimizer.state.get(self._params[n], {}).items()
                 if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()]
        if not found:
            return
        try:      # one transfer (float types widen exactly)
            values = torch.stack([v for _, v in found]).tolist()
        except RuntimeError:     # on several devices
            values = [float(v) for _, v in found]
        for (key, _), v in zip(found, values):
            last = self._state_values.get(key)
            if last is not None and v == last:
                self._stuck_counters[key] = self._stuck_counters.get(key, 0) + 1
            self._state_values[key] = v

    def held_bytes(self) -> int:
        """The memory the watch keeps from step to step: its two copies of the tracked parameters,
        the forecast's histograms and trend points and the rows-with-gradient flags."""
        tensors = [t for t in (self._before, self._after) if t is not None] + list(self._hist.values()) \
            + list(self._recent.values()) + list(self._rows_seen.values()) + [self._plan.tensor_id]
        return sum(t.numel() * t.element_size() for t in tensors) + sum(t.nbytes() for t in self._trend.values())

    # ---- attach and detach ---------------------------------------------------------------------

    def detach(self) -> "FreezeWatch":
        """Remove the hooks (the measurements stay); save the report if a ``path`` was given."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._before = None
        if self._bar is not None and hasattr(self._bar, "close"):
            self._bar.close()
        if self.path is not None:
            self._save_quietly()
        return self

    def __enter__(self) -> "FreezeWatch":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    # ---- answers -------------------------------------------------------------------------------

    def record(self, fmt=None) -> FreezeRecord:
        """The :class:`~lowprec_demo.prediction.FreezeRecord` of a format (the first when None):
        per watched step the frozen fraction overall and by tensor (predicted or observed)."""
        name = self.formats[0] if fmt is None else watch_format(fmt).name
        if name not in self.records:
            raise KeyError(f"no record for {name}; this watch records: {', '.join(self.formats)}")
        return self.records[name]

    def frozen_since(self, fmt=None, threshold: Optional[float] = None) -> Dict[str, Optional[int]]:
        """The step from which each tensor (and ``"overall"``) has stayed at or above the
        threshold, or None."""
        rec, tau = self.record(fmt), self.threshold if threshold is None else threshold
        out = {}
        for name, values in [("overall", rec.overall)] + list(rec.by_tensor.items()):
            i = freeze_step(values, tau)
            out[name] = None if i is None else self.steps[i]
        return out

    # ---- measurements, read by the forecast and the diagnoses ----------------------------------

    def param_group_of(self, name: str) -> int:
        """The index of the optimizer's param group that holds the tracked tensor ``name``."""
        return self._group[name]

    def shape_of(self, name: str) -> tuple:
        """The shape of ``name`` (the whole tensor's, when sharded)."""
        return tuple(self._params[name].shape)

    def optimizer_state(self, name: str) -> dict:
        """The optimizer's state of the tracked tensor ``name`` (``{}`` before its first step)."""
        return self.optimizer.state.get(self._params[name], {})

    def stored_formats(self) -> List[FloatFormat]:
        """The formats the tensors are stored in (observation) or predicted for (prediction)."""
        return list(dict.fromkeys(self._formats.values())) if self.mode == "observe" else self.formats_given

    def ratio_histogram(self, fmt=None, recent: bool = False) -> torch.Tensor:
        """Prediction mode: per tracked tensor, the histogram of ``log2(|d| / (lr gap))`` in the
        bins of :data:`~lowprec_demo.watch_forecast.EDGES`, a moving average over about the last
        20 watched steps (``recent=True``: the last 4), as fractions: ``(tensors, bins)``,
        float64 (a copy)."""
        return (self._recent if recent else self._hist)[self.record(fmt).format].clone()

    def ratio_trend(self, fmt=None) -> RatioTrend:
        """Prediction mode: the median of ``log2(|d| / (lr gap))`` per tracked tensor at the
        watched steps (:class:`~lowprec_demo.watch_forecast.RatioTrend`), which the forecast
        fits its trend on."""
        return self._trend[self.record(fmt).format]

    def rows_with_gradient(self) -> Dict[str, torch.Tensor]:
        """For each embedding tracked, one flag per row: did it have a gradient on a watched step."""
        return dict(self._rows_seen)

    def counters(self) -> Dict[tuple, tuple]:
        """The optimizer-state counters (0-dimensional float state, such as Adam's ``step``):
        ``{(tensor, key): (last value, steps on which it stood still)}``."""
        return {k: (v, self._stuck_counters.get(k, 0)) for k, v in self._state_values.items()}

    def forecast_curves(self, fmt=None, total_steps: Optional[int] = None,
                        trend: float = 1.0) -> Dict[str, Dict[int, float]]:
        """The forecast frozen fraction of every tensor and ``"overall"`` at every step after the
        last watched one, to the end of the run: ``{name: {step: fraction}}``.

        From what the watch measured: each element's update per unit of learning rate, in gaps
        of its stored value (``|d| / (lr gap)``, a histogram of the last few watched steps), is
        carried along each tensor's fitted trend (``trend=0``: taken to stay as it is); an
        element is then frozen at a later step whose learning rate ``lr_s`` makes
        ``lr_s |d| / (lr gap)`` less than 1/2 (:func:`~lowprec_demo.watch_forecast.forecast_curves`)."""
        return watch_forecast.forecast_curves(self, fmt, total_steps, trend)

    def update_ratios(self, fmt=None, q: float = 0.5) -> Dict[str, float]:
        """Per tensor, the ``q`` quantile of ``|d| / (lr gap)``, each element's step per unit of
        learning rate in gaps of its stored value, as the forecast takes it now (a moving
        average over about the last 20 watched steps). An element freezes at a learning rate
        below ``1 / (2 ratio)``."""
        return watch_forecast.update_ratios(self, fmt, q)

    def forecast(self, fmt=None, threshold: Optional[float] = None,
                 total_steps: Optional[int] = None) -> Dict[str, object]:
        """The step at which the whole model and each tensor will pass the threshold (the first
        step from which the frozen fraction stays at or above it to the end of the run: the
        measured points so far, then :meth:`forecast_curves`), with a band, or None when that
        does not happen within the schedule: ``{"overall": step, "low": step, "high": step,
        "by_tensor": {name: {"step": ..., "low": ..., "high": ...}}}``
        (:func:`~lowprec_demo.watch_forecast.forecast`). Computed when asked, from what the
        hooks keep; it costs the training loop nothing."""
        return watch_forecast.forecast(self, fmt, threshold, total_steps)

    def plan(self, fmt=None, budget: float = 1.0, threshold: Optional[float] = None,
             total_steps: Optional[int] = None, kahan_format="auto") -> FreezePlan:
        """A remedy per tensor within ``budget`` extra bytes per parameter, from the diagnoses and
        the forecast (:func:`~lowprec_demo.freeze_plan.make_plan`): ``LowPrecisionOptimizer(..., plan=)``."""
        return make_plan(self, fmt, budget, threshold, total_steps, kahan_format)

    def groups(self) -> Dict[str, List[str]]:
        """Tensors by kind: ``"vectors"`` (biases, norm gains: one dimension), ``"embeddings"``
        (an ``nn.Embedding``'s weight, or a name with ``emb``, ``wte`` or ``wpe``) and
        ``"matrices"`` (the other tensors with 2 or more dimensions)."""
        return {kind: list(members) for kind, members in self._groups.items()}

    def _group_tensors(self) -> Dict[str, List[str]]:
        out: Dict[str, List[str]] = {}
        for n in self.tracked:
            p = self._params[n]
            kind = "vectors" if p.dim() < 2 else "embeddings" if any(
                k in n for k in ("emb", "wte", "wpe")) else "matrices"
            out.setdefault(kind, []).append(n)
        return out

    def diagnoses(self) -> List[Diagnosis]:
        """What cannot move, and why, each with its numbers and the remedy the book measures
        (:func:`~lowprec_demo.watch_diagnoses.diagnose`)."""
        return diagnose(self)

    # ---- report --------------------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The report as JSON-ready data: settings, steps and learning rates, the records, idle
        fractions, the table, the forecast curves (prediction mode with a known run length) and
        the diagnoses."""
        forecasts, curves = {}, {}
        if self.mode == "predict" and self.steps and self.total_steps:
            for f in self.formats:
                forecasts[f] = watch_forecast.forecast(self, f, curves=True)
                curves[f] = {n: {str(s): v for s, v in c.items()} for n, c in forecasts[f].pop("curves").items()}
        return {"kind": "lowprec_demo.watch", "mode": self.mode, "formats": self.formats, "threshold": self.threshold,
                "every": self.every, "total_steps": self.total_steps, "steps": self.steps, "lrs": self.lrs,
                "sizes": {n: self.sizes[n] for n in self.tracked}, "groups": self.groups(),
                "records": {f: r.to_dict() for f, r in self.records.items()}, "idle": self.idle,
                "frozen_since": {f: self.frozen_since(f) for f in self.formats},
                "forecast": forecasts, "forecast_curves": curves,
                "diagnoses": [asdict(d) for d in self.diagnoses()]}

    def save(self, path) -> None:
        """Write :meth:`to_dict` to ``path`` as JSON, atomically (a crash leaves the last saved
        report as it was). On sharded parameters every process holds the same report and only
        the first (rank 0) writes it."""
        if self.sharded:
            import torch.distributed as dist
            if dist.get_rank() != 0:
                return
        data = jsonable(self.to_dict())
        try:
            atomic_write_json(path, data)
        except OSError as error:     # it may name the temporary file beside the target: name the target
            reason = error.strerror or str(error)
            raise type(error)(f"cannot save the freeze watch's report to {path}: {reason}") from error

    def summary(self, fmt=None, show: bool = True) -> str:
        """The table (tensor, size, format, frozen now, frozen since, forecast, diagnosis),
        printed unless ``show=False``, and returned."""
        return WatchReport(jsonable(self.to_dict())).summary(None if fmt is None else watch_format(fmt), show=show)

    def plot(self, fmt=None, ax=None):
        """The frozen fraction of each group of tensors over the watched steps, the forecast
        dashed to the end of the run (prediction mode)."""
        return WatchReport(jsonable(self.to_dict())).plot(None if fmt is None else watch_format(fmt), ax=ax)


def watch(model: torch.nn.Module, optimizer, formats: Sequence = ("bf16",), scheduler=None, every: int = 1,
          threshold: float = 0.5, total_steps: Optional[int] = None, patience: int = 10, path=None,
          save_every: int = 100, writer=None, progress: bool = False, sample: Optional[int] = 1 << 14) -> FreezeWatch:
    """Watch a training run for weights that cannot move; returns a :class:`FreezeWatch`.

    Args:
        model: the model whose parameters the optimizer trains.
        optimizer: any ``torch.optim`` optimizer, a LowPrecisionOptimizer, or a wrapper holding one
            as ``.optimizer``.
        formats: the formats to predict for float32 parameters (names such as ``"bf16"``,
            ``"fp16"``, ``"e4m3"``, ``"e8m5"``, or the torch dtypes that store them:
            ``torch.bfloat16``, ``torch.float16``, the float8 dtypes); parameters stored in a
            low-precision dtype are observed in their own format instead. Every method that
            takes a format takes the same.
        scheduler: the learning-rate schedule, for the forecast: a ``torch.optim.lr_scheduler``
            scheduler, a callable step -> lr, the list of learning rates, or None (constant).
        every: watch one optimizer step in ``every``.
        threshold: the frozen fraction that defines a freeze step, in (0, 1].
        total_steps: the run's length (for the forecast), when the schedule does not say it.
        patience: watched steps a tensor must stay held before it is diagnosed.
        path: save the report there every ``save_every`` watched steps and on ``detach()``; a
            save that fails there is a warning (once), and training goes on.
        writer: a TensorBoard ``SummaryWriter``: frozen fractions written as scalars.
        progress: a progress bar with the frozen fraction (needs ``total_steps``).
        sample: follow at most this many elements of each tensor (evenly strided, the same ones
            every step; smaller tensors in full), or None for all of them: the cost of a watched
            step then stays a small part of a training step however large the model.

    Options are checked here, so that a mistake ends the call rather than a run part way; a
    warning says when no parameter the optimizer holds requires grad (nothing would train).
    In the kernels' ``"auto"`` mode, a run whose watched elements would compile the watch's
    kernel part way through compiles it at the first watched step instead, with one line on
    stderr.
    """
    return FreezeWatch(model, optimizer, formats, scheduler, every, threshold, total_steps, patience, path,
                       save_every, writer, progress, sample)
