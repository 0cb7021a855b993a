"""What a setting stores: :func:`bytes_per_parameter` of any optimizer, plain or a :class:`LowPrecisionOptimizer`."""

from __future__ import annotations

import torch

from lowprec_demo.optim import storage
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer

__all__ = ["bytes_per_parameter"]


def bytes_per_parameter(optimizer: torch.optim.Optimizer) -> dict:
    """Bytes per parameter element, as an implementation that really keeps each tensor in its format would store them:
    ``weights`` (the format's width for the low-precision parameters), ``master`` copies (4 bytes; a bf16 weight's
    16-bit remainder: 2), optimizer ``state`` (once a step made it), ``compensation`` buffers and their ``total``
    (gradients and activations: the same for all); and ``held``, what the process holds: every parameter, every tensor
    of the optimizer's state and of the wrapper, by the tensors' own sizes (``total`` where the parameters are really
    stored in bf16 or fp16; more where a format is simulated in float32).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(10))
        >>> opt = torch.optim.AdamW([w]); w.grad = torch.ones(10); opt.step()
        >>> bytes_per_parameter(opt)["total"]   # 4 (float32) + 2 x 4 (Adam's two moments)
        12.0
    """
    wrapper = optimizer if isinstance(optimizer, LowPrecisionOptimizer) else None
    inner = wrapper.optimizer if wrapper is not None else optimizer
    width = lambda fmt, t: fmt.bits / 8 if fmt is not None else t.element_size()   # noqa: E731
    totals, count, held = {"weights": 0.0, "master": 0.0, "state": 0.0, "compensation": 0.0}, 0, 0
    for p in (p for group in inner.param_groups for p in group["params"]):
        n, remedy = p.numel(), wrapper.remedy_of(p) if wrapper is not None else None
        count += n
        held += n * p.element_size() + sum(v.numel() * v.element_size() for v in inner.state.get(p, {}).values()
                                           if torch.is_tensor(v))
        totals["weights"] += n * width(wrapper.fmt if remedy else None, p)
        totals["master"] += n * {"master": 4, "remainder": 2}.get(remedy, 0)
        if remedy == "kahan":
            totals["compensation"] += n * (wrapper.compensation_format.bits / 8 if wrapper.compensation_format
                                           else wrapper.buffer_dtype(p).itemsize)
        state_format = wrapper.state_format if remedy else None
        totals["state"] += n * sum(width(state_format, v) for v in storage.elementwise_state(inner, p))
    out = {k: v / max(count, 1) for k, v in totals.items()}
    out["total"] = sum(out.values())
    out["held"] = (held + (wrapper.held_bytes() if wrapper is not None else 0)) / max(count, 1)
    return out
