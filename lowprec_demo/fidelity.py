"""What torch itself computes for a parameter stored in bfloat16 or float16, op by op.

``torch.optim.SGD`` and ``torch.optim.AdamW`` on the CPU (their default for-loop code: torch
chooses its foreach kernels only on accelerators) run every tensor operation of their step in the
parameter's dtype. Each CPU kernel widens its inputs to float32, computes in float32 and rounds
the result to the parameter's dtype; a Python scalar enters the kernel as a float32 number,
except ``alpha`` of ``add``/``sub`` and a scalar added with ``add``, which are rounded to the
tensor's dtype first. So one bf16 SGD step is ``q(fl32(w + q(-lr) g))``, not ``q(w - lr g)``:
``lr`` itself is rounded to 8 significant bits. The functions below replay those steps on
float64 tensors holding the stored values, with :func:`lowprec_demo.quantize` for every rounding;
``tests/test_fidelity.py`` checks that they reproduce torch's bits for many steps.

Example:
    >>> w, g = torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    >>> sgd_step(w, g, {}, lr=3e-3).item()   # 1 - bf16(0.003): 0.0029907, more than half a gap
    0.99609375
"""

from __future__ import annotations

from typing import Tuple, Union

import torch

from .formats import FloatFormat
from .rounding import quantize

__all__ = ["sgd_step", "adamw_step", "NoisyQuadratic", "real_and_simulated"]

Format = Union[str, FloatFormat]


def _fl32(x: torch.Tensor) -> torch.Tensor:
    """The float32 result of one kernel operation whose exact value is ``x`` (float64)."""
    return quantize(x, "fp32")


def _stored(x: torch.Tensor, fmt: Format) -> torch.Tensor:
    """A kernel's float32 result written to a tensor of the storage dtype."""
    return quantize(_fl32(x), fmt)


def _scalar(value: float, fmt: Format) -> float:
    """A Python scalar as a kernel sees it: rounded to nearest in ``fmt`` ("fp32" or the dtype's)."""
    return quantize(torch.tensor([value], dtype=torch.float64), fmt).item()


def sgd_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
             nesterov: bool = False, fmt: Format = "bf16") -> torch.Tensor:
    """One ``torch.optim.SGD`` step on a CPU parameter of dtype ``fmt``, replayed exactly.

    ``param`` and ``grad`` are float64 tensors holding ``fmt`` values; ``state`` holds the
    ``"momentum_buffer"`` between calls. With ``q`` the rounding to ``fmt`` and ``fl32`` to
    float32: ``g = q(fl32(g + q(wd) w))``; ``b = g`` at the first step, then
    ``b = q(fl32(q(fl32(b fl32(mu))) + q(1 - dampening) g))``; Nesterov ``g = q(fl32(g + q(mu) b))``
    else ``g = b``; ``w = q(fl32(w + q(-lr) g))``. Returns the new ``param``.

    Example:
        >>> sgd_step(torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), {}, lr=1e-3).item()
        1.0
    """
    if weight_decay != 0:
        grad = _stored(grad + _scalar(weight_decay, fmt) * param, fmt)
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = grad.clone()
        else:
            buf = _stored(buf * _scalar(momentum, "fp32"), fmt)
            buf = _stored(buf + _scalar(1 - dampening, fmt) * grad, fmt)
        state["momentum_buffer"] = buf
        grad = _stored(grad + _scalar(momentum, fmt) * buf, fmt) if nesterov else buf
    return _stored(param + _scalar(-lr, fmt) * grad, fmt)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
               betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, fmt: Format = "bf16") -> torch.Tensor:
    """One ``torch.optim.AdamW`` step on a CPU parameter of dtype ``fmt`` (its moments are then
    of that dtype too), replayed exactly. ``state`` holds ``"step"``, ``"exp_avg"`` and
    ``"exp_avg_sq"`` between calls; returns the new ``param``.

    The step, with ``q`` the rounding to ``fmt``, ``fl32`` to float32 and the bias corrections
    ``c1 = 1 - b1**t``, ``c2 = 1 - b2**t`` in Python floats:
    ``w = q(fl32(w fl32(1 - lr wd)))``; ``m = m.lerp(g, 1 - b1)``, that is
    ``q(fl32(m + a fl32(g - m)))`` with ``a = fl32(1 - b1)`` fused (for ``a >= 0.5`` the kernel
    computes ``q(fl32(g + (a - 1) fl32(g - m)))``); ``v = q(fl32(v fl32(b2)))``, then
    ``v = q(fl32(v + fl32(fl32(1 - b2) g) g))`` fused; ``d = q(fl32(sqrt v))``,
    ``d = q(fl32(d / fl32(sqrt c2)))``, ``d = q(fl32(d + q(eps)))`` (so fp16 drops an eps of 1e-8
    to 0); ``w = q(fl32(w + fl32(fl32(-lr/c1) m) / d))``.

    Example:
        >>> w, g = torch.ones(1, dtype=torch.float64), torch.full((1,), 0.5, dtype=torch.float64)
        >>> adamw_step(w, g, {}, lr=1e-3, weight_decay=0.0).item()   # 1 - 0.001 rounds back to 1
        1.0
    """
    beta1, beta2 = betas
    if not state:
        state.update(step=0, exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))
    state["step"] += 1
    step = state["step"]
    if weight_decay != 0:
        param = _stored(param * _scalar(1 - lr * weight_decay, "fp32"), fmt)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    weight = _scalar(1 - beta1, "fp32")
    diff = _fl32(grad - m)
    m = _stored(m + weight * diff if weight < 0.5 else grad + (weight - 1) * diff, fmt)
    v = _stored(v * _scalar(beta2, "fp32"), fmt)
    v = _stored(v + _fl32(_scalar(1 - beta2, "fp32") * grad) * grad, fmt)
    state["exp_avg"], state["exp_avg_sq"] = m, v
    step_size = lr / (1 - beta1**step)
    denom = _stored(v.sqrt(), fmt)
    denom = _stored(denom / _scalar((1 - beta2**step) ** 0.5, "fp32"), fmt)
    denom = _stored(denom + _scalar(eps, fmt), fmt)
    return _stored(param + _fl32(_fl32(_scalar(-step_size, "fp32") * m) / denom), fmt)


