"""When weights freeze: :class:`FreezePredictor` (from a high-precision run and the freeze rule),
:class:`FreezeObserver` (in a low-precision run), their :class:`FreezeRecord`, the freeze step of
a frozen-fraction curve and whether two of them agree, and element-level agreement of masks.

Example:
    >>> freeze_step([0.1, 0.4, 0.6], 0.5)
    2
"""

from lowprec_demo.freeze.agreement import mask_mismatch, stratified_chance_mismatch
from lowprec_demo.freeze.prediction import (RATIO_BINS, FreezeObserver, FreezePredictor, FreezeRecord, freeze_order,
                                            freeze_step, steps_agree)

__all__ = ["FreezePredictor", "FreezeObserver", "FreezeRecord", "freeze_step", "freeze_order", "steps_agree",
           "mask_mismatch", "stratified_chance_mismatch", "RATIO_BINS"]
