"""The one count of a step, for every tracker: the rule at ``q(old)`` gives every element a code
(:func:`lowprec_demo.rounding.freeze_rule.element_codes`: its tensor, its bin of ``log2(|d| / gap)``, less
``log2(lr)`` where a learning rate is given, frozen or not, and the gradient flag) and one :func:`torch.bincount`
counts them all (:func:`step_counts`; per tensor of a :class:`~lowprec_demo.freeze.sampling.Sample`,
:func:`predicted_counts`); a stored value left bit for bit the same is counted by :func:`observed_counts`. The bins are
eighths of an octave; a record's histogram folds them into whole octaves for display (:func:`fold_octaves`).

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> old = torch.ones(4); new = old + torch.tensor([1e-3, 1e-2, 0.0, 1.0])
    >>> zero = torch.zeros((), dtype=torch.int32)
    >>> counts, moves = step_counts(old, new, get_format("bf16"), zero, 1, torch.zeros(()))
    >>> counts[:, :, 1].sum().item()
    2
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from lowprec_demo.formats import FloatFormat
from lowprec_demo.rounding import freeze_rule, move_probability, round_to_grid, update_ulp_ratio, would_freeze
from lowprec_demo.rounding.freeze_rule import BINS, FIRST_EDGE, LAST_EDGE, PER_OCTAVE, bin_thresholds, element_codes

__all__ = ["step_counts", "predicted_counts", "observed_counts", "histograms", "fold_octaves", "fewbit_count", "EDGES"]

#: the edges of the bins, eighths of an octave from ``FIRST_EDGE`` to ``LAST_EDGE`` (:mod:`~lowprec_demo.rounding.freeze_rule`)
EDGES = torch.arange(FIRST_EDGE * PER_OCTAVE, LAST_EDGE * PER_OCTAVE + 1, dtype=torch.float32) / PER_OCTAVE


def step_counts(old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat, tensor_id: torch.Tensor, n_tensors: int,
                log_lr: Optional[torch.Tensor], grad: Optional[torch.Tensor] = None, rand_bits: Optional[int] = None,
                compile_now: bool = False) -> tuple:
    """``(counts, moves)`` of the update ``new - old`` (flat tensors, float32 through the kernel where it fits, else
    through the public functions) at ``q(old)``: ``counts[t, bin, frozen, flag]`` (int64, ``BINS + 1`` slots, the
    last for NaN) of ``n_tensors`` tensors by ``tensor_id`` (int32 per element, or 0-dim for one), the bins shifted
    by ``log_lr`` (float32 per tensor, 0-dim for all, None for none; see
    :func:`~lowprec_demo.rounding.freeze_rule.bin_thresholds`), the flag ``grad != 0`` (0 without ``grad``). ``moves``:
    every element's move probability with ``rand_bits`` random bits (None: full resolution). ``compile_now``
    compiles the kernel in this call whatever the mode."""
    if freeze_rule.fits(old, fmt):
        previous = round_to_grid.set_mode("on") if compile_now else None
        try:
            code, moves = freeze_rule.step_codes(old, new, grad, tensor_id, log_lr, fmt, rand_bits)
        finally:
            if previous is not None:
                round_to_grid.set_mode(previous)
    else:   # the same rule through the public functions (float64 tensors, formats beyond float32)
        update = new - old
        flag = 0 if grad is None else (grad != 0).to(torch.int32)
        code = element_codes(would_freeze(old, update, fmt), _float32_up(update_ulp_ratio(old, update, fmt)), flag,
                             tensor_id, bin_thresholds(log_lr, old.device))
        moves = move_probability(old, update, fmt, rand_bits=rand_bits)
    counts = torch.bincount(code.reshape(-1), minlength=n_tensors * (BINS + 1) * 4)
    return counts.view(n_tensors, BINS + 1, 2, 2), moves


def predicted_counts(sample, old: torch.Tensor, new: torch.Tensor, formats: Sequence[FloatFormat],
                     grad: Optional[torch.Tensor] = None, log_lr: Optional[torch.Tensor] = None,
                     rand_bits: Optional[int] = None, compile_now: bool = False) -> List[torch.Tensor]:
    """Per format, :func:`step_counts` per tensor of ``sample`` (followed elements end to end): the elements per bin
    ``(tensors, BINS + 1)`` (NaN in the last slot), per (frozen, gradient) pair ``(tensors, 2, 2)``, and the move
    probabilities' float64 sum ``(tensors,)``; local until ``sample.reduce``."""
    local = []
    for fmt in formats:
        counts, moves = step_counts(old, new, fmt, sample.tensor_id, len(sample.counts), log_lr, grad, rand_bits,
                                    compile_now)
        local += [counts.sum((2, 3)), counts.sum(1), sample.per_tensor(moves)]
    return local


