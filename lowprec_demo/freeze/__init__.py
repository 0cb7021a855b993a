"""When weights freeze: one tracker (``tracker``) that predicts it from a high-precision run (:class:`FreezePredictor`)
or observes it in a low-precision one (:class:`FreezeObserver`), following every element or a sample (``sampling``)
and counting a step once (``counts``), as a :class:`FreezeRecord` with its freeze step (``records``); the
element-level agreement of two frozen masks (``agreement``).
"""

from lowprec_demo.freeze.agreement import mask_mismatch, stratified_chance_mismatch
from lowprec_demo.freeze.records import RATIO_BINS, FreezeRecord, freeze_order, freeze_step, steps_agree
from lowprec_demo.freeze.tracker import FreezeObserver, FreezePredictor, FreezeTracker

__all__ = ["FreezeTracker", "FreezePredictor", "FreezeObserver", "FreezeRecord", "freeze_step", "freeze_order",
           "steps_agree", "mask_mismatch", "stratified_chance_mismatch", "RATIO_BINS"]
