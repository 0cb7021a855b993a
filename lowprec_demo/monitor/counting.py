"""One watched step's counts per tensor over the followed elements laid end to end
(:mod:`lowprec_demo.monitor.sampling`), local until the plan's ``reduce``."""

from __future__ import annotations

import math
import sys
from typing import Dict, List, Optional, Sequence

import torch

from lowprec_demo.formats import FloatFormat
from lowprec_demo.freeze.counts import histograms, step_counts
from lowprec_demo.freeze.records import FreezeRecord
from lowprec_demo.rounding import freeze_rule, round_to_grid

__all__ = ["observed_counts", "predicted_counts", "state_counters", "add_point", "compile_up_front", "UNKNOWN_RUN"]

UNKNOWN_RUN = 1000     # watched steps taken for a run of unknown length, when deciding to compile up front


def observed_counts(plan, old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``(3, tensors)``: the elements with no gradient, those the step left bit for bit the same,
    and those of them with a gradient (frozen rather than idle)."""
    has_grad = grad != 0
    same = new == old
    return torch.stack([plan.per_tensor(c) for c in (~has_grad, same, same & has_grad)])


def predicted_counts(plan, old: torch.Tensor, new: torch.Tensor, grad: torch.Tensor, formats: Sequence[FloatFormat],
                     log_lr: torch.Tensor, compile_now: bool = False) -> List[torch.Tensor]:
    """Per format, by the rule at ``q(old)``: the histogram ``(tensors, bins)`` of
    ``log2(|d| / (lr gap))`` over :data:`~lowprec_demo.freeze.counts.EDGES` (NaN in the last bin), the elements per
    (frozen, gradient) pair ``(tensors, 2, 2)``, and the move probabilities' sum: the predictor's count
    (:func:`lowprec_demo.freeze.counts.step_counts`) per tensor of the plan."""
    local = []
    for fmt in formats:
        counts, moves = step_counts(old, new, fmt, plan.tensor_id, len(plan.counts), log_lr, grad,
                                    compile_now=compile_now)
        local += [histograms(counts), counts.sum(1), plan.per_tensor(moves)]
    return local


def compile_up_front(old: torch.Tensor, formats: Sequence[FloatFormat], steps_left: Optional[int]) -> bool:
    """Whether to compile the kernel at the first watched step: ``"auto"`` mode compiles once the eager work reaches
    :data:`~lowprec_demo.rounding.round_to_grid.EAGER_BUDGET` elements, on a large model a silent pause part way through the
    run; when the steps left (``None``: :data:`UNKNOWN_RUN`) would reach it, compile now and say so on stderr."""
    if round_to_grid.get_mode() != "auto" or not any(freeze_rule.fits(old, f) for f in formats):
        return False
    left = UNKNOWN_RUN if steps_left is None else steps_left
    if old.numel() * left <= round_to_grid.EAGER_BUDGET:
        return False
    print(f"freeze watch: compiling its kernel now, once per process (seconds): {left:,} watched steps of "
          f"{old.numel():,} elements would compile it part way through the run", file=sys.stderr, flush=True)
    return True


def state_counters(optimizer, params: Dict[str, torch.Tensor]) -> Dict[tuple, float]:
    """The optimizer's 0-dimensional float state (Adam's ``step``), ``{(tensor, key): value}``."""
    found = [((n, key), value) for n, p in params.items() for key, value in optimizer.state.get(p, {}).items()
             if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()]
    if not found:
        return {}
    try:      # (float types widen exactly)
        values = torch.stack([v for _, v in found]).tolist()
    except RuntimeError:     # on several devices
        values = [float(v) for _, v in found]
    return {key: v for (key, _), v in zip(found, values)}


def add_point(record: FreezeRecord, items: list, sizes: Dict[str, int], moves: bool) -> None:
    """One point of a record from ``(tensor, frozen, followed, move sum or None)`` per tensor."""
    total = sum(sizes[n] for n, *_ in items)
    held = moved = 0.0
    for n, frozen, counted, move in items:
        if n not in record.by_tensor:
            record.by_tensor[n], record.sizes[n] = [], sizes[n]
        record.by_tensor[n].append(frozen / counted)
        scale = sizes[n] / counted
        held += frozen * scale
        if move is not None:
            moved += move * scale
    record.overall.append(held / total if total else math.nan)
    if moves:
        record.move_fraction.append(moved / total if total else math.nan)
