"""Stored weights on a format's grid: :class:`LowPrecisionOptimizer` wraps a ``torch.optim`` optimizer, whose step is
computed in float32, and stores every selected parameter back on the grid, so that the next
forward pass uses exactly the weights of a model kept in that format. The remedies, the ways to store a step's result:

* ``rounding="nearest"`` (ties to even): an update below half an ulp of the weight is lost; the
  weight freezes although its gradient is not zero.
* ``rounding="stochastic"``: unbiased; an update ``d`` moves the weight with probability ``|d|/ulp``.
* ``compensation="kahan"``: nearest rounding plus a per-element buffer carrying the rounding residual into the next
  step, so that lost updates pile up until they move the weight; the buffer in the parameter's dtype (4 bytes), or with
  ``compensation_format="bf16"`` in 2 bytes (as torch-optimi keeps it: only the residual's leading bits carry over).
* ``master_weights=True``: a float32 master copy takes the steps, the parameters hold it rounded
  to nearest: nothing is lost, for 4 bytes a parameter more.
* ``compensation="remainder"`` (bf16): the same steps to the same stored bits, the master kept as the stored weight
  plus a 16-bit remainder, for 2 bytes more.
* ``compensation="feedback"``: each step's rounding error fed into the optimizer's first moment (ECO), no byte more.

Parameters really stored in torch.bfloat16 or torch.float16 take their step in float32 working copies that live
during the step only (:mod:`~lowprec_demo.optim.storage`): for that step the process holds float32 copies of all their
weights, gradients and elementwise state at once; between steps the state stays in their dtype.

A :class:`FreezePlan` gives each tensor its own remedy, ``state_format`` keeps the optimizer state (Adam's moments) on
a grid too, and :func:`bytes_per_parameter` (``memory``) counts what a setting stores; ``options`` checks the arguments.
Packing small tensors into one buffer (``pack=True``) and FSDP2's shards are :mod:`lowprec_demo.common`'s.

Example:
    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(3))
    >>> opt = LowPrecisionOptimizer(torch.optim.SGD([w], lr=1e-3), "bf16")
    >>> w.grad = torch.ones(3); opt.step()
    >>> w.tolist()   # 1 - 0.001 is closer to 1.0 than to 1 - 2**-8: frozen
    [1.0, 1.0, 1.0]
"""

from lowprec_demo.optim.memory import bytes_per_parameter
from lowprec_demo.optim.optimizer import COMPENSATIONS, PARAM_SELECTIONS, LowPrecisionOptimizer, select_params
from lowprec_demo.optim.plan import PLAN_REMEDIES, FreezePlan, load_plan

__all__ = ["LowPrecisionOptimizer", "bytes_per_parameter", "select_params", "PARAM_SELECTIONS", "COMPENSATIONS",
           "FreezePlan", "load_plan", "PLAN_REMEDIES"]
