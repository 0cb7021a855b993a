"""``nanogpt``: a character-level GPT on Tiny Shakespeare, the setup of nanoGPT's shakespeare-char.

AdamW with a linear warmup and a cosine decay of the learning rate, weight decay on matrices
only. Every parameter is stored on the format's grid after every step (``bf16``: 7 mantissa bits,
"bf16-equivalent stored weights").

Why there is a wall: Adam's update is about ``lr_t`` in size whatever the gradient, and round to
nearest drops an update below half a gap of the weight, about ``|w| 2^-(m+1)`` for m mantissa
bits. As the cosine schedule lowers ``lr_t`` the weights cross that line, the largest first:
LayerNorm gains (``|w| = 1``) never move in bf16 at ``lr <= 2^-9``, and the bulk of the matrices
(``|w|`` about 0.02) stop at a step the fp32 reference run predicts.

Options: ``model`` (a name in :data:`lowprec_demo.models.GPT_CONFIGS`), ``n_layer``, ``n_head``,
``n_embd``, ``block_size`` (override the model's shape), ``bias`` (biases in the linear layers and
LayerNorms, as in GPT-2; nanoGPT's own default is without), ``batch_size``, ``eval_batches``
(validation batches per evaluation), ``val_fraction``.
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch

from ..data import CharTokenizer, TokenBatches, load_shakespeare
from ..models import GPT, gpt_config
from ..runtime import pick_device
from ..config import TrainConfig
from ..training import Task
from . import Experiment, register

__all__ = ["char_tokens", "gpt_task", "decay_groups", "shard_rows"]

_SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size")


@lru_cache(maxsize=4)
def _char_tokens(data_dir: str, offline: str):
    corpus = load_shakespeare()
    tokenizer = CharTokenizer(corpus.text)
    tokens = torch.tensor(tokenizer.encode(corpus.text), dtype=torch.long)
    return tokens, tokenizer, corpus.source


def char_tokens():
    """Tiny Shakespeare (or the offline stand-in) as character tokens: ``(tokens, tokenizer,
    source)``. Cached per data folder, so a notebook that builds many runs reads the file once.

    Example: ``tokens, tok, source = char_tokens(); tok.vocab_size`` -> 65."""
    return _char_tokens(os.environ.get("LOWPREC_DATA_DIR", ""), os.environ.get("LOWPREC_OFFLINE", ""))


def decay_groups(model: torch.nn.Module, config: TrainConfig) -> list:
    """nanoGPT's optimizer groups: weight decay on tensors with 2 or more dimensions (matrices and
    embeddings), none on biases and LayerNorm parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _flag(value) -> bool:
    """An on/off option given as a bool or as text (``--set bias=false`` on the command line)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


def shard_rows(batch, rank: int, world_size: int):
    """This rank's share of an ``(x, y)`` batch: an equal block of rows (the batch size must be a
    multiple of the number of processes, so that the mean of the shards' mean losses is the mean
    loss of the whole batch)."""
    x, y = batch
    if x.shape[0] % world_size:
        raise ValueError(f"batch_size {x.shape[0]} is not a multiple of the {world_size} processes")
    return x.chunk(world_size)[rank], y.chunk(world_size)[rank]


def gpt_task(config: TrainConfig, model_config, tokens: torch.Tensor, context: int, description: str) -> Task:
    """A language-modelling Task for a GPT: random windows of ``context`` tokens (the same for a
    given seed and step in every run), mean next-token cross-entropy, and a validation loss on
    ``eval_batches`` fixed batches. Shared by the ``nanogpt`` and ``gpt2`` experiments."""
    o = config.options
    device = pick_device(config.device)
    batches = TokenBatches(tokens, block_size=context, batch_size=int(o.get("batch_size", 12)), seed=config.seed,
                           val_fraction=float(o.get("val_fraction", 0.1)), device=device)
    eval_batches = int(o.get("eval_batches", 4))

    def loss(model, batch):
        x, y = batch
        return model(x, y)[1]

    def evaluate(model):
        losses = [loss(model, batches.get_batch(i, "val")).item() for i in range(eval_batches)]
        return {"val_loss": sum(losses) / len(losses)}

    return Task(make_model=lambda gen: GPT(model_config, generator=gen), batch=batches.get_batch, loss=loss,
                evaluate=evaluate if eval_batches > 0 else None, param_groups=decay_groups, shard=shard_rows,
                description=description)


def _defaults(scale: str) -> dict:
    # nanoGPT's recipe for shakespeare-char (lr 1e-3, beta2 0.99, weight decay 0.1), with the
    # cosine decaying to zero so that the whole tail of the schedule is in the run
    recipe = {"format": "bf16", "lr": 1e-3, "optimizer": "adamw", "betas": (0.9, 0.99), "weight_decay": 0.1,
              "schedule": "cosine", "min_lr_ratio": 0.0, "threshold": 0.9}
    if scale == "quick":
        # a 2-layer model small enough to train, predict and observe on a laptop CPU in seconds
        return {**recipe, "steps": 200, "warmup_steps": 10,
                "options": {"model": "nanogpt-quick", "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64,
                            "batch_size": 8, "eval_batches": 4}}
    # nanoGPT's shakespeare-char model (6 layers, 6 heads, 384 wide, context 256), without dropout
    return {**recipe, "steps": 5000, "warmup_steps": 100, "eval_every": 250,
            "options": {"model": "shakespeare-char", "batch_size": 64, "eval_batches": 8}}


def build(config: TrainConfig) -> Task:
    o = config.options
    tokens, tokenizer, source = char_tokens()
    shape = {k: int(o[k]) for k in _SHAPE_OPTIONS if k in o}
    if "bias" in o:
        shape["bias"] = _flag(o["bias"])
    model_config = gpt_config(str(o.get("model", "nanogpt-quick")), vocab_size=tokenizer.vocab_size, **shape)
    description = (f"character-level GPT ({model_config.n_layer} layers, {model_config.n_head} heads, "
                   f"{model_config.n_embd} wide, context {model_config.block_size}, vocab {tokenizer.vocab_size}) "
                   f"on {source}")
    return gpt_task(config, model_config, tokens, model_config.block_size, description)


register(Experiment(name="nanogpt", description="character-level GPT on Tiny Shakespeare (nanoGPT shakespeare-char)",
                    defaults=_defaults, build=build,
                    options=("model", *_SHAPE_OPTIONS, "bias", "batch_size", "val_fraction", "eval_batches")))
