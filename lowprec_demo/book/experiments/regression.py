"""``regression``: a linear readout ``w`` (from zero) on frozen random Fourier features
``sqrt(2) cos(A x + b)``, targets from a teacher readout plus noise. Its loss is a quadratic with
Hessian ``H = Phi^T Phi / n``, so full-batch GD has the closed form ``e_t = (I - lr H)^t e_0``,
``d_t = -lr H e_t``, and each coordinate's freeze is known in advance (:func:`closed_form`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from lowprec_demo.book.config import TrainConfig
from lowprec_demo.book.experiments.registry import Experiment, ExperimentOptions, register
from lowprec_demo.book.runtime import pick_device
from lowprec_demo.book.training import Task
from lowprec_demo.formats import get_format
from lowprec_demo.freeze import freeze_step
from lowprec_demo.rounding import quantize, would_freeze

__all__ = ["RegressionOptions", "RandomFeatures", "RegressionProblem", "problem", "closed_form", "steps_per_bit"]


@dataclass(frozen=True)
class RegressionOptions(ExperimentOptions):
    """The ``regression`` experiment's options: the inputs' dimension d, the number p of ``features``, of training
    ``samples`` n and of ``test_samples``, the label ``noise`` (standard deviation), the ``bandwidth`` (scale of
    ``A``), and ``batch_size`` (0: full batch; else minibatches drawn with a per-step seed)."""

    input_dim: int = 16
    features: int = 128
    samples: int = 512
    noise: float = 0.03
    bandwidth: float = 2.0
    batch_size: int = 0
    test_samples: int = 1000


class RandomFeatures(torch.nn.Module):
    """``f(x) = sqrt(2) cos(x A^T + b) . w``: fixed features (buffers ``proj``, ``phase``), readout ``w``."""

    def __init__(self, proj: torch.Tensor, phase: torch.Tensor, w0: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("proj", proj.clone())
        self.register_buffer("phase", phase.clone())
        self.w = torch.nn.Parameter(w0.clone())

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen features ``sqrt(2) cos(x A^T + b)``, shape (n, p); E[phi_j^2] = 1."""
        x = x.to(self.proj.dtype)
        return math.sqrt(2.0) * torch.cos(x @ self.proj.T + self.phase)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x) @ self.w


@dataclass
class RegressionProblem:
    """The data and the frozen features of one config (float64, CPU)."""

    proj: torch.Tensor        # (p, d)
    phase: torch.Tensor       # (p,)
    w_star: torch.Tensor      # (p,) teacher readout
    x: torch.Tensor           # (n, d) training inputs
    y: torch.Tensor           # (n,)
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def model(self) -> RandomFeatures:
        return RandomFeatures(self.proj, self.phase, torch.zeros_like(self.w_star))

    def features(self, x: Optional[torch.Tensor] = None) -> torch.Tensor:
        with torch.no_grad():
            return self.model.double().features(self.x if x is None else x)


def problem(config: TrainConfig) -> RegressionProblem:
    """Features, teacher and data for a config, deterministic in the seed (float64). The teacher
    is ``w_star ~ N(0, 1/p)``: targets of variance about 1, weights of size about ``1/sqrt(p)``."""
    o = RegressionOptions.from_options(config.options)
    d, p, n, n_test = o.input_dim, o.features, o.samples, o.test_samples
    if min(d, p, n, n_test) < 1:
        raise ValueError(f"input_dim, features, samples and test_samples must be positive; got {d}, {p}, {n}, {n_test}")
    noise, bandwidth = o.noise, o.bandwidth
    g = torch.Generator().manual_seed(config.seed)
    proj = torch.randn(p, d, generator=g, dtype=torch.float64) * (bandwidth / math.sqrt(d))
    phase = 2 * math.pi * torch.rand(p, generator=g, dtype=torch.float64)
    w_star = torch.randn(p, generator=g, dtype=torch.float64) / math.sqrt(p)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x_test = torch.randn(n_test, d, generator=g, dtype=torch.float64)
    teacher = RandomFeatures(proj, phase, w_star).double()
    with torch.no_grad():
        y = teacher(x) + noise * torch.randn(n, generator=g, dtype=torch.float64)
        y_test = teacher(x_test) + noise * torch.randn(n_test, generator=g, dtype=torch.float64)
    return RegressionProblem(proj, phase, w_star, x, y, x_test, y_test)


