"""Freeze prediction from a high-precision run, and freeze observation in a low-precision run.

Prediction (science): run the training in float32. At step t every element i has a stored value
``w_t`` and a reference update ``d_t = w_{t+1} - w_t``. With ``q`` the rounding to a format, the
element is predicted frozen when ``q(q(w_t) + d_t) == q(w_t)`` (round to nearest), i.e.
``|d_t| < gap/2`` (see :func:`lowprec_demo.rounding.would_freeze`). The predicted frozen fraction
F(t) is the mean over elements, per tensor and overall. One reference run predicts any number of
formats at once, in memory proportional to the parameters: each step keeps one copy of the tracked
tensors and nothing of the trajectory.

Stochastic rounding: an element moves with probability ``min(1, |d|/gap)``; the predicted fraction
of elements that move is the mean of that, and the expected SR trajectory is the reference one.
With k random bits an element whose ``|d|/gap`` rounds to zero at k bits never moves.

Observation: in a low-precision run an element is frozen at step t when its stored value did not
change.

Element by element: with ``keep_masks=True`` both trackers keep the last step's frozen mask
(``masks[format][tensor]``, one bool per element), so that a reference run and a low-precision
run stepped in lockstep can be compared element by element (:func:`lowprec_demo.agreement.mask_mismatch`) in memory
proportional to the parameters.

Baselines: the *schedule rule* (:meth:`FreezePredictor.schedule_rule`) predicts without the
trajectory: it keeps only the first step's update of every element, measured in gaps of its
initial stored value, and scales it by the learning-rate schedule (for SGD, eta_t times the first
gradient; for Adam-type optimizers, whose first update is about eta_0 per element, eta_t). Adam's
later steps are smaller than its first (the ratio ``r = |d_t| / eta_t`` falls below one), so the
*fitted schedule rule* (:meth:`FreezePredictor.fitted_schedule_rule`) measures each element's
ratio over the run's first ``fit_steps`` steps only (the warmup, say) and scales that: it looks at
the beginning of the trajectory, never at the steps it predicts.

Both are :class:`StepTracker` objects with one protocol: call ``before_step()`` just before
``optimizer.step()`` and ``after_step()`` just after it; ``record(fmt)`` returns the
:class:`FreezeRecord` of a format and ``records`` holds them all by format name.

The freeze step for a threshold tau is the first step from which the frozen fraction stays at or
above tau until the end of the run.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> predictor = FreezePredictor({"w": w}, formats=["bf16"])
    >>> predictor.before_step(); w.data -= 1e-3; predictor.after_step()
    >>> predictor.record("bf16").overall
    [1.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch

from lowprec_demo.rounding import kernels
from lowprec_demo.freeze.counts import count_freezes
from lowprec_demo.rounding.rule import RATIO_EDGES
from lowprec_demo.optim.packing import Pack, copy_into, packs
from lowprec_demo.formats import FloatFormat, get_format
from lowprec_demo.rounding.core import move_probability, quantize, update_ulp_ratio, would_freeze

__all__ = ["FreezeRecord", "StepTracker", "FreezePredictor", "FreezeObserver", "freeze_step", "freeze_order",
           "steps_agree", "named_tensors", "RATIO_BINS"]

# log2(|d| / gap) histogram bins: edges -24, -23, ..., +8 (values outside go to the end bins).
RATIO_BINS = list(RATIO_EDGES)

TensorSource = Union[Mapping[str, torch.Tensor], Callable[[], Mapping[str, torch.Tensor]], torch.nn.Module]


def named_tensors(source: TensorSource) -> Dict[str, torch.Tensor]:
    """Resolve a tensor source: a mapping, a callable returning one, or a module (its named
    parameters). Example: ``named_tensors(torch.nn.Linear(2, 2)).keys()`` -> weight, bias."""
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    if callable(source):
        return dict(source())
    return dict(source)


def freeze_step(fractions: Sequence[float], threshold: float) -> Optional[int]:
    """The first step from which the frozen fraction stays ``>= threshold`` to the end of the run,
    or None if the last step is below it.

    Example:
        >>> freeze_step([0.1, 0.9, 0.5, 0.95, 1.0], 0.9)
        3
    """
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    step = None
    for t in range(len(fractions) - 1, -1, -1):
        if fractions[t] >= threshold:
            step = t
        else:
            break
    return step


def steps_agree(predicted: Optional[int], observed: Optional[int], total_steps: int) -> bool:
    """The book's tolerance: the predicted and observed freeze steps differ by at most
    max(2 steps, 2 % of the run).

    A freeze step is None when the frozen fraction does not stay at or above the threshold by the
    end of the run. Both None is agreement: the prediction that nothing freezes within the run,
    confirmed. One None and the other a step is not. A tally of how often the prediction holds
    where something froze leaves the runs where both are None out (the sweep's rows say which
    with ``froze``).

    Example:
        >>> steps_agree(100, 103, 500), steps_agree(100, 103, 100), steps_agree(None, None, 100)
        (True, False, True)
    """
    if predicted is None or observed is None:
        return predicted is None and observed is None
    return abs(predicted - observed) <= max(2, 0.02 * total_steps)


@dataclass
class FreezeRecord:
    """Per-step frozen fractions of a set of tensors (predicted or observed).

    ``overall[t]`` is the element-weighted mean over all tensors at step t, ``by_tensor[name][t]``
    the fraction of one tensor, ``sizes[name]`` its element count. Predictions also carry
    ``move_fraction`` (expected fraction of elements SR moves, with ``rand_bits`` random bits when
    set) and ``ratio_histogram`` (counts of ``log2(|d|/gap)`` per bin of :data:`RATIO_BINS`,
    summed over the run).
    """

    format: str
    kind: str                                  # "predicted" or "observed"
    sizes: Dict[str, int] = field(default_factory=dict)
    overall: List[float] = field(default_factory=list)
    by_tensor: Dict[str, List[float]] = field(default_factory=dict)
    move_fraction: List[float] = field(default_factory=list)
    fewbit_frozen: List[float] = field(default_factory=list)
    rand_bits: Optional[int] = None
    ratio_histogram: List[int] = field(default_factory=lambda: [0] * (len(RATIO_BINS) + 1))
    by_tensor_steps: Optional[List[int]] = None  # set when per-tensor curves were thinned

    def tensor_steps(self, name: str) -> List[int]:
        """The step of every point of ``by_tensor[name]``."""
        return self.by_tensor_steps or list(range(len(self.by_tensor[name])))

    def freeze_step(self, threshold: float) -> Optional[int]:
        """First step from which the overall fraction stays >= threshold."""
        return freeze_step(self.overall, threshold)

    def tensor_freeze_steps(self, threshold: float) -> Dict[str, Optional[int]]:
        """Freeze step of every tensor (on thinned curves: the step of the first kept point from
        which the tensor stays frozen)."""
        out = {}
        for name, values in self.by_tensor.items():
            i = freeze_step(values, threshold)
            out[name] = None if i is None else self.tensor_steps(name)[i]
        return out

    def to_dict(self) -> dict:
        return {"format": self.format, "kind": self.kind, "sizes": self.sizes, "overall": self.overall,
                "by_tensor": self.by_tensor, "move_fraction": self.move_fraction,
                "fewbit_frozen": self.fewbit_frozen, "rand_bits": self.rand_bits,
                "ratio_bins": RATIO_BINS, "ratio_histogram": self.ratio_histogram}

    @classmethod
    def from_dict(cls, d: dict) -> "FreezeRecord":
        keys = {"format", "kind", "sizes", "overall", "by_tensor", "move_fraction", "fewbit_frozen",
                "rand_bits", "ratio_histogram", "by_tensor_steps"}
        return cls(**{k: v for k, v in d.items() if k in keys})


def freeze_order(record: FreezeRecord, threshold: float) -> List[tuple]:
    """Tensors sorted by the step at which they freeze (never-frozen ones last).

    Example: ``freeze_order(record, 0.9)[0]`` is the first tensor to freeze, as ``(name, step)``.
    """
    steps = record.tensor_freeze_steps(threshold)
    return sorted(steps.items(), key=lambda kv: (kv[1] is None, kv[1] if kv[1] is not None else 0, kv[0]))


def _frozen_mask(stored: torch.Tensor, old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Element by element, whether round to nearest of the exact sum ``q(w) + d`` gives back
    ``q(w)`` (``d = new - old``, ``stored = q(old)``): the rule of :mod:`lowprec_demo.freeze_rule`,
    by the freeze kernel for float32 tensors of a format float32 holds, else by
    :func:`~lowprec_demo.rounding.would_freeze`."""
    fmt = get_format(fmt)
    if old.dtype == torch.float32 and kernels.fits(old, fmt):
        return kernels.freeze_detail(old.reshape(-1), new.reshape(-1), fmt)[0].view(old.shape)
    return would_freeze(stored, new - old, fmt)


