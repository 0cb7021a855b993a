"""The freeze watch and its fix in a Hugging Face Trainer (:func:`hf_callback`) and in Lightning
(:func:`lightning_callback`), and a plan applied to an optimizer that a loop steps itself (:func:`attach_plan`).

The callback attaches :func:`lowprec_demo.watch` (``callback.watch``) to the trainer's model, optimizer, scheduler and
run length when training starts, logs each format's frozen fraction (``frozen_bf16``) at every step, and saves the
report at the end (``freeze_watch.json`` in the output or log folder, with the plan applied). ``plan_after`` applies a
:class:`~lowprec_demo.optim.plan.FreezePlan` (``callback.plan``, saved to ``freeze_plan.json``; applied by
:func:`attach_plan`: ``callback.plan_optimizer``):

* ``plan_after=0``, the one to use: before the first step the callback runs :func:`lowprec_demo.preflight` on the
  trainer's model, optimizer, scheduler and run length (its probe steps on a copy; ``callback.preflight`` holds the
  report, whose verdict it prints) and applies its plan from step 0. The loss of the probe's batches comes from the
  trainer's train data loader (a fresh iterator; the torch random state is put back after it) or from
  ``preflight_loss(model)``.
* ``plan_after=k``: the watch's own plan after k watched steps. It comes late: the steps at the peak learning rate are
  the ones lost. On the bf16 fine-tune benchmark (``benchmarks/cpu-2026-12-06-finetune-bf16.md``, 300 steps of AdamW)
  the plan made at step 30 closed 97 % of plain bf16's gap to float32, the same plan from step 0 99 %; on a tiny
  Llama fine-tuned 200 steps (issue 51) a plan at step 50 closed 72-75 % at lr 1e-4 and 55-56 % at lr 1e-5, one from
  step 0 about 100 %.

After the plan the watch goes on (observation of the stored weights: it sees them before the plan's pre hook opens
them and after its post hook stores them). ``frozen_<fmt>`` alone does not show the fix: under every remedy a weight
far below its gap still moves at few steps (stochastic rounding a whole gap with probability ``|d| / gap``; Kahan,
master copies and the remainder once the summed update crosses half a gap), so most stay the same at a step. Under
AdamW, Adam or SGD the callbacks also log ``kept_<fmt>``, the share of the update the optimizer meant that reached the
stored weights (:mod:`~lowprec_demo.monitor.kept`; the mean of the last 10 watched steps): about 0 where round to
nearest freezes them, about 1 under a working plan (``tests/test_kept.py``: a tiny bf16 model, AdamW at lr 1e-4,
200 steps: 0.07 plain, 1.03 stochastic, 1.00 master, while the frozen share went only from 0.94 to 0.88). The
plan's stochastic rounding draws from a generator of its own, seeded by ``torch.initial_seed()`` (the trainer's seed;
nothing drawn from torch's generator). Checkpoints carry the plan's state (Kahan buffers, master copies, remainders,
that generator, the plan): the Hugging Face callback writes ``lowprec_state.pt`` into each ``checkpoint-<step>``
folder and reads it back on resume; Lightning's callback has it in its ``state_dict``. A resumed
run takes the same steps, to the bit, as an unbroken one (the watch starts again at the resumed step); resuming
without that state warns. Bad options raise when the callback is made, a ``plan_after`` not before the run's end when
training starts. Both use the trainers' public callback hooks only.
"""

from __future__ import annotations

import os
import warnings
from typing import Callable, Optional

import torch

from lowprec_demo.optim.plan import FreezePlan, load_plan
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.monitor.freeze_watch import check_watch_options, watch
from lowprec_demo.monitor.plan_hooks import AttachedPlan, attach_plan      # noqa: F401 (here as before)
from lowprec_demo.monitor.report import watch_format

__all__ = ["attach_plan", "hf_callback", "lightning_callback"]

