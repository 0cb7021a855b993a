"""A freeze watch for any training loop (:func:`watch`): which weights each step leaves in place,
when a format would freeze them (``forecast``), why (``diagnoses``), the report (``report``) and
a remedy per tensor (``planning``), advice before the first step (``preflight``); ``integrations`` has the
trainer callbacks and :func:`attach_plan`.
"""

from lowprec_demo.monitor.diagnoses import Diagnosis
from lowprec_demo.monitor.freeze_watch import FreezeWatch, watch
from lowprec_demo.monitor.integrations import attach_plan, hf_callback, lightning_callback
from lowprec_demo.monitor.preflight import Preflight      # (the function: lp.preflight, monitor.preflight.preflight)
from lowprec_demo.monitor.report import WatchReport, load_watch

__all__ = ["watch", "FreezeWatch", "Diagnosis", "WatchReport", "load_watch", "attach_plan", "hf_callback",
           "lightning_callback", "Preflight"]
