"""The experiments the book and the command line run, by name.

Each experiment module (``quadratic``, ``regression``, ``mlp``, ``mnist``, ``nanogpt``, ``gpt2``)
registers an :class:`Experiment` (see :mod:`lowprec_demo.experiments.registry`): a description,
default settings for the quick and full scales, its options as a frozen dataclass (an
:class:`ExperimentOptions` subclass such as ``QuadraticOptions``, which states each option's type
and default), and a function that builds the :class:`~lowprec_demo.training.Task` for a config.
What the two GPT experiments share is in :mod:`lowprec_demo.experiments.language`.
``run_experiment`` is the one way to run any of them; a setting that is neither a
:class:`~lowprec_demo.training.TrainConfig` field nor one of the experiment's options is refused
(a ValueError that lists the valid names).

Example:
    >>> "quadratic" in experiment_names()
    True
"""

from __future__ import annotations

from dataclasses import fields
from typing import Dict, List, Mapping, Optional, Sequence

from lowprec_demo.book.runtime import progress_bar
from lowprec_demo.book.runtime import scale as current_scale
from lowprec_demo.book.config import TrainConfig
from lowprec_demo.formats import get_format
from lowprec_demo.book.results import TrainResult
from lowprec_demo.book.training import Variants, train_formats, train_variants
from lowprec_demo.book.experiments.registry import (Experiment, ExperimentOptions, experiment_names, get_experiment, register)
# importing each experiment's module registers it
from lowprec_demo.book.experiments import quadratic, regression, mlp, mnist, nanogpt, gpt2  # noqa: F401
from lowprec_demo.book.experiments.quadratic import QuadraticOptions
from lowprec_demo.book.experiments.regression import RegressionOptions
from lowprec_demo.book.experiments.mlp import MLPOptions
from lowprec_demo.book.experiments.mnist import MNISTOptions
from lowprec_demo.book.experiments.language import LanguageModelOptions
from lowprec_demo.book.experiments.nanogpt import NanoGPTOptions
from lowprec_demo.book.experiments.gpt2 import GPT2Options

__all__ = ["Experiment", "ExperimentOptions", "register", "experiment_names", "get_experiment", "config_fields",
           "check_settings", "make_config", "run_experiment", "run_formats", "sweep",
           "QuadraticOptions", "RegressionOptions", "MLPOptions", "MNISTOptions", "LanguageModelOptions",
           "NanoGPTOptions", "GPT2Options"]


_CONFIG_FIELDS = tuple(f.name for f in fields(TrainConfig) if f.name != "options")


def config_fields() -> tuple:
    """The names of the :class:`~lowprec_demo.training.TrainConfig` fields a setting can set
    (every field but ``options``, whose entries are set one by one).

    Example:
        >>> "lr" in config_fields()
        True
    """
    return _CONFIG_FIELDS


def check_settings(name: str, settings: Mapping[str, object]) -> None:
    """Raise ValueError unless every key of ``settings`` is a TrainConfig field or one of
    experiment ``name``'s options (the entries of an ``options`` dict are checked as options);
    the message lists the valid names.

    Example:
        >>> check_settings("quadratic", {"lr": 0.1, "dim": 8})   # passes
    """
    exp = get_experiment(name)
    keys = [k for k in settings if k != "options"] + list(settings.get("options") or {})
    allowed_options = None if exp.options is None else tuple(exp.options)
    unknown = [k for k in keys if k not in _CONFIG_FIELDS and allowed_options is not None
               and k not in allowed_options]
    if unknown:
        raise ValueError(f"unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} for "
                         f"{name}; {name}'s options: {', '.join(allowed_options) or 'none'}; "
                         f"config fields: {', '.join(_CONFIG_FIELDS)}")


def make_config(name: str, scale: Optional[str] = None, **overrides) -> TrainConfig:
    """The experiment's default config for ``scale`` with ``overrides`` applied. Keys that are not
    TrainConfig fields go into ``options``; a key that is neither a field nor one of the
    experiment's options raises ValueError (see :func:`check_settings`).

    Example:
        >>> make_config("quadratic", lr=0.05).lr
        0.05
    """
    exp = get_experiment(name)
    check_settings(name, overrides)
    settings = dict(exp.defaults(current_scale(scale)))
    options = dict(settings.pop("options", {}))
    for key, value in overrides.items():
        if value is None:
            continue
        if key == "options":
            options.update(value)
        elif key in _CONFIG_FIELDS:
            settings[key] = value
        else:
            options[key] = value
    return TrainConfig(**settings, options=options)


