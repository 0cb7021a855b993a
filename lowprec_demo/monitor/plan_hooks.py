"""A plan applied to an optimizer that a loop steps itself (:func:`attach_plan`), through its step hooks, and a freeze
watch hooked around it (:meth:`AttachedPlan.follow`) so that it goes on counting the stored weights."""

from __future__ import annotations

from typing import Optional

import torch

from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.rounding import GeneratorLike
from lowprec_demo.monitor.freeze_watch import FreezeWatch

__all__ = ["AttachedPlan", "attach_plan"]


class AttachedPlan(LowPrecisionOptimizer):
    """A :class:`LowPrecisionOptimizer` that applies a plan around the steps of the optimizer it wraps, which a training
    loop keeps stepping itself, through that optimizer's step hooks (made by :func:`attach_plan`; do not step this one
    as well): :meth:`before_inner_step` before the update (after the closure, for a step given one), and
    :meth:`after_inner_step` after it. :meth:`detach_plan` removes the hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, plan: FreezePlan, model: Optional[torch.nn.Module] = None,
                 generator: GeneratorLike = None, watch: Optional[FreezeWatch] = None) -> None:
        super().__init__(optimizer, plan.format if isinstance(plan, FreezePlan) else "bf16", generator=generator,
                         plan=plan, model=model)
        self.hooks = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]
        if watch is not None:
            self.follow(watch)

    def follow(self, watch: FreezeWatch) -> None:
        """Hook ``watch`` (on this optimizer) again so that it sees the stored weights: its pre hook before the plan's
        (which opens bf16/fp16 storage into float32 working copies and puts the master copies in), its post hook
        after the plan's (which stores them back). Its frozen share is then what an observer of the stored bits
        counts between steps. Costs nothing per step."""
        if watch.optimizer is not self.optimizer:
            raise ValueError("the watch is on another optimizer than the plan's: watch the optimizer the plan is on")
        for handle in [*watch._handles, *self.hooks]:
            handle.remove()
        opt = self.optimizer
        first = opt.register_step_pre_hook(watch.before_step)
        self.hooks = [opt.register_step_pre_hook(self._before), opt.register_step_post_hook(self._after)]
        watch._handles = [first, opt.register_step_post_hook(watch.after_step)]

    def _before(self, opt, args, kwargs):
        closure = args[1] if len(args) > 1 else kwargs.get("closure")     # (args: the optimizer, then step's own)
        if closure is None:
            with torch.no_grad():
                self.before_inner_step()
            return None

        def closure_first():      # the loop's closure (forward, backward) on the stored weights, then the opening
            loss = closure()
            with torch.no_grad():
                self.before_inner_step()
            return loss
        if len(args) > 1:
            return (args[0], closure_first, *args[2:]), kwargs
        return args, {**kwargs, "closure": closure_first}

    @torch.no_grad()
    def _after(self, opt, args, kwargs) -> None:
        self.after_inner_step()

    def detach_plan(self) -> None:
        """Remove the hooks: the optimizer's steps store the parameters as it computes them."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


def attach_plan(optimizer: torch.optim.Optimizer, plan: FreezePlan, model: Optional[torch.nn.Module] = None,
                generator: GeneratorLike = None, watch: Optional[FreezeWatch] = None) -> AttachedPlan:
    """Apply ``plan`` to an optimizer that a training loop keeps stepping itself (a Trainer's, a plain loop's):
    the tensors it names are rounded onto the plan's grid now, and from then on every ``optimizer.step()`` stores them
    with their remedies, through the optimizer's step hooks. Returns the :class:`AttachedPlan` (a
    :class:`LowPrecisionOptimizer`) that does it (for :func:`~lowprec_demo.optim.memory.bytes_per_parameter` and
    ``state_dict()``, whose ``"lowprec"`` part a checkpoint needs beside the optimizer's own; do not step it as well);
    its ``detach_plan()`` removes the hooks. ``watch``: a :func:`~lowprec_demo.watch` on this optimizer, hooked again
    so that it goes on counting the stored weights under the plan (:meth:`AttachedPlan.follow`). Other step hooks run
    in the order registered: from the plan's pre hook to its post hook, parameters stored in bf16 or fp16 are float32
    working copies and master weights are in place.

    In a plain loop, plan from step 0 (on the bf16 fine-tune benchmark a plan from step 0 closed 99 % of the gap to
    float32, the same plan made at 10 % of the run 97 %; see :mod:`~lowprec_demo.monitor.integrations`)::

        plan = lp.preflight(model, opt, scheduler, total_steps=T, loss=lambda m: m(**next(batches)).loss).plan
        lp.attach_plan(opt, plan, model=model, watch=w)      # w: lp.watch(model, opt, ...), or leave it out

    Example:
        >>> from lowprec_demo.optim.plan import FreezePlan
        >>> lin = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
        >>> lp_opt = attach_plan(opt, FreezePlan("bf16", {"weight": "master", "bias": "nearest"}), model=lin)
        >>> lp_opt.remedy_of(lin.weight)
        'master'
        >>> lp_opt.detach_plan()
    """
    if isinstance(optimizer, LowPrecisionOptimizer):
        raise TypeError("attach_plan takes the plain optimizer the loop steps; this one is a LowPrecisionOptimizer "
                        "already")
    return AttachedPlan(optimizer, plan, model, generator, watch)
