"""The one count of a step, for the predictor and the watch alike: the rule at ``q(old)`` gives every element a code
(:func:`lowprec_demo.rounding.freeze_rule.element_codes`: its tensor, its bin of ``log2(|d| / gap)`` less ``log2(lr)``, frozen
or not, and the watch's gradient flag) and one :func:`torch.bincount` counts them all. The predictor counts the same
bins in whole octaves (a byte per element, no shift, no flag) and folds them into its histogram (:func:`fold_octaves`).

Example:
    >>> import torch
    >>> from lowprec_demo.formats import get_format
    >>> old = torch.ones(4); new = old + torch.tensor([1e-3, 1e-2, 0.0, 1.0])
    >>> zero = torch.zeros((), dtype=torch.int32)
    >>> counts, moves = step_counts(old, new, get_format("bf16"), zero, 1, torch.zeros(()))
    >>> frozen_per_tensor(counts).tolist()
    [2]
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch

from lowprec_demo.formats import FloatFormat
from lowprec_demo.rounding import freeze_rule, round_to_grid
from lowprec_demo.rounding import move_probability, update_ulp_ratio, would_freeze
from lowprec_demo.rounding.freeze_rule import BINS, FIRST_EDGE, LAST_EDGE, OCTAVES, PER_OCTAVE, bin_thresholds, element_codes

__all__ = ["step_counts", "frozen_per_tensor", "histograms", "fold_octaves", "fewbit_count", "EDGES"]

#: the edges of the bins, eighths of an octave from :data:`~lowprec_demo.rounding.freeze_rule.FIRST_EDGE` to ``LAST_EDGE``
EDGES = torch.arange(FIRST_EDGE * PER_OCTAVE, LAST_EDGE * PER_OCTAVE + 1, dtype=torch.float32) / PER_OCTAVE


def step_counts(old: torch.Tensor, new: torch.Tensor, fmt: FloatFormat, tensor_id: torch.Tensor, n_tensors: int,
                log_lr: Optional[torch.Tensor], grad: Optional[torch.Tensor] = None, rand_bits: Optional[int] = None,
                moves_sum: bool = False, compile_now: bool = False, octaves: bool = False) -> tuple:
    """``(counts, moves)`` of the update ``new - old`` (flat tensors, float32 through the kernel where it fits, else
    through the public functions) at ``q(old)``: ``counts[t, bin, frozen, flag]`` (int64, ``BINS + 1`` slots, the
    last for NaN) of ``n_tensors`` tensors by ``tensor_id`` (int32 per element, or 0-dim for one), the bins shifted
    by ``log_lr`` (float32 per tensor, 0-dim for all, None for none; see
    :func:`~lowprec_demo.rounding.freeze_rule.bin_thresholds`), the flag ``grad != 0`` (0 without ``grad``); with
    ``octaves``, whole-octave bins (``OCTAVES + 1`` slots), no shift and one flag slot. ``moves``: every element's
    move probability with ``rand_bits`` random bits (None: full resolution), or with ``moves_sum`` their float64
    sum. ``compile_now`` compiles the kernel in this call whatever the mode."""
    if octaves and (grad is not None or log_lr is not None):
        raise ValueError("whole-octave counts take neither a gradient flag nor a learning-rate shift")
    if freeze_rule.fits(old, fmt):
        previous = round_to_grid.set_mode("on") if compile_now else None
        try:
            code, moves = freeze_rule.step_codes(old, new, grad, tensor_id, log_lr, fmt, rand_bits, moves_sum, octaves)
        finally:
            if previous is not None:
                round_to_grid.set_mode(previous)
    else:   # the same rule through the public functions (float64 tensors, formats beyond float32)
        update = new - old
        flag = 0 if grad is None else (grad != 0).to(torch.int32)
        code = element_codes(would_freeze(old, update, fmt), _float32_up(update_ulp_ratio(old, update, fmt)), flag,
                             tensor_id, None if octaves else bin_thresholds(log_lr, old.device))
        moves = move_probability(old, update, fmt, rand_bits=rand_bits)
        moves = moves.sum(dtype=torch.float64) if moves_sum else moves
    slots, flags = (OCTAVES + 1, 1) if octaves else (BINS + 1, 2)
    counts = torch.bincount(code.reshape(-1), minlength=n_tensors * slots * 2 * flags)
    return counts.view(n_tensors, slots, 2, flags), moves


def _float32_up(ratio: torch.Tensor) -> torch.Tensor:
    """Non-negative ratios as float32 rounded up: a float64 ratio just above a power of two stays above it (to nearest
    it could land on it), so its octave, and whether it is at most ``2**-(k+1)``, are those of the exact ratio."""
    if ratio.dtype == torch.float32:
        return ratio
    down = ratio.float()
    return torch.where(down.double() < ratio, torch.nextafter(down, torch.full_like(down, math.inf)), down)


def frozen_per_tensor(counts: torch.Tensor) -> torch.Tensor:
    """The frozen elements of each tensor in :func:`step_counts`' counts."""
    return counts[:, :, 1].sum((1, 2))