STATE_FILE = "lowprec_state.pt"       # the plan's state in a Hugging Face checkpoint folder
WATCH_OPTIONS = ("formats", "every", "threshold", "patience", "save_every", "writer", "progress", "sample")


class _Watching:
    """What both callbacks share: the watch, where its report goes, the plan (from the preflight, or the watch's after
    ``plan_after`` steps; saved, applied, watched through), and the plan's state in checkpoints. Options are checked
    when the callback is made, and against the run (:meth:`_start`) before the first step."""

    watch = target = plan = plan_optimizer = preflight = plan_file = None

    def __init__(self, path, plan_after, plan_format, plan_budget, plan_path, preflight_loss, watch_options) -> None:
        if plan_after is not None and (isinstance(plan_after, bool) or not isinstance(plan_after, int)
                                       or plan_after < 0):
            raise ValueError(f"plan_after is a number of optimizer steps >= 0 (0: the preflight's plan from the first "
                             f"step; None: no plan), got {plan_after!r}")
        if isinstance(plan_budget, bool) or not isinstance(plan_budget, (int, float)) or plan_budget < 0:
            raise ValueError(f"plan_budget is extra bytes per parameter, >= 0; got {plan_budget!r}")
        if plan_format is not None:
            plan_format = watch_format(plan_format).name   # a ValueError names the valid formats
        if preflight_loss is not None and not callable(preflight_loss):
            raise TypeError(f"preflight_loss must be a callable loss(model) -> the loss of the next batch, or None "
                            f"(the trainer's data); got {type(preflight_loss).__name__}")
        if unknown := sorted(set(watch_options) - set(WATCH_OPTIONS)):
            raise TypeError(f"unknown watch option{'s' * (len(unknown) > 1)} {', '.join(unknown)}: the callback takes "
                            f"{', '.join(WATCH_OPTIONS)} (the trainer gives the model, optimizer, scheduler and run "
                            f"length; path= is the callback's own)")
        check_watch_options(**watch_options)      # one line naming the bad value
        self.path, self.plan_after, self.plan_format, self.plan_budget = path, plan_after, plan_format, plan_budget
        self.plan_path, self.preflight_loss, self.watch_options = plan_path, preflight_loss, watch_options

    def _start(self, model, optimizer, scheduler, total_steps, folder, resumed: int, saved, trainer_loss) -> None:
        """The watch, checked against the run; then, resuming at step ``resumed`` > 0, the plan ``saved`` with a
        checkpoint (its state), or with ``plan_after=0`` the preflight's plan (``trainer_loss()``: the default loss)."""
        self.target = self.path if self.path is not None else os.path.join(folder, "freeze_watch.json")
        self.plan = self.plan_optimizer = self.preflight = None
        self.watch = w = watch(model, optimizer, scheduler=scheduler, total_steps=total_steps, path=self.target,
                               **self.watch_options)
        try:
            self._check(w)
            w._step = resumed            # its steps numbered as the trainer's
            if saved is not None:
                self._apply(FreezePlan.from_dict(saved["plan"]), model, saved["lowprec"])
            elif resumed and self.plan_after is not None and resumed >= self.plan_after:
                self._missing_state(model, resumed)
            if self.plan is None and self.plan_after == 0:
                self._plan_from_preflight(model, self.preflight_loss or trainer_loss())
        except BaseException:
            w.path = None       # nothing was watched: no report to leave behind
            w.detach()
            raise

    def _check(self, w) -> None:
        """Raise ValueError now unless the plan can be made for this run (its format watched, a run length that
        ``plan_after`` is before; for a plan after k steps, a watch that forecasts) and attached (a plain torch
        optimizer)."""
        if self.plan_after is None:
            return
        if isinstance(w.optimizer, LowPrecisionOptimizer):
            raise ValueError(f"plan_after={self.plan_after}: the optimizer is a LowPrecisionOptimizer, which keeps the "
                             f"parameters on its grid already; give it the plan itself (plan=watch.plan()). Allowed: "
                             f"a plain torch optimizer")
        if w.total_steps is None:
            raise ValueError(f"plan_after={self.plan_after}: the plan needs the run's length (its forecast runs to the "
                             f"end of the run), and the trainer gives none: set a number of steps (max_steps)")
        if self.plan_after >= w.total_steps:
            raise ValueError(f"plan_after={self.plan_after} is not before the run's end: the run has {w.total_steps} "
                             f"optimizer steps (max_steps), so the plan would never act; choose plan_after from 0 "
                             f"(before the first step, the preflight's plan) to {w.total_steps - 1}")
        if w.no_forecast and self.plan_after > 0:
            raise ValueError(f"plan_after={self.plan_after}: {w.no_forecast}, or plan_after=0 (the preflight's plan), "
                             f"or leave plan_after out to watch this run")
        fmt = self.plan_format if self.plan_format is not None else w.formats[0]
        if fmt not in w.formats:
            what = "predicts; add it to formats=... or choose" if w.mode == "predict" else \
                "observes, the parameters' storage (cast the model to it to plan for it); choose"
            raise ValueError(f"plan_format={fmt!r} is not one of the formats the watch {what} one of "
                             f"{', '.join(w.formats)}")

    def _plan_from_preflight(self, model, loss) -> None:
        """:func:`lowprec_demo.preflight` on the trainer's run, its verdict printed, its plan applied before step 0."""
        from lowprec_demo.monitor.preflight import preflight
        w = self.watch
        for handle in w._handles:     # unhooked while the preflight copies the optimizer; the plan hooks it again
            handle.remove()
        w._handles = []
        devices = sorted({p.device.index or 0 for p in w.params.values() if p.is_cuda})
        with torch.random.fork_rng(devices=devices):      # (the loss draws the trainer loader's shuffle)
            self.preflight = preflight(model, w.optimizer, w.scheduler, w.total_steps,
                                       (self.plan_format or w.formats[0],), loss=loss, budget=self.plan_budget)
        print(self.preflight, flush=True)
        self._apply(self.preflight.plan, model)

    def _apply(self, plan: FreezePlan, model, state: Optional[dict] = None) -> None:
        """Save ``plan`` beside the report and attach it (with the remedies' ``state`` from a checkpoint), the watch
        hooked around it."""
        self.plan = plan
        self.plan_file = self.plan_path if self.plan_path is not None else \
            os.path.join(os.path.dirname(os.path.abspath(self.target)), "freeze_plan.json")
        plan.save(self.plan_file)
        # the torch optimizer the watch found inside the trainer's wrapper (accelerate's, Lightning's); stochastic
        # rounding from a generator of its own, seeded by the process's torch seed (drawing nothing from torch's) and
        # kept in checkpoints, so that a resumed run draws the same bits whatever the trainer restores
        self.plan_optimizer = attach_plan(self.watch.optimizer, plan, model=model, watch=self.watch,
                                          generator=torch.initial_seed())
        if state is not None:
            self.plan_optimizer._load_lowprec(state)

    def _missing_state(self, model, resumed: int) -> None:
        """Resumed past the plan without its state: say so, then go on with the saved plan, fresh remedies' state."""
        saved = self.plan_path if self.plan_path is not None else \
            os.path.join(os.path.dirname(os.path.abspath(self.target)), "freeze_plan.json")
        then = f"the plan in {saved} is applied again with fresh state" if os.path.exists(saved) else \
            "the preflight plans again now" if self.plan_after == 0 else "a new plan is made after the next step"
        warnings.warn(f"resuming at step {resumed} without the freeze plan's state ({STATE_FILE} in the checkpoint, or "
                      f"the callback's checkpoint state): the Kahan buffers, master copies and remainders of the plan "
                      f"made at step {self.plan_after} are lost, so this run will not take the steps of an unbroken "
                      f"one; {then}. Resume from a checkpoint saved with this callback", UserWarning, stacklevel=3)
        if os.path.exists(saved):
            self._apply(load_plan(saved), model)

    def _step_done(self, steps: int, model) -> None:
        w = self.watch
        if self.plan_after is None or self.plan is not None or w is None or steps < self.plan_after:
            return
        self._apply(w.plan(self.plan_format, budget=self.plan_budget), model)
        self._save()

    def _save(self) -> None:
        """The report with the plan, to its path; a failure is a warning (the watch's), not the end of the run."""
        w = self.watch
        if w.path is not None and w.steps:
            try:
                w.save(w.path, plan=self.plan)
            except OSError as error:
                warnings.warn(f"{error}; training goes on: call callback.watch.save(other_path) to keep the report",
                              RuntimeWarning, stacklevel=2)

    def _checkpoint_state(self) -> Optional[dict]:
        """What a checkpoint needs to go on with the plan: the plan and its optimizer's own state (None: no plan)."""
        if self.plan_optimizer is None:
            return None
        return {"kind": "lowprec_demo.plan_state", "plan": self.plan.to_dict(),
                "lowprec": self.plan_optimizer.state_dict()["lowprec"]}

    def _values(self) -> dict:
        """``frozen_<fmt>`` at the last watched step, and ``kept_<fmt>`` (the watch's ``kept``) over the last ten."""
        w = self.watch
        if w is None or not w.steps:
            return {}
        return {f"frozen_{f}": w.records[f].overall[-1] for f in w.formats} | {
            f"kept_{f}": record.window() for f, record in w.kept.items()}

    def _end(self) -> None:
        w = self.watch
        if w is not None:
            path, w.path = w.path, None
            w.detach()
            w.path = path
            self._save()


