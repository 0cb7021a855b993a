"""The freeze watch in a Hugging Face Trainer (:func:`hf_callback`) and in Lightning (:func:`lightning_callback`): the
callback attaches :func:`lowprec_demo.watch` (``callback.watch``) to the trainer's model, optimizer, scheduler and run
length when training starts, logs each format's frozen fraction (``frozen_bf16``), and detaches at the end, saving
the report (``freeze_watch.json`` in the output or log folder). With ``plan_after=k`` it makes a
:class:`~lowprec_demo.optim.plan.FreezePlan` after k steps (``plan_format``, ``plan_budget`` extra bytes per
parameter), saves it (``freeze_plan.json``), applies it with :func:`attach_plan` (``callback.plan``,
``callback.plan_optimizer``) and stops watching; a plan that could not be made raises ValueError when training starts.
Both use the trainers' public callback hooks only; how the values reach the logs is told at each callback.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.rounding import GeneratorLike
from lowprec_demo.monitor.freeze_watch import watch
from lowprec_demo.monitor.report import watch_format

__all__ = ["attach_plan", "hf_callback", "lightning_callback"]


class AttachedPlan(LowPrecisionOptimizer):
    """A :class:`LowPrecisionOptimizer` that applies a plan around the steps of the optimizer it wraps, which a training
    loop keeps stepping itself, through that optimizer's step hooks (made by :func:`attach_plan`; do not step this one
    as well): :meth:`before_inner_step` before the update (after the closure, for a step given one), and
    :meth:`after_inner_step` after it. :meth:`detach_plan` removes the hooks."""

    def __init__(self, optimizer: torch.optim.Optimizer, plan: FreezePlan, model: Optional[torch.nn.Module] = None,
                 generator: GeneratorLike = None) -> None:
        super().__init__(optimizer, plan.format if isinstance(plan, FreezePlan) else "bf16", generator=generator,
                         plan=plan, model=model)
        self.hooks = [optimizer.register_step_pre_hook(self._before), optimizer.register_step_post_hook(self._after)]

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
                generator: GeneratorLike = None) -> AttachedPlan:
    """Apply ``plan`` to an optimizer that a training loop keeps stepping itself (a Trainer's):
    the tensors it names are rounded onto the plan's grid now, and from then on every ``optimizer.step()`` stores them
    with their remedies, through the optimizer's step hooks. Returns the :class:`AttachedPlan` (a
    :class:`LowPrecisionOptimizer`) that does it (for :func:`~lowprec_demo.optim.memory.bytes_per_parameter` and
    ``state_dict``; do not step it as well); its ``detach_plan()`` removes the hooks. Other step hooks on the optimizer
    run in the order registered: from the plan's pre hook to its post hook, parameters stored in bf16 or fp16 are
    float32 working copies and master weights are in place (a hook registered before the plan sees the stored weights
    before the step, one registered after it sees them after).

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


class _Watching:
    """What both callbacks share: the watch, where its report goes, and the plan made after ``plan_after`` steps (plan,
    save, apply, stop watching). The plan's options are checked when the callback is made, and against the run
    (:meth:`_start`) before the first step."""

    watch = target = plan = plan_optimizer = None

    def __init__(self, path, plan_after, plan_format, plan_budget, plan_path, watch_options: dict) -> None:
        if plan_after is not None and (isinstance(plan_after, bool) or not isinstance(plan_after, int)
                                       or plan_after < 1):
            raise ValueError(f"plan_after is a number of optimizer steps >= 1 (or None: no plan), got {plan_after!r}")
        if isinstance(plan_budget, bool) or not isinstance(plan_budget, (int, float)) or plan_budget < 0:
            raise ValueError(f"plan_budget is extra bytes per parameter, >= 0; got {plan_budget!r}")
        if plan_format is not None:
            plan_format = watch_format(plan_format).name   # a ValueError names the valid formats
        self.path, self.plan_after, self.plan_format, self.plan_budget = path, plan_after, plan_format, plan_budget
        self.plan_path, self.watch_options = plan_path, watch_options

    def _start(self, model, optimizer, scheduler, total_steps, folder) -> None:
        self.target = self.path if self.path is not None else os.path.join(folder, "freeze_watch.json")
        self.watch = watch(model, optimizer, scheduler=scheduler, total_steps=total_steps, path=self.target,
                           **self.watch_options)
        try:
            self._check(self.watch)
        except ValueError:
            self.watch.path = None       # nothing was watched: no report to leave behind
            self.watch.detach()
            raise

    def _check(self, w) -> None:
        """Raise ValueError now unless the watch forecasts the plan's format with a run length, and the plan can be
        attached (a plain torch optimizer; stored in low precision: one whose update the watch reads)."""
        if self.plan_after is None:
            return
        if isinstance(w.optimizer, LowPrecisionOptimizer):
            raise ValueError(f"plan_after={self.plan_after}: the optimizer is a LowPrecisionOptimizer, which keeps the "
                             f"parameters on its grid already; give it the plan itself (plan=watch.plan()). Allowed: "
                             f"a plain torch optimizer")
        if w.no_forecast:
            raise ValueError(f"plan_after={self.plan_after}: {w.no_forecast}, or leave plan_after out to watch this "
                             f"run")
        fmt = self.plan_format if self.plan_format is not None else w.formats[0]
        if fmt not in w.formats:
            what = "predicts; add it to formats=... or choose" if w.mode == "predict" else \
                "observes, the parameters' storage (cast the model to it to plan for it); choose"
            raise ValueError(f"plan_format={fmt!r} is not one of the formats the watch {what} one of "
                             f"{', '.join(w.formats)}")
        if w.total_steps is None:
            raise ValueError(f"plan_after={self.plan_after}: the plan needs the run's length (its forecast runs to the "
                             f"end of the run), and the trainer gives none: set a number of steps (max_steps)")

    def _step_done(self, steps: int, model) -> None:
        w = self.watch
        if self.plan_after is None or self.plan is not None or w is None or steps < self.plan_after:
            return
        self.plan = w.plan(self.plan_format, budget=self.plan_budget)
        self.plan.save(self.plan_path if self.plan_path is not None else
                       os.path.join(os.path.dirname(os.path.abspath(self.target)), "freeze_plan.json"))
        # the torch optimizer the watch found inside the trainer's wrapper (accelerate's, Lightning's)
        self.plan_optimizer = attach_plan(w.optimizer, self.plan, model=model)
        w.save(self.target)
        w.detach()
        self.watch = None

    def _values(self) -> dict:
        w = self.watch
        return {f"frozen_{f}": w.records[f].overall[-1] for f in w.formats} if w is not None and w.steps else {}

    def _end(self) -> None:
        if self.watch is not None:
            self.watch.detach()