def observed_counts(sample, old: torch.Tensor, new: torch.Tensor, grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per tensor of ``sample``, the elements the step left bit for bit the same; with ``grad``, ``(3, tensors)``:
    also those with no gradient and those left the same with one (frozen rather than idle)."""
    same = new == old
    if grad is None:
        return sample.per_tensor(same).reshape(1, -1)
    has_grad = grad != 0
    return torch.stack([sample.per_tensor(c) for c in (same, ~has_grad, same & has_grad)])


def _float32_up(ratio: torch.Tensor) -> torch.Tensor:
    """Non-negative ratios as float32 rounded up: a float64 ratio just above a power of two stays above it (to nearest
    it could land on it), so its octave, and whether it is at most ``2**-(k+1)``, are those of the exact ratio."""
    if ratio.dtype == torch.float32:
        return ratio
    down = ratio.float()
    return torch.where(down.double() < ratio, torch.nextafter(down, torch.full_like(down, math.inf)), down)


def histograms(hist: torch.Tensor, nan: str = "last") -> torch.Tensor:
    """Per tensor, the elements per bin of :func:`predicted_counts`' ``(tensors, BINS + 1)``: a NaN ratio in the
    last bin (``nan="last"``) or left out (``"drop"``)."""
    bins = hist.shape[1] - 1
    if nan == "drop":
        return hist[:, :bins]
    if nan != "last":
        raise ValueError(f"nan must be 'last' or 'drop'; got {nan!r}")
    out = hist[:, :bins].clone()
    out[:, -1] += hist[:, bins]
    return out


def _check_edges(edges: Sequence[int]) -> List[int]:
    edges = [int(e) for e in edges]
    if not edges or edges != list(range(edges[0], edges[0] + len(edges))):
        raise ValueError(f"the ratio bins' edges must be consecutive integers; got {edges}")
    if edges[0] < FIRST_EDGE or edges[-1] > LAST_EDGE:
        raise ValueError(f"edges from {edges[0]} to {edges[-1]} reach beyond the bins' "
                         f"{FIRST_EDGE} to {LAST_EDGE}")
    return edges


def _fold_index(edges: tuple, device: torch.device) -> torch.Tensor:
    """Per bin of :data:`BINS`, the index in ``edges`` it folds into (see :func:`fold_octaves`), made once per edges
    and device."""
    key = (edges, str(device))
    index = _FOLD_INDEX.get(key)
    if index is None:
        at = torch.arange(BINS, dtype=torch.int64)
        # bin b covers (b/8 - 1/8, b/8] above FIRST_EDGE: its whole octave is the ceil of its upper edge
        octave = -torch.div(-at, PER_OCTAVE, rounding_mode="floor")
        index = (FIRST_EDGE + octave - edges[0]).clamp(0, len(edges))
        index = _FOLD_INDEX[key] = index.to(device)
    return index


_FOLD_INDEX: dict = {}


def _check_bins(hist) -> None:
    bins = hist.shape[-1] if torch.is_tensor(hist) else len(hist)
    if bins != BINS:
        raise ValueError(f"a histogram of {BINS} eighth-octave bins is needed; got {bins}")


def fold_octaves(hist, edges: Sequence[int]):
    """A histogram of :data:`BINS` eighth-octave bins (NaN left out) as ``bucketize(log2 ratio, edges)`` for
    consecutive integer ``edges`` within the bins' range: a bin ``b`` of ``(e - 1/8, e]`` folds into the whole octave
    ``ceil`` of its upper edge, the first bin into 0 and the last into ``len(edges)``. A tensor (int64, histograms
    along its last dimension) gives a tensor on its device, a sequence a list.

    Example:
        >>> hist = [0] * 770; hist[0] = 1; hist[8 * 64] = 2; hist[8 * 64 + 1] = 3; hist[-1] = 4
        >>> fold_octaves(hist, [-1, 0, 1])
        [1, 2, 3, 4]
    """
    edges = tuple(_check_edges(edges))
    _check_bins(hist)
    h = hist if torch.is_tensor(hist) else torch.tensor([int(c) for c in hist], dtype=torch.int64)
    out = torch.zeros(h.shape[:-1] + (len(edges) + 1,), dtype=h.dtype, device=h.device)
    out.index_add_(-1, _fold_index(edges, h.device), h)
    return out if torch.is_tensor(hist) else out.tolist()


def fewbit_count(hist, rand_bits: int):
    """How many ratios of a histogram of :data:`BINS` eighths (NaN left out) are at most ``2**-(rand_bits + 1)``:
    those that SR with ``rand_bits`` random bits never moves. A tensor (histograms along its last dimension) gives a
    tensor, a sequence an int."""
    _check_bins(hist)
    last = max(PER_OCTAVE * (-(rand_bits + 1) - FIRST_EDGE), 0) + 1   # up to the bin whose upper edge is -(k + 1)
    if torch.is_tensor(hist):
        return hist[..., :last].sum(-1)
    return int(sum(int(c) for c in hist[:last]))
