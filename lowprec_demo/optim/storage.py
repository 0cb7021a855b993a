"""Parameters really stored in torch.bfloat16 or torch.float16 (a model after ``model.to(torch.bfloat16)``): the
step runs in float32 and is stored with each tensor's remedy, so that the process holds the 2-byte weights.

:func:`open_step` puts float32 working copies in the place of each stored tensor, its gradient and its elementwise
optimizer state (exact: float32 holds every bf16 and fp16 value); the inner optimizer steps them as it would float32
parameters, and :class:`~lowprec_demo.optim.LowPrecisionOptimizer` rounds the results onto the grid as it does for a
simulated format; :func:`close_step` puts them back into storage (exact again) and the working copies go. Given the
same gradients, real storage and simulation (float32 tensors on the same grid) take the same steps to the same bits.

Two remedies live here. The 16-bit *remainder* (:func:`split_remainder`, :func:`join_remainder`) keeps the exact
float32 master weight of a bf16 parameter in 4 bytes, as Transformer Engine's ``store_param_remainders`` does: the
stored weight is the master rounded to nearest (ties to even), so that the forward pass sees what a float32-master run
stores, and an int16 holds the master's bit pattern minus the stored one's, in ``[-2^15, 2^15]``. One value does not
fit: a master exactly halfway above an even stored weight (``+2^15``), about one element-step in 2^17; that master is
kept one float32 ulp nearer the stored weight. *Error feedback* (:func:`feed_back`) carries the rounding error ``e``
of the stored weight into the optimizer's first moment (ECO: Nikdan et al., 2026), for no byte more: adding ``delta``
to Adam's ``m`` moves the weights of the following steps by ``-lr / (bc1 denom) * delta * b1 / (1 - b1)`` in all, so
``delta = -e * denom * bc1 * (1 - b1) / (lr * b1)`` puts ``e`` back (SGD: ``-e * (1 - mu) / (lr * mu)``). The moment
must be able to hold what it carries: a moment stored in bf16 and rounded to nearest freezes too (keep the state in
float32, or give ``state_rounding="stochastic"``).

Example:
    >>> master = torch.tensor([1.0 + 2 ** -10, -3.0e-3])
    >>> stored, remainder = split_remainder(master)
    >>> stored.tolist(), torch.equal(join_remainder(stored, remainder), master)
    ([1.0, -0.0030059814453125], True)
"""

from __future__ import annotations

import math
from typing import Callable, Dict, NamedTuple, Optional

import torch

from lowprec_demo.formats import FloatFormat

__all__ = ["STORED_DTYPES", "is_stored", "storage_dtype", "elementwise_keys", "elementwise_state", "open_step",
           "close_step", "split_remainder", "join_remainder", "split_remainder_", "join_remainder_", "check_feedback",
           "feed_back"]

STORED_DTYPES = (torch.bfloat16, torch.float16)
_NATIVE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def is_stored(t: torch.Tensor) -> bool:
    """Whether ``t`` is really stored in a low-precision dtype (not simulated in float32 or float64)."""
    return t.dtype in STORED_DTYPES


def storage_dtype(fmt: Optional[FloatFormat], default: torch.dtype) -> torch.dtype:
    """The dtype that holds values of ``fmt`` between steps: its own where torch has one (bf16, fp16, fp32), float32
    for another (values on its grid); ``default`` for None."""
    if fmt is None:
        return default
    return _NATIVE.get(fmt.name, torch.float32)


def elementwise_keys(state: dict, p: torch.Tensor) -> list:
    """The keys of ``p``'s optimizer state that hold one value per element (Adam's moments, momentum)."""
    return [k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape]


