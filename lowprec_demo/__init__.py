"""lowprec_demo: watch weights freeze in low-precision training, and predict when.

When an optimizer update is smaller than half the unit in the last place (ULP) of a stored
weight, round-to-nearest hands back the same weight. This package simulates any small float
format exactly (bit for bit), wraps any torch optimizer so stored weights live on that format's
grid, predicts from a high-precision run when each weight freezes, and plots it.

Modules: ``formats`` (float formats), ``rounding`` (exact nearest and stochastic rounding, the
freeze rule), ``optimizer`` (LowPrecisionOptimizer), ``prediction`` (freeze prediction and
observation), ``training`` (the training loop), ``experiments`` (named experiments),
``data`` and ``models``, ``distributed`` and ``sharding`` (torchrun: DDP replicas, FSDP2 shards),
``plots``, ``widgets``, ``demos``, ``results`` (stored full-scale
runs), ``watch`` (a freeze watch for your own training loop: ``lowprec_demo.watch(model, optimizer)``),
``remedies`` (the remedies side by side: ``compare_remedies``), ``fidelity`` (torch's own bf16 and
fp16 optimizer steps, op by op), ``cli`` (``python -m lowprec_demo``) and ``bench`` (``python -m lowprec_demo.bench``).

Example:
    >>> import lowprec_demo as lp
    >>> lp.quantize(lp.torch.tensor([1.001]), "bf16").item()
    1.0
"""

import torch

from .formats import FORMAT_NAMES, FloatFormat, format_table, get_format
from .optimizer import LowPrecisionOptimizer, bytes_per_parameter, select_params
from .agreement import mask_mismatch, stratified_chance_mismatch
from .prediction import (FreezeObserver, FreezePredictor, FreezeRecord, freeze_order, freeze_step,
                         steps_agree)
from .rounding import move_probability, quantize, ulp, update_ulp_ratio, would_freeze
from .runtime import by_scale, pick_device, progress_bar, scale, seed_everything
from .config import TrainConfig, lr_factor
from .results import TrainResult, evidence_table, load_result, stored_results
from .training import Task, train_formats, train_variants
from .experiments import experiment_names, make_config, run_experiment, run_formats, sweep
from .watch import Diagnosis, FreezeWatch, load_watch, watch
from .freeze_plan import FreezePlan, load_plan
from .integrations import attach_plan
from .remedies import RemedyComparison, compare_remedies
from .version import __version__

__all__ = [
    "FORMAT_NAMES", "FloatFormat", "format_table", "get_format",
    "quantize", "ulp", "would_freeze", "move_probability", "update_ulp_ratio",
    "LowPrecisionOptimizer", "select_params",
    "FreezePredictor", "FreezeObserver", "FreezeRecord", "freeze_step", "freeze_order", "steps_agree",
    "mask_mismatch", "stratified_chance_mismatch",
    "Task", "TrainConfig", "TrainResult", "train_variants", "train_formats", "run_formats", "lr_factor",
    "evidence_table",
    "load_result", "stored_results",
    "experiment_names", "make_config", "run_experiment", "sweep",
    "scale", "by_scale", "pick_device", "seed_everything", "progress_bar",
    "watch", "FreezeWatch", "Diagnosis", "load_watch", "FreezePlan", "load_plan", "attach_plan", "compare_remedies", "RemedyComparison", "bytes_per_parameter",
]