def histograms(counts: torch.Tensor, nan: str = "last") -> torch.Tensor:
    """Per tensor, the elements per bin (``BINS``, or ``OCTAVES`` of whole-octave counts): a NaN ratio in the last
    bin (``nan="last"``) or left out (``"drop"``)."""
    hist = counts.sum((2, 3))
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


def _fold_index(edges: tuple, bins: int, device: torch.device) -> torch.Tensor:
    """Per bin of :data:`BINS` eighths or :data:`OCTAVES` whole octaves, the index in ``edges`` it folds into (see
    :func:`fold_octaves`), made once per edges, resolution and device."""
    key = (edges, bins, str(device))
    index = _FOLD_INDEX.get(key)
    if index is None:
        at = torch.arange(bins, dtype=torch.int64)
        # bin b covers (b/8 - 1/8, b/8] above FIRST_EDGE: its whole octave is the ceil of its upper edge
        octave = -torch.div(-at, PER_OCTAVE, rounding_mode="floor") if bins == BINS else at
        index = (FIRST_EDGE + octave - edges[0]).clamp(0, len(edges))
        index = _FOLD_INDEX[key] = index.to(device)
    return index


_FOLD_INDEX: dict = {}


def _resolution(hist) -> tuple:
    """``(bins, per octave)`` of a histogram of eighths (:data:`BINS`) or whole octaves (:data:`OCTAVES`)."""
    bins = hist.shape[-1] if torch.is_tensor(hist) else len(hist)
    if bins not in (BINS, OCTAVES):
        raise ValueError(f"a histogram of {BINS} eighth-octave or {OCTAVES} octave bins is needed; got {bins}")
    return bins, PER_OCTAVE if bins == BINS else 1


def fold_octaves(hist, edges: Sequence[int]):
    """A histogram of :data:`BINS` eighth-octave bins or :data:`OCTAVES` whole ones (NaN left out) as
    ``bucketize(log2 ratio, edges)`` for consecutive integer ``edges`` within the bins' range: an eighth bin ``b`` of
    ``(e - 1/8, e]`` folds into the whole octave ``ceil`` of its upper edge (an octave bin is one already), the first
    bin into 0 and the last into ``len(edges)``. A tensor (int64, histograms along its last dimension) gives a tensor
    on its device, a sequence a list.

    Example:
        >>> hist = [0] * 770; hist[0] = 1; hist[8 * 64] = 2; hist[8 * 64 + 1] = 3; hist[-1] = 4
        >>> fold_octaves(hist, [-1, 0, 1])
        [1, 2, 3, 4]
        >>> hist = [0] * 98; hist[0] = 1; hist[64] = 2; hist[65] = 3; hist[-1] = 4
        >>> fold_octaves(hist, [-1, 0, 1])
        [1, 2, 3, 4]
    """
    edges = tuple(_check_edges(edges))
    bins, _ = _resolution(hist)
    h = hist if torch.is_tensor(hist) else torch.tensor([int(c) for c in hist], dtype=torch.int64)
    out = torch.zeros(h.shape[:-1] + (len(edges) + 1,), dtype=h.dtype, device=h.device)
    out.index_add_(-1, _fold_index(edges, bins, h.device), h)
    return out if torch.is_tensor(hist) else out.tolist()


def fewbit_count(hist, rand_bits: int):
    """How many ratios of a histogram of eighths or whole octaves (NaN left out) are at most ``2**-(rand_bits + 1)``:
    those that SR with ``rand_bits`` random bits never moves. A tensor (histograms along its last dimension) gives a
    tensor, a sequence an int."""
    _, per = _resolution(hist)
    last = max(per * (-(rand_bits + 1) - FIRST_EDGE), 0) + 1   # up to the bin whose upper edge is -(k + 1)
    if torch.is_tensor(hist):
        return hist[..., :last].sum(-1)
    return int(sum(int(c) for c in hist[:last]))