class NoisyQuadratic:
    """The problem the cross-checks train: ``loss = mean(h (w - target)**2 / 2)`` with curvatures
    ``h`` from 0.1 to 10 (log-uniform) and gradient noise of standard deviation ``noise``, the
    same at a given step for every run. The gradient is computed in float32 from the stored
    weights and handed to the parameter in its own dtype, as autograd would.

    Example:
        >>> problem = NoisyQuadratic(1024)
        >>> p = torch.nn.Parameter(problem.w0.clone())
        >>> moved, losses, never_moved = problem.train(p, torch.optim.SGD([p], lr=0.1), steps=5)
        >>> len(losses)
        5
    """

    def __init__(self, n: int, seed: int = 0, noise: float = 0.5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n, self.seed, self.noise = n, seed, noise
        self.target = torch.randn(n, generator=g)
        self.h = torch.exp(torch.empty(n).uniform_(-2.302585, 2.302585, generator=g))
        self.w0 = torch.randn(n, generator=g)

    def grad(self, w: torch.Tensor, step: int) -> torch.Tensor:
        """The float32 gradient at the stored weights ``w`` at ``step``."""
        noise = self.noise * torch.randn(self.n, generator=torch.Generator().manual_seed(10_000 + self.seed + step))
        return self.h * (w.float() - self.target) + noise

    def loss(self, w: torch.Tensor) -> float:
        return (0.5 * self.h * (w.float() - self.target) ** 2).mean().item()

    def train(self, param: torch.nn.Parameter, optimizer, steps: int, after_step=None):
        """Train ``param`` (float32, bfloat16 or float16) with ``optimizer`` for ``steps`` steps.
        Returns ``(moved, losses, never_moved)``: per step the fraction of elements whose stored
        value changed and the loss, and the share of elements that never changed. ``after_step``,
        if given, is called after every step."""
        moved, losses = [], []
        ever = torch.zeros(self.n, dtype=torch.bool)
        for t in range(steps):
            before = param.detach().float().clone()
            param.grad = self.grad(before, t).to(param.dtype)
            optimizer.step()
            changed = param.detach().float() != before
            ever |= changed
            moved.append(changed.float().mean().item())
            losses.append(self.loss(param.detach()))
            if after_step is not None:
                after_step()
        return torch.tensor(moved), torch.tensor(losses), 1 - ever.float().mean().item()


def real_and_simulated(lr: float = 1e-3, optimizer: str = "adamw", fmt: str = "bf16", n: int = 1 << 15,
                       steps: int = 200, seed: int = 0, noise: float = 0.5) -> dict:
    """Train the same noisy quadratic twice from one start: parameters really stored in ``fmt``
    (``torch.bfloat16`` or ``torch.float16``) under torch's own optimizer, and float32 parameters
    under ``LowPrecisionOptimizer`` (the book's simulation), each fed the gradient of its own
    stored weights. The loss is ``mean(h (w - target)**2 / 2)`` with curvatures ``h`` from 0.1 to
    10 and gradient noise of standard deviation ``noise``.

    Returns, per run (``"real"``, ``"simulated"``): ``moved`` (per step, the fraction of elements
    whose stored value changed), ``never_moved`` (the share that never changed) and ``loss`` (per
    step); and ``second_moment_decreased``: whether any element of the real run's
    ``exp_avg_sq`` ever decreased (AdamW only).

    Example:
        >>> r = real_and_simulated(lr=1e-3, n=1024, steps=20)
        >>> sorted(r)
        ['real', 'second_moment_decreased', 'simulated']
    """
    from .optimizer import LowPrecisionOptimizer   # optimizer imports rounding, as this module does

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    if fmt not in dtypes:
        raise ValueError(f"fmt must be one of {', '.join(dtypes)} (a torch dtype); got {fmt!r}")
    makers = {"adamw": lambda p: torch.optim.AdamW([p], lr=lr), "sgd": lambda p: torch.optim.SGD([p], lr=lr)}
    if optimizer not in makers:
        raise ValueError(f"optimizer must be one of {', '.join(makers)}; got {optimizer!r}")
    problem = NoisyQuadratic(n, seed, noise)
    real = torch.nn.Parameter(problem.w0.to(dtypes[fmt]))
    sim = torch.nn.Parameter(problem.w0.clone())
    history = {"decreased": False, "previous": None}

    def watch_second_moment():   # does any element of the real run's exp_avg_sq ever go down?
        v = opts["real"].state[real]["exp_avg_sq"].float()
        if history["previous"] is not None and bool((v < history["previous"]).any()):
            history["decreased"] = True
        history["previous"] = v.clone()
    opts = {"real": makers[optimizer](real), "simulated": LowPrecisionOptimizer(makers[optimizer](sim), fmt)}
    result = {}
    for key, p in (("real", real), ("simulated", sim)):
        moved, loss, never = problem.train(p, opts[key], steps,
                                           watch_second_moment if key == "real" and optimizer == "adamw" else None)
        result[key] = {"moved": moved.tolist(), "loss": loss.tolist(), "never_moved": never}
    decreased = history["decreased"]
    result["second_moment_decreased"] = decreased
    return result
