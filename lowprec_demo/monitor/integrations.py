"""The freeze watch in a Hugging Face Trainer (:func:`hf_callback`) and in Lightning (:func:`lightning_callback`): the
callback attaches :func:`lowprec_demo.watch` (``callback.watch``) to the trainer's model, optimizer, scheduler and run
length when training starts, adds each format's frozen fraction to the logs (``frozen_bf16``), and detaches at the
end, saving the report (``freeze_watch.json`` in the output or log folder). With ``plan_after=k`` it makes a
:class:`~lowprec_demo.optim.plan.FreezePlan` after k steps (``plan_format``, ``plan_budget`` extra bytes per
parameter), saves it (``freeze_plan.json``), applies it with :func:`attach_plan` (``callback.plan``,
``callback.plan_optimizer``) and stops watching; a plan that could not be made raises ValueError when training starts.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.rounding import GeneratorLike
from lowprec_demo.monitor.freeze_watch import watch
from lowprec_demo.monitor.report import watch_format

__all__ = ["attach_plan", "hf_callback", "lightning_callback"]


class AttachedPlan(LowPrecisionOptimizer):
    """A :class:`LowPrecisionOptimizer` that applies a plan around the steps of the optimizer it wraps, which a
    training loop keeps stepping itself: through that optimizer's step hooks (made by :func:`attach_plan`; do not step
    this one as well). :meth:`detach_plan` removes the hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, plan: FreezePlan, model: Optional[torch.nn.Module] = None,
                 generator: GeneratorLike = None) -> None:
        super().__init__(optimizer, plan.format if isinstance(plan, FreezePlan) else "bf16", generator=generator,
                         plan=plan, model=model)
        self._hidden: dict = {}      # during a step: the gradients step_stored hid
        self.hooks = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

    @torch.no_grad()
    def _before(self, opt, args, kwargs) -> None:
        self._hidden = self.step_stored()     # bf16/fp16 storage: stepped here, hidden from the optimizer's own step
        self.before_inner_step()

    @torch.no_grad()
    def _after(self, opt, args, kwargs) -> None:
        self.after_inner_step()
        self.show_grads(self._hidden)
        self._hidden = {}

    def detach_plan(self) -> None:
        """Remove the hooks: the optimizer's steps store the parameters as it computes them."""
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()


def attach_plan(optimizer: torch.optim.Optimizer, plan: FreezePlan, model: Optional[torch.nn.Module] = None,
                generator: GeneratorLike = None) -> AttachedPlan:
    """Apply ``plan`` to an optimizer that a training loop keeps stepping itself (a Trainer's):
    the tensors it names are rounded onto the plan's grid now, and from then on every ``optimizer.step()`` stores them
    with their remedies, through the optimizer's step hooks. Returns the :class:`AttachedPlan` (a
    :class:`LowPrecisionOptimizer`) that does it (for :func:`~lowprec_demo.optim.optimizer.bytes_per_parameter` and
    ``state_dict``; do not step it as well); its ``detach_plan()`` removes the hooks.

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
    return AttachedPlan(optimizer, plan, model, generator)


def _log_values(w) -> dict:
    if w is None or not w.steps:
        return {}
    return {f"frozen_{f}": w.records[f].overall[-1] for f in w.formats}


class _Planner:
    """What both callbacks do at ``plan_after``: plan, save, apply, stop watching; its options
    are checked when made, and against the run (:meth:`check`) before the first step."""

    def __init__(self, plan_after, plan_format, plan_budget, plan_path) -> None:
        if plan_after is not None and (isinstance(plan_after, bool) or not isinstance(plan_after, int)
                                       or plan_after < 1):
            raise ValueError(f"plan_after is a number of optimizer steps >= 1 (or None: no plan), got {plan_after!r}")
        if isinstance(plan_budget, bool) or not isinstance(plan_budget, (int, float)) or plan_budget < 0:
            raise ValueError(f"plan_budget is extra bytes per parameter, >= 0; got {plan_budget!r}")
        if plan_format is not None:
            plan_format = watch_format(plan_format).name   # a ValueError names the valid formats
        self.after, self.format, self.budget, self.path = plan_after, plan_format, plan_budget, plan_path
        self.plan = self.plan_optimizer = None

    def check(self, w, model) -> None:
        """Raise ValueError now unless the watch forecasts the plan's format with a run length, and the plan can be
        attached (a plain torch optimizer; stored in low precision: one whose update the watch reads)."""
        if self.after is None:
            return
        if isinstance(w.optimizer, LowPrecisionOptimizer):
            raise ValueError(f"plan_after={self.after}: the optimizer is a LowPrecisionOptimizer, which keeps the "
                             f"parameters on its grid already; give it the plan itself (plan=watch.plan()). Allowed: "
                             f"a plain torch optimizer")
        if w.no_forecast:
            raise ValueError(f"plan_after={self.after}: {w.no_forecast}, or leave plan_after out to watch this run")
        fmt = self.format if self.format is not None else w.formats[0]
        if fmt not in w.formats:
            what = "predicts; add it to formats=... or choose" if w.mode == "predict" else \
                "observes, the parameters' storage (cast the model to it to plan for it); choose"
            raise ValueError(f"plan_format={fmt!r} is not one of the formats the watch {what} one of "
                             f"{', '.join(w.formats)}")
        if w.total_steps is None:
            raise ValueError(f"plan_after={self.after}: the plan needs the run's length (its forecast runs to the end "
                             f"of the run), and the trainer gives none: set a number of steps (max_steps)")

    def maybe_apply(self, w, steps_done: int, model, report_path) -> None:
        if self.after is None or self.plan is not None or w is None or steps_done < self.after:
            return
        self.plan = w.plan(self.format, budget=self.budget)
        target = self.path if self.path is not None else os.path.join(os.path.dirname(os.path.abspath(report_path)),
                                                                      "freeze_plan.json")
        self.plan.save(target)
        # the torch optimizer the watch found inside the trainer's wrapper (accelerate's, Lightning's)
        self.plan_optimizer = attach_plan(w.optimizer, self.plan, model=model)
        w.save(report_path)
        w.detach()


def _run_first(callback) -> None:
    """Put ``callback`` first in the calling ``CallbackHandler``'s list (found a frame up), so that
    what it adds to the logs reaches the reporting integrations (TensorBoard, W&B)."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return
        callbacks = getattr(frame.f_locals.get("self"), "callbacks", None)   # the CallbackHandler's
        if isinstance(callbacks, list) and any(c is callback for c in callbacks):
            # moved to the front during the iteration: the callbacks after it are still called once
            callbacks.remove(callback)
            callbacks.insert(0, callback)
            return