def hf_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None, **watch_options):
    """A ``transformers.TrainerCallback`` with a freeze watch: the report to ``path``, a plan after ``plan_after`` steps
    in ``plan_format`` (the watch's first) to ``plan_path``; ``watch_options`` to :func:`lowprec_demo.watch`.

    Give it to the Trainer in one of two ways; at each of the Trainer's logs it adds the values ``frozen_<format>``::

        trainer = transformers.Trainer(..., callbacks=[callback])   # (1) into the logs the callbacks after it see
        callback = hf_callback(...).attach(trainer)                 # (2) logged by the Trainer itself

    (1) ``on_log`` adds them to the ``logs`` dict, in place: the callbacks after this one see them, such as the
    printer, which the Trainer adds last. The Trainer places its ``report_to`` integrations (TensorBoard, W&B) before
    the callbacks given to it and records ``state.log_history`` before any callback runs: neither gets them.
    (2) ``attach(trainer)`` adds the callback (``trainer.add_callback``) and logs the values through ``trainer.log``,
    a log of their own at the same step, once per step: they reach ``state.log_history``, every ``report_to``
    integration and the printer, whatever the order of the callbacks."""
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise ImportError("hf_callback needs the transformers package: pip install transformers") from error

    class FreezeWatchCallback(_Watching, TrainerCallback):
        """The freeze watch over a Hugging Face Trainer run (see :func:`hf_callback`)."""

        trainer, _logged = None, None

        def attach(self, trainer):
            """Add this callback to ``trainer`` and log its values through ``trainer.log``; returns the callback."""
            self.trainer = trainer
            trainer.add_callback(self)
            return self

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            self._start(model, optimizer, lr_scheduler, state.max_steps or None, args.output_dir)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self._step_done(state.global_step, model)

        def on_log(self, args, state, control, logs=None, **kwargs):
            values = self._values()
            if logs is None or not values or values.keys() <= logs.keys():
                return
            if self.trainer is None:
                logs.update(values)
            elif self._logged != state.global_step:
                self._logged = state.global_step
                self.trainer.log(values)

        def on_train_end(self, args, state, control, **kwargs):
            self._end()

    return FreezeWatchCallback(path, plan_after, plan_format, plan_budget, plan_path, watch_options)


def lightning_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None,
                       **watch_options):
    """A Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``) running a freeze watch over ``trainer.fit`` on
    the first optimizer and its scheduler, in any place of ``Trainer(callbacks=[...])``; options as for
    :func:`hf_callback`. After each training batch it logs ``frozen_<format>`` through ``pl_module.log_dict`` (to the
    trainer's logger, at that step)."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as error:
            raise ImportError("lightning_callback needs Lightning: pip install lightning (or pytorch-lightning)") \
                from error

    class FreezeWatchCallback(_Watching, pl.Callback):
        """The freeze watch over a Lightning run (see :func:`lightning_callback`)."""

        def on_train_start(self, trainer, pl_module):
            if not trainer.optimizers:
                raise ValueError("the freeze watch needs an optimizer: the LightningModule configured none")
            configs = trainer.lr_scheduler_configs
            scheduler = configs[0].scheduler if configs and configs[0].interval == "step" else None
            total = trainer.estimated_stepping_batches
            total = int(total) if total is not None and total != float("inf") else None
            self._start(pl_module, trainer.optimizers[0], scheduler, total, trainer.log_dir or os.getcwd())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._step_done(trainer.global_step, pl_module)
            values = self._values()
            if values and trainer.logger is not None:
                pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)

        def on_train_end(self, trainer, pl_module):
            self._end()

    return FreezeWatchCallback(path, plan_after, plan_format, plan_budget, plan_path, watch_options)
