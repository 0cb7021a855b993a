"""What torch itself computes for a parameter stored in bfloat16 or float16, op by op.

torch's CPU optimizers (their for-loop code) compute each operation in float32 and round it to the parameter's dtype; a
Python scalar enters as float32, except ``alpha`` of ``add``/``sub`` and a scalar ``add``, rounded to the dtype first: a
bf16 SGD step is ``q(fl32(w + q(-lr) g))``. The last ``share % vector_width()`` elements of each thread's share go one
by one, where ``add`` rounds the product first (:func:`scalar_path`). :func:`sgd_step` and :func:`adamw_step` replay
this on float64 tensors holding the stored values; ``tests/test_fidelity.py`` checks their bits.

Example:
    >>> w, g = torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    >>> sgd_step(w, g, {}, lr=3e-3).item()   # 1 - bf16(0.003): 0.0029907, more than half a gap
    0.99609375
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple, Union

import torch

from lowprec_demo.formats import FloatFormat
from lowprec_demo.optim import LowPrecisionOptimizer
from lowprec_demo.rounding import quantize

__all__ = ["sgd_step", "adamw_step", "GRAIN_SIZE", "vector_width", "scalar_path", "NoisyQuadratic",
           "real_and_simulated"]

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


# at::internal::GRAIN_SIZE: a CPU kernel over fewer elements runs on one thread; over more, on
# min(threads, ceil(numel / GRAIN_SIZE)) equal shares (at::parallel_for)
GRAIN_SIZE = 32768


@functools.lru_cache(maxsize=None)
def vector_width() -> int:
    """The 16-bit elements per block of torch's CPU vector loop on this machine: the smallest bf16
    tensor whose ``add_`` takes it, probed where the loops differ (0.5390625 - 1e-3 * 1.9609375 is
    0.53515625 there, while the scalar loop's rounded product leaves a tie that goes to 0.5390625)."""
    for n in range(1, 257):
        w = torch.full((n,), 0.5390625, dtype=torch.bfloat16)
        w.add_(torch.full((n,), 1.9609375, dtype=torch.bfloat16), alpha=-1e-3)
        if w[0].item() != 0.5390625:
            return n
    raise RuntimeError("torch's CPU add_ took the scalar loop at every size up to 256: no vector width found")


def scalar_path(numel: int, threads: Optional[int] = None) -> torch.Tensor:
    """Which elements of a contiguous tensor torch's CPU kernels compute in their scalar loop: the
    last ``share % vector_width()`` of each of ``T`` shares of ``ceil(numel / T)``, ``T`` being 1
    below :data:`GRAIN_SIZE` elements or at one thread, else ``min(threads, ceil(numel / GRAIN_SIZE))``.

    Example:
        >>> int(scalar_path(100_000, threads=2).sum())   # two shares of 50,000; blocks of 32: 16 + 16
        32
    """
    threads = torch.get_num_threads() if threads is None else int(threads)
    if threads < 1:
        raise ValueError(f"threads must be 1 or more; got {threads}")
    mask = torch.zeros(numel, dtype=torch.bool)
    if numel == 0:
        return mask
    tasks = 1 if numel < GRAIN_SIZE or threads == 1 else min(threads, math.ceil(numel / GRAIN_SIZE))
    share, width = math.ceil(numel / tasks), vector_width()
    for begin in range(0, numel, share):
        end = min(numel, begin + share)
        mask[end - (end - begin) % width:end] = True
    return mask


def _add(a: torch.Tensor, b: torch.Tensor, alpha: float, fmt: Format, scalar: torch.Tensor) -> torch.Tensor:
    """``a.add(b, alpha=alpha)`` on tensors of dtype ``fmt``: ``q(fl32(a + q(alpha) b))`` on the
    vector loop, ``q(fl32(a + q(q(alpha) b)))`` on the elements of the scalar loop (``scalar``)."""
    rounded_alpha = _scalar(alpha, fmt)
    vector = _stored(a + rounded_alpha * b, fmt)
    if not bool(scalar.any()):
        return vector
    one_by_one = _stored(a + quantize(_fl32(rounded_alpha * b), fmt), fmt)
    return torch.where(scalar.reshape(a.shape), one_by_one, vector)


def sgd_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
             momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
             nesterov: bool = False, fmt: Format = "bf16", threads: Optional[int] = None) -> torch.Tensor:
    """One ``torch.optim.SGD`` step on a CPU parameter of dtype ``fmt``, replayed exactly on float64 ``param`` and
    ``grad`` holding ``fmt`` values (``state`` keeps the momentum buffer); returns the new ``param``. With ``q`` the
    rounding to ``fmt`` and ``fl32`` to float32: ``g = q(fl32(g + q(wd) w))``; ``b = g`` first, then
    ``b = q(fl32(q(fl32(b fl32(mu))) + q(1 - dampening) g))``; ``g = q(fl32(g + q(mu) b))`` (Nesterov) or ``b``;
    ``w = q(fl32(w + q(-lr) g))``. On the elements of :func:`scalar_path` each addition rounds its product first.

    Example:
        >>> sgd_step(torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64), {}, lr=1e-3).item()
        1.0
    """
    scalar = scalar_path(param.numel(), threads)
    if weight_decay != 0:
        grad = _add(grad, param, weight_decay, fmt, scalar)
    if momentum != 0:
        buf = state.get("momentum_buffer")
        if buf is None:
            buf = grad.clone()
        else:
            buf = _stored(buf * _scalar(momentum, "fp32"), fmt)
            buf = _add(buf, grad, 1 - dampening, fmt, scalar)
        state["momentum_buffer"] = buf
        grad = _add(grad, buf, momentum, fmt, scalar) if nesterov else buf
    return _add(param, grad, -lr, fmt, scalar)