class _Watching:
    """What both callbacks share: the watch, where its report goes, and the plan (``_planner``)."""

    watch = target = None
    _planner: _Planner
    plan = property(lambda self: self._planner.plan)
    plan_optimizer = property(lambda self: self._planner.plan_optimizer)

    def _start(self, model, optimizer, scheduler, total_steps, target, watch_options: dict) -> None:
        self.target = target
        self.watch = watch(model, optimizer, scheduler=scheduler, total_steps=total_steps, path=target, **watch_options)
        try:
            self._planner.check(self.watch, model)
        except ValueError:
            self.watch.path = None       # nothing was watched: no report to leave behind
            self.watch.detach()
            raise

    def _step_done(self, steps: int, model) -> None:
        planner = self._planner
        if planner.plan is None and planner.after is not None and steps >= planner.after:
            planner.maybe_apply(self.watch, steps, model, self.target)
            self.watch = None

    def _end(self) -> None:
        if self.watch is not None:
            self.watch.detach()


def hf_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None, **watch_options):
    """A ``transformers.TrainerCallback`` with a freeze watch: the report to ``path``, a plan after ``plan_after`` steps
    in ``plan_format`` (the watch's first) to ``plan_path``; ``watch_options`` to :func:`lowprec_demo.watch`."""
    planner = _Planner(plan_after, plan_format, plan_budget, plan_path)
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise ImportError("hf_callback needs the transformers package: pip install transformers") from error

    class FreezeWatchCallback(_Watching, TrainerCallback):
        """The freeze watch over a Hugging Face Trainer run (see :func:`hf_callback`)."""

        _planner = planner

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            _run_first(self)
            self._start(model, optimizer, lr_scheduler, state.max_steps or None,
                        path if path is not None else os.path.join(args.output_dir, "freeze_watch.json"), watch_options)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self._step_done(state.global_step, model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = _log_values(self.watch)
            if logs is None or not values:
                return
            # the Trainer keeps a copy of these logs in state.log_history before the callbacks run
            last = state.log_history[-1] if state.log_history else None
            if last is not None and last.get("step") == state.global_step and \
                    all(last.get(k) is v or last.get(k) == v for k, v in logs.items()):
                last.update(values)
            logs.update(values)     # in place: the callbacks after this one (TensorBoard, the printer) see them

        def on_train_end(self, args, state, control, **kwargs):
            self._end()

    return FreezeWatchCallback()


def lightning_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None,
                       **watch_options):
    """A Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``) running a freeze watch
    over ``trainer.fit`` on the first optimizer and its scheduler; options as for :func:`hf_callback`."""
    planner = _Planner(plan_after, plan_format, plan_budget, plan_path)
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as error:
            raise ImportError("lightning_callback needs Lightning: pip install lightning (or pytorch-lightning)") from error

    class FreezeWatchCallback(_Watching, pl.Callback):
        """The freeze watch over a Lightning run (see :func:`lightning_callback`)."""

        _planner = planner

        def on_train_start(self, trainer, pl_module):
            if not trainer.optimizers:
                raise ValueError("the freeze watch needs an optimizer: the LightningModule configured none")
            configs = getattr(trainer, "lr_scheduler_configs", [])
            scheduler = configs[0].scheduler if configs and configs[0].interval == "step" else None
            total = trainer.estimated_stepping_batches
            total = int(total) if total is not None and total != float("inf") else None
            self._start(pl_module, trainer.optimizers[0], scheduler, total,
                        path if path is not None else os.path.join(trainer.log_dir or os.getcwd(), "freeze_watch.json"),
                        watch_options)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._step_done(trainer.global_step, pl_module)
            values = _log_values(self.watch)
            if values and trainer.logger is not None:
                pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)

        def on_train_end(self, trainer, pl_module):
            self._end()

    return FreezeWatchCallback()
