"""``quadratic``: gradient descent on a separable least-squares problem.

Minimise ``L(w) = 1/2 * sum_i c_i (w_i - t_i)^2`` from ``w = 0``. Each coordinate approaches its
target geometrically, ``e_i(t) = (1 - lr c_i)^t e_i(0)``, so its update ``d_i = -lr c_i e_i``
shrinks until it drops below half an ulp of ``w_i`` and round to nearest stops it, up to
``ulp / (2 lr c_i)`` from its target. With ``dim=1`` it is the scalar problem of chapter 2.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.experiments.registry import Experiment, ExperimentOptions, register
from lowprec_demo.book.runtime import pick_device
from lowprec_demo.book.training import Task


@dataclass(frozen=True)
class QuadraticOptions(ExperimentOptions):
    """The ``quadratic`` experiment's options: ``dim`` coordinates, curvatures log-spaced from
    ``c_min`` to ``c_max`` (``c_max`` alone for ``dim=1``), targets uniform in ``[t_min, t_max]``,
    and the standard deviation of Gaussian gradient ``noise`` (0: exact gradient descent)."""

    dim: int = 64
    c_min: float = 0.2
    c_max: float = 1.0
    t_min: float = 1.0
    t_max: float = 2.0
    noise: float = 0.0


class Quadratic(torch.nn.Module):
    """``L(w) = 1/2 sum c_i (w_i - t_i)^2`` with a trainable ``w`` starting at ``w0``."""

    def __init__(self, curvature: torch.Tensor, target: torch.Tensor, w0: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w0.clone())
        self.register_buffer("curvature", curvature)
        self.register_buffer("target", target)

    def forward(self) -> torch.Tensor:
        return 0.5 * (self.curvature * (self.w - self.target) ** 2).sum()


def closed_form_freeze_steps(curvature: torch.Tensor, target: torch.Tensor, w0: torch.Tensor, lr: float,
                             man_bits: int) -> torch.Tensor:
    """Per coordinate, the first step whose exact GD update is below half the ulp at the target,
    ``ceil(log(ulp_i / (2 lr c_i |e_i(0)|)) / log(1 - lr c_i))`` (an estimate: ties and the path's grid ignored)."""
    e0 = (w0 - target).abs().double()
    c = curvature.double()
    ulp = torch.exp2(torch.floor(torch.log2(target.abs().double())) - man_bits)
    ratio = ulp / (2 * lr * c * e0)
    steps = torch.log(ratio) / torch.log1p(-lr * c)
    return torch.ceil(steps).clamp(min=0)


def _defaults(scale: str) -> dict:
    quick = scale == "quick"
    options = QuadraticOptions() if quick else QuadraticOptions(dim=4096)
    return {"format": "bf16", "steps": 300 if quick else 2000, "lr": 0.1, "optimizer": "sgd", "threshold": 0.5,
            "options": options.to_dict()}


def problem(config: TrainConfig):
    """The curvatures, targets and starting point for a config (deterministic in the seed)."""
    o = QuadraticOptions.from_options(config.options)
    dim = o.dim
    if dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim}")
    g = torch.Generator().manual_seed(config.seed)
    if dim == 1:
        curvature = torch.tensor([o.c_max])
    else:
        curvature = torch.exp(torch.linspace(math.log(o.c_min), math.log(o.c_max), dim))
    target = o.t_min + (o.t_max - o.t_min) * torch.rand(dim, generator=g)
    return curvature, target, torch.zeros(dim)


def build(config: TrainConfig) -> Task:
    curvature, target, w0 = problem(config)
    noise = QuadraticOptions.from_options(config.options).noise
    device = pick_device(config.device)

    def loss(model, batch):
        value = model()
        if noise:   # gradient noise drawn per step, the same for every variant
            value = value + (batch * model.w).sum()
        return value

    def batch(step):
        if not noise:
            return None
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        return (noise * torch.randn(curvature.numel(), generator=g)).to(device)

    return Task(make_model=lambda gen: Quadratic(curvature, target, w0), batch=batch, loss=loss,
                evaluate=lambda model: {"distance": float((model.w - model.target).abs().max())},
                description=f"separable quadratic, {curvature.numel()} coordinates, targets in "
                            f"[{target.min():.3g}, {target.max():.3g}], curvatures in "
                            f"[{curvature.min():.3g}, {curvature.max():.3g}]")


register(Experiment(name="quadratic", description="gradient descent on a separable least-squares problem",
                    defaults=_defaults, build=build, option_class=QuadraticOptions))
