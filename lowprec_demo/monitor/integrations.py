"""The freeze watch in the trainers people use: a Hugging Face ``transformers`` callback and a
PyTorch Lightning callback, one core (:func:`lowprec_demo.watch`) under both. TensorBoard needs
nothing here: pass a ``SummaryWriter`` as ``writer=`` to the watch or to either callback.

Hugging Face::

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[lowprec_demo.integrations.hf_callback(formats=("bf16",))])

Lightning::

    trainer = L.Trainer(max_steps=1000, callbacks=[lowprec_demo.integrations.lightning_callback()])

Each callback attaches the watch when training starts (to the trainer's model, optimizer and
learning-rate scheduler, with the run's length), adds the overall frozen fraction of every format
to the trainer's logs (Hugging Face: ``frozen_bf16`` and so on in every log, so in
``trainer.state.log_history`` and the reporting integrations such as TensorBoard, which is why
the callback runs first among the Trainer's callbacks), and detaches when training ends, saving the report (by default as
``freeze_watch.json`` in the trainer's output or log folder). The watch is ``callback.watch``.
The packages are optional: each function raises ImportError naming the package when it is
missing.

With ``plan_after=k`` either callback also acts on what the watch saw: after k optimizer steps
of the float32 run it makes a :class:`~lowprec_demo.freeze_plan.FreezePlan` (``plan_format``,
the watch's first format by default; ``plan_budget`` extra bytes per parameter), saves it
(``freeze_plan.json`` beside the report), applies it to the trainer's optimizer with
:func:`attach_plan` (from step k on, every tensor is stored in that
format with its remedy) and saves the watch's report and detaches the watch, whose prediction
ends there (``callback.plan`` and ``callback.plan_optimizer`` hold the plan and what applies it).
A plan that could not be made then (parameters stored in bf16 or another low-precision dtype, a
``plan_format`` the watch does not predict, no run length) raises ValueError when training
starts, before the first step.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import torch

from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.rounding.core import GeneratorLike
from lowprec_demo.monitor.freeze_watch import watch
from lowprec_demo.monitor.report import watch_format

__all__ = ["attach_plan", "hf_callback", "lightning_callback"]


def attach_plan(optimizer: torch.optim.Optimizer, plan: FreezePlan, model: Optional[torch.nn.Module] = None,
                generator: GeneratorLike = None) -> LowPrecisionOptimizer:
    """Apply ``plan`` to an optimizer that a training loop keeps stepping itself (a Trainer's):
    the tensors it names are rounded onto the plan's grid now, and from then on every
    ``optimizer.step()`` stores them with their remedies, through the optimizer's step hooks.
    Returns the :class:`LowPrecisionOptimizer` that does it (for
    :func:`~lowprec_demo.optimizer.bytes_per_parameter` and ``state_dict``; do not step it as
    well); ``detach_plan()`` on it removes the hooks.

    Example:
        >>> from lowprec_demo.freeze_plan import FreezePlan
        >>> lin = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(lin.parameters(), lr=1e-3)
        >>> lp_opt = attach_plan(opt, FreezePlan("bf16", {"weight": "master", "bias": "nearest"}), model=lin)
        >>> lp_opt.remedy_of(lin.weight)
        'master'
    """
    if isinstance(optimizer, LowPrecisionOptimizer):
        raise TypeError("attach_plan takes the plain optimizer the loop steps; this one is a LowPrecisionOptimizer "
                        "already")
    wrapper = LowPrecisionOptimizer(optimizer, plan.format if isinstance(plan, FreezePlan) else "bf16",
                                    generator=generator, plan=plan, model=model)

    def before(opt, args, kwargs):
        with torch.no_grad():
            wrapper.before_inner_step()

    def after(opt, args, kwargs):
        with torch.no_grad():
            wrapper.after_inner_step()

    handles = [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]

    def detach_plan() -> None:
        for h in handles:
            h.remove()
        handles.clear()

    wrapper.detach_plan = detach_plan
    return wrapper


def _log_values(w) -> dict:
    if w is None or not w.steps:
        return {}
    return {f"frozen_{f}": w.records[f].overall[-1] for f in w.formats}


def _check_plan_options(plan_after, plan_budget) -> None:
    if plan_after is not None and (isinstance(plan_after, bool) or not isinstance(plan_after, int) or plan_after < 1):
        raise ValueError(f"plan_after is a number of optimizer steps >= 1 (or None: no plan), got {plan_after!r}")
    if isinstance(plan_budget, bool) or not isinstance(plan_budget, (int, float)) or plan_budget < 0:
        raise ValueError(f"plan_budget is extra bytes per parameter, >= 0; got {plan_budget!r}")


class _Planner:
    """What both callbacks do at ``plan_after``: plan, save, apply, stop watching. Its options are
    checked when the callback is made, and against the run (:meth:`check`) when the watch is
    attached, before the first step: a plan that cannot be made fails then, not after
    ``plan_after`` steps of work."""

    def __init__(self, plan_after, plan_format, plan_budget, plan_path) -> None:
        _check_plan_options(plan_after, plan_budget)
        if plan_format is not None:
            plan_format = watch_format(plan_format).name   # a ValueError names the valid formats
        self.after, self.format, self.budget, self.path = plan_after, plan_format, plan_budget, plan_path
        self.plan = self.plan_optimizer = None

    def check(self, w, model) -> None:
        """Raise ValueError now if the plan could not be made at ``plan_after`` on this run: the
        watch must predict (float32 or float64 parameters, the plain optimizer), for the plan's
        format, with a known run length."""
        if self.after is None:
            return
        if w.mode != "predict":
            watched = set(w.names)
            low = [(n, p.dtype) for n, p in model.named_parameters()
                   if n in watched and p.dtype not in (torch.float32, torch.float64)]
            where = (f"the trained parameters are stored in {', '.join(sorted({str(d) for _, d in low}))} "
                     f"(e.g. {low[0][0]})" if low else
                     "the optimizer is a LowPrecisionOptimizer, which keeps the parameters on its grid already")
            raise ValueError(f"plan_after={self.after}: a freeze plan is made from the updates of a float32 run (the "
                             f"watch in prediction mode), but {where}. Allowed: parameters in torch.float32 or "
                             f"torch.float64 under a plain torch optimizer; train in float32 (e.g. load the model with "
                             f"dtype=torch.float32) to plan, or leave plan_after out to watch this run")
        fmt = self.format if self.format is not None else w.formats[0]
        if fmt not in w.formats:
            raise ValueError(f"plan_format={fmt!r} is not one of the formats the watch predicts "
                             f"({', '.join(w.formats)}); add it to formats=... or choose one of those")
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
    """Put ``callback`` first in the Trainer's list of callbacks, from its first event on: the
    values it adds to the logs in ``on_log`` then reach the reporting integrations
    (TensorBoard, W&B, ...), which the Trainer calls before the callbacks a user passes. The
    list is that of the ``CallbackHandler`` calling the event (a frame up); where none is found,
    the order stays as it is."""
    frame = sys._getframe(1)
    for _ in range(4):
        frame = frame.f_back
        if frame is None:
            return
        handler = frame.f_locals.get("self")
        callbacks = getattr(handler, "callbacks", None)
        if isinstance(callbacks, list) and any(c is callback for c in callbacks):
            # moved to the front while the handler iterates the list: the callbacks after it keep their
            # places, so each is still called once
            callbacks.remove(callback)
            callbacks.insert(0, callback)
            return


def hf_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None, **watch_options):
    """A ``transformers.TrainerCallback`` that runs a freeze watch over the Trainer's training.

    Args:
        path: where to save the report (default ``freeze_watch.json`` in ``args.output_dir``).
        plan_after: make and apply a freeze plan after this many optimizer steps (see the module
            docstring); None: watch only.
        plan_format, plan_budget, plan_path: the plan's format (the watch's first), extra bytes
            per parameter, and file (``freeze_plan.json`` beside the report).
        **watch_options: passed to :func:`lowprec_demo.watch` (``formats``, ``every``,
            ``threshold``, ``writer``, ...).
    """
    planner = _Planner(plan_after, plan_format, plan_budget, plan_path)
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise ImportError("hf_callback needs the transformers package: pip install transformers") from error

    class FreezeWatchCallback(TrainerCallback):
        """The freeze watch over a Hugging Face Trainer run (see :func:`hf_callback`)."""

        def __init__(self) -> None:
            self.watch = None
            self.target = None

        @property
        def plan(self):
            return planner.plan

        @property
        def plan_optimizer(self):
            return planner.plan_optimizer

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            _run_first(self)
            self.target = path if path is not None else os.path.join(args.output_dir, "freeze_watch.json")
            self.watch = watch(model, optimizer, scheduler=lr_scheduler, total_steps=state.max_steps or None,
                               path=self.target, **watch_options)
            try:
                planner.check(self.watch, model)
            except ValueError:
                self.watch.path = None       # nothing was watched: no report to leave behind
                self.watch.detach()
                raise

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if planner.plan is None and planner.after is not None and state.global_step >= planner.after:
                planner.maybe_apply(self.watch, state.global_step, model, self.target)
                self.watch = None

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
            if self.watch is not None:
                self.watch.detach()

    return FreezeWatchCallback()


def lightning_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None,
                       **watch_options):
    """A Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``) that runs a freeze watch
    over ``trainer.fit``, on the first optimizer and its scheduler.

    Args:
        path: where to save the report (default ``freeze_watch.json`` in ``trainer.log_dir``,
            or the working directory).
        plan_after, plan_format, plan_budget, plan_path: a freeze plan after this many optimizer
            steps, as for :func:`hf_callback`.
        **watch_options: passed to :func:`lowprec_demo.watch`.
    """
    planner = _Planner(plan_after, plan_format, plan_budget, plan_path)
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as error:
            raise ImportError("lightning_callback needs Lightning: pip install lightning (or pytorch-lightning)") from error

    class FreezeWatchCallback(pl.Callback):
        """The freeze watch over a Lightning run (see :func:`lightning_callback`)."""

        def __init__(self) -> None:
            self.watch = None
            self.target = None

        @property
        def plan(self):
            return planner.plan

        @property
        def plan_optimizer(self):
            return planner.plan_optimizer

        def on_train_start(self, trainer, pl_module):
            if not trainer.optimizers:
                raise ValueError("the freeze watch needs an optimizer: the LightningModule configured none")
            configs = getattr(trainer, "lr_scheduler_configs", [])
            scheduler = configs[0].scheduler if configs and configs[0].interval == "step" else None
            total = trainer.estimated_stepping_batches
            total = int(total) if total is not None and total != float("inf") else None
            self.target = path if path is not None else os.path.join(trainer.log_dir or os.getcwd(),
                                                                     "freeze_watch.json")
            self.watch = watch(pl_module, trainer.optimizers[0], scheduler=scheduler, total_steps=total,
                               path=self.target, **watch_options)
            try:
                planner.check(self.watch, pl_module)
            except ValueError:
                self.watch.path = None       # nothing was watched: no report to leave behind
                self.watch.detach()
                raise

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if planner.plan is None and planner.after is not None and trainer.global_step >= planner.after:
                planner.maybe_apply(self.watch, trainer.global_step, pl_module, self.target)
                self.watch = None
            values = _log_values(self.watch)
            if values and trainer.logger is not None:
                pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)

        def on_train_end(self, trainer, pl_module):
            if self.watch is not None:
                self.watch.detach()

    return FreezeWatchCallback()
