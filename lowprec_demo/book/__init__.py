"""The book's machinery on top of the library: a run's settings (``config``), the training loop (``training``), results,
the named ``experiments`` with their ``data`` and ``models``, ``remedies``, ``fidelity`` (torch's own low-precision
steps), ``plots``, ``widgets``, ``demos``, ``glue``, ``distributed``, a chapter's first cell (``runtime``) and the
command line (``cli``). A chapter starts with ``from lowprec_demo import book`` and calls ``book.run_experiment``,
``book.scale()`` ...; the submodules load when first named (``book.plots``).
"""

import importlib

from lowprec_demo.book.config import TrainConfig, lr_factor
from lowprec_demo.book.experiments import experiment_names, make_config, run_experiment, run_formats, sweep
from lowprec_demo.book.remedies import RemedyComparison, compare_remedies
from lowprec_demo.book.results import TrainResult, evidence_table, load_result, stored_results
from lowprec_demo.book.runtime import by_scale, pick_device, progress_bar, scale, seed_everything
from lowprec_demo.book.training import Task, train_formats, train_variants

__all__ = ["TrainConfig", "lr_factor", "experiment_names", "make_config", "run_experiment", "run_formats", "sweep",
           "RemedyComparison", "compare_remedies", "TrainResult", "evidence_table", "load_result", "stored_results",
           "by_scale", "pick_device", "progress_bar", "scale", "seed_everything", "Task", "train_formats",
           "train_variants"]

_MODULES = ("cli", "config", "data", "demos", "distributed", "experiments", "fidelity", "finetune", "glue", "models",
            "plots", "remedies", "results", "runtime", "training", "widgets")


def __getattr__(name: str):
    if name in _MODULES:
        return importlib.import_module(f"lowprec_demo.book.{name}")
    raise AttributeError(f"module 'lowprec_demo.book' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_MODULES))