def closed_form(config: TrainConfig, fmt=None, prob: Optional[RegressionProblem] = None) -> Dict[str, object]:
    """The exact full-batch GD trajectory (float64): ``frozen`` per step (:func:`~lowprec_demo.rounding.would_freeze`
    on ``q(w_t)`` and ``d_t``), ``freeze_step``, ``loss``, ``w_hat``, ``eigenvalues``,
    ``element_freeze_steps`` (``config.steps`` if never), ``loss_floor``, ``steps_per_bit``.

    Example:
        >>> from lowprec_demo.book.experiments import make_config
        >>> len(closed_form(make_config("regression", steps=50))["frozen"])
        50
    """
    if RegressionOptions.from_options(config.options).batch_size or config.momentum or config.schedule != "constant" \
            or config.optimizer != "sgd" or config.weight_decay or config.warmup_steps:
        raise ValueError("the closed form holds for full-batch plain gradient descent with a constant learning rate")
    fmt = get_format(fmt or config.format)
    prob = prob or problem(config)
    phi = prob.features()
    n = phi.shape[0]
    hessian = phi.T @ phi / n
    lam, vecs = torch.linalg.eigh(hessian)
    lam = lam.clamp(min=0.0)
    w_hat = torch.linalg.lstsq(phi, prob.y.unsqueeze(1)).solution.squeeze(1)
    w0 = torch.zeros_like(w_hat)
    c = vecs.T @ (w0 - w_hat)
    lr = float(config.lr)
    t = torch.arange(config.steps, dtype=torch.float64).unsqueeze(1)
    decay = (1 - lr * lam).unsqueeze(0) ** t                      # (steps, p)
    errors = (decay * c) @ vecs.T                                 # e_t
    updates = -lr * (decay * (lam * c)) @ vecs.T                  # d_t
    weights = (w_hat + errors).float()                            # as the reference run stores w_t
    frozen = would_freeze(quantize(weights, fmt), updates.float(), fmt)
    residual = prob.y - phi @ w_hat
    floor = 0.5 * float((residual ** 2).mean())
    loss = floor + 0.5 * ((decay * c) ** 2 * lam).sum(dim=1)
    steps = []
    for i in range(frozen.shape[1]):
        s = freeze_step(frozen[:, i].double().tolist(), 1.0)
        steps.append(config.steps if s is None else s)
    fractions = frozen.double().mean(dim=1).tolist()
    return {"frozen": fractions, "freeze_step": freeze_step(fractions, config.threshold),
            "loss": loss.tolist(), "w_hat": w_hat, "eigenvalues": lam,
            "element_freeze_steps": torch.tensor(steps), "loss_floor": floor,
            "steps_per_bit": steps_per_bit(lr, float(lam[0]))}


def steps_per_bit(lr: float, lam_min: float) -> float:
    """The most one more mantissa bit postpones the freeze of full-batch GD on a quadratic when
    ``lr lam_max <= 1``: the steps in which the slowest mode halves, ``ln 2 / -ln(1 - lr lam_min)``."""
    if not 0 < lr * lam_min < 1:
        raise ValueError(f"need 0 < lr * lam_min < 1, got {lr * lam_min}")
    return math.log(2.0) / -math.log(1.0 - lr * lam_min)


def _defaults(scale: str) -> dict:
    quick = scale == "quick"
    options = RegressionOptions() if quick else RegressionOptions(features=1024, samples=4096)
    # lr about 0.5 / lam_max: the low-frequency feature direction makes lam_max grow with p
    return {"format": "bf16", "steps": 400 if quick else 2000, "optimizer": "sgd", "lr": 0.07 if quick else 0.01,
            "threshold": 0.5, "options": options.to_dict()}


def build(config: TrainConfig) -> Task:
    device = pick_device(config.device)
    options = RegressionOptions.from_options(config.options)
    prob = problem(config)
    batch_size = options.batch_size
    n = prob.x.shape[0]
    x, y = prob.x.to(device), prob.y.to(device)
    x_test, y_test = prob.x_test.to(device), prob.y_test.to(device)

    def batch(step):
        if not batch_size or batch_size >= n:
            return x, y
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        idx = torch.randperm(n, generator=g)[:batch_size].to(device)
        return x[idx], y[idx]

    def loss(model, batch):
        xb, yb = batch
        return 0.5 * ((model(xb) - yb.to(model.w.dtype)) ** 2).mean()

    @torch.no_grad()
    def evaluate(model):
        return {"test_loss": float(0.5 * ((model(x_test) - y_test.to(model.w.dtype)) ** 2).mean())}

    def make_model(gen):   # the features come from the seed through problem(); the readout starts at zero
        return RandomFeatures(prob.proj, prob.phase, torch.zeros_like(prob.w_star)).float()

    p, d = prob.proj.shape
    return Task(make_model=make_model, batch=batch, loss=loss, evaluate=evaluate,
                description=(f"linear readout on {p} frozen random Fourier features of {d}-dim Gaussian inputs, "
                             f"{n} training samples, {'full batch' if not batch_size else f'batch {batch_size}'}, "
                             f"label noise {options.noise:g}"))


register(Experiment(name="regression", description="gradient descent on a linear readout of frozen random features",
                    defaults=_defaults, build=build, option_class=RegressionOptions))
