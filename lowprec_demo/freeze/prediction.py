"""Freeze prediction in a high-precision run, and observation in a low-precision one.

Prediction: an element with value ``w_t`` and update ``d_t = w_{t+1} - w_t`` is frozen in a format when
``q(q(w_t) + d_t) == q(w_t)`` (round to nearest ``q``), i.e. ``|d_t| < gap/2``; stochastic rounding moves it with
probability ``min(1, |d|/gap)``. One reference run predicts any number of formats at once. Observation: an element is
frozen at a step when its stored value did not change. Both are :class:`StepTracker` objects: call ``before_step()``
just before ``optimizer.step()`` and ``after_step()`` just after it.

The predictor's baselines need no trajectory: the *schedule rule* scales each element's first
update, in gaps of its initial stored value, by the schedule; the *fitted* one takes the update
per unit of learning rate over the first ``fit_steps`` steps (Adam's later steps are smaller).

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
from lowprec_demo.freeze.counts import fewbit_count, fold_octaves, frozen_per_tensor, histograms, step_counts
from lowprec_demo.freeze.records import RATIO_BINS, FreezeRecord, freeze_order, freeze_step, steps_agree
from lowprec_demo.optim.packing import Pack, copy_into, packs
from lowprec_demo.rounding import freeze_rule
from lowprec_demo.rounding.freeze_rule import OCTAVES
from lowprec_demo.rounding import quantize, update_ulp_ratio, would_freeze

__all__ = ["FreezeRecord", "StepTracker", "FreezePredictor", "FreezeObserver", "freeze_step", "freeze_order",
           "steps_agree", "named_tensors", "RATIO_BINS"]

TensorSource = Union[Mapping[str, torch.Tensor], Callable[[], Mapping[str, torch.Tensor]], torch.nn.Module]


def named_tensors(source: TensorSource) -> Dict[str, torch.Tensor]:
    """The tensors of a source: a mapping, a callable returning one, or a module (its parameters)."""
    if isinstance(source, torch.nn.Module):
        return dict(source.named_parameters())
    if callable(source):
        return dict(source())
    return dict(source)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _frozen_mask(stored: torch.Tensor, old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Per element, whether ``q(q(old) + new - old) == q(old)`` (``stored = q(old)``), by
    :func:`~lowprec_demo.rounding.would_freeze`."""
    return would_freeze(stored, new - old, get_format(fmt))


