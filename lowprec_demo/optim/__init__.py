"""Stored weights on a format's grid: :class:`LowPrecisionOptimizer` wraps any torch optimizer
and stores each step's weights with a remedy (round to nearest, stochastic rounding, Kahan
summation, a float32 master copy), per tensor when a :class:`FreezePlan` says which. ``packing``
packs a model's small tensors into one buffer; ``sharding`` rounds FSDP2 shards as one tensor.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16")
"""

from lowprec_demo.optim.optimizer import COMPENSATIONS, PARAM_SELECTIONS, LowPrecisionOptimizer, bytes_per_parameter, select_params
from lowprec_demo.optim.plan import PLAN_REMEDIES, FreezePlan, load_plan

__all__ = ["LowPrecisionOptimizer", "bytes_per_parameter", "select_params", "PARAM_SELECTIONS", "COMPENSATIONS",
           "FreezePlan", "load_plan", "PLAN_REMEDIES"]