def adamw_step(param: torch.Tensor, grad: torch.Tensor, state: dict, *, lr: float,
               betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
               weight_decay: float = 1e-2, fmt: Format = "bf16") -> torch.Tensor:
    """One ``torch.optim.AdamW`` step on a CPU parameter of dtype ``fmt`` (its moments too), replayed
    exactly at any thread count (``state`` keeps ``step``, ``exp_avg``, ``exp_avg_sq``); returns the
    new ``param``. With ``c1 = 1 - b1**t``, ``c2 = 1 - b2**t`` in Python floats:
    ``w = q(fl32(w fl32(1 - lr wd)))``; ``m = q(fl32(m + a fl32(g - m)))`` with ``a = fl32(1 - b1)`` (``lerp``; for
    ``a >= 0.5`` it computes ``q(fl32(g + (a - 1) fl32(g - m)))``); ``v = q(fl32(v fl32(b2)))``, then
    ``v = q(fl32(v + fl32(fl32(1 - b2) g) g))``; ``d = q(fl32(sqrt v))``, ``d = q(fl32(d / fl32(sqrt c2)))``,
    ``d = q(fl32(d + q(eps)))`` (fp16 drops an eps of 1e-8 to 0); ``w = q(fl32(w + fl32(fl32(-lr/c1) m) / d))``.

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
    """The problem the cross-checks train: ``mean(h (w - target)**2 / 2)``, curvatures ``h`` log-uniform in [0.1, 10],
    gradient noise of standard deviation ``noise`` (the same at a step for every run), the gradient computed in
    float32 from the stored weights and handed over in the parameter's dtype, as autograd would."""

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
        """Train ``param`` (fp32, bf16 or fp16) for ``steps`` steps, calling
        ``after_step`` after each; ``(moved, losses, never_moved)``: per step the share of elements
        that moved and the loss, and the share that never moved."""
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
    """:class:`NoisyQuadratic` trained from one start stored in ``fmt`` (bf16 or fp16) under torch's
    optimizer (``"real"``) and in float32 under ``LowPrecisionOptimizer`` (``"simulated"``): each
    with ``moved``, ``loss``, ``never_moved``; and ``second_moment_decreased`` (AdamW).

    Example:
        >>> sorted(real_and_simulated(lr=1e-3, n=1024, steps=20))
        ['real', 'second_moment_decreased', 'simulated']
    """
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
    result["second_moment_decreased"] = history["decreased"]
    return result
