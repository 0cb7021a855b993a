"""What an experiment is, and the registry of them by name (each module registers one on import)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Callable, Dict, Mapping, Optional, Tuple, Type

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.training import Task

__all__ = ["ExperimentOptions", "Experiment", "register", "experiment_names", "get_experiment"]

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_EXPECTED = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def _convert(value, kind: type):
    """``value`` as a ``kind`` (bool, int, float or str), from that type or text; ValueError (no message) if neither."""
    if isinstance(value, str) and kind is not str:
        text = value.strip().lower()
        if kind is bool:
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError
        return kind(text)                          # int("16"), float("1e-3"); ValueError otherwise
    if kind is bool:
        if isinstance(value, bool) or value in (0, 1):
            return bool(value)
        raise ValueError
    if isinstance(value, bool) or (kind is str) != isinstance(value, str):
        raise ValueError
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if not isinstance(value, int):
            raise ValueError
        return value
    return kind(value)


@dataclass(frozen=True)
class ExperimentOptions:
    """An experiment's options: a subclass is a frozen dataclass whose fields are the options, each with its type and
    default, stated there alone (``Optional[...] = None``: "not set", the build chooses).

    Example:
        >>> from lowprec_demo.book.experiments.quadratic import QuadraticOptions
        >>> QuadraticOptions.from_options({"dim": "8"}).to_dict("dim", "noise")
        {'dim': 8, 'noise': 0.0}
    """

    @classmethod
    def names(cls) -> Tuple[str, ...]:
        """The options' names, in the order of the fields."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def types(cls) -> Dict[str, Tuple[type, bool]]:
        """Per option, its type (bool, int, float or str) and whether it may be None."""
        hints = typing.get_type_hints(cls)
        out = {}
        for name in cls.names():
            hint = hints[name]
            args = typing.get_args(hint)
            optional = typing.get_origin(hint) is typing.Union and type(None) in args
            out[name] = (next(a for a in args if a is not type(None)) if optional else hint, optional)
        return out

    @classmethod
    def from_options(cls, options: Mapping[str, object]) -> "ExperimentOptions":
        """The typed options of a config's ``options`` (defaults for the rest); text (``--set bias=false``)
        is read as the option's type, ``"none"`` as None where allowed; else a ValueError."""
        types = cls.types()
        unknown = [name for name in options if name not in types]
        if unknown:
            raise ValueError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                             f"for {cls.__name__}; its options: {', '.join(cls.names()) or 'none'}")
        values = {}
        for name, value in options.items():
            kind, optional = types[name]
            if optional and (value is None or (isinstance(value, str) and value.strip().lower() == "none")):
                values[name] = None
                continue
            try:
                values[name] = _convert(value, kind)
            except (ValueError, TypeError):
                raise ValueError(f"option {name} takes {_EXPECTED[kind]}" + (" or None" if optional else "")
                                 + f", not {value!r}") from None
        return cls(**values)

    def to_dict(self, *names: str) -> dict:
        """The options as a config's ``options`` records them: all, or ``names`` in that order."""
        return {name: getattr(self, name) for name in (names or self.names())}


@dataclass
class Experiment:
    """A named experiment: ``name``, a one-line ``description``, ``defaults(scale)`` (TrainConfig fields, ``options``
    among them), ``build(config) -> Task``, and ``option_class`` (None: any option name is accepted)."""

    name: str
    description: str
    defaults: Callable[[str], dict]
    build: Callable[[TrainConfig], Task]
    option_class: Optional[Type[ExperimentOptions]] = None

    @property
    def options(self) -> Optional[Tuple[str, ...]]:
        """The names of the experiment's options, or None when it declares none."""
        return None if self.option_class is None else self.option_class.names()


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
