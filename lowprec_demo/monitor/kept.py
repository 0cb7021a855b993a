"""How much of the update the optimizer meant reaches the stored weights: the freeze watch's *kept* share, in
observation under AdamW, Adam or SGD (where :mod:`~lowprec_demo.monitor.intended` reads the meant update ``d``).

Per tensor and watched step, over the followed elements, ``kept = sum((new - old) * sign(d)) / sum(|d|)`` (float64;
exact for bf16/fp16 weights): 0 where round to nearest froze every element, 1 where the stored weight moved by
``d``. The frozen share (``record().overall``) cannot show that a remedy works: under stochastic rounding a weight
far below its gap moves a whole gap with probability ``|d| / gap``, under Kahan, master copies or the remainder once
the summed update crosses half a gap, so a step still leaves most weights bit for bit the same (``tests/test_kept.py``,
a tiny bf16 model under AdamW at lr 1e-4: frozen share 0.94 plain, 0.88 under stochastic rounding, while ``kept``
went from 0.07 to 1.03 over 200 steps). ``kept`` shows it: its expectation is 1 under stochastic rounding (unbiased;
per step it is noisy, relative variance at most ``gap / sum(|d|)``), about 1 over a window under Kahan, master copies
and the remainder while the update keeps its sign, about 0 for weights frozen under round to nearest.

The overall share of a step is the size-weighted mean of the tensors' shares, over the tensors with a meant update.
Cost: two float64 sums per followed element and step, added to the watch's counts (no transfer or ``all_reduce`` of
their own under FSDP2), and one transfer of two numbers per tensor.

Example:
    >>> import torch
    >>> from lowprec_demo.freeze.sampling import Sample
    >>> w = torch.zeros(4)
    >>> new, d = torch.tensor([1., 0., 0., 0.]), torch.tensor([.5, .5, -.5, -.5])     # one element moved: by 1
    >>> kept_sums(Sample([w], None), torch.zeros(4), new, d).tolist()
    [[1.0], [2.0]]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from lowprec_demo.monitor.intended import intended_update

__all__ = ["KeptRecord", "kept_sums", "observe_step", "WINDOW"]

WINDOW = 10     # watched steps in the trainers' callbacks' kept_<fmt> (:meth:`KeptRecord.window`)


def kept_sums(sample, old: torch.Tensor, new: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``(2, tensors)`` float64: per tensor of ``sample``, ``sum((new - old) * sign(d))`` and ``sum(|d|)`` over its
    followed elements in this process (``old``, ``new``: the stored weights before and after the step)."""
    d = d.double()
    moved = (new.double() - old.double()) * torch.sign(d)
    return torch.stack([sample.per_tensor(moved), sample.per_tensor(d.abs())])


@dataclass
class KeptRecord:
    """The kept share of a format, watched step by watched step: ``overall[t]``, ``by_tensor[name][t]`` (NaN where
    the step meant no update), ``meant[name][t]`` the mean ``|d|`` per followed element, ``sizes[name]``."""

    format: str
    sizes: Dict[str, int] = field(default_factory=dict)
    overall: List[float] = field(default_factory=list)
    by_tensor: Dict[str, List[float]] = field(default_factory=dict)
    meant: Dict[str, List[float]] = field(default_factory=dict)

    def add_step(self, names: List[str], counts: List[int], sizes: Dict[str, int], moved: List[float],
                 meant: List[float]) -> float:
        """Add a step from the per-tensor sums of :func:`kept_sums` (``counts``: the followed elements); returns the
        overall share."""
        held = total = 0.0
        for n, c, m, d in zip(names, counts, moved, meant):
            share = m / d if d > 0 else math.nan
            self.sizes[n] = sizes[n]
            self.by_tensor.setdefault(n, [math.nan] * (len(self.overall))).append(share)
            self.meant.setdefault(n, [math.nan] * (len(self.overall))).append(d / c if c else math.nan)
            if d > 0:
                held, total = held + share * sizes[n], total + sizes[n]
        self.overall.append(held / total if total else math.nan)
        return self.overall[-1]

    def window(self, last: int = WINDOW) -> float:
        """The mean of the last ``last`` watched steps' overall shares (those with a meant update; NaN: none)."""
        values = [v for v in self.overall[-last:] if not math.isnan(v)]
        return sum(values) / len(values) if values else math.nan

    def to_dict(self) -> dict:
        return {"format": self.format, "sizes": self.sizes, "overall": self.overall, "by_tensor": self.by_tensor,
                "meant": self.meant}


def observe_step(watch, names: List[str], sample, params: List[torch.Tensor], old: torch.Tensor, new: torch.Tensor,
                 grad: torch.Tensor, rows: List[torch.Tensor]) -> List[torch.Tensor]:
    """Observation's point of a watched step: the frozen and idle counts (``watch.tracker``), and with a meant update
    (``watch.expected`` set) the frozen share it predicts and the kept share (``watch.kept``), the sums reduced with
    the counts. Returns ``rows`` (per embedding, the rows with a gradient) reduced."""
    d = None
    if watch.expected:        # the update meant, from the optimizer's state at the stored weights
        d = intended_update(watch.optimizer, sample, params, [watch._lr_now[watch.group_of[n]] for n in names],
                            old.float(), grad)
        rows = [kept_sums(sample, old, new, d), *rows]
    (_, idle, frozen_grad), rows = watch.tracker.count_observed(names, sample, old, new, grad, rows)
    watch._add_idle(idle, frozen_grad)
    if d is not None:
        (moved, meant), rows = rows[0].tolist(), rows[1:]
        for f, record in watch.kept.items():
            at = [j for j, n in enumerate(names) if watch.tracker._record_of(n) == f]
            record.add_step([names[j] for j in at], [sample.counts[j] for j in at], watch.sizes,
                            [moved[j] for j in at], [meant[j] for j in at])
        old = old.float()        # prediction's rule at the stored weights
        watch._predict(sample, old, (old.double() + d).float(), grad.float(), watch.expected)
    return rows
