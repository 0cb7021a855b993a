"""The experiments the book and the command line run, by name, each with its options as a typed
dataclass (``language``: what the two GPTs share). :func:`run_experiment` runs any of them and
refuses a setting that is neither a TrainConfig field nor an option, naming the valid ones."""

from __future__ import annotations

from dataclasses import fields
from typing import Dict, List, Mapping, Optional, Sequence

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.experiments.registry import (Experiment, ExperimentOptions, experiment_names, get_experiment,
                                                    register)
from lowprec_demo.book.results import TrainResult
from lowprec_demo.book.runtime import progress_bar
from lowprec_demo.book.runtime import scale as current_scale
from lowprec_demo.book.training import Variants, train_formats, train_variants
from lowprec_demo.formats import get_format
from lowprec_demo.freeze import steps_agree
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
    """The TrainConfig fields a setting can set (not ``options``, whose entries are set one by one)."""
    return _CONFIG_FIELDS


def check_settings(name: str, settings: Mapping[str, object]) -> None:
    """Raise ValueError, naming the valid keys, unless each key of ``settings`` (and its ``options``)
    is a TrainConfig field or an option of experiment ``name``."""
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
    """The experiment's config for ``scale`` with ``overrides`` (None: the default); keys that are not
    TrainConfig fields go into ``options``. E.g. ``make_config("quadratic", lr=0.05, dim=8)``."""
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
    """Build and train experiment ``name`` (:func:`~lowprec_demo.book.training.train_variants`),
    unset arguments from its defaults at the scale (``LOWPREC_SCALE``, default quick)."""
    config = make_config(name, scale, format=fmt, steps=steps, lr=lr, seed=seed, device=device, **overrides)
    task = get_experiment(name).build(config)
    return train_variants(name, task, config, progress=progress)


def sweep(name: str, man_bits: Sequence[int] = (7,), lrs: Sequence[Optional[float]] = (None,), exp_bits: int = 8,
          seeds: Sequence[int] = (0,), progress: bool = False, keep_results: bool = False, **overrides) -> List[dict]:
    """Run ``name`` for every mantissa length (format ``e{exp_bits}m{m}``), learning rate and seed: a
    row per run with the ``predicted`` and ``observed`` freeze steps, ``agree`` (True also when
    neither freezes), ``froze``, the ``schedule_rule``'s step, ``decisive`` and the final losses.

    Example:
        >>> [r["man_bits"] for r in sweep("quadratic", man_bits=[4, 6], steps=100)]
        [4, 6]
    """
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
    """:func:`~lowprec_demo.book.training.train_formats` for a named experiment.

    Example:
        >>> sorted(run_formats("quadratic", ["e8m4", "bf16"], steps=100, progress=False))
        ['bf16', 'e8m4']
    """
    config = make_config(name, scale, format=get_format(formats[0]).name if formats else None, seed=seed,
                         device=device, **overrides)
    task = get_experiment(name).build(config)
    return train_formats(name, task, config, formats, variants=variants, progress=progress)