def hf_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None, preflight_loss=None,
                **watch_options):
    """A ``transformers.TrainerCallback`` with a freeze watch and its fix: the report to ``path``; a plan in
    ``plan_format`` (the watch's first) to ``plan_path``, from the preflight before the first step with
    ``plan_after=0`` (the loss of its probe steps ``model(**batch).loss`` on batches of a fresh iterator of the
    trainer's train data loader, moved to the model's device, or ``preflight_loss(model)``), or the watch's after
    ``plan_after`` steps (see :mod:`~lowprec_demo.monitor.integrations` for what a late plan costs);
    ``watch_options`` to :func:`lowprec_demo.watch`. ``plan_after=0`` costs the preflight before the first step (its
    probe steps in float32 on a copy of the model: :func:`lowprec_demo.preflight`). Checkpoints: ``on_save`` writes the
    plan and its state to ``lowprec_state.pt`` in ``output_dir/checkpoint-<step>`` (the remedies' buffers: the plan's
    ``bytes_per_parameter()["extra"]`` per parameter, and a few kB); a resumed run (``state.global_step`` > 0) reads
    it back and attaches the same plan, or warns when it is missing. The watch starts again at the resumed step.

    Give it to the Trainer in one of two ways; at each of the Trainer's logs it adds the values ``frozen_<format>``
    and (AdamW, Adam or SGD) ``kept_<format>``, the share of the meant update stored (the module docstring)::

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

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                           train_dataloader=None, **kwargs):
            resumed, saved = state.global_step, None
            file = os.path.join(args.output_dir, f"checkpoint-{resumed}", STATE_FILE)
            if resumed and os.path.exists(file):
                saved = torch.load(file, map_location="cpu", weights_only=True)
            self._start(model, optimizer, lr_scheduler, state.max_steps or None, args.output_dir, resumed, saved,
                        lambda: _hf_loss(train_dataloader))

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self._step_done(state.global_step, model)

        def on_save(self, args, state, control, **kwargs):
            data = self._checkpoint_state()
            folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
            if data is not None and state.is_world_process_zero and os.path.isdir(folder):
                torch.save(data, os.path.join(folder, STATE_FILE))

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

    return FreezeWatchCallback(path, plan_after, plan_format, plan_budget, plan_path, preflight_loss, watch_options)


def _hf_loss(loader) -> Callable:
    """``model(**batch).loss`` on the batches of a fresh iterator of the trainer's train data loader (accelerate's
    plain loader behind it: the trainer's own iteration state is left alone), moved to the model's device."""
    if loader is None:
        raise ValueError("plan_after=0: the trainer gave no train data loader for the preflight's probe steps; pass "
                         "preflight_loss=lambda model: ... (the loss of the next batch)")
    loader = getattr(loader, "base_dataloader", loader)
    batches = None      # (iterated at the first call: within the preflight, whose random state is put back)

    def loss(model):
        nonlocal batches
        batch = next(batches, None) if batches is not None else None
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        device = next(model.parameters()).device
        return model(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}).loss
    return loss


def lightning_callback(path=None, plan_after=None, plan_format=None, plan_budget=1.0, plan_path=None,
                       preflight_loss=None, **watch_options):
    """A Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``) running a freeze watch over ``trainer.fit`` on
    the first optimizer and its scheduler, in any place of ``Trainer(callbacks=[...])``; options as for
    :func:`hf_callback`. With ``plan_after=0`` the preflight's loss is the module's ``training_step`` on its copy
    (``log``/``log_dict`` silenced, in the trainer's precision context) over a fresh iterator of the trainer's train
    data loader, or ``preflight_loss(model)`` (needed where ``training_step`` uses the trainer). After each training
    batch it logs ``frozen_<format>`` and ``kept_<format>`` through ``pl_module.log_dict`` (to the trainer's logger,
    at that step). The plan and its state are in the callback's ``state_dict`` (so in every checkpoint) and attached
    again on resume."""
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

        _saved = None      # the plan's state from a checkpoint (load_state_dict), until training starts

        def state_dict(self) -> dict:
            return self._checkpoint_state() or {}

        def load_state_dict(self, state_dict: dict) -> None:
            self._saved = state_dict or None

        def on_train_start(self, trainer, pl_module):
            if not trainer.optimizers:
                raise ValueError("the freeze watch needs an optimizer: the LightningModule configured none")
            configs = trainer.lr_scheduler_configs
            scheduler = configs[0].scheduler if configs and configs[0].interval == "step" else None
            total = trainer.estimated_stepping_batches
            total = int(total) if total is not None and total != float("inf") else None
            saved, self._saved = self._saved, None
            self._start(pl_module, trainer.optimizers[0], scheduler, total, trainer.log_dir or os.getcwd(),
                        trainer.global_step, saved, lambda: _lightning_loss(trainer))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self._step_done(trainer.global_step, pl_module)
            values = self._values()
            if values and trainer.logger is not None:
                pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)

        def on_train_end(self, trainer, pl_module):
            self._end()

    return FreezeWatchCallback(path, plan_after, plan_format, plan_budget, plan_path, preflight_loss, watch_options)


def _lightning_loss(trainer) -> Callable:
    """The module's ``training_step`` on the copy it is given, over a fresh iterator of the train data loader."""
    loader = trainer.train_dataloader
    if not isinstance(loader, torch.utils.data.DataLoader):
        raise ValueError(f"plan_after=0: the trainer's train data is a {type(loader).__name__}, not one DataLoader; "
                         f"pass preflight_loss=lambda model: ... (the loss of the next batch)")
    batches, index = None, 0      # (iterated at the first call: within the preflight, whose random state is put back)
    silent = lambda *args, **kwargs: None       # noqa: E731

    def loss(module):
        nonlocal batches, index
        batch = next(batches, None) if batches is not None else None
        if batch is None:
            batches = iter(loader)
            batch = next(batches)
        module.log, module.log_dict = silent, silent
        batch = trainer.strategy.batch_to_device(batch, next(module.parameters()).device)
        with trainer.precision_plugin.train_step_context():
            out = module.training_step(batch, index)
        index += 1
        return out["loss"] if isinstance(out, dict) else out
    return loss