class StepTracker:
    """What both trackers share: :meth:`before_step` snapshots the tracked ``tensors`` (a module, a mapping name ->
    tensor, or a callable returning one, for optimizer state that appears after the first step) into buffers kept from
    step to step, one per pack of :func:`lowprec_demo.optim.packing.packs`, so that a step costs a few operations per
    pack rather than per tensor; :meth:`after_step` compares and adds one point to each of ``records`` (a
    :class:`FreezeRecord` per format name). With ``keep_masks``, ``masks`` holds the last step's
    ``{format: {tensor: bool mask}}`` (:mod:`lowprec_demo.freeze.agreement`).
    """

    def __init__(self, tensors: TensorSource, keep_masks: bool = False) -> None:
        self.records: Dict[str, FreezeRecord] = {}
        self.keep_masks = keep_masks
        self.masks: Dict[str, Dict[str, torch.Tensor]] = {}
        self._source = tensors
        self._before: Dict[str, torch.Tensor] = {}  # the snapshot by name (views of the buffers), until compared
        self._layout: Optional[tuple] = None
        self._packs: List[Pack] = []
        self._names: List[List[str]] = []           # per pack, the names of its tensors
        self._snapshots: List[torch.Tensor] = []    # per pack, the values before the step
        self._views: Dict[str, torch.Tensor] = {}   # per tensor, its view of its pack's buffer

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tracked tensors as they are now, by name (the live tensors, not copies)."""
        return {k: v for k, v in named_tensors(self._source).items() if torch.is_tensor(v)}

    def held_bytes(self) -> int:
        """The memory kept from step to step: snapshot buffers, the packs' codes and tags, masks."""
        masks = [m for by_name in self.masks.values() for m in by_name.values()]
        return sum(pack.held_bytes() for pack in self._packs) + _nbytes(self._snapshots + masks)

    @staticmethod
    def _layout_of(tensors: Dict[str, torch.Tensor]) -> tuple:
        return tuple((k, v.shape, v.dtype, v.device) for k, v in tensors.items())

    def record(self, fmt: Union[str, FloatFormat, None] = None) -> FreezeRecord:
        """The record of format ``fmt`` (a name or a FloatFormat; the first when None)."""
        if fmt is None:
            return next(iter(self.records.values()))
        name = get_format(fmt).name
        if name not in self.records:
            raise KeyError(f"no record for {name}; recorded: {', '.join(self.records) or 'none'}")
        return self.records[name]

    @torch.no_grad()
    def before_step(self) -> None:
        """Copy the tracked tensors into the snapshot buffers (remade when the tensors change)."""
        current = self.tensors()
        layout = self._layout_of(current)
        if layout != self._layout:
            names = list(current)
            self._packs = packs([v.detach() for v in current.values()], block=freeze_rule.BLOCK)
            self._names = [[names[i] for i in pack.indices] for pack in self._packs]
            self._snapshots = [pack.zeros() for pack in self._packs]
            self._views = {name: view for pack, names, buffer in zip(self._packs, self._names, self._snapshots)
                           for name, view in zip(names, pack.views(buffer))}
            self._layout = layout
        values = list(current.values())
        for pack, names in zip(self._packs, self._names):
            copy_into([self._views[n] for n in names], [values[i] for i in pack.indices])
        self._before = self._views

    def after_step(self) -> None:
        """Compare with the snapshot and add one step to every record."""
        raise NotImplementedError

    def _pairs(self):
        now = self.tensors()
        for name, old in self._before.items():
            if name in now:
                yield name, old, now[name].detach()

    def _packed_now(self):
        """``(pack, names, snapshot, current values)`` per pack, or None when the tensors changed
        since the snapshot (the tensor-by-tensor path handles that)."""
        if not self._before:
            return None
        now = self.tensors()
        if self._layout_of(now) != self._layout:
            return None
        values = list(now.values())
        return [(pack, names, snapshot, [values[i] for i in pack.indices])
                for pack, names, snapshot in zip(self._packs, self._names, self._snapshots)]


class FreezeObserver(StepTracker):
    """Observed freezing in a low-precision run whose values are stored in ``format`` (the
    record's name); ``tensors``, ``keep_masks`` as for :class:`StepTracker`.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> obs = FreezeObserver({"w": w}, "bf16"); obs.before_step(); w.data[0] = 2.0; obs.after_step()
        >>> obs.record().overall, list(obs.records)
        ([0.5], ['bf16'])
    """

    def __init__(self, tensors: TensorSource, format: Union[str, FloatFormat] = "", keep_masks: bool = False) -> None:
        super().__init__(tensors, keep_masks)
        self._record = FreezeRecord(format=str(format), kind="observed")
        self.records = {get_format(format).name if format else str(format): self._record}

    @torch.no_grad()
    def after_step(self) -> None:
        """Count the elements whose stored value did not change, as one step of the record."""
        packed = self._packed_now()
        if packed is None:
            pairs = [(name, int((new == old).sum().item()), new.numel()) for name, old, new in self._pairs()]
        else:  # one comparison per pack, one transfer of all the counts
            counts = torch.cat([pack.per_tensor(freeze_rule.changed_blocks(old, pack.flat(now))) if pack.several
                                else freeze_rule.equal_count(old, pack.flat(now)).reshape(1)
                                for pack, _, old, now in packed]).tolist()
            pairs, start = [], 0
            for pack, names, _, _ in packed:   # several tensors: changed elements counted, one: equal ones
                for name, n, count in zip(names, pack.sizes, counts[start:start + len(names)]):
                    pairs.append((name, n - int(count) if pack.several else int(count), n))
                start += len(names)
        self._record.add_step(pairs)
        if self.keep_masks:   # the same comparison, kept element by element
            self.masks = {next(iter(self.records)): {name: new == old for name, old, new in self._pairs()}}
        self._before = {}