def elementwise_state(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> list:
    """The optimizer's per-element state tensors of ``p`` (Adam's moments, momentum)."""
    return [optimizer.state[p][k] for k in elementwise_keys(optimizer.state.get(p, {}), p)]


class Opened(NamedTuple):
    stored: torch.Tensor             # the tensor that holds the weights between steps
    grad: Optional[torch.Tensor]     # its gradient, in its own dtype


def open_step(params: list, state: dict) -> Dict[torch.Tensor, Opened]:
    """Float32 working copies in the place of each parameter's data, gradient and elementwise state."""
    opened = {}
    for p in params:
        stored, grad = p.data, p.grad
        p.grad = None                   # (a gradient must match the data's dtype)
        p.data = stored.float()
        p.grad = None if grad is None else grad.float()
        st = state.get(p, {})
        for k in elementwise_keys(st, p):
            st[k] = st[k].float()
        opened[p] = Opened(stored, grad)
    return opened


def close_step(opened: Dict[torch.Tensor, Opened], state: dict, state_dtype: Callable[[torch.Tensor], torch.dtype],
               keep: bool = True) -> None:
    """Store the working copies (on their grids: exact; ``keep=False``: the stored weights left as they were) and
    drop them; the state in ``state_dtype(stored)``."""
    for p, (stored, grad) in opened.items():
        st = state.get(p, {})
        for k in elementwise_keys(st, p):
            st[k] = st[k].to(state_dtype(stored))
        if keep:
            stored.copy_(p.data)
        p.grad = None
        p.data = stored
        p.grad = grad


def split_remainder(master: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple:
    """``(stored, remainder)`` of float32 master weights: the master rounded to nearest bf16 (as float32) and the int16
    difference of their bit patterns (written into ``out`` if given)."""
    stored = master.to(torch.bfloat16).float()
    diff = master.view(torch.int32) - stored.view(torch.int32)
    diff.clamp_(max=(1 << 15) - 1)            # +2^15 (a tie rounded down): the master one ulp nearer
    remainder = diff.to(torch.int16) if out is None else out.copy_(diff)
    return stored, remainder


def join_remainder(stored: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """The float32 master weights of bf16 weights (any float dtype holding bf16 values) and their remainders."""
    return (stored.float().contiguous().view(torch.int32) + remainder.int()).view(torch.float32)


def join_remainder_(work: torch.Tensor, remainder: torch.Tensor) -> None:
    """:func:`join_remainder` written over ``work`` (float32 holding bf16 values), in one in-place pass."""
    if work.dtype == torch.float32 and work.is_contiguous():
        work.view(torch.int32).add_(remainder)        # (int32 += int16: the same sums, no temporaries)
    else:
        work.copy_(join_remainder(work, remainder))


def split_remainder_(work: torch.Tensor, remainder: torch.Tensor) -> None:
    """:func:`split_remainder` in place: ``work`` (float32 masters) becomes the stored weights (as float32), the
    remainders go into ``remainder``: the same bits in fewer passes, with one temporary instead of three."""
    if work.dtype != torch.float32 or not work.is_contiguous():
        work.copy_(split_remainder(work, out=remainder)[0])
        return
    stored = work.to(torch.bfloat16).float()          # the master rounded to nearest bf16, as float32
    bits = work.view(torch.int32)
    bits.sub_(stored.view(torch.int32)).clamp_(max=(1 << 15) - 1)
    remainder.copy_(bits)
    work.copy_(stored)


def check_feedback(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless error feedback knows ``optimizer``'s first moment."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and not any(
            g.get("maximize") for g in optimizer.param_groups):
        return
    if isinstance(optimizer, torch.optim.SGD) and all(
            g["momentum"] > 0 and not g["nesterov"] and not g.get("maximize") for g in optimizer.param_groups):
        return
    raise ValueError(f"compensation='feedback' feeds the rounding error into the optimizer's first moment: it needs "
                     f"torch.optim.Adam or AdamW (maximize=False) or SGD with momentum > 0 (no Nesterov); got "
                     f"{type(optimizer).__name__}")


def feed_back(optimizer: torch.optim.Optimizer, params: list, errors: list) -> None:
    """Add each parameter's rounding error ``e`` (intended minus stored) to its first moment (the module's rule)."""
    group_of = {p: g for g in optimizer.param_groups for p in g["params"]}
    for p, e in zip(params, errors):
        group, st = group_of[p], optimizer.state.get(p, {})
        lr = float(group["lr"])
        if lr <= 0 or not st:
            continue
        if "exp_avg" in st:
            b1, b2 = group["betas"]
            if b1 <= 0:
                continue
            t = float(st["step"])
            v = st.get("max_exp_avg_sq", st["exp_avg_sq"])
            denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
            st["exp_avg"].addcmul_(e, denom, value=-(1 - b1 ** (t + 1)) * (1 - b1) / (lr * b1))
        else:
            mu = group["momentum"]
            st["momentum_buffer"].add_(e, alpha=-(1 - mu) / (lr * mu))
