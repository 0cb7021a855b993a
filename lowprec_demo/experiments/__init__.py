"""The experiments the book and the command line run, by name.

Each experiment module registers an :class:`Experiment`: a description, default settings for the
quick and full scales, and a function that builds the :class:`~lowprec_demo.training.Task` for a
config. ``run_experiment`` is the one way to run any of them.

Example:
    >>> "quadratic" in experiment_names()
    True
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional

from ..runtime import scale as current_scale
from ..training import Task, TrainConfig, TrainResult, train_variants

__all__ = ["Experiment", "register", "experiment_names", "get_experiment", "make_config", "run_experiment"]


@dataclass
class Experiment:
    """A named experiment.

    Attributes:
        name: the name used by ``run_experiment`` and the command line.
        description: one line.
        defaults: ``f(scale) -> dict`` of TrainConfig fields (``options`` for model sizes etc.)
            for ``"quick"`` and ``"full"``.
        build: ``f(config) -> Task``.
    """

    name: str
    description: str
    defaults: Callable[[str], dict]
    build: Callable[[TrainConfig], Task]


_REGISTRY: Dict[str, Experiment] = {}


def register(experiment: Experiment) -> Experiment:
    """Add an experiment to the registry (a module does this once, at import)."""
    _REGISTRY[experiment.name] = experiment
    return experiment


def experiment_names() -> list:
    """Names of all registered experiments."""
    return sorted(_REGISTRY)


def get_experiment(name: str) -> Experiment:
    """The experiment called ``name``; a ValueError lists the valid names otherwise."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown experiment {name!r}; valid experiments: {', '.join(experiment_names())}")
    return _REGISTRY[name]


_CONFIG_FIELDS = {f.name for f in fields(TrainConfig)}


def make_config(name: str, scale: Optional[str] = None, **overrides) -> TrainConfig:
    """The experiment's default config for ``scale`` with ``overrides`` applied. Keys that are not
    TrainConfig fields go into ``options``.

    Example:
        >>> make_config("quadratic", lr=0.05).lr
        0.05
    """
    exp = get_experiment(name)
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


# Registration: one module per experiment.
from . import quadratic  # noqa: E402,F401
