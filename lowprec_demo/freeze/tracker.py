"""One freeze tracker: which followed elements a step leaves in place, predicted or observed.

:class:`FreezeTracker` copies the followed elements of some tensors just before a step (``before_step``; every
element, or an even sample of a large tensor: :mod:`~lowprec_demo.freeze.sampling`) and just after it counts per
tensor those the step left in place (``after_step``), one point of a :class:`FreezeRecord` per format. Two counts (:mod:`~lowprec_demo.freeze.counts`):

* *predicted*, in a high-precision run: an element with value ``w_t`` and update ``d_t = w_{t+1} - w_t`` is frozen in a
  format when ``q(q(w_t) + d_t) == q(w_t)`` (round to nearest ``q``), i.e. ``|d_t| < gap/2``; stochastic rounding moves
  it with probability ``min(1, |d|/gap)``; one reference run predicts any number of formats at once;
* *observed*, in a low-precision run: an element is frozen when its stored value did not change.

:class:`FreezePredictor` and :class:`FreezeObserver` are the tracker set up for the book's runs (every element, no
gradient, no learning rate); the freeze watch (:mod:`lowprec_demo.monitor`) sets it up with a sample, the gradients and
the learning rates. The predictor's baselines need no trajectory: the *schedule rule* scales each element's first
update, in gaps of its initial stored value, by the schedule; the *fitted* one takes the update per unit of learning
rate over the first ``fit_steps`` steps (Adam's later steps are smaller).

Example:
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> predictor = FreezePredictor({"w": w}, formats=["bf16"])
    >>> predictor.before_step(); w.data -= 1e-3; predictor.after_step()
    >>> predictor.record("bf16").overall
    [1.0]
"""

from __future__ import annotations

import math
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from lowprec_demo.formats import FloatFormat, get_format
from lowprec_demo.freeze.counts import fewbit_count, fold_octaves, histograms, observed_counts, predicted_counts
from lowprec_demo.freeze.records import RATIO_BINS, FreezeRecord
from lowprec_demo.freeze.sampling import Sample, ShardedSample
from lowprec_demo.common import sharding
from lowprec_demo.rounding import quantize, update_ulp_ratio, would_freeze
from lowprec_demo.rounding.freeze_rule import BINS

__all__ = ["FreezeTracker", "FreezePredictor", "FreezeObserver", "named_tensors"]

TensorSource = Union[Mapping[str, torch.Tensor], Callable[[], Mapping[str, torch.Tensor]], torch.nn.Module]
Format = Union[str, FloatFormat]


