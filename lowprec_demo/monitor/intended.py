"""The update an optimizer meant to make at a step, before storage rounded it, from its state after the step, on the
freeze watch's followed elements (float64), for a model stored in bf16 or fp16 (observation's forecast and plan).
``w`` is the stored weight before the step, ``g`` its gradient, ``t = state["step"]``, ``lr`` the group's at the step:

* Adam / AdamW: ``d = -lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps) - lr * wd * w``, ``m = exp_avg``, ``v =
  exp_avg_sq`` (amsgrad: ``max_exp_avg_sq``); the last term only with decoupled decay (AdamW), Adam's L2 decay and
  ``maximize`` being inside ``m`` already;
* SGD: ``d = -lr * u``, ``g' = ±g + wd * w`` (``-g``: ``maximize``), ``u = g'`` without momentum, else ``u = buf``
  (``momentum_buffer``), or ``u = g' + momentum * buf`` with nesterov.

A parameter without a gradient is skipped by the step: ``d = 0``. Other optimizers: :func:`unsupported` says so.

Example:
    >>> from lowprec_demo.freeze.sampling import Sample
    >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    >>> opt = torch.optim.AdamW([w], lr=0.1, weight_decay=0.5)
    >>> old = w.detach().clone(); w.grad = torch.tensor([1.0, 1.0, -1.0]); opt.step()
    >>> d = intended_update(opt, Sample([w], None), [w], [0.1], old, w.grad)
    >>> torch.allclose(d.float(), w.detach() - old), [round(x, 6) for x in d.tolist()]
    (True, [-0.15, 0.0, -0.05])
"""

from __future__ import annotations

from typing import List, Optional

import torch

__all__ = ["SUPPORTED", "stepper", "unsupported", "intended_update"]

SUPPORTED = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)


def stepper(optimizer):
    """The torch optimizer that computes the update: a LowPrecisionOptimizer's ``.optimizer``, else itself."""
    from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
    return optimizer.optimizer if isinstance(optimizer, LowPrecisionOptimizer) else optimizer


def unsupported(optimizer) -> Optional[str]:
    """None where the update can be read from the optimizer's state, else why not (naming it and the supported)."""
    opt = stepper(optimizer)
    if type(opt) in SUPPORTED:
        return None
    return (f"a forecast or plan of parameters stored in low precision reads the update the optimizer meant from its "
            f"state, which the watch reads for {', '.join('torch.optim.' + c.__name__ for c in SUPPORTED)} only; "
            f"this optimizer is {type(opt).__module__}.{type(opt).__name__}. Train with one of those to forecast "
            f"and plan (watching works with any)")


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return p.new_zeros(()).expand(p.shape)


def _runs(coefficients: torch.Tensor, counts: List[int]) -> List[tuple]:
    """``(start, end, column)`` per run of consecutive tensors whose column of ``coefficients`` (one per tensor) is the
    same (usually a param group's): each run's elements take the same float64 operations with scalars, which give
    the bits that one coefficient per element would, without the per-element coefficient tensors."""
    out, start = [], 0
    for column, n in zip(coefficients.t().tolist(), counts):
        if out and out[-1][2] == column and out[-1][1] == start:
            out[-1] = (out[-1][0], start + n, column)
        else:
            out.append((start, start + n, column))
        start += n
    return out


def intended_update(optimizer, sample, params: List[torch.Tensor], lrs: List[float], old: torch.Tensor,
                    grad: torch.Tensor) -> torch.Tensor:
    """The module docstring's ``d`` at the followed elements of ``params`` (float64), from ``optimizer``'s state after
    the step; ``lrs`` the learning rate of each parameter at the step, ``old`` and ``grad`` the followed elements."""
    opt = stepper(optimizer)
    group_of = {id(p): g for g in opt.param_groups for p in g["params"]}
    groups, states = [group_of[id(p)] for p in params], [opt.state.get(p, {}) for p in params]
    dev, old = old.device, old.double()

    def per_tensor(values) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64, device=dev)

    def state(keys) -> torch.Tensor:               # a key, or one per parameter
        found = [s.get(k) for s, k in zip(states, [keys] * len(params) if isinstance(keys, str) else keys)]
        return sample.gather([_zeros(p) if v is None else v for p, v in zip(params, found)]).double()

    # per tensor, then per element in one indexing: lr is 0 where no gradient (the step skips the parameter)
    lr = per_tensor(lrs) * per_tensor(p.grad is not None for p in params)
    wd = per_tensor(g["weight_decay"] for g in groups)
    if isinstance(opt, torch.optim.Adam):      # (AdamW is an Adam in torch >= 2.6)
        t = torch.stack([torch.as_tensor(s.get("step", 0.0), dtype=torch.float64, device=dev) for s in states])
        beta1, beta2 = (per_tensor(g["betas"][i] for g in groups) for i in (0, 1))
        decoupled = per_tensor(isinstance(opt, torch.optim.AdamW) or g.get("decoupled_weight_decay", False)
                               for g in groups)
        c = torch.stack([lr / (1 - beta1 ** t.clamp(min=1)), 1 / (1 - beta2 ** t.clamp(min=1)),
                         per_tensor(g["eps"] for g in groups), decoupled * lr * wd])
        v = state(["max_exp_avg_sq" if g["amsgrad"] else "exp_avg_sq" for g in groups])
        m = state("exp_avg")
        for start, end, (c0, c1, c2, c3) in _runs(c, getattr(sample, "local_counts", sample.counts)):
            denom = v[start:end].mul_(c1).sqrt_().add_(c2)       # in place, one scalar per run of equal tensors:
            m[start:end].mul_(-c0).div_(denom).sub_(old[start:end] * c3)   # -c0 m / (sqrt(v c1) + c2) - c3 w
        return m
    # SGD: d = -lr (k_g g' + k_buf buf)
    mom = [float(g["momentum"]) for g in groups]
    k_g = per_tensor(1.0 if m == 0 or g["nesterov"] else 0.0 for m, g in zip(mom, groups))
    k_buf = per_tensor(0.0 if m == 0 else m if g["nesterov"] else 1.0 for m, g in zip(mom, groups))
    sign = per_tensor(-1.0 if g["maximize"] else 1.0 for g in groups)
    c = torch.stack([lr * k_g * sign, lr * k_g * wd, lr * k_buf])[:, sample.tensor_id.long()]
    return -(c[0] * grad.double() + c[1] * old + c[2] * state("momentum_buffer"))
