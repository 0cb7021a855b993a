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

__all__ = ["sgd_step", "adamw_step"]

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