class StepTracker:
    """What :class:`FreezeObserver` and :class:`FreezePredictor` share: a snapshot of the tracked
    tensors taken by :meth:`before_step`, just before ``optimizer.step()``, compared with their
    new values by :meth:`after_step`, just after it, which adds one point per step to the
    records. The snapshot lives in buffers kept from step to step (one copy of the tracked
    tensors), one per pack of :func:`lowprec_demo.packing.packs`: a large tensor alone, or a
    run of small ones, so that a step costs a few operations per pack rather than per tensor.
    In a pack of several tensors each tensor starts at a multiple of
    :data:`lowprec_demo.kernels.BLOCK` elements and zeros fill the gaps (the same zeros in every
    buffer of the pack): the kernels count per block, and a tensor's count is the sum of its
    blocks' (one weighted bincount over the blocks, not an operation over the elements). The
    tracked tensors may change between steps (optimizer state appears after the first one).

    Args:
        tensors: what to track: a module, a mapping name -> tensor, or a callable returning one.
        keep_masks: also keep the last step's frozen mask of every tensor in ``masks``.

    Attributes:
        records: one :class:`FreezeRecord` per format, by format name.
        masks: with ``keep_masks``, ``{format name: {tensor name: bool tensor}}`` for the last
            step (replaced every step: one bool per element and format).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> tracker = FreezeObserver({"w": w}, "bf16")
        >>> tracker.before_step(); w.data[0] = 2.0; tracker.after_step()
        >>> tracker.record().overall, list(tracker.records)
        ([0.5], ['bf16'])
    """

    def __init__(self, tensors: TensorSource, keep_masks: bool = False) -> None:
        self.records: Dict[str, FreezeRecord] = {}
        self.keep_masks = keep_masks
        self.masks: Dict[str, Dict[str, torch.Tensor]] = {}
        self._source = tensors
        self._before: Dict[str, torch.Tensor] = {}
        self._layout: Optional[tuple] = None
        self._packs: List[Pack] = []
        self._names: List[List[str]] = []          # per pack, the names of its tensors
        self._snapshots: List[torch.Tensor] = []    # per pack, the values before the step
        self._snapshot_views: List[List[torch.Tensor]] = []
        self._views: Dict[str, torch.Tensor] = {}

    def _current(self) -> Dict[str, torch.Tensor]:
        return {k: v for k, v in named_tensors(self._source).items() if torch.is_tensor(v)}

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tracked tensors as they are now, by name (the live tensors, not copies)."""
        return self._current()

    def held_bytes(self) -> int:
        """The memory this tracker keeps from step to step: its snapshot buffers (codes and tags
        included), the kept masks, and a predictor's first-step ratios and fit (with the initial
        stored values until the fit steps are over)."""
        tensors = [m for masks in self.masks.values() for m in masks.values()]
        tensors += list(getattr(self, "_first_ratios", {}).values()) + list(getattr(self, "_fit_sums", {}).values())
        tensors += [t for stored in getattr(self, "_stored0", {}).values() for t in stored.values()]
        tensors += self._snapshots
        return sum(pack.held_bytes() for pack in self._packs) + sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def _layout_of(tensors: Dict[str, torch.Tensor]) -> tuple:
        return tuple((k, v.shape, v.dtype, v.device) for k, v in tensors.items())

    def record(self, fmt: Union[str, FloatFormat, None] = None) -> FreezeRecord:
        """The record of format ``fmt`` (a name or a FloatFormat), or of the first format when
        None; a KeyError names the recorded formats otherwise."""
        if fmt is None:
            return next(iter(self.records.values()))
        name = get_format(fmt).name
        if name not in self.records:
            raise KeyError(f"no record for {name}; recorded: {', '.join(self.records) or 'none'}")
        return self.records[name]

    @torch.no_grad()
    def before_step(self) -> None:
        """Copy the tracked tensors (call just before ``optimizer.step()``). The copies live in
        buffers kept from step to step: one copy of the tracked tensors."""
        current = self._current()
        layout = self._layout_of(current)
        if layout != self._layout:
            names = list(current)
            self._packs = packs([v.detach() for v in current.values()], block=kernels.BLOCK)
            self._names = [[names[i] for i in pack.indices] for pack in self._packs]
            self._snapshots = [pack.zeros() for pack in self._packs]
            self._snapshot_views = [pack.views(buffer) for pack, buffer in zip(self._packs, self._snapshots)]
            self._layout = layout
            self._views = {name: view for names, views in zip(self._names, self._snapshot_views)
                           for name, view in zip(names, views)}
        values = list(current.values())
        for pack, views in zip(self._packs, self._snapshot_views):
            copy_into(views, [values[i] for i in pack.indices])
        self._before = self._views

    def after_step(self) -> None:
        """Compare the tracked tensors with the snapshot and add one step to every record (call
        just after ``optimizer.step()``); each tracker says what it counts."""
        raise NotImplementedError

    def _pairs(self):
        now = self._current()
        for name, old in self._before.items():
            if name in now:
                yield name, old, now[name].detach()

    def _packed_now(self):
        """``(pack, names, snapshot, current values)`` per pack, when the tensors still have the
        layout of the snapshot (else None: the tensor by tensor path handles appearing and
        vanishing tensors)."""
        if not self._before:
            return None
        now = self._current()
        if self._layout_of(now) != self._layout:
            return None
        values = list(now.values())
        return [(pack, names, snapshot, [values[i] for i in pack.indices])
                for pack, names, snapshot in zip(self._packs, self._names, self._snapshots)]


class FreezeObserver(StepTracker):
    """Observed freezing in a low-precision run: an element is frozen at a step when its stored
    value did not change. Call :meth:`before_step` just before ``optimizer.step()`` and
    :meth:`after_step` just after it.

    Args:
        tensors: what to track: a module, a mapping name -> tensor, or a callable returning one
            (for optimizer state, which appears after the first step).
        format: the format the stored values live in, the name of the record.

    Attributes:
        records: the one record, ``{format name: FreezeRecord}``; :meth:`record` returns it.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> obs = FreezeObserver({"w": w}, "bf16"); obs.before_step(); w.data[0] = 2.0; obs.after_step()
        >>> obs.record().overall
        [0.5]
    """

    def __init__(self, tensors: TensorSource, format: Union[str, FloatFormat] = "", keep_masks: bool = False) -> None:
        super().__init__(tensors, keep_masks)
        self._record = FreezeRecord(format=str(format), kind="observed")
        self.records = {get_format(format).name if format else str(format): self._record}

    @torch.no_grad()
    def after_step(self) -> None:
        """Count the elements whose stored value did not change, per tensor and overall, and add
        them as one step of the record (call just after ``optimizer.step()``)."""
        packed = self._packed_now()
        if packed is None:
            pairs = [(name, int((new == old).sum().item()), new.numel()) for name, old, new in self._pairs()]
        else:  # one comparison per pack, one transfer of all the counts
            counts = torch.cat([pack.per_tensor(kernels.changed_blocks(old, pack.flat(now))) if pack.several
                                else kernels.equal_count(old, pack.flat(now)).reshape(1)
                                for pack, _, old, now in packed]).tolist()
            pairs, start = [], 0
            for pack, names, _, _ in packed:   # several tensors: changed elements counted, one: equal ones
                for name, n, count in zip(names, pack.sizes, counts[start:start + len(names)]):
                    pairs.append((name, n - int(count) if pack.several else int(count), n))
                start += len(names)
        total_frozen, total = 0, 0
        for name, frozen, n in pairs:
            self._append(name, frozen / n if n else math.nan, n)
            total_frozen += frozen
            total += n
        self._record.overall.append(total_frozen / total if total else math.nan)
        if self.keep_masks:   # the same comparison, kept element by element
            self.masks = {next(iter(self.records)): {name: new == old for name, old, new in self._pairs()}}
        self._before = {}

    def _append(self, name: str, value: float, n: int) -> None:
        rec = self._record
        if name not in rec.by_tensor:   # state tensors appear after the first step: pad with NaN
            rec.by_tensor[name] = [math.nan] * len(rec.overall)
            rec.sizes[name] = n
        rec.by_tensor[name].append(value)


class FreezePredictor(StepTracker):
    """Predict, during a high-precision reference run, which elements would freeze if the stored
    values lived in each of ``formats`` (round to nearest), and how many SR would move. Call
    :meth:`before_step` just before ``optimizer.step()`` and :meth:`after_step` just after it.

    Args:
        tensors: what to track: a module, a mapping name -> tensor, or a callable returning one
            (for optimizer state, which appears after the first step).
        formats: one or several formats, predicted at once.
        rand_bits: also predict few-bit SR with this many random bits (None: skip).
        keep_masks: also keep the last step's predicted frozen mask of every tensor and format in
            ``masks``.
        fit_steps: the first steps whose updates :meth:`fitted_schedule_rule` measures (it keeps
            one copy of the initial stored values per format until then).

    Attributes:
        formats: the distinct formats predicted, as FloatFormats, in the order given.
        records: one record per format, by format name; :meth:`record` returns one.

    Example: see the module docstring.
    """

    def __init__(self, tensors: TensorSource, formats: Sequence[Union[str, FloatFormat]] = ("bf16",),
                 rand_bits: Optional[int] = None, keep_masks: bool = False, fit_steps: int = 1) -> None:
        super().__init__(tensors, keep_masks)
        if isinstance(fit_steps, bool) or not isinstance(fit_steps, int) or fit_steps < 1:
            raise ValueError(f"fit_steps must be a whole number of steps, 1 or more; got {fit_steps!r}")
        if isinstance(formats, (str, FloatFormat)):
            formats = [formats]
        self.formats = []
        for f in formats:  # one record per distinct grid name, in the order given
            f = get_format(f)
            if f.name not in [g.name for g in self.formats]:
                self.formats.append(f)
        if not self.formats:
            raise ValueError("give at least one format to predict")
        self.rand_bits = rand_bits
        self.records = {f.name: FreezeRecord(format=f.name, kind="predicted", rand_bits=rand_bits)
                        for f in self.formats}
        self._first_ratios: Dict[str, torch.Tensor] = {}
        self.fit_steps = fit_steps
        self._fit_sums: Dict[str, torch.Tensor] = {}     # per format: sum over the fit steps of |d_t| / gap(q(w_0))
        self._fit_seen = 0
        self._stored0: Dict[str, Dict[str, torch.Tensor]] = {}   # the initial stored values, during the fit steps

    @torch.no_grad()
    def after_step(self) -> None:
        """Predict, for the update just applied, which elements would freeze in each format and
        the fraction SR would move, and add them as one step of each record (call just after
        ``optimizer.step()``)."""
        packed = self._packed_now()
        fused = packed is not None and all(
            kernels.fits(old, fmt) for _, _, old, _ in packed for fmt in self.formats)
        if fused:
            self._after_step_packed(packed)
        else:
            self._after_step_by_tensor()
        first = not self._first_ratios
        fitting = self._fit_seen < self.fit_steps
        if self.keep_masks or fitting:
            pairs = list(self._pairs())
            masks = {}
            for fmt in self.formats:
                stored = {name: quantize(old, fmt) for name, old, _ in pairs}
                if self.keep_masks:
                    masks[fmt.name] = {name: _frozen_mask(stored[name], old, new, fmt) for name, old, new in pairs}
                if first:   # the initial stored values: the gaps both schedule rules measure in
                    self._stored0[fmt.name] = stored
                if fitting:   # this update in gaps of the initial stored value
                    stored0 = self._stored0[fmt.name]
                    ratios = [update_ulp_ratio(stored0[name], new - old, fmt).reshape(-1).double()
                              for name, old, new in pairs if name in stored0]
                    ratios = torch.cat(ratios) if ratios else torch.zeros(0, dtype=torch.float64)
                    if first:
                        self._first_ratios[fmt.name] = ratios.float()
                        self._fit_sums[fmt.name] = ratios
                    elif ratios.numel() == self._fit_sums[fmt.name].numel():
                        self._fit_sums[fmt.name] += ratios
            self.masks = masks
        if fitting:
            self._fit_seen += 1
            if self._fit_seen == self.fit_steps:
                self._stored0 = {}
        self._before = {}

    def schedule_rule(self, fmt: Union[str, FloatFormat, None], lr_scale: Sequence[float]) -> List[float]:
        """The schedule rule, a baseline that does not use the reference trajectory after its
        first step: the fraction of elements whose first update, times ``lr_scale[t]``
        (``eta_t / eta_0``), is below half the gap of the initial stored value, per step.

        Example:
            >>> w = torch.nn.Parameter(torch.ones(4))
            >>> p = FreezePredictor({"w": w}, ["bf16"])
            >>> p.before_step(); w.data -= torch.tensor([2e-3, 4e-3, 8e-3, 16e-3]); p.after_step()
            >>> p.schedule_rule("bf16", [1.0, 0.5, 0.1])
            [0.0, 0.25, 1.0]
        """
        return _share_below_half(self._fit_values(fmt, self._first_ratios), lr_scale)

    def fitted_schedule_rule(self, fmt: Union[str, FloatFormat, None], lrs: Sequence[float]) -> List[float]:
        """The schedule rule with Adam's ratio fitted on the run's first steps: each element's
        updates over the first :attr:`fit_steps` steps, in gaps of its initial stored value,
        summed and divided by the sum of those steps' learning rates (``lrs[:fit_steps]``), give
        its update per unit of learning rate; the element is frozen at step t when that times
        ``lrs[t]`` is below one half. It uses nothing of the trajectory after the fit steps.

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

    def baselines(self, fmt: Union[str, FloatFormat, None], lrs: Sequence[float]) -> Dict[str, List[float]]:
        """The rules that need no fp32 run after its first steps, as frozen-fraction curves over
        a run whose learning rate at step t is ``lrs[t]``: ``"schedule"`` (:meth:`schedule_rule`),
        ``"schedule_fitted"`` (:meth:`fitted_schedule_rule`), ``"always"`` and ``"never"``
        (frozen at every step, at none). ``TrainResult.predictor_errors`` scores them.

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

    def _add(self, rec: FreezeRecord, per_tensor: List[tuple], moved_total: float, fewbit_total: float,
             hist: List[int]) -> None:
        frozen_total, count = 0.0, 0
        for name, f, n in per_tensor:
            if name not in rec.by_tensor:
                rec.by_tensor[name] = [math.nan] * len(rec.overall)
                rec.sizes[name] = n
            rec.by_tensor[name].append(f / n if n else math.nan)
            frozen_total += f
            count += n
        rec.overall.append(frozen_total / count if count else math.nan)
        rec.move_fraction.append(moved_total / count if count else math.nan)
        if self.rand_bits is not None:
            rec.fewbit_frozen.append(fewbit_total / count if count else math.nan)
        rec.ratio_histogram = [a + b for a, b in zip(rec.ratio_histogram, hist)]

    def _after_step_packed(self, packed) -> None:
        """All formats from the fused kernels (:func:`count_freezes`): one
        pass over each pack per format, the counts from one bincount per pack, everything in
        Python after one transfer."""
        pairs = [(pack, old, pack.flat(now)) for pack, _, old, now in packed]
        counted = count_freezes(pairs, self.formats, RATIO_BINS, self.rand_bits)
        names = [name for _, pack_names, _, _ in packed for name in pack_names]
        sizes = [n for pack, _, _, _ in packed for n in pack.sizes]
        for fmt, counts in zip(self.formats, counted):
            self._add(self.records[fmt.name], list(zip(names, counts.frozen, sizes)), counts.moved, counts.fewbit,
                      counts.ratio_hist)

    def _after_step_by_tensor(self) -> None:
        """Tensor by tensor with the public freeze functions (float64 or narrow tensors,
        formats float32 cannot hold, tensors that appeared or vanished since the snapshot)."""
        pairs = list(self._pairs())
        edges = torch.tensor(RATIO_BINS, dtype=torch.float32)
        for fmt in self.formats:
            rec = self.records[fmt.name]
            moved_total = fewbit_total = 0.0
            per_tensor = []
            hist = torch.zeros(len(RATIO_BINS) + 1, dtype=torch.int64)
            for name, old, new in pairs:
                stored = quantize(old, fmt)
                update = new - old
                frozen = would_freeze(stored, update, fmt)
                ratio = update_ulp_ratio(stored, update, fmt)
                moved = move_probability(stored, update, fmt, rand_bits=self.rand_bits)   # 0 where stuck
                if self.rand_bits is not None:  # the position in the gap resolved to k bits rounds to 0
                    fewbit_total += (torch.round(ratio.clamp(max=1.0) * 2.0**self.rand_bits) == 0).sum().item()
                per_tensor.append((name, frozen.sum().item(), old.numel()))
                moved_total += moved.sum().item()
                log_ratio = torch.log2(ratio[ratio > 0].float().cpu())
                hist += torch.bucketize(log_ratio, edges).bincount(minlength=len(RATIO_BINS) + 1)
                hist[0] += int((ratio == 0).sum().item())
            self._add(rec, per_tensor, moved_total, fewbit_total, hist.tolist())


def _share_below_half(values: torch.Tensor, scale: Sequence[float]) -> List[float]:
    """Per step t, the share of elements whose ``value * scale[t]`` is below one half."""
    n = values.numel()
    if n == 0:
        return [math.nan] * len(scale)
    # below at step t when value < 0.5 / scale_t: one pass over the elements, counting them into
    # the intervals between the distinct limits (sorted), then cumulative counts
    limits = sorted({0.5 / s if s > 0 else math.inf for s in scale})
    edges = torch.tensor(limits, dtype=torch.float64, device=values.device)
    below = torch.bincount(torch.bucketize(values.double(), edges, right=True), minlength=len(limits) + 1)
    count = dict(zip(limits, torch.cumsum(below, 0)[:len(limits)].tolist()))
    return [count[0.5 / s if s > 0 else math.inf] / n for s in scale]

