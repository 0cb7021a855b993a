"""The book's machinery on top of the library: a run's settings (``config``), the training loop (``training``), results,
the named ``experiments`` with their ``data`` and ``models``, ``remedies``, ``fidelity`` (torch's own low-precision
steps), ``plots``, ``widgets``, ``demos``, ``glue``, ``distributed`` and a chapter's first cell (``runtime``)."""

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