def named_tensors(source: TensorSource) -> Dict[str, torch.Tensor]:
    """The tensors of a source: a mapping, a callable returning one, or a module (its parameters)."""
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    if callable(source):
        return dict(source())
    return dict(source)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class FreezeTracker:
    """Track ``tensors`` (a module, a mapping name -> tensor, or a callable returning one, for optimizer state that
    appears after the first step) step by step. It predicts ``formats`` (``self.formats``: the distinct ones, in
    order; SR's moves with ``rand_bits`` random bits, None: full resolution), or with ``stored_in`` (a format name, or
    one per tensor) observes a run stored in it. ``sample``: the elements followed per tensor at most (None: all).
    ``records`` holds a :class:`FreezeRecord` per format; with ``keep_masks``, ``masks`` the last step's
    ``{format: {tensor: bool mask}}`` (every element followed; :mod:`lowprec_demo.freeze.agreement`).

    A step: :meth:`before_step` just before ``optimizer.step()``, :meth:`after_step` just after it; or, with the
    gradients and learning rates, :meth:`compare` and :meth:`count_predicted` or :meth:`count_observed`."""

    def __init__(self, tensors: TensorSource, formats: Union[Format, Sequence[Format]] = ("bf16",),
                 stored_in: Union[Format, Mapping[str, Format], None] = None, sample: Optional[int] = None,
                 rand_bits: Optional[int] = None, keep_masks: bool = False) -> None:
        self.rand_bits, self.keep_masks, self.sample_size = rand_bits, keep_masks, sample
        self.masks: Dict[str, Dict[str, torch.Tensor]] = {}
        self.observed = stored_in is not None
        if self.observed:
            self.formats = []
            self._stored_in = stored_in if isinstance(stored_in, Mapping) else None
            labels = {self._name(f): f.name for f in stored_in.values()} if self._stored_in else {
                self._name(stored_in): str(stored_in)}     # (one format: the record named as given)
            self.records = {n: FreezeRecord(format=label, kind="observed") for n, label in labels.items()}
        else:
            if isinstance(formats, (str, FloatFormat)):
                formats = [formats]
            distinct: Dict[str, FloatFormat] = {}
            for f in map(get_format, formats):   # one record per distinct grid name, in the order given
                distinct.setdefault(f.name, f)
            self.formats = list(distinct.values())
            if not self.formats:
                raise ValueError("give at least one format to predict")
            self.records = {f.name: FreezeRecord(format=f.name, kind="predicted", rand_bits=rand_bits)
                            for f in self.formats}
        self._source = tensors
        self._layout: Optional[tuple] = None
        self._shapes: tuple = (None, {})    # (the layout, its shape by name)
        self.names: List[str] = []          # the tensors followed (those with elements), in order
        self.sizes: Dict[str, int] = {}     # every tracked tensor's elements, empty ones included
        self.sample: Union[Sample, ShardedSample, None] = None
        self.before: Optional[torch.Tensor] = None   # the followed elements before the step, end to end
        self._after: Optional[torch.Tensor] = None   # the buffer of those after it
        self._waiting = False                         # a snapshot not yet compared
        self._follow(self.tensors())

    @staticmethod
    def _name(fmt) -> str:
        return get_format(fmt).name if fmt else str(fmt)

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tracked tensors as they are now, by name (the live tensors, not copies)."""
        return {k: v for k, v in named_tensors(self._source).items() if torch.is_tensor(v)}

    def record(self, fmt: Union[Format, None] = None) -> FreezeRecord:
        """The record of format ``fmt`` (a name or a FloatFormat; the first when None)."""
        if fmt is None:
            return next(iter(self.records.values()))
        name = get_format(fmt).name
        if name not in self.records:
            raise KeyError(f"no record for {name}; recorded: {', '.join(self.records) or 'none'}")
        return self.records[name]

    def held_bytes(self) -> int:
        """The memory kept from step to step: the copies before and after a step, tensor indices, masks."""
        masks = [m for by_name in self.masks.values() for m in by_name.values()]
        kept = [t for t in (self.before, self._after) if t is not None] + masks
        return _nbytes(kept + ([self.sample.tensor_id] if self.sample is not None else []))

    @staticmethod
    def _layout_of(tensors: Dict[str, torch.Tensor]) -> tuple:
        return tuple((k, v.shape, v.dtype, v.device) for k, v in tensors.items())

    def _follow(self, current: Dict[str, torch.Tensor]) -> None:
        """Choose the followed elements of the tensors as they are now (a :class:`ShardedSample` for FSDP2's)."""
        self.sizes = {n: v.numel() for n, v in current.items()}
        self.names = [n for n, v in current.items() if v.numel()]
        followed = [current[n] for n in self.names]
        kind = ShardedSample if sharding.any_sharded(followed) else Sample
        self.sample = kind(followed, self.sample_size) if followed else None
        self.before = self._after = None
        self._layout = self._layout_of(current)

    @torch.no_grad()
    def before_step(self) -> None:
        """Copy the followed elements (chosen again when the tensors change)."""
        current = self.tensors()
        if self._layout_of(current) != self._layout:
            self._follow(current)
        if self.sample is not None:
            self.before = self.sample.gather_params([current[n] for n in self.names], self.before)   # a copy
        self._waiting = True

    @torch.no_grad()
    def compare(self) -> tuple:
        """``(names, sample, old, new)``: the followed elements before and after the step, end to end (``new`` a copy
        in a buffer kept from step to step). Tensors changed since :meth:`before_step` (optimizer state that
        appeared) are left out of this step; ``sample`` is None when no tensor is followed."""
        if not self._waiting or self.sample is None:
            return [], None, None, None
        self._waiting = False
        now = self.tensors()
        if self._layout_of(now) == self._layout:
            self._after = self.sample.gather_params([now[n] for n in self.names], self._after)
            return self.names, self.sample, self.before, self._after
        same = {n: v for n, v in now.items() if (n, v.shape, v.dtype, v.device) in set(self._layout)}
        names = [n for n in self.names if n in same]
        if not names:
            return [], None, None, None
        sample = Sample([same[n] for n in names], self.sample_size)
        old = dict(zip(self.names, self.before.split(self.sample.counts)))
        return names, sample, sample.gather([old[n] for n in names]), sample.gather([same[n] for n in names])

    def _items(self, names: List[str], sample, frozen, moves=None) -> List[tuple]:
        """A record's ``(name, frozen, followed, size, move)`` per tensor counted, and for the empty ones, in order."""
        at = {n: j for j, n in enumerate(names)}
        return [(n, frozen[at[n]], sample.counts[at[n]], size, None if moves is None else moves[at[n]]) if n in at
                else (n, 0, 0, 0, None) for n, size in self.sizes.items() if n in at or not size]

    def count_observed(self, names: List[str], sample, old, new, grad: Optional[torch.Tensor] = None,
                       extra: Sequence[torch.Tensor] = ()) -> tuple:
        """Observation's point of every record: the elements left bit for bit the same per tensor (with ``grad``,
        also those with no gradient and those the same with one). Returns those counts (one list per row) and
        ``extra`` reduced with them."""
        counts, *extra = sample.reduce([observed_counts(sample, old, new, grad), *extra]) if sample else [None, *extra]
        rows = counts.tolist() if counts is not None else [[]]     # one transfer
        by_record: Dict[str, list] = {f: [] for f in self.records}
        for item in self._items(names, sample, rows[0]):
            by_record[self._record_of(item[0])].append(item)
        for f, items in by_record.items():
            self.records[f].add_step(items)
        if self.keep_masks and sample is not None:   # the same comparison, kept element by element
            self.masks = {f: {n: o.view(self._shape(n)) == v.view(self._shape(n)) for n, o, v in
                              zip(names, old.split(sample.counts), new.split(sample.counts))} for f in self.records}
        return rows, extra

    def _record_of(self, name: str) -> str:
        return self._name(self._stored_in[name]) if self._stored_in else next(iter(self.records))

    def _shape(self, name: str) -> tuple:
        if self._shapes[0] is not self._layout:
            self._shapes = (self._layout, {n: shape for n, shape, _, _ in self._layout})
        return self._shapes[1][name]

    def count_predicted(self, names: List[str], sample, old, new, formats: Optional[Sequence[FloatFormat]] = None,
                        records: Optional[Dict[str, FreezeRecord]] = None, grad: Optional[torch.Tensor] = None,
                        log_lr: Optional[torch.Tensor] = None, extra: Sequence[torch.Tensor] = (),
                        compile_now: bool = False) -> tuple:
        """Prediction's point of each format's record (``formats``, ``records``: the tracker's when None) for the
        update ``new - old``, binned by ``log2(|d| / gap)`` less ``log_lr`` (None: unshifted, then also the
        records' histograms and few-bit shares). Returns per format ``(bins, flags)``, the elements per bin
        ``(tensors, BINS + 1)`` and per (frozen, gradient) pair ``(tensors, 2, 2)``, and ``extra``, all reduced."""
        formats = self.formats if formats is None else formats
        records = self.records if records is None else records
        if sample is None:
            reduced = [torch.zeros(0, BINS + 1), torch.zeros(0, 2, 2), torch.zeros(0)] * len(formats) + list(extra)
        else:
            local = predicted_counts(sample, old, new, formats, grad, log_lr, self.rand_bits, compile_now)
            reduced = sample.reduce(local + list(extra))   # sharded: every process's counts added, one all_reduce
        parts, n_tensors = [], len(names)
        for i in range(len(formats)):
            bins, flags, moves = reduced[3 * i:3 * i + 3]
            hist = histograms(bins, nan="drop").sum(0)
            few = fewbit_count(hist, self.rand_bits).reshape(1) if self.rand_bits is not None else hist[:0]
            parts += [flags[:, 1].sum(1).double(), moves.double(), fold_octaves(hist, RATIO_BINS).double(),
                      few.double()]
        values = torch.cat([p.reshape(-1) for p in parts]).tolist() if parts else []   # one transfer
        at = 0
        for fmt in formats:
            frozen, moves = values[at:at + n_tensors], values[at + n_tensors:at + 2 * n_tensors]
            at += 2 * n_tensors
            octaves = [int(v) for v in values[at:at + len(RATIO_BINS) + 1]]
            at += len(RATIO_BINS) + 1
            rec = records[fmt.name]
            total = rec.add_step(self._items(names, sample, frozen, moves))
            if log_lr is None:     # the record's histogram and few-bit share: of |d| / gap itself
                rec.ratio_histogram = [a + b for a, b in zip(rec.ratio_histogram, octaves)]
                if self.rand_bits is not None:
                    rec.fewbit_frozen.append(values[at] / total if total else math.nan)
            at += self.rand_bits is not None
        return [tuple(reduced[3 * i:3 * i + 2]) for i in range(len(formats))], reduced[3 * len(formats):]

    @torch.no_grad()
    def after_step(self) -> None:
        """Compare with the copy and add one point to every record."""
        names, sample, old, new = self.compare()
        if self.observed:
            self.count_observed(names, sample, old, new)
        else:
            self.count_predicted(names, sample, old, new)
            if sample is not None:
                self._per_tensor(names, sample, old, new)

    def _per_tensor(self, names, sample, old, new) -> None:
        """Prediction's element-by-element work: the masks (with ``keep_masks``)."""
        if not (self.keep_masks or self._needs_pairs()):
            return
        pairs = [(n, o.view(self._shape(n)), v.view(self._shape(n)))
                 for n, o, v in zip(names, old.split(sample.counts), new.split(sample.counts))]
        if self.keep_masks:
            self.masks = {f.name: {n: would_freeze(quantize(o, f), v - o, f) for n, o, v in pairs}
                          for f in self.formats}
        self._pairs_seen(pairs)

    def _needs_pairs(self) -> bool:
        """Whether :meth:`_pairs_seen` wants this step's pairs."""
        return False

    def _pairs_seen(self, pairs) -> None:
        """What a configuration adds from each step's ``(name, old, new)`` (nothing here)."""


class FreezeObserver(FreezeTracker):
    """Observed freezing in a low-precision run whose values are stored in ``format`` (the record's name), every
    element followed; ``tensors``, ``keep_masks`` as for :class:`FreezeTracker`.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> obs = FreezeObserver({"w": w}, "bf16"); obs.before_step(); w.data[0] = 2.0; obs.after_step()
        >>> obs.record().overall, list(obs.records)
        ([0.5], ['bf16'])
    """

    def __init__(self, tensors: TensorSource, format: Format = "", keep_masks: bool = False) -> None:
        super().__init__(tensors, stored_in=format, keep_masks=keep_masks)


class FreezePredictor(FreezeTracker):
    """Predict in a high-precision run which elements would freeze if stored in each of ``formats``, and how many SR
    would move; with ``rand_bits``, few-bit SR too (every element followed). ``fit_steps``: the first steps
    :meth:`fitted_schedule_rule` measures (holding the initial stored values until then).
    """

    def __init__(self, tensors: TensorSource, formats: Sequence[Format] = ("bf16",),
                 rand_bits: Optional[int] = None, keep_masks: bool = False, fit_steps: int = 1) -> None:
        if isinstance(fit_steps, bool) or not isinstance(fit_steps, int) or fit_steps < 1:
            raise ValueError(f"fit_steps must be a whole number of steps, 1 or more; got {fit_steps!r}")
        super().__init__(tensors, formats, rand_bits=rand_bits, keep_masks=keep_masks)
        self.fit_steps = fit_steps
        self._fit_seen = 0
        self._first_ratios: Dict[str, torch.Tensor] = {}  # per format: |d_0| / gap(q(w_0)), every element
        self._fit_sums: Dict[str, torch.Tensor] = {}      # per format: the sum of |d_t| / gap(q(w_0)) over the fit
        self._stored0: Dict[str, Dict[str, torch.Tensor]] = {}   # the initial stored values, during the fit

    def held_bytes(self) -> int:
        """:meth:`FreezeTracker.held_bytes` and the baselines' ratios, sums and initial values."""
        stored0 = [t for by_name in self._stored0.values() for t in by_name.values()]
        return super().held_bytes() + _nbytes([*self._first_ratios.values(), *self._fit_sums.values(), *stored0])

    def after_step(self) -> None:
        """Predict, for the update just applied, the frozen elements and SR's moves per format."""
        super().after_step()
        if self._fit_seen < self.fit_steps:
            self._fit_seen += 1
            if self._fit_seen == self.fit_steps:
                self._stored0 = {}

    def _needs_pairs(self) -> bool:
        return self._fit_seen < self.fit_steps

    def _pairs_seen(self, pairs) -> None:
        """The fit: each update of the first :attr:`fit_steps` steps in gaps of the initial stored value."""
        if self._fit_seen >= self.fit_steps:
            return
        first = not self._first_ratios
        for fmt in self.formats:
            if first:   # the initial stored values: the gaps both schedule rules measure in
                self._stored0[fmt.name] = {name: quantize(old, fmt) for name, old, _ in pairs}
            stored0 = self._stored0[fmt.name]
            ratios = [update_ulp_ratio(stored0[name], new - old, fmt).reshape(-1).double()
                      for name, old, new in pairs if name in stored0]
            ratios = torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)
            if first:
                self._first_ratios[fmt.name] = ratios.float()
                self._fit_sums[fmt.name] = ratios
            elif ratios.numel() == self._fit_sums[fmt.name].numel():
                self._fit_sums[fmt.name] += ratios

    def schedule_rule(self, fmt: Union[Format, None], lr_scale: Sequence[float]) -> List[float]:
        """The schedule rule: per step t, the fraction of elements whose first update times
        ``lr_scale[t]`` (``eta_t / eta_0``) is below half the gap of the initial stored value."""
        return _share_below_half(self._fit_values(fmt, self._first_ratios), lr_scale)

    def fitted_schedule_rule(self, fmt: Union[Format, None], lrs: Sequence[float]) -> List[float]:
        """The schedule rule fitted on the first :attr:`fit_steps` steps: an element's updates over them in gaps of
        its initial stored value, over the sum of ``lrs[:fit_steps]``, is its update per unit of learning rate; it is
        frozen at step t when that times ``lrs[t]`` is below one half.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2))
            >>> p = FreezePredictor({"w": w}, ["bf16"], fit_steps=2)
            >>> for d in (8e-3, 2e-3):   # the second step a quarter of the first
            ...     p.before_step(); w.data -= d; p.after_step()
            >>> p.fitted_schedule_rule("bf16", [1.0, 1.0, 0.5, 0.3])   # 1.28 gaps per unit of lr
            [0.0, 0.0, 0.0, 1.0]
            >>> p.schedule_rule("bf16", [1.0, 1.0, 0.5, 0.3])          # the first step alone: 2.05
            [0.0, 0.0, 0.0, 0.0]
        """
        lrs = [float(x) for x in lrs]
        if self._fit_seen < self.fit_steps:
            raise ValueError(f"the fit needs {self.fit_steps} steps; the run took {self._fit_seen}")
        total = sum(lrs[:self.fit_steps])
        if len(lrs) < self.fit_steps or not total > 0:
            raise ValueError(f"give the learning rate of every step, the first {self.fit_steps} not all zero; "
                             f"got {lrs[:self.fit_steps]}")
        values = {name: sums / total for name, sums in self._fit_sums.items()}
        return _share_below_half(self._fit_values(fmt, values), lrs)

    def baselines(self, fmt: Union[Format, None], lrs: Sequence[float]) -> Dict[str, List[float]]:
        """The baselines' frozen-fraction curves for learning rates ``lrs``: ``"schedule"``,
        ``"schedule_fitted"``, ``"always"`` and ``"never"``.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(2))
            >>> p = FreezePredictor({"w": w}, ["bf16"], fit_steps=1)
            >>> p.before_step(); w.data -= 8e-3; p.after_step()
            >>> p.baselines("bf16", [1.0, 0.1])
            {'schedule': [0.0, 1.0], 'schedule_fitted': [0.0, 1.0], 'always': [1.0, 1.0], 'never': [0.0, 0.0]}
        """
        return {"schedule": self.schedule_rule(fmt, [lr / lrs[0] for lr in lrs]),
                "schedule_fitted": self.fitted_schedule_rule(fmt, lrs),
                "always": [1.0] * len(lrs), "never": [0.0] * len(lrs)}

    def _fit_values(self, fmt, values: Dict[str, torch.Tensor]) -> torch.Tensor:
        name = self.formats[0].name if fmt is None else get_format(fmt).name
        if name not in values:
            raise KeyError(f"no first step recorded for {name}; predicted: {', '.join(f.name for f in self.formats)}")
        return values[name]


def _share_below_half(values: torch.Tensor, scale: Sequence[float]) -> List[float]:
    """Per step t, the share of ``values`` with ``value * scale[t] < 0.5`` (one bucketize pass)."""
    n = values.numel()
    if n == 0:
        return [math.nan] * len(scale)
    limits = sorted({0.5 / s if s > 0 else math.inf for s in scale})
    edges = torch.tensor(limits, dtype=torch.float64, device=values.device)
    below = torch.bincount(torch.bucketize(values.double(), edges, right=True), minlength=len(limits) + 1)
    count = dict(zip(limits, torch.cumsum(below, 0)[:len(limits)].tolist()))
    return [count[0.5 / s if s > 0 else math.inf] / n for s in scale]