def run_experiment(name: str, fmt: Optional[str] = None, steps: Optional[int] = None, lr: Optional[float] = None,
                   seed: int = 0, device: str = "auto", scale: Optional[str] = None, progress: bool = True,
                   **overrides) -> TrainResult:
    """Build and train experiment ``name``: the reference, round-to-nearest and stochastic runs
    from one initialisation, with the freeze prediction. Unset arguments take the experiment's
    defaults for the scale (``LOWPREC_SCALE``, default quick).

    Example:
        >>> r = run_experiment("quadratic", fmt="bf16", steps=20, progress=False)
        >>> len(r.runs["nearest"].loss)
        20
    """
    config = make_config(name, scale, format=fmt, steps=steps, lr=lr, seed=seed, device=device, **overrides)
    task = get_experiment(name).build(config)
    return train_variants(name, task, config, progress=progress)


def sweep(name: str, man_bits: Sequence[int] = (7,), lrs: Sequence[Optional[float]] = (None,), exp_bits: int = 8,
          seeds: Sequence[int] = (0,), progress: bool = False, keep_results: bool = False, **overrides) -> List[dict]:
    """Run ``name`` for every combination of mantissa length (format ``e{exp_bits}m{m}``), learning
    rate and seed; one row per run with the predicted and observed freeze steps, whether they agree
    within max(2 steps, 2 % of the run) (``agree``, see
    :func:`~lowprec_demo.prediction.steps_agree`: True as well when neither freezes within the
    run), whether either froze (``froze``; to count agreement only where something froze, count
    the rows where both hold), the schedule rule's freeze step (``schedule_rule``), whether the
    run is one where no baseline agrees with the observed freeze (``decisive``, see
    :meth:`~lowprec_demo.training.TrainResult.is_decisive`: the rows an honest tally counts), and
    the final losses. Only the reference and nearest runs are trained unless ``variants`` is given.

    Example:
        >>> rows = sweep("quadratic", man_bits=[4, 6], steps=100)
        >>> [r["man_bits"] for r in rows]
        [4, 6]
    """
    from lowprec_demo.freeze.prediction import steps_agree
    overrides.setdefault("variants", ("reference", "nearest"))
    rows = []
    combos = [(m, lr, s) for m in man_bits for lr in lrs for s in seeds]
    for m, lr, s in progress_bar(combos, desc=f"sweep {name}", disable=not progress):
        result = run_experiment(name, fmt=f"e{exp_bits}m{m}", lr=lr, seed=s, progress=False, **overrides)
        pred, obs = result.predicted_freeze_step(), result.observed_freeze_step()
        has_nearest = "nearest" in result.runs
        row = {"man_bits": m, "lr": result.config.lr, "seed": s, "steps": result.config.steps,
               "predicted": pred, "observed": obs, "agree": steps_agree(pred, obs, result.config.steps),
               "froze": pred is not None or obs is not None,
               "schedule_rule": result.predictor_errors()["schedule"]["freeze_step"] if has_nearest else None,
               "decisive": has_nearest and result.is_decisive(),
               **{f"final_loss_{v}": run.loss[-1] for v, run in result.runs.items()}}
        if keep_results:
            row["result"] = result
        rows.append(row)
    return rows


def run_formats(name: str, formats: Sequence[str], variants: Variants = ("nearest",), seed: int = 0,
                device: str = "auto", scale: Optional[str] = None, progress: bool = True,
                **overrides) -> Dict[str, TrainResult]:
    """:func:`train_formats` for a named experiment: one reference run predicting every format,
    then ``variants`` in each format. Other arguments as for
    :func:`lowprec_demo.experiments.run_experiment`.

    Example:
        >>> results = run_formats("quadratic", ["e8m4", "e8m5", "bf16"], steps=100, progress=False)
        >>> [r.predicted_freeze_step() is not None for r in results.values()]
        [True, True, True]
    """
    config = make_config(name, scale, format=get_format(formats[0]).name if formats else None, seed=seed,
                         device=device, **overrides)
    task = get_experiment(name).build(config)
    return train_formats(name, task, config, formats, variants=variants, progress=progress)

