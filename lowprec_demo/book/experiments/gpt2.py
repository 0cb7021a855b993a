"""``gpt2``: GPT-2 124M with its dense weights on an fp8 grid after every step.

GPT-2 small (12 layers, 768 wide, vocabulary padded to 50304, weight tying, GPT-2's initialisation) with nanoGPT's
AdamW recipe; the embeddings and linear weights (99.9 % of the parameters) are stored on the format's grid (``e4m3``),
biases and LayerNorms in float32. It locks at once: the weights are drawn with standard deviation 0.02, where an
update must exceed 2^-10 = 9.8e-4 to move any E4M3 weight, and Adam's update is about the learning rate (6e-4). The
tokens are GPT-2's BPE (tiktoken) or, without it, UTF-8 bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.data.environment import cached_per_data_environment
from lowprec_demo.book.data.text import gpt2_tokens, load_shakespeare
from lowprec_demo.book.experiments.language import LanguageModelOptions, gpt_task
from lowprec_demo.book.experiments.registry import Experiment, register
from lowprec_demo.book.models import gpt_config
from lowprec_demo.book.training import Task
from lowprec_demo.freeze import FreezeRecord

__all__ = ["GPT2Options", "text_tokens", "layer_of", "by_layer"]

_SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "vocab_size")


@dataclass(frozen=True)
class GPT2Options(LanguageModelOptions):
    """Beyond :class:`LanguageModelOptions`: ``model`` (in :data:`~lowprec_demo.book.models.GPT_CONFIGS`), its shape
    overridden by ``n_layer``, ``n_head``, ``n_embd``, ``vocab_size`` (None: its own), ``context`` (at most, and by
    default, its ``block_size``) and ``tf32`` (TF32 matrix products on a GPU; stored weights unchanged)."""

    model: str = "gpt2"
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    vocab_size: Optional[int] = None
    context: Optional[int] = None
    tf32: bool = False


@cached_per_data_environment()
def _text_tokens():
    corpus = load_shakespeare()
    tokens, vocab_size, how = gpt2_tokens(corpus.text)
    return tokens, vocab_size, f"{how}; text: {corpus.source}"


def text_tokens():
    """Tiny Shakespeare (or the stand-in) as GPT-2 BPE tokens, or bytes when the BPE cannot be
    loaded: ``(tokens, vocab_size, description)``, cached per data environment."""
    return _text_tokens()


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: ``"embeddings"`` (wte, shared with the output layer, and
    wpe), ``"block 0"`` ... ``"block 11"``, or ``"final"`` (ln_f).

    Example:
        >>> layer_of("transformer.h.3.mlp.c_fc.weight")
        'block 3'
    """
    parts = name.split(".")
    if "h" in parts:
        return f"block {parts[parts.index('h') + 1]}"
    if "wte" in parts or "wpe" in parts or "lm_head" in parts:
        return "embeddings"
    return "final"


def by_layer(record: FreezeRecord) -> dict:
    """Per-layer frozen fractions of a record, each tensor weighted by its element count:
    ``{layer: [fraction per step]}`` in model order (see :func:`layer_of`)."""
    groups: dict = {}
    for name, values in record.by_tensor.items():
        groups.setdefault(layer_of(name), []).append((record.sizes[name], values))
    out = {}
    for layer, members in groups.items():
        total = sum(n for n, _ in members)
        length = min(len(v) for _, v in members)
        out[layer] = [sum(n * v[t] for n, v in members) / total for t in range(length)]

    def order(layer: str):
        return (0, 0) if layer == "embeddings" else (2, 0) if layer == "final" else (1, int(layer.split()[1]))
    return {k: out[k] for k in sorted(out, key=order)}


def _defaults(scale: str) -> dict:
    common = {"format": "e4m3", "lr": 6e-4, "optimizer": "adamw", "betas": (0.9, 0.95), "weight_decay": 0.1,
              "schedule": "cosine", "min_lr_ratio": 0.1, "threshold": 0.99, "lowprec_params": "matrices"}
    recorded = ("model", "context", "batch_size", "eval_batches")
    if scale == "quick":
        # the real model for a few steps at a short context, every one at the peak learning rate (a cosine over 4
        # steps would leave only the first there): the lock at the recipe's largest steps
        return {**common, "steps": 4, "warmup_steps": 0, "schedule": "constant",
                "options": GPT2Options(context=64, batch_size=4, eval_batches=1).to_dict(*recorded)}
    return {**common, "steps": 300, "warmup_steps": 20, "eval_every": 50,
            "options": GPT2Options(context=1024, batch_size=16).to_dict(*recorded)}


def build(config: TrainConfig) -> Task:
    options = GPT2Options.from_options(config.options)
    tokens, token_vocab, how = text_tokens()
    shape = {k: getattr(options, k) for k in _SHAPE_OPTIONS if getattr(options, k) is not None}
    model_config = gpt_config(options.model, **shape)
    if token_vocab > model_config.vocab_size:
        raise ValueError(f"the tokens need a vocabulary of {token_vocab}, the model has {model_config.vocab_size}")
    context = model_config.block_size if options.context is None else options.context
    if not 1 <= context <= model_config.block_size:
        raise ValueError(f"context must be in 1..{model_config.block_size}, got {context}")
    if options.tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    description = (f"GPT ({model_config.n_layer} layers, {model_config.n_head} heads, {model_config.n_embd} wide, "
                   f"vocab {model_config.vocab_size}) at context {context}; {how}")
    return gpt_task(config, options, model_config, tokens, context, description)


register(Experiment(name="gpt2", description="GPT-2 124M with dense weights on an fp8 (E4M3) grid",
                    defaults=_defaults, build=build, option_class=GPT2Options))
