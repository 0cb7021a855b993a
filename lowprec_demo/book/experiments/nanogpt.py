"""``nanogpt``: a character-level GPT on Tiny Shakespeare, nanoGPT's shakespeare-char recipe (AdamW, warmup, cosine to
a tenth of the peak, weight decay on matrices), every parameter on the format's grid. Adam's update is about ``lr_t``,
and round to nearest drops one below half a gap, about ``|w| 2^-(m+1)``: as the cosine lowers ``lr_t`` the weights
freeze, the largest first (LayerNorm gains never move in bf16 at ``lr <= 2^-9``), the bulk of the matrices at a step
the fp32 reference predicts, while the fp32 run goes on learning."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.data.environment import cached_per_data_environment
from lowprec_demo.book.data.text import CharTokenizer, load_shakespeare
from lowprec_demo.book.experiments.language import LanguageModelOptions, decay_groups, gpt_task, shard_rows
from lowprec_demo.book.experiments.registry import Experiment, register
from lowprec_demo.book.models import gpt_config
from lowprec_demo.book.training import Task

__all__ = ["NanoGPTOptions", "char_tokens", "gpt_task", "decay_groups", "shard_rows"]

_SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "block_size")


@dataclass(frozen=True)
class NanoGPTOptions(LanguageModelOptions):
    """Beyond :class:`LanguageModelOptions`: ``model`` (in :data:`~lowprec_demo.book.models.GPT_CONFIGS`), its shape
    overridden by ``n_layer``, ``n_head``, ``n_embd``, ``block_size`` and ``bias`` (None: the model's own)."""

    model: str = "nanogpt-quick"
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    block_size: Optional[int] = None
    bias: Optional[bool] = None


@cached_per_data_environment()
def _char_tokens():
    corpus = load_shakespeare()
    tokenizer = CharTokenizer(corpus.text)
    tokens = torch.tensor(tokenizer.encode(corpus.text), dtype=torch.long)
    return tokens, tokenizer, corpus.source


def char_tokens():
    """Tiny Shakespeare (or the offline stand-in) as character tokens, ``(tokens, tokenizer,
    source)``, cached per data environment (a fallback corpus warns on every call)."""
    return _char_tokens()


def _defaults(scale: str) -> dict:
    # nanoGPT's recipe for shakespeare-char: AdamW (beta2 0.99, weight decay 0.1), linear warmup,
    # cosine decay to a tenth of the peak, the freeze step where half the elements stay frozen
    recipe = {"format": "bf16", "lr": 1e-3, "optimizer": "adamw", "betas": (0.9, 0.99), "weight_decay": 0.1,
              "schedule": "cosine", "min_lr_ratio": 0.1, "threshold": 0.5}
    if scale == "quick":
        # 2 layers for a laptop CPU. At nanoGPT's peak of 1e-3 it has learned almost all before its bf16 weights freeze,
        # so the quick run's cosine starts at 2e-4: they freeze at about a third of the run, while fp32 still learns
        options = NanoGPTOptions(n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8)
        return {**recipe, "lr": 2e-4, "steps": 600, "warmup_steps": 10,
                "options": options.to_dict("model", *_SHAPE_OPTIONS, "batch_size", "eval_batches")}
    # nanoGPT's shakespeare-char model (6 layers, 6 heads, 384 wide, context 256), without dropout,
    # and its schedule (5000 steps, warmup 100, lr 1e-3 to 1e-4)
    options = NanoGPTOptions(model="shakespeare-char", batch_size=64, eval_batches=8)
    return {**recipe, "steps": 5000, "warmup_steps": 100, "eval_every": 250,
            "options": options.to_dict("model", "batch_size", "eval_batches")}


def build(config: TrainConfig) -> Task:
    options = NanoGPTOptions.from_options(config.options)
    tokens, tokenizer, source = char_tokens()
    shape = {k: getattr(options, k) for k in (*_SHAPE_OPTIONS, "bias") if getattr(options, k) is not None}
    model_config = gpt_config(options.model, vocab_size=tokenizer.vocab_size, **shape)
    description = (f"character-level GPT ({model_config.n_layer} layers, {model_config.n_head} heads, "
                   f"{model_config.n_embd} wide, context {model_config.block_size}, vocab {tokenizer.vocab_size}) "
                   f"on {source}")
    return gpt_task(config, options, model_config, tokens, model_config.block_size, description)


register(Experiment(name="nanogpt", description="character-level GPT on Tiny Shakespeare (nanoGPT shakespeare-char)",
                    defaults=_defaults, build=build, option_class=NanoGPTOptions))
