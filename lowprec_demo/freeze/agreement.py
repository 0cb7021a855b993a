"""How far a predicted frozen mask and an observed one (``masks[format][tensor]`` of two trackers stepped in lockstep,
:mod:`lowprec_demo.freeze.tracker`) agree element by element, against what masks that know less would give:
independent masks with the same frozen fractions overall (:func:`mask_mismatch`) or per tensor and binade
(:func:`stratified_chance_mismatch`: a prediction that knew only each weight's size and the schedule).
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

__all__ = ["mask_mismatch", "stratified_chance_mismatch"]


def mask_mismatch(predicted: Mapping[str, torch.Tensor], observed: Mapping[str, torch.Tensor]) -> tuple:
    """The fraction of elements whose predicted and observed states differ, and the chance
    level of two independent masks with frozen fractions p and q, ``p(1-q) + q(1-p)``.

    Example:
        >>> a = {"w": torch.tensor([True, True, False, False])}
        >>> b = {"w": torch.tensor([True, False, False, False])}
        >>> mask_mismatch(a, b)
        (0.25, 0.5)
    """
    names = [k for k in predicted if k in observed]
    if not names:
        return math.nan, math.nan
    sums = torch.stack([torch.stack([(predicted[k] != observed[k]).sum(), predicted[k].sum(), observed[k].sum()])
                        for k in names]).sum(0).tolist()
    n = sum(predicted[k].numel() for k in names)
    differ, p, q = sums[0] / n, sums[1] / n, sums[2] / n
    return differ, p * (1 - q) + q * (1 - p)


def stratified_chance_mismatch(predicted: Mapping[str, torch.Tensor], observed: Mapping[str, torch.Tensor],
                               weights: Mapping[str, torch.Tensor]) -> float:
    """The chance level of masks independent *within each stratum* (a tensor and a binade of its
    ``weights``; zeros a stratum of their own): ``p_s(1-q_s) + q_s(1-p_s)`` averaged with weights
    n_s. Freezing depends mostly on a weight's exponent, so this lies below the global one.

    Example:
        >>> w = {"w": torch.tensor([1.0, 1.5, 0.01, 0.015])}   # two binades, two elements each
        >>> p = {"w": torch.tensor([True, True, False, False])}
        >>> q = {"w": torch.tensor([True, False, False, False])}
        >>> mask_mismatch(p, q)[1], stratified_chance_mismatch(p, q, w)
        (0.5, 0.25)
    """
    names = [k for k in predicted if k in observed and k in weights]
    if not names:
        return math.nan
    total = n_all = 0.0
    for k in names:
        exponent = torch.frexp(weights[k].detach().reshape(-1).float())[1].long()
        exponent = torch.where(weights[k].detach().reshape(-1) == 0, exponent.min() - 1, exponent)
        bins = exponent - exponent.min()
        n = torch.bincount(bins).double()
        p = torch.bincount(bins, weights=predicted[k].reshape(-1).double(), minlength=n.numel())
        q = torch.bincount(bins, weights=observed[k].reshape(-1).double(), minlength=n.numel())
        # per stratum n (p/n)(1 - q/n) + (q/n)(1 - p/n) = (p (n - q) + q (n - p)) / n
        safe = n.clamp(min=1)
        total += float(((p * (n - q) + q * (n - p)) / safe).sum())
        n_all += bins.numel()
    return total / n_all if n_all else math.nan
