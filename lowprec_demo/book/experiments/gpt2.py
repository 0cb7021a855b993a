"""``gpt2``: GPT-2 124M with its dense weights projected onto an fp8 grid after every step.

The real GPT-2 small architecture (12 layers, 12 heads, 768 wide, vocabulary 50257 padded to
50304, weight tying, GPT-2 initialisation), trained with AdamW as in nanoGPT (betas 0.9/0.95,
weight decay 0.1 on matrices, cosine schedule). Every parameter with 2 or more dimensions (the
embeddings and the linear layers' weights, 99.9 % of the parameters) is stored on the format's
grid (``e4m3`` by default); biases and LayerNorm parameters stay in float32, as in the reference.

Why it locks: GPT-2's weights are drawn with standard deviation 0.02, where E4M3's grid is coarse:
below its smallest normal 2^-6 the spacing is the subnormal step 2^-9, and above it the spacing
is |w|/16 or more, so an update must exceed 2^-10 = 9.8e-4 to move any weight. Adam's update is
about the learning rate (6e-4), so round to nearest returns every dense weight unchanged from the
first step, and the fp32 reference predicts it, element by element.

Tokens: GPT-2's BPE through ``tiktoken`` when its encoding can be loaded, otherwise UTF-8 bytes
(the model keeps its 50304 outputs; only the first 256 are ever targets). The text is Tiny
Shakespeare, or the offline stand-in (see :func:`lowprec_demo.data.load_shakespeare`).

Options (:class:`GPT2Options`): ``model`` (a name in :data:`lowprec_demo.models.GPT_CONFIGS`,
default ``gpt2``), ``n_layer``, ``n_head``, ``n_embd``, ``vocab_size`` (override the shape, for
tests), ``context`` (tokens per sequence, at most the model's ``block_size`` of 1024),
``batch_size``, ``eval_batches``, ``val_fraction``, ``tf32`` (allow TensorFloat-32 matrix
products on a GPU: faster, and the stored weights are unchanged; recorded in the config).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lowprec_demo.book.data.environment import cached_per_data_environment
from lowprec_demo.book.data.text import gpt2_tokens, load_shakespeare
from lowprec_demo.book.models import gpt_config
from lowprec_demo.freeze.prediction import FreezeRecord
from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.training import Task
from lowprec_demo.book.experiments.language import LanguageModelOptions, gpt_task
from lowprec_demo.book.experiments.registry import Experiment, register

__all__ = ["GPT2Options", "text_tokens", "layer_of", "by_layer"]

_SHAPE_OPTIONS = ("n_layer", "n_head", "n_embd", "vocab_size")


@dataclass(frozen=True)
class GPT2Options(LanguageModelOptions):
    """The options of the ``gpt2`` experiment (and ``batch_size``, ``val_fraction``,
    ``eval_batches`` of :class:`~lowprec_demo.experiments.language.LanguageModelOptions`).

    Attributes:
        model: a name in :data:`lowprec_demo.models.GPT_CONFIGS`.
        n_layer, n_head, n_embd, vocab_size: override the model's shape (None: the model's own).
        context: tokens per sequence, at most the model's ``block_size`` (None: the block size).
        tf32: allow TensorFloat-32 matrix products on a GPU.
    """

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
    """Tiny Shakespeare (or the offline stand-in) as GPT-2 BPE tokens, or bytes when the BPE
    cannot be loaded: ``(tokens, vocab_size, description)``, cached per data environment (a
    fallback corpus warns on every call).

    Example: ``tokens, vocab, how = text_tokens(); print(how)``."""
    return _text_tokens()


def layer_of(name: str) -> str:
    """The layer a parameter belongs to: ``"embeddings"`` (wte, shared with the output layer,
    and wpe), ``"block 0"`` ... ``"block 11"``, or ``"final"`` (ln_f).

    Example: ``layer_of("transformer.h.3.mlp.c_fc.weight")`` -> ``"block 3"``."""
    parts = name.split(".")
    if "h" in parts:
        return f"block {parts[parts.index('h') + 1]}"
    if "wte" in parts or "wpe" in parts or "lm_head" in parts:
        return "embeddings"
    return "final"


def by_layer(record: FreezeRecord) -> dict:
    """Per-layer frozen fractions of a record, each tensor weighted by its element count:
    ``{layer: [fraction per step]}`` in model order (see :func:`layer_of`).

    Example: ``by_layer(result.prediction)["block 0"][0]`` is block 0's predicted frozen
    fraction at the first step."""
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
        # the real model for a handful of steps at a short context: enough for the lock, on a CPU;
        # every step at the peak learning rate (a cosine over 4 steps would leave only the first
        # there), so that the lock is tested at the largest steps of the recipe
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
