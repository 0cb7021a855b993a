"""A freeze watch for any training loop: :func:`watch` attaches to a model and its optimizer,
counts the weights each step leaves where they were, forecasts when a format would freeze them,
diagnoses why (``diagnoses``), reports (``report``: :class:`WatchReport`, :func:`load_watch`) and
plans a remedy per tensor. ``integrations`` gives the Hugging Face and Lightning callbacks and
:func:`attach_plan`.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    >>> w = watch(model, opt, progress=False)
"""

from lowprec_demo.monitor.diagnoses import Diagnosis
from lowprec_demo.monitor.freeze_watch import FreezeWatch, watch
from lowprec_demo.monitor.integrations import attach_plan, hf_callback, lightning_callback
from lowprec_demo.monitor.report import WatchReport, load_watch

__all__ = ["watch", "FreezeWatch", "Diagnosis", "WatchReport", "load_watch", "attach_plan", "hf_callback",
           "lightning_callback"]