class FreezePredictor(StepTracker):
    """Predict in a high-precision run which elements would freeze if stored in each of ``formats`` (``self.formats``:
    the distinct ones, in order), and how many SR would move; with ``rand_bits``, few-bit SR too. ``fit_steps``: the
    first steps :meth:`fitted_schedule_rule` measures (holding the initial stored values until then).
    """

    def __init__(self, tensors: TensorSource, formats: Sequence[Union[str, FloatFormat]] = ("bf16",),
                 rand_bits: Optional[int] = None, keep_masks: bool = False, fit_steps: int = 1) -> None:
        super().__init__(tensors, keep_masks)
        if isinstance(fit_steps, bool) or not isinstance(fit_steps, int) or fit_steps < 1:
            raise ValueError(f"fit_steps must be a whole number of steps, 1 or more; got {fit_steps!r}")
        if isinstance(formats, (str, FloatFormat)):
            formats = [formats]
        distinct: Dict[str, FloatFormat] = {}
        for f in map(get_format, formats):   # one record per distinct grid name, in the order given
            distinct.setdefault(f.name, f)
        self.formats = list(distinct.values())
        if not self.formats:
            raise ValueError("give at least one format to predict")
        self.rand_bits = rand_bits
        self.records = {f.name: FreezeRecord(format=f.name, kind="predicted", rand_bits=rand_bits)
                        for f in self.formats}
        self.fit_steps = fit_steps
        self._fit_seen = 0
        self._first_ratios: Dict[str, torch.Tensor] = {}  # per format: |d_0| / gap(q(w_0)), every element
        self._fit_sums: Dict[str, torch.Tensor] = {}      # per format: the sum of |d_t| / gap(q(w_0)) over the fit
        self._stored0: Dict[str, Dict[str, torch.Tensor]] = {}   # the initial stored values, during the fit

    def held_bytes(self) -> int:
        """:meth:`StepTracker.held_bytes` and the baselines' ratios, sums and initial values."""
        stored0 = [t for by_name in self._stored0.values() for t in by_name.values()]
        return super().held_bytes() + _nbytes([*self._first_ratios.values(), *self._fit_sums.values(), *stored0])

    @torch.no_grad()
    def after_step(self) -> None:
        """Predict, for the update just applied, the frozen elements and SR's moves per format."""
        packed = self._packed_now()
        if packed is not None and all(freeze_rule.fits(old, fmt) for _, _, old, _ in packed for fmt in self.formats):
            self._after_step_packed(packed)
        else:
            self._after_step_by_tensor()
        first, fitting = not self._first_ratios, self._fit_seen < self.fit_steps
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
        """The schedule rule: per step t, the fraction of elements whose first update times
        ``lr_scale[t]`` (``eta_t / eta_0``) is below half the gap of the initial stored value."""
        return _share_below_half(self._fit_values(fmt, self._first_ratios), lr_scale)

    def fitted_schedule_rule(self, fmt: Union[str, FloatFormat, None], lrs: Sequence[float]) -> List[float]:
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

    def baselines(self, fmt: Union[str, FloatFormat, None], lrs: Sequence[float]) -> Dict[str, List[float]]:
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

    def _after_step_packed(self, packed) -> None:
        """Every format by :func:`~lowprec_demo.freeze.counts.step_counts` per pack, folded on the device, one
        transfer."""
        device = packed[0][2].device if packed else torch.device("cpu")
        zero_id = torch.zeros((), dtype=torch.int32, device=device)
        names = [name for _, pack_names, _, _ in packed for name in pack_names]
        sizes = [n for pack, _, _, _ in packed for n in pack.sizes]
        parts = []
        for fmt in self.formats:
            hist = torch.zeros(OCTAVES, dtype=torch.int64, device=device)
            moved = torch.zeros((), dtype=torch.float64, device=device)
            for pack, _, old, now in packed:
                k = len(pack.sizes)   # (a pack's gaps: one more tensor index, left out)
                ids, n = (pack.tensor_ids(), k + 1) if pack.several else (zero_id, 1)
                counts, moves = step_counts(old, pack.flat(now), fmt, ids, n, None, rand_bits=self.rand_bits,
                                            moves_sum=True, octaves=True)
                parts.append(frozen_per_tensor(counts[:k]).double())
                hist = hist + histograms(counts[:k].sum(0, keepdim=True), nan="drop")[0]
                moved = moved + moves
            parts += self._summary(hist, moved)
        self._add_all(torch.cat(parts).tolist(), names, sizes)

    def _after_step_by_tensor(self) -> None:
        """Tensor by tensor (where the kernel does not fit: float64 tensors, formats beyond float32): the same count."""
        pairs = list(self._pairs())
        device = pairs[0][1].device if pairs else torch.device("cpu")
        zero_id = torch.zeros((), dtype=torch.int32, device=device)
        parts = []
        for fmt in self.formats:
            hist = torch.zeros(OCTAVES, dtype=torch.int64, device=device)
            moved = torch.zeros((), dtype=torch.float64, device=device)
            for _, old, new in pairs:
                counts, moved_here = step_counts(old.reshape(-1), new.reshape(-1), fmt, zero_id.to(old.device), 1, None,
                                                 rand_bits=self.rand_bits, moves_sum=True, octaves=True)
                parts.append(frozen_per_tensor(counts).double().to(device))
                hist = hist + histograms(counts, nan="drop").sum(0).to(device)
                moved = moved + moved_here.to(device)
            parts += self._summary(hist, moved)
        self._add_all(torch.cat(parts).tolist(), [n for n, _, _ in pairs],
                      [old.numel() for _, old, _ in pairs])

    def _summary(self, hist: torch.Tensor, moved: torch.Tensor) -> List[torch.Tensor]:
        """A format's step on the device: its whole-octave histogram folded into :data:`RATIO_BINS`, the move sum
        and, for few-bit SR, the count that never moves (float64, to go in one transfer)."""
        fewbit = fewbit_count(hist, self.rand_bits).reshape(1) if self.rand_bits is not None else hist[:0]
        return [fold_octaves(hist, RATIO_BINS).double(), moved.reshape(1), fewbit.double()]

    def _add_all(self, values: List[float], names: List[str], sizes: List[int]) -> None:
        """Every format's record from the values of :meth:`_summary` after its frozen elements per tensor."""
        at, n_bins = 0, len(RATIO_BINS) + 1
        for fmt in self.formats:
            frozen = [int(v) for v in values[at:at + len(names)]]
            at += len(names)
            octaves, moved = [int(v) for v in values[at:at + n_bins]], values[at + n_bins]
            at += n_bins + 1
            fewbit = None
            if self.rand_bits is not None:
                fewbit, at = int(values[at]), at + 1
            self._add_counts(fmt, list(zip(names, frozen, sizes)), moved, octaves, fewbit)

    def _add_counts(self, fmt: FloatFormat, per_tensor: List[tuple], moved: float, octaves: List[int],
                    fewbit: Optional[int]) -> None:
        """One step of ``fmt``'s record from the frozen elements per tensor, the move sum, the whole-octave histogram
        and (few-bit SR) the count that never moves."""
        rec = self.records[fmt.name]
        count = rec.add_step(per_tensor)
        rec.move_fraction.append(moved / count if count else math.nan)
        if fewbit is not None:
            rec.fewbit_frozen.append(fewbit / count if count else math.nan)
        rec.ratio_histogram = [a + b for a, b in zip(rec.ratio_histogram, octaves)]


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
