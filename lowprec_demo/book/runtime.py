"""What every chapter's first cell needs: the quick or full scale, the device, seeds, progress bars."""

from __future__ import annotations

import os
import random
from typing import Optional

import torch

from lowprec_demo.common.output import progress_bar

__all__ = ["SCALES", "DEVICES", "scale", "pick_device", "seed_everything", "progress_bar", "by_scale"]

SCALES = ("quick", "full")
DEVICES = ("auto", "cpu", "cuda")


def scale(value: Optional[str] = None) -> str:
    """The run size: ``value``, else ``$LOWPREC_SCALE``, else ``"quick"`` (a laptop CPU; ``"full"``: a GPU).

    Example:
        >>> scale("full")
        'full'
    """
    chosen = value if value is not None else os.environ.get("LOWPREC_SCALE", "quick")
    chosen = chosen.strip().lower()
    if chosen not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(SCALES)} (LOWPREC_SCALE); got {chosen!r}")
    return chosen


def by_scale(quick, full, value: Optional[str] = None):
    """Pick the quick or the full value for the current scale. Example: ``by_scale(100, 5000)``."""
    return quick if scale(value) == "quick" else full


def pick_device(preference: str = "auto") -> str:
    """``"cuda"`` when asked for (or ``"auto"`` with a GPU present), else ``"cpu"``. E.g. ``pick_device("cpu")``."""
    pref = str(preference).strip().lower()
    pref_base = "cuda" if pref.startswith("cuda:") else pref
    if pref_base not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)} (or cuda:N); got {preference!r}")
    if pref_base == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but torch sees no GPU; use 'cpu' or 'auto'")
    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return pref


def seed_everything(seed: int) -> None:
    """Seed Python's, torch's (CPU and CUDA) and numpy's random generators."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
