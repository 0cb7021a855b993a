"""lowprec_demo: watch weights freeze in low-precision training, and predict when.

When an optimizer update is smaller than half the unit in the last place (ULP) of a stored weight, round-to-nearest
hands back the same weight. This package simulates any small float format exactly (bit for bit), wraps any torch
optimizer so stored weights live on that format's grid, predicts from a high-precision run when each weight freezes,
and watches any training loop for it.

Five layers, each a subpackage that imports only those before it:

* ``formats``: the float formats;
* ``rounding``: rounding onto a format's grid and the freeze rule;
* ``optim``: :class:`LowPrecisionOptimizer` and the freeze plan it applies;
* ``freeze``: freezes predicted from a high-precision run and observed in a low-precision one, and their analysis;
* ``monitor``: the freeze watch (:func:`watch`), its forecast, diagnoses, report and trainer callbacks.

The names below are what a practitioner uses; analysis helpers stay in their subpackages
(``lowprec_demo.freeze.steps_agree``). The book's machinery, its experiments, training loop, results, plots and command
line, lives in :mod:`lowprec_demo.book`, which the library never imports. ``import lowprec_demo`` loads none of the
layers until a name is used.

Example:
    >>> import torch
    >>> import lowprec_demo as lp
    >>> lp.quantize(torch.tensor([1.001]), "bf16").item()
    1.0
"""

import importlib

from lowprec_demo.version import __version__

# name -> the module that defines it; imported on first use (PEP 562).
_API = {
    "FORMAT_NAMES": "formats", "FloatFormat": "formats", "get_format": "formats",
    "quantize": "rounding", "quantize_": "rounding", "ulp": "rounding", "would_freeze": "rounding",
    "move_probability": "rounding",
    "LowPrecisionOptimizer": "optim", "bytes_per_parameter": "optim", "FreezePlan": "optim", "load_plan": "optim",
    "watch": "monitor", "FreezeWatch": "monitor", "load_watch": "monitor", "attach_plan": "monitor",
    "hf_callback": "monitor", "lightning_callback": "monitor", "preflight": "monitor.preflight",
}
_SUBPACKAGES = ("formats", "rounding", "optim", "freeze", "monitor", "book", "common", "version")

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(f"lowprec_demo.{_API[name]}"), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"lowprec_demo.{name}")
    else:
        raise AttributeError(f"module 'lowprec_demo' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_API) | set(_SUBPACKAGES))
