"""lowprec_demo: watch weights freeze in low-precision training, and predict when.

When an optimizer update is smaller than half the unit in the last place (ULP) of a stored weight, round-to-nearest
hands back the same weight. This package simulates any small float format exactly (bit for bit), wraps any torch
optimizer so stored weights live on that format's grid, predicts from a high-precision run when each weight freezes,
and watches any training loop for it.

Five layers, each a subpackage that imports only those before it:

* ``formats``: the float formats;
* ``rounding``: rounding onto a format's grid and the freeze rule;
* ``optim``: :class:`LowPrecisionOptimizer` and the freeze plan it applies;
* ``freeze``: freezes predicted from a high-precision run and observed in a low-precision one;
* ``monitor``: the freeze watch (:func:`watch`), its forecast, diagnoses, report and callbacks;

and ``book``, the book's machinery (experiments, training loop, results, plots), which the layers never import.
``import lowprec_demo`` loads none of them until a name is used; the names below are the user's API, and the book's
names (``run_experiment``, ``scale``, ``plots`` ...) stay reachable here too.

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
    "FORMAT_NAMES": "formats", "FloatFormat": "formats", "format_table": "formats", "get_format": "formats",
    "quantize": "rounding", "ulp": "rounding", "would_freeze": "rounding", "move_probability": "rounding",
    "update_ulp_ratio": "rounding",
    "LowPrecisionOptimizer": "optim", "bytes_per_parameter": "optim", "FreezePlan": "optim", "load_plan": "optim",
    "FreezePredictor": "freeze", "FreezeObserver": "freeze", "FreezeRecord": "freeze", "freeze_step": "freeze",
    "freeze_order": "freeze", "steps_agree": "freeze",
    "watch": "monitor", "FreezeWatch": "monitor", "Diagnosis": "monitor", "load_watch": "monitor",
    "attach_plan": "monitor",
}
# The book's names, reachable from the top as the chapters call them (not in __all__).
_BOOK = {
    **{name: "book" for name in ("TrainConfig", "lr_factor", "experiment_names", "make_config", "run_experiment",
                                 "run_formats", "sweep", "RemedyComparison", "compare_remedies", "TrainResult",
                                 "evidence_table", "load_result", "stored_results", "by_scale", "pick_device",
                                 "progress_bar", "scale", "seed_everything", "Task", "train_formats",
                                 "train_variants")},
    "select_params": "optim", "mask_mismatch": "freeze", "stratified_chance_mismatch": "freeze",
}
# Modules of the book reachable as attributes (``lp.experiments``, ``from lowprec_demo import plots``).
_BOOK_MODULES = ("experiments", "data", "models", "plots", "widgets", "demos", "glue", "results", "config",
                 "training", "remedies", "fidelity", "runtime", "distributed")
_SUBPACKAGES = ("formats", "rounding", "optim", "freeze", "monitor", "book", "common", "cli", "version")

__all__ = sorted(_API) + ["__version__"]


def __getattr__(name: str):
    if name in _API or name in _BOOK:
        value = getattr(importlib.import_module(f"lowprec_demo.{_API.get(name) or _BOOK[name]}"), name)
    elif name in _BOOK_MODULES:
        value = importlib.import_module(f"lowprec_demo.book.{name}")
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"lowprec_demo.{name}")
    else:
        raise AttributeError(f"module 'lowprec_demo' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_API) | set(_BOOK) | set(_BOOK_MODULES) | set(_SUBPACKAGES))
