"""The options of :class:`~lowprec_demo.optim.optimizer.LowPrecisionOptimizer`: which parameters
it keeps in low precision (:func:`select_params`), which remedies go together
(:func:`check_options`) and which parameters each can keep (:func:`check_param`), and the generator
stochastic rounding draws from (:func:`make_generator`).

Example:
    >>> import torch
    >>> check_options(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), "bf16", "stochastic",
    ...               "nearest", "kahan", None, False, "all", None, None)
    Traceback (most recent call last):
    ...
    ValueError: compensation='kahan' is a remedy for round-to-nearest; use rounding='nearest'
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

import torch

from lowprec_demo.common.sharding import check_placements, is_sharded
from lowprec_demo.formats import FloatFormat, format_of_dtype, get_format
from lowprec_demo.optim import storage
from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.rounding import ROUNDING_MODES, GeneratorLike

__all__ = ["select_params", "check_options", "check_param", "make_generator", "PARAM_SELECTIONS", "COMPENSATIONS"]

PARAM_SELECTIONS = ("all", "matrices")
COMPENSATIONS = (None, "kahan", "remainder", "feedback")

ParamSelection = Union[str, Callable[[torch.Tensor], bool], Iterable[torch.Tensor]]


def select_params(params: Iterable[torch.Tensor], which: ParamSelection = "all") -> list:
    """The parameters to keep in low precision: ``"all"``; ``"matrices"`` (2 or more dimensions: linear
    and embedding weights, convolution kernels); those a predicate accepts; or those of a collection.

    Example:
        >>> lin = torch.nn.Linear(2, 2)
        >>> [tuple(p.shape) for p in select_params(lin.parameters(), "matrices")]
        [(2, 2)]
    """
    params = list(params)
    if isinstance(which, str) and which in PARAM_SELECTIONS:
        return params if which == "all" else [p for p in params if p.dim() >= 2]
    if isinstance(which, str):
        raise ValueError(f"params must be one of {', '.join(PARAM_SELECTIONS)}, a predicate or a "
                         f"collection of tensors; got {which!r}")
    if callable(which):
        return [p for p in params if which(p)]
    chosen = {id(p) for p in which}
    return [p for p in params if id(p) in chosen]


def check_options(optimizer, fmt, rounding, state_rounding, compensation, compensation_format, master_weights,
                  params, plan, model) -> None:
    """Refuse, naming what is allowed, the arguments of a ``LowPrecisionOptimizer`` that do not go
    together (in the order of its signature, ``params``, ``plan`` and ``model`` last)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if plan is not None:
        if not isinstance(plan, FreezePlan):
            raise TypeError(f"plan must be a FreezePlan (watch.plan(fmt) or load_plan(path)), got {type(plan).__name__}")
        if given := [name for name, chosen in (
                ("rounding", rounding != "nearest"), ("compensation", compensation is not None),
                ("compensation_format", compensation_format is not None), ("master_weights", master_weights is True),
                ("params", not (isinstance(params, str) and params == "all"))) if chosen]:
            raise ValueError(f"plan= chooses the remedy of every tensor it names; leave {', '.join(given)} at "
                             f"the default")
        if get_format(fmt).name != plan.format:
            raise ValueError(f"the plan is for {plan.format}; this optimizer stores {get_format(fmt).name}")
    elif model is not None:
        raise ValueError("model= tells a plan's names; give plan= too")
    for name, value in (("rounding", rounding), ("state_rounding", state_rounding)):
        if value not in ROUNDING_MODES:
            raise ValueError(f"{name} must be one of {', '.join(ROUNDING_MODES)}; got {value!r}")
    if compensation not in COMPENSATIONS:
        raise ValueError(f"compensation must be one of {', '.join(map(repr, COMPENSATIONS))}; got {compensation!r}")
    if compensation in ("kahan", "remainder") and rounding != "nearest":
        raise ValueError(f"compensation={compensation!r} is a remedy for round-to-nearest; use rounding='nearest'")
    if compensation_format is not None and compensation != "kahan":
        raise ValueError("compensation_format is the format of the Kahan buffer: give compensation='kahan' too")
    if not isinstance(master_weights, bool):
        raise TypeError(f"master_weights must be True or False, got {master_weights!r}")
    if master_weights and (rounding != "nearest" or compensation is not None):
        raise ValueError("master_weights=True keeps every update in a float32 copy: use it with "
                         "rounding='nearest' and no compensation")


def check_param(p: torch.Tensor, fmt: FloatFormat, remedy: str) -> None:
    """Refuse, naming what is allowed, a parameter the optimizer cannot keep in ``fmt`` with ``remedy``."""
    if p.dtype not in (torch.float32, torch.float64, *storage.STORED_DTYPES):
        raise TypeError(f"a LowPrecisionOptimizer keeps parameters in float32 or float64 (a format simulated "
                        f"on them) or really stored in torch.bfloat16 or torch.float16; got {p.dtype}")
    if storage.is_stored(p) and format_of_dtype(p.dtype) != fmt.name:
        raise ValueError(f"a parameter of shape {tuple(p.shape)} is stored in {p.dtype}, whose grid is "
                         f"{format_of_dtype(p.dtype)}; this optimizer's format is {fmt.name}: give "
                         f"fmt={format_of_dtype(p.dtype)!r}, or keep the parameters in float32 to simulate {fmt.name}")
    if storage.is_stored(p) and is_sharded(p):
        raise ValueError("FSDP2 parameters are rounded in float32 or float64 (a simulated format); these are "
                         f"stored in {p.dtype}: shard a float32 model")
    if remedy == "remainder" and (fmt.name != "bf16" or p.dtype == torch.float64):
        raise ValueError(f"the remainder remedy keeps a float32 master as bf16 plus 16 bits: it needs the "
                         f"bf16 format on float32 or bfloat16 parameters; got {fmt.name} on {p.dtype}")
    check_placements(p)    # FSDP2's Shard(0) (and Replicate) only


def make_generator(generator: GeneratorLike) -> Optional[torch.Generator]:
    """The SR generator: an int seeds a new CPU generator (one seed for the run, fresh bits each step)."""
    if isinstance(generator, bool) or not (generator is None or isinstance(generator, (int, torch.Generator))):
        raise TypeError(f"generator must be a torch.Generator, an int seed or None, got {type(generator).__name__}")
    return torch.Generator().manual_seed(generator & ((1 << 63) - 1)) if isinstance(generator, int) else generator
