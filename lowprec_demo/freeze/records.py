"""What a freeze tracker records (:class:`FreezeRecord`: the frozen fraction at every step), and
its freeze step for a threshold tau: the first step from which it stays at or above tau.

Example:
    >>> rec = FreezeRecord("bf16", "observed", by_tensor={"a": [0, 1, 1], "b": [0, 0, 1]})
    >>> freeze_step([0.1, 0.9, 0.5, 0.95, 1.0], 0.9), freeze_order(rec, 0.5)
    (3, [('a', 1), ('b', 2)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Dict, Iterable, List, Optional, Sequence

__all__ = ["FreezeRecord", "freeze_step", "freeze_order", "steps_agree", "RATIO_BINS"]

# the predictor's histogram of log2(|d| / gap): whole octaves, edges -24, -23, ..., +8 (values outside go to the end
# bins), folded from the one binning in whole octaves (:func:`lowprec_demo.freeze.counts.fold_octaves`)
RATIO_BINS = list(range(-24, 9))


def freeze_step(fractions: Sequence[float], threshold: float) -> Optional[int]:
    """The first step from which ``fractions`` stay ``>= threshold`` to the end, or None."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    step = None
    for t in range(len(fractions) - 1, -1, -1):
        if not fractions[t] >= threshold:   # (NaN too)
            break
        step = t
    return step


def steps_agree(predicted: Optional[int], observed: Optional[int], total_steps: int) -> bool:
    """The book's tolerance: the freeze steps differ by at most max(2 steps, 2 % of the run).
    Both None (nothing freezes, as predicted) agree; one None does not. A tally of how often the
    prediction holds where something froze leaves out the runs where both are None.

    Example:
        >>> steps_agree(100, 103, 500), steps_agree(100, 103, 100), steps_agree(None, None, 100)
        (True, False, True)
    """
    if predicted is None or observed is None:
        return predicted is None and observed is None
    return abs(predicted - observed) <= max(2, 0.02 * total_steps)


@dataclass
class FreezeRecord:
    """Per-step frozen fractions: ``overall[t]`` over all tensors (element-weighted), ``by_tensor[name][t]`` per
    tensor of ``sizes[name]`` elements. Predictions also carry ``move_fraction`` (the expected fraction SR moves),
    ``fewbit_frozen`` (the fraction SR with ``rand_bits`` random bits never moves) and ``ratio_histogram``
    (``log2(|d|/gap)`` per bin of :data:`RATIO_BINS`, summed over the run)."""

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

    def add_step(self, per_tensor: Iterable[tuple]) -> int:
        """Add a step of ``(name, frozen, followed, size, move sum or None)`` per tensor: ``frozen`` of the
        ``followed`` elements of a tensor of ``size`` (a new tensor: NaN before), the whole model's fraction and, for a
        prediction, SR's from them weighted by size. Return the size of the tensors."""
        held = moved = 0.0
        total = 0
        for name, frozen, followed, size, move in per_tensor:
            if name not in self.by_tensor:
                self.by_tensor[name] = [math.nan] * len(self.overall)
                self.sizes[name] = size
            self.by_tensor[name].append(frozen / followed if followed else math.nan)
            total += size
            if followed:
                scale = size / followed
                held += frozen * scale
                if move is not None:
                    moved += move * scale
        self.overall.append(held / total if total else math.nan)
        if self.kind == "predicted":
            self.move_fraction.append(moved / total if total else math.nan)
        return total

    def tensor_steps(self, name: str) -> List[int]:
        """The step of every point of ``by_tensor[name]``."""
        return self.by_tensor_steps or list(range(len(self.by_tensor[name])))

    def freeze_step(self, threshold: float) -> Optional[int]:
        """First step from which the overall fraction stays >= threshold."""
        return freeze_step(self.overall, threshold)

    def tensor_freeze_steps(self, threshold: float) -> Dict[str, Optional[int]]:
        """Freeze step of every tensor (on thinned curves, that of a kept point)."""
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
        keys = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in keys})


def freeze_order(record: FreezeRecord, threshold: float) -> List[tuple]:
    """Tensors as ``(name, step)`` by freeze step, the never-frozen last."""
    steps = record.tensor_freeze_steps(threshold)
    return sorted(steps.items(), key=lambda kv: (kv[1] is None, kv[1] if kv[1] is not None else 0, kv[0]))
