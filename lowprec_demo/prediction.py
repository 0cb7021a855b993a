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

from . import _fused
from .formats import FloatFormat, get_format
from .rounding import quantize, update_ulp_ratio, would_freeze

__all__ = ["FreezeRecord", "FreezePredictor", "FreezeObserver", "freeze_step", "freeze_order",
           "steps_agree", "named_tensors", "RATIO_BINS"]

# log2(|d| / gap) histogram bins: edges -24, -23, ..., +8 (values outside go to the end bins).
RATIO_BINS = list(range(-24, 9))

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
    """The book's tolerance: both exist and differ by at most max(2 steps, 2 % of the run).

    Example:
        >>> steps_agree(100, 103, 500), steps_agree(100, 103, 100)
        (True, False)
    """
    if predicted is None or observed is None:
        return False
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


class _Pack:
    """Tracked tensors that share one flat snapshot buffer: a large tensor alone, or a run of
    small ones (see :func:`lowprec_demo._fused.pack`), so that a step costs a few operations
    per pack rather than per tensor."""

    def __init__(self, names: List[str], tensors: List[torch.Tensor]) -> None:
        self.names = names
        self.shapes = [t.shape for t in tensors]
        self.sizes = [t.numel() for t in tensors]
        self.buffer = torch.empty(sum(self.sizes), dtype=tensors[0].dtype, device=tensors[0].device)
        self.views = [v.view(shape) for v, shape in zip(self.buffer.split(self.sizes), self.shapes)]
        # where each tensor's elements end in the buffer, for per-tensor counts from a cumsum;
        # the tensor of each element, shifted into the high byte, for one bincount of every code
        self._ends = torch.tensor(self.sizes, device=self.buffer.device).cumsum(0) - 1
        self.tags = None if len(names) == 1 else torch.repeat_interleave(
            torch.arange(len(names), dtype=torch.int32, device=self.buffer.device) << 8,
            torch.tensor(self.sizes, device=self.buffer.device))
        # one tensor of an even size: its codes can be counted two per bincount entry
        self.paired = len(names) == 1 and self.buffer.numel() % 2 == 0 and _fused.PAIRED_BINCOUNT
        self._codes: Optional[torch.Tensor] = None

    def codes(self) -> torch.Tensor:
        """A uint8 buffer of one code per element, kept for the next steps (allocated when first
        asked for: a fresh allocation of this size costs more than filling it)."""
        if self._codes is None:
            self._codes = torch.empty(self.buffer.numel(), dtype=torch.uint8, device=self.buffer.device)
        return self._codes

    def counts(self, flags: torch.Tensor) -> torch.Tensor:
        """How many elements of each tensor have ``flags`` (flat, 0 or 1) set, as int64."""
        if len(self.names) == 1:
            return flags.sum(dtype=torch.int64).reshape(1)
        total = flags.cumsum(0, dtype=torch.int32)[self._ends].to(torch.int64)
        return torch.cat([total[:1], total[1:] - total[:-1]])

    def snapshot(self, tensors: List[torch.Tensor]) -> None:
        if len(tensors) == 1:
            self.views[0].copy_(tensors[0])
        else:
            torch.cat([t.reshape(-1) for t in tensors], out=self.buffer)

    def flat(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        """The tensors' current values, flat, in the buffer's layout."""
        if len(tensors) == 1:
            return tensors[0].reshape(-1)
        return torch.cat([t.reshape(-1) for t in tensors])


class _StepTracker:
    """Snapshot tracked tensors before a step, compare after it."""

    def __init__(self, tensors: TensorSource) -> None:
        self._source = tensors
        self._before: Dict[str, torch.Tensor] = {}
        self._layout: Optional[tuple] = None
        self._packs: List[_Pack] = []

    def _current(self) -> Dict[str, torch.Tensor]:
        return {k: v for k, v in named_tensors(self._source).items() if torch.is_tensor(v)}

    @staticmethod
    def _layout_of(tensors: Dict[str, torch.Tensor]) -> tuple:
        return tuple((k, tuple(v.shape), v.dtype, v.device) for k, v in tensors.items())

    @torch.no_grad()
    def before_step(self) -> None:
        """Copy the tracked tensors (call just before ``optimizer.step()``). The copies live in
        buffers kept from step to step: one copy of the tracked tensors."""
        current = {k: v.detach() for k, v in self._current().items()}
        layout = self._layout_of(current)
        if layout != self._layout:
            names, tensors = list(current), list(current.values())
            self._packs = [_Pack([names[i] for i in group], [tensors[i] for i in group])
                           for group in _fused.pack(tensors)]
            self._layout = layout
        values = list(current.values())
        start = 0
        for pack in self._packs:
            pack.snapshot(values[start:start + len(pack.names)])
            start += len(pack.names)
        self._before = {name: view for pack in self._packs for name, view in zip(pack.names, pack.views)}

    def _pairs(self):
        now = self._current()
        for name, old in self._before.items():
            if name in now:
                yield name, old, now[name].detach()

    def _packed_now(self):
        """The packs with the tensors' current values, when they still have the layout of the
        snapshot (else None: the tensor by tensor path handles appearing and vanishing tensors)."""
        if not self._before:
            return None
        now = {k: v.detach() for k, v in self._current().items()}
        if self._layout_of(now) != self._layout:
            return None
        values = list(now.values())
        out, start = [], 0
        for pack in self._packs:
            out.append((pack, values[start:start + len(pack.names)]))
            start += len(pack.names)
        return out


class FreezeObserver(_StepTracker):
    """Observed freezing in a low-precision run: an element is frozen at a step when its stored
    value did not change.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> obs = FreezeObserver({"w": w}); obs.before_step(); w.data[0] = 2.0; obs.after_step()
        >>> obs.record.overall
        [0.5]
    """

    def __init__(self, tensors: TensorSource, format: str = "") -> None:
        super().__init__(tensors)
        self.record = FreezeRecord(format=str(format), kind="observed")

    @torch.no_grad()
    def after_step(self) -> None:
        """Count unchanged elements per tensor (call just after ``optimizer.step()``)."""
        packed = self._packed_now()
        if packed is None:
            pairs = [(name, int((new == old).sum().item()), new.numel()) for name, old, new in self._pairs()]
        else:  # one comparison per pack, one transfer of all the counts
            counts = torch.cat([_fused.equal_count(pack.buffer, pack.flat(now)).reshape(1) if len(now) == 1
                                else pack.counts(torch.eq(pack.flat(now), pack.buffer))
                                for pack, now in packed]).cpu()
            names = [(name, n) for pack, _ in packed for name, n in zip(pack.names, pack.sizes)]
            pairs = [(name, frozen, n) for (name, n), frozen in zip(names, counts.tolist())]
        total_frozen, total = 0, 0
        for name, frozen, n in pairs:
            self._append(name, frozen / n, n)
            total_frozen += frozen
            total += n
        self.record.overall.append(total_frozen / total if total else math.nan)
        self._before = {}

    def _append(self, name: str, value: float, n: int) -> None:
        rec = self.record
        if name not in rec.by_tensor:   # state tensors appear after the first step: pad with NaN
            rec.by_tensor[name] = [math.nan] * len(rec.overall)
            rec.sizes[name] = n
        rec.by_tensor[name].append(value)


class FreezePredictor(_StepTracker):
    """Predict, during a high-precision reference run, which elements would freeze if the stored
    values lived in each of ``formats`` (round to nearest), and how many SR would move.

    Args:
        tensors: what to track: a module, a mapping name -> tensor, or a callable returning one
            (for optimizer state, which appears after the first step).
        formats: one or several formats, predicted at once.
        rand_bits: also predict few-bit SR with this many random bits (None: skip).

    Example: see the module docstring.
    """

    def __init__(self, tensors: TensorSource, formats: Sequence[Union[str, FloatFormat]] = ("bf16",),
                 rand_bits: Optional[int] = None) -> None:
        super().__init__(tensors)
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

    def record(self, fmt: Union[str, FloatFormat, None] = None) -> FreezeRecord:
        """The record of one format (the first one by default)."""
        name = self.formats[0].name if fmt is None else get_format(fmt).name
        return self.records[name]

    @torch.no_grad()
    def after_step(self) -> None:
        """Predict freezing for the update just applied (call just after ``optimizer.step()``)."""
        packed = self._packed_now()
        fused = packed is not None and all(
            pack.buffer.dtype == torch.float32 for pack, _ in packed) and all(
            _fused.fits(pack.buffer, fmt) for pack, _ in packed for fmt in self.formats)
        if fused:
            self._after_step_packed(packed)
        else:
            self._after_step_by_tensor()
        self._before = {}

    def _add(self, rec: FreezeRecord, per_tensor: List[tuple], moved_total: float, fewbit_total: float,
             hist: List[int]) -> None:
        frozen_total, count = 0.0, 0
        for name, f, n in per_tensor:
            if name not in rec.by_tensor:
                rec.by_tensor[name] = [math.nan] * len(rec.overall)
                rec.sizes[name] = n
            rec.by_tensor[name].append(f / n)
            frozen_total += f
            count += n
        rec.overall.append(frozen_total / count if count else math.nan)
        rec.move_fraction.append(moved_total / count if count else math.nan)
        if self.rand_bits is not None:
            rec.fewbit_frozen.append(fewbit_total / count if count else math.nan)
        rec.ratio_histogram = [a + b for a, b in zip(rec.ratio_histogram, hist)]

    def _after_step_packed(self, packed) -> None:
        """All formats from the fused kernels: one pass over each pack per format, which writes
        one byte per element (frozen, ratio bin and, for packs of several tensors or with a
        few-bit prediction, the tensor and the few-bit flag: then wider) and returns the sum of
        the move probabilities; the counts come from one bincount per pack, and everything
        reaches Python in one transfer. A pack of one tensor without few-bit prediction takes
        :func:`lowprec_demo._fused.freeze_code_paired` (two codes per bincount entry)."""
        current = [(pack, pack.flat(now)) for pack, now in packed]
        names = [(name, n) for pack, _ in packed for name, n in zip(pack.names, pack.sizes)]
        bins = len(RATIO_BINS) + 1
        rows = []
        for fmt in self.formats:
            per_tensor, hist, moved, fewbit = [], None, None, None
            for pack, new in current:
                if pack.paired and self.rand_bits is None:
                    codes = pack.codes()
                    moved_sum = _fused.freeze_code_paired(pack.buffer, new, fmt, codes)
                    frozen, counts = _fused.paired_counts(codes)
                    per_tensor.append(frozen.reshape(1))
                else:
                    # one bincount: frozen, few-bit and bin jointly, per tensor of the pack
                    code, moved_sum = _fused.freeze_code(pack.buffer, new, fmt, self.rand_bits, pack.tags)
                    joint = torch.bincount(code, minlength=256 * len(pack.names)).view(-1, 256)
                    per_tensor.append(joint.view(-1, 128, 2)[:, :, 1].sum(1))
                    by_code = joint.sum(0).view(64, 4)
                    counts = by_code.sum(1)
                    few = by_code[:, 2:].sum()
                    fewbit = few if fewbit is None else fewbit + few
                hist = counts if hist is None else hist + counts
                moved = moved_sum if moved is None else moved + moved_sum
            few = torch.zeros_like(hist[0]) if fewbit is None else fewbit
            rows.append(torch.cat([torch.cat(per_tensor), few.reshape(1), hist[:bins]]).to(torch.float64))
            rows.append(moved.to(torch.float64).reshape(1))
        values = torch.cat(rows).tolist()           # one transfer
        k, width = len(names), len(names) + 2 + bins
        for i, fmt in enumerate(self.formats):
            row = values[i * width:(i + 1) * width]
            per_tensor = [(name, int(f), n) for (name, n), f in zip(names, row[:k])]
            self._add(self.records[fmt.name], per_tensor, row[-1], row[k], [int(c) for c in row[k + 1:k + 1 + bins]])

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
                moved = ratio.clamp(max=1.0)
                if self.rand_bits is not None:  # the position in the gap resolved to k bits
                    moved = torch.round(moved * 2.0**self.rand_bits) / 2.0**self.rand_bits
                    fewbit_total += (moved == 0).sum().item()
                per_tensor.append((name, frozen.sum().item(), old.numel()))
                moved_total += moved.sum().item()
                log_ratio = torch.log2(ratio[ratio > 0].float().cpu())
                hist += torch.bucketize(log_ratio, edges).bincount(minlength=len(RATIO_BINS) + 1)
                hist[0] += int((ratio == 0).sum().item())
            self._add(rec, per_tensor, moved_total, fewbit_total, hist.tolist())
