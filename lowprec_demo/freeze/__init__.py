"""When weights freeze: predicted from a high-precision run (:class:`FreezePredictor`), observed in
a low-precision one (:class:`FreezeObserver`), as a :class:`FreezeRecord` with its freeze step
(``records``), and the element-level agreement of two frozen masks (``agreement``). ``counts`` is the
one count of a step's predicted freezes, which the predictor and the freeze watch share.
"""

from lowprec_demo.freeze.agreement import mask_mismatch, stratified_chance_mismatch
from lowprec_demo.freeze.prediction import FreezeObserver, FreezePredictor
from lowprec_demo.freeze.records import RATIO_BINS, FreezeRecord, freeze_order, freeze_step, steps_agree

__all__ = ["FreezePredictor", "FreezeObserver", "FreezeRecord", "freeze_step", "freeze_order", "steps_agree",
           "mask_mismatch", "stratified_chance_mismatch", "RATIO_BINS"]
