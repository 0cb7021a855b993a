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
to the trainer's logs, and detaches when training ends, saving the report (by default as
``freeze_watch.json`` in the trainer's output or log folder). The watch is ``callback.watch``.
The packages are optional: each function raises ImportError naming the package when it is
missing.
"""

from __future__ import annotations

import os

from .watch import watch

__all__ = ["hf_callback", "lightning_callback"]


def _log_values(w) -> dict:
    if w is None or not w.steps:
        return {}
    return {f"frozen_{f}": w.records[f].overall[-1] for f in w.formats}


def hf_callback(path=None, **watch_options):
    """A ``transformers.TrainerCallback`` that runs a freeze watch over the Trainer's training.

    Args:
        path: where to save the report (default ``freeze_watch.json`` in ``args.output_dir``).
        **watch_options: passed to :func:`lowprec_demo.watch` (``formats``, ``every``,
            ``threshold``, ``writer``, ...).
    """
    try:
        from transformers import TrainerCallback
    except ImportError as error:
        raise ImportError("hf_callback needs the transformers package: pip install transformers") from error

    class FreezeWatchCallback(TrainerCallback):
        """The freeze watch over a Hugging Face Trainer run (see :func:`hf_callback`)."""

        def __init__(self) -> None:
            self.watch = None

        def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
            target = path if path is not None else os.path.join(args.output_dir, "freeze_watch.json")
            self.watch = watch(model, optimizer, scheduler=lr_scheduler, total_steps=state.max_steps or None,
                               path=target, **watch_options)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is not None:
                logs.update(_log_values(self.watch))

        def on_train_end(self, args, state, control, **kwargs):
            if self.watch is not None:
                self.watch.detach()

    return FreezeWatchCallback()


def lightning_callback(path=None, **watch_options):
    """A Lightning ``Callback`` (``lightning`` or ``pytorch_lightning``) that runs a freeze watch
    over ``trainer.fit``, on the first optimizer and its scheduler.

    Args:
        path: where to save the report (default ``freeze_watch.json`` in ``trainer.log_dir``,
            or the working directory).
        **watch_options: passed to :func:`lowprec_demo.watch`.
    """
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

        def on_train_start(self, trainer, pl_module):
            if not trainer.optimizers:
                raise ValueError("the freeze watch needs an optimizer: the LightningModule configured none")
            configs = getattr(trainer, "lr_scheduler_configs", [])
            scheduler = configs[0].scheduler if configs and configs[0].interval == "step" else None
            total = trainer.estimated_stepping_batches
            total = int(total) if total is not None and total != float("inf") else None
            target = path if path is not None else os.path.join(trainer.log_dir or os.getcwd(), "freeze_watch.json")
            self.watch = watch(pl_module, trainer.optimizers[0], scheduler=scheduler, total_steps=total, path=target,
                               **watch_options)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            values = _log_values(self.watch)
            if values and trainer.logger is not None:
                pl_module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)

        def on_train_end(self, trainer, pl_module):
            if self.watch is not None:
                self.watch.detach()

    return FreezeWatchCallback()
