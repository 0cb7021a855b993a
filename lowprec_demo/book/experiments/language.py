"""What the two GPT experiments (``nanogpt`` and ``gpt2``) share: their common options, the
language-modelling Task, nanoGPT's weight-decay groups and the split of a batch over processes.

Example:
    >>> LanguageModelOptions().batch_size
    12
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.data.batches import TokenBatches
from lowprec_demo.book.experiments.registry import ExperimentOptions
from lowprec_demo.book.models import GPT
from lowprec_demo.book.runtime import pick_device
from lowprec_demo.book.training import Task

__all__ = ["LanguageModelOptions", "gpt_task", "decay_groups", "shard_rows"]


@dataclass(frozen=True)
class LanguageModelOptions(ExperimentOptions):
    """The options every GPT experiment has: sequences per step (all processes together), the share of the tokens held
    out for validation (the end of the text), and validation batches per evaluation (0: none)."""

    batch_size: int = 12
    val_fraction: float = 0.1
    eval_batches: int = 4


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list:
    """nanoGPT's optimizer groups: ``weight_decay`` on tensors with 2 or more dimensions (matrices and
    embeddings), none on biases and LayerNorm parameters. The book's GPT runs and its fine-tune use them."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def shard_rows(batch, rank: int, world_size: int):
    """This rank's share of an ``(x, y)`` batch: an equal block of rows (the batch size a multiple
    of the processes, so that the mean of the shards' mean losses is the whole batch's)."""
    x, y = batch
    if x.shape[0] % world_size:
        raise ValueError(f"batch_size {x.shape[0]} is not a multiple of the {world_size} processes")
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def gpt_task(config: TrainConfig, options: LanguageModelOptions, model_config, tokens: torch.Tensor,
             context: int, description: str) -> Task:
    """A language-modelling Task for a GPT: random windows of ``context`` tokens (the same for a seed and step in
    every run), mean next-token cross-entropy, a validation loss on ``options.eval_batches`` fixed batches."""
    device = pick_device(config.device)
    batches = TokenBatches(tokens, block_size=context, batch_size=options.batch_size, seed=config.seed,
                           val_fraction=options.val_fraction, device=device)
    eval_batches = options.eval_batches

    def loss(model, batch):
        x, y = batch
        return model(x, y)[1]

    def evaluate(model):
        losses = [loss(model, batches.get_batch(i, "val")).item() for i in range(eval_batches)]
        return {"val_loss": sum(losses) / len(losses)}

    return Task(make_model=lambda gen: GPT(model_config, generator=gen), batch=batches.get_batch, loss=loss,
                evaluate=evaluate if eval_batches > 0 else None, param_groups=lambda model, config: decay_groups(model, config.weight_decay), shard=shard_rows,
                description=description)
