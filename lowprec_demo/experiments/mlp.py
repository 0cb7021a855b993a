"""``mlp``: a small MLP student learns a random teacher network (teacher-student regression).

Inputs ``x ~ N(0, I_d)``; targets ``y = teacher(x) + noise``, with the teacher a random
``MLP([d, teacher_hidden, 1], tanh)`` scaled so that ``y`` has unit variance. The student is
``MLP([d, hidden, ..., hidden, 1], activation)`` from :mod:`lowprec_demo.models`, trained on a
fixed training set, full batch (``batch_size=0``) or in minibatches drawn with a per-step seed.

With AdamW the update of a weight is ``lr_t * m_hat / (sqrt(v_hat) + eps)``, about ``lr_t`` in
size whatever the gradient, so under round to nearest weight i freezes once
``lr_t * |m_hat/sqrt(v_hat)| < ulp(w_i)/2 ~ |w_i| 2^-(m+1)``: the learning-rate schedule, the
weight's magnitude and the mantissa length decide the step, and doubling the learning rate
postpones the freeze as much as one more mantissa bit does. With SGD the update is
``lr * gradient`` and shrinks only as fast as the gradient does.

Options: ``input_dim``, ``hidden`` (width), ``depth`` (hidden layers), ``activation``,
``teacher_hidden``, ``samples`` (training set), ``test_samples``, ``batch_size``, ``noise``.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional

import torch

from ..models import MLP
from ..config import TrainConfig
from ..training import Task
from . import Experiment, register

__all__ = ["teacher_data", "build", "adam_noise_estimate"]


def teacher_data(config: TrainConfig):
    """Training and test sets from a random teacher network, deterministic in the seed.

    Returns ``(x, y, x_test, y_test)`` (float32, CPU); the targets have unit variance before the
    label noise is added.

    Example:
        >>> from lowprec_demo.experiments import make_config
        >>> x, y, _, _ = teacher_data(make_config("mlp", samples=100))
        >>> x.shape, y.shape
        (torch.Size([100, 16]), torch.Size([100]))
    """
    o = config.options
    d, n, n_test = int(o.get("input_dim", 16)), int(o.get("samples", 2048)), int(o.get("test_samples", 2048))
    width, noise = int(o.get("teacher_hidden", 32)), float(o.get("noise", 0.0))
    if min(d, n, n_test, width) < 1:
        raise ValueError(f"input_dim, samples, test_samples and teacher_hidden must be positive; got {d}, {n}, {n_test}, {width}")
    g = torch.Generator().manual_seed(10_000 + config.seed)
    teacher = MLP([d, width, 1], "tanh", generator=g)
    with torch.no_grad():
        for layer in teacher.layers:    # a teacher with larger weights than the default init: more curvature
            if isinstance(layer, torch.nn.Linear):
                layer.weight.mul_(2.0)
        x = torch.randn(n + n_test, d, generator=g)
        y = teacher(x).squeeze(1)
        y = (y - y.mean()) / y.std()
        y = y + noise * torch.randn(n + n_test, generator=g)
    return x[:n], y[:n], x[n:], y[n:]


def adam_noise_estimate(config: TrainConfig, weights: Optional[Dict[str, torch.Tensor]] = None,
                        fmt=None) -> List[float]:
    """The frozen fraction per step predicted from the learning-rate schedule alone, for Adam(W)
    whose gradients are dominated by noise.

    If the gradient of a weight is white noise, Adam's ``m_hat / sqrt(v_hat)`` is about Gaussian
    with standard deviation ``s = sqrt((1 - beta1) / (1 + beta1))`` (0.23 for beta1 = 0.9), so the
    update is ``lr_t s Z`` and round to nearest keeps weight i with probability
    ``P(|Z| < ulp(w_i) / (2 lr_t s)) = erf(ulp(w_i) / (2 sqrt(2) lr_t s))``. The estimate is the
    mean of that over the weights (by default the initial ones): no reference run, only the
    schedule, the weights' sizes and the mantissa length. It ignores weight decay and the signal
    part of the gradient, which makes real steps larger (early) or, when gradients shrink faster
    than ``v_hat`` forgets, smaller.

    Example:
        >>> from lowprec_demo.experiments import make_config
        >>> len(adam_noise_estimate(make_config("mlp", steps=10)))
        10
    """
    from ..experiments import get_experiment
    from ..rounding import quantize, ulp
    from ..config import lr_factor
    if config.optimizer not in ("adam", "adamw"):
        raise ValueError(f"the estimate is for Adam and AdamW, not {config.optimizer}")
    fmt = fmt or config.format
    if weights is None:
        model = get_experiment("mlp").build(config).make_model(torch.Generator().manual_seed(config.seed))
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
    return {
        "format": "bf16", "steps": 600 if quick else 4000, "lr": 1e-2, "optimizer": "adamw",
        "weight_decay": 0.01, "schedule": "cosine", "warmup_steps": 0, "min_lr_ratio": 0.0,
        "threshold": 0.5,
        "options": {"input_dim": 16, "hidden": 64 if quick else 256, "depth": 2, "activation": "tanh",
                    "teacher_hidden": 32, "samples": 2048 if quick else 16384, "test_samples": 2048,
                    "batch_size": 0, "noise": 0.0},
    }


def build(config: TrainConfig) -> Task:
    from ..runtime import pick_device
    device = pick_device(config.device)
    o = config.options
    x, y, x_test, y_test = (t.to(device) for t in teacher_data(config))
    d = x.shape[1]
    hidden, depth = int(o.get("hidden", 64)), int(o.get("depth", 2))
    activation = str(o.get("activation", "tanh"))
    if hidden < 1 or depth < 1:
        raise ValueError(f"hidden and depth must be positive; got {hidden}, {depth}")
    sizes = [d] + [hidden] * depth + [1]
    batch_size = int(o.get("batch_size", 0))
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

    return Task(
        make_model=lambda gen: MLP(sizes, activation, generator=gen),
        batch=batch, loss=loss, evaluate=evaluate,
        description=(f"MLP {sizes} ({activation}) learning a random tanh teacher on {n} samples, "
                     f"{'full batch' if not batch_size or batch_size >= n else f'batch {batch_size}'}, "
                     f"label noise {float(o.get('noise', 0.0)):g}"),
    )


register(Experiment(name="mlp", description="a small MLP student learns a random teacher network (AdamW or SGD)",
                    defaults=_defaults, build=build,
                    options=("input_dim", "hidden", "depth", "activation", "teacher_hidden", "samples", "test_samples",
                             "batch_size", "noise")))
