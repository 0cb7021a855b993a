"""``mlp``: a small MLP student learns a random tanh teacher (teacher-student regression).

With AdamW a weight's update is about ``lr_t`` whatever the gradient, so round to nearest freezes weight i once
``lr_t |m_hat/sqrt(v_hat)| < ulp(w_i)/2 ~ |w_i| 2^-(m+1)``: the schedule, the weight's size and the mantissa length
decide the step, and doubling the learning rate postpones the freeze as much as one more mantissa bit. With SGD the
update shrinks only as fast as the gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from lowprec_demo.book.config import TrainConfig, lr_factor
from lowprec_demo.book.experiments.registry import Experiment, ExperimentOptions, register
from lowprec_demo.book.models import MLP
from lowprec_demo.book.runtime import pick_device
from lowprec_demo.book.training import Task
from lowprec_demo.rounding import quantize, ulp

__all__ = ["MLPOptions", "teacher_data", "build", "adam_noise_estimate"]


@dataclass(frozen=True)
class MLPOptions(ExperimentOptions):
    """The ``mlp`` experiment's options: the inputs' dimension d, the student's width (``hidden``), hidden layers
    (``depth``) and ``activation``, the teacher's width, the sizes of the training and test sets, ``batch_size`` (0:
    full batch; else minibatches drawn with a per-step seed) and the label ``noise`` (standard deviation)."""

    input_dim: int = 16
    hidden: int = 64
    depth: int = 2
    activation: str = "tanh"
    teacher_hidden: int = 32
    samples: int = 2048
    test_samples: int = 2048
    batch_size: int = 0
    noise: float = 0.0


def teacher_data(config: TrainConfig):
    """``(x, y, x_test, y_test)`` (float32, CPU) from a random teacher, deterministic in the seed, the
    targets of unit variance before the label noise."""
    o = MLPOptions.from_options(config.options)
    d, n, n_test = o.input_dim, o.samples, o.test_samples
    width, noise = o.teacher_hidden, o.noise
    if min(d, n, n_test, width) < 1:
        raise ValueError(f"input_dim, samples, test_samples and teacher_hidden must be positive; got {d}, {n}, {n_test}, {width}")
    g = torch.Generator().manual_seed(10_000 + config.seed)
    teacher = MLP([d, width, 1], "tanh", generator=g)
    with torch.no_grad():
        for layer in teacher.layers:    # larger weights than the default init: more curvature
            if isinstance(layer, torch.nn.Linear):
                layer.weight.mul_(2.0)
        x = torch.randn(n + n_test, d, generator=g)
        y = teacher(x).squeeze(1)
        y = (y - y.mean()) / y.std()
        y = y + noise * torch.randn(n + n_test, generator=g)
    return x[:n], y[:n], x[n:], y[n:]


def adam_noise_estimate(config: TrainConfig, weights: Optional[Dict[str, torch.Tensor]] = None,
                        fmt=None) -> List[float]:
    """The frozen fraction per step from the schedule alone, for Adam(W) with mostly noisy gradients:
    ``m_hat / sqrt(v_hat)`` is then about Gaussian with deviation ``s = sqrt((1 - b1) / (1 + b1))``,
    and round to nearest keeps weight i with probability ``erf(ulp(w_i) / (2 sqrt(2) lr_t s))``,
    averaged over ``weights`` (default the initial ones). Weight decay and signal are ignored.

    Example:
        >>> from lowprec_demo.book.experiments import make_config
        >>> len(adam_noise_estimate(make_config("mlp", steps=10)))
        10
    """
    if config.optimizer not in ("adam", "adamw"):
        raise ValueError(f"the estimate is for Adam and AdamW, not {config.optimizer}")
    fmt = fmt or config.format
    if weights is None:
        model = build(config).make_model(torch.Generator().manual_seed(config.seed))
        weights = dict(model.named_parameters())
    w = torch.cat([t.detach().flatten().double().cpu() for t in weights.values()])
    half_gap = ulp(quantize(w, fmt), fmt) / 2
    spread = math.sqrt((1 - config.betas[0]) / (1 + config.betas[0]))
    out = []
    for step in range(config.steps):
        lr = config.lr * lr_factor(step, config)
        if lr <= 0:
            out.append(1.0)
            continue
        out.append(float(torch.erf(half_gap / (math.sqrt(2.0) * lr * spread)).mean()))
    return out


def _defaults(scale: str) -> dict:
    quick = scale == "quick"
    options = MLPOptions() if quick else MLPOptions(hidden=256, samples=16384)
    return {"format": "bf16", "steps": 600 if quick else 4000, "lr": 1e-2, "optimizer": "adamw",
            "weight_decay": 0.01, "schedule": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.0,
            "threshold": 0.5, "options": options.to_dict()}


def build(config: TrainConfig) -> Task:
    device = pick_device(config.device)
    o = MLPOptions.from_options(config.options)
    x, y, x_test, y_test = (t.to(device) for t in teacher_data(config))
    d = x.shape[1]
    hidden, depth, activation = o.hidden, o.depth, o.activation
    if hidden < 1 or depth < 1:
        raise ValueError(f"hidden and depth must be positive; got {hidden}, {depth}")
    sizes = [d] + [hidden] * depth + [1]
    batch_size = o.batch_size
    n = x.shape[0]

    def batch(step):
        if not batch_size or batch_size >= n:
            return x, y
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        idx = torch.randint(n, (batch_size,), generator=g).to(device)
        return x[idx], y[idx]

    def loss(model, batch):
        xb, yb = batch
        dtype = next(model.parameters()).dtype
        return 0.5 * ((model(xb.to(dtype)).squeeze(1) - yb.to(dtype)) ** 2).mean()

    @torch.no_grad()
    def evaluate(model):
        dtype = next(model.parameters()).dtype
        return {"test_loss": float(0.5 * ((model(x_test.to(dtype)).squeeze(1) - y_test.to(dtype)) ** 2).mean())}

    return Task(make_model=lambda gen: MLP(sizes, activation, generator=gen), batch=batch, loss=loss,
                evaluate=evaluate,
                description=(f"MLP {sizes} ({activation}) learning a random tanh teacher on {n} samples, "
                             f"{'full batch' if not batch_size or batch_size >= n else f'batch {batch_size}'}, "
                             f"label noise {o.noise:g}"))


register(Experiment(name="mlp", description="a small MLP student learns a random teacher network (AdamW or SGD)",
                    defaults=_defaults, build=build, option_class=MLPOptions))
