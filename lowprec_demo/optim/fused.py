"""The fused step: torch's Adam or AdamW on parameters really stored in bf16, rounded to nearest, stochastically or
with the 16-bit remainder, in three passes over each chunk of a tensor instead of about twenty, to the same bits.

The generic step (:meth:`~lowprec_demo.optim.LowPrecisionOptimizer.step`) opens float32 working copies of the weights,
gradients and moments, runs the user's optimizer on them (eight passes of torch's own kernels), rounds the weights and
casts everything back. Here, per chunk of :data:`CHUNK` elements (each element's arithmetic is its own), one compiled
kernel computes the second moment into a float32 scratch; torch's own ``sqrt_`` takes its root (torch's CPU square root
is not always the correctly rounded one, so it is called, not rewritten); a second compiled kernel updates both moments
and the weight and stores them, rounded as the generic step rounds them: the same seeds, the same element indices
(:func:`bf16_stochastic_bits`; with ``rand_bits`` the general kernel, and the remainder's split, run after it on the
weight left in the scratch). Each kernel computes what torch's ``_single_tensor_adam`` computes, in its order: a
product and a sum that torch fuses (``lerp``'s and ``addcmul``'s multiply-add) are compiled with contraction allowed,
and a product that torch rounds before a sum (the weight decay, ``beta2 * v``) gets ``-0.0`` added, which leaves it as
it is and keeps the compiler from fusing it with the sum after.

It runs where the bits are known to agree: torch.optim.Adam or AdamW (not amsgrad, maximize, capturable,
differentiable, fused or foreach; decay decoupled or none), on the CPU, every parameter the optimizer steps stored in
bf16, contiguous and kept with one of those three remedies (a :class:`~lowprec_demo.optim.FreezePlan` may mix them), the
state in bf16 as torch keeps it, no step hooks on the inner optimizer (hooks on the wrapper, such as the watch's, run),
and the compile mode (:func:`~lowprec_demo.rounding.round_to_grid.set_mode`) not ``"off"``. In ``"auto"`` mode it
starts once the generic steps have moved :data:`~lowprec_demo.rounding.round_to_grid.EAGER_BUDGET` elements, so that a
short run never waits for the compiler. Before its first step a process checks it against the generic step on a probe
(two steps of tensors of 4,099, 33 and 1 elements, the optimizer's betas and eps); any difference, or a compiler that
fails, and the generic step is used from then on, with one warning. A NaN weight stays a NaN, its payload not kept.
Beyond the optimizer's own tensors it holds one float32 scratch of :data:`CHUNK` elements per device.
Cost (``benchmarks/cpu-2026-12-06-costs.md``): see :class:`~lowprec_demo.optim.LowPrecisionOptimizer`.
"""

from __future__ import annotations

import copy
import warnings
from typing import Optional

import torch
from torch.optim import optimizer as torch_optimizer

from lowprec_demo.common.packing import group as runs_of
from lowprec_demo.optim import storage
from lowprec_demo.rounding import round_to_grid as rg

__all__ = ["eligible", "step", "bf16_stochastic_bits", "CHUNK"]

_OPTIONS = {"cpp.enable_floating_point_contract_flag": "fast"}    # torch's own CPU kernels contract these too
_REMEDIES = ("nearest", "stochastic", "remainder")
_ready: dict = {}     # (stored dtype, remedy) -> True once checked, False where the check or the compiler failed
_work = {"elements": 0}


def _round_first(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``x + (-0.0)``, ``x`` itself (``-0.0 + -0.0 = -0.0``): contracted into a product before it, it is that product
    rounded, so that no product in ``x`` is fused with a later sum (``c[7]`` is -0.0, unknown to the compiler)."""
    return x + c[7]


def _second_moment(grad: torch.Tensor, v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)``, in float32."""
    g = grad.float()
    return _round_first(v.float() * c[2], c) + c[3] * g * g


def _into_root(grad: torch.Tensor, v: torch.Tensor, c: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_second_moment(grad, v, c))


def _moved(p: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, root: torch.Tensor, c: torch.Tensor,
           remainder: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Weight decay, ``m.lerp_(grad, 1 - beta1)`` and ``p.addcdiv_(m, root / bc2_sqrt + eps, value=-step_size)`` in
    float32, the moments cast back (``v`` again: one bf16 store per pass is the fast one): the weight before it is
    stored (the remainder's master joined first)."""
    w = p.float()
    if remainder is not None:
        w = (w.view(torch.int32) + remainder.int()).view(torch.float32)
    w = _round_first(w * c[0], c)
    mf = torch.lerp(m.float(), grad.float(), c[1])
    m.copy_(mf.to(m.dtype))
    v.copy_(_second_moment(grad, v, c).to(v.dtype))
    return w + c[6] * mf / (root / c[4] + c[5])


def _nearest(p, grad, m, v, root, c, remainder=None) -> None:
    p.copy_(_moved(p, grad, m, v, root, c).to(p.dtype))


def _master(p, grad, m, v, root, c, remainder=None) -> None:     # the weight into root's place, stored after
    root.copy_(_moved(p, grad, m, v, root, c, remainder))


def bf16_stochastic_bits(bits: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """:func:`~lowprec_demo.rounding.round_to_grid.stochastic_bits` of float32 bit patterns onto bf16's grid with 32
    random bits, in fewer operations: bf16 keeps float32's exponent, so every value (subnormals too) drops its low 16
    bits, ``frac``, and moves up one bf16 step when the top 16 of its 32 random bits are below ``frac`` (the same
    draw, the same comparison); beyond max the overflow policy's value, a NaN the layout's NaN."""
    p = rg.RoundParams.read(q)
    index = torch.arange(bits.numel(), dtype=torch.int32, device=bits.device) + p.index_offset
    r = rg.hash32(index, p.seed_lo, p.seed_hi)
    u = bits & 0x7FFFFFFF
    move = ((r >> 16) & 0xFFFF) < (u & 0xFFFF)
    out = (u & -(1 << 16)) + (move.to(torch.int32) << 16)
    out = torch.where(u > 0x7F800000, 0x7FC00000, torch.where(out > p.max_bits, p.overflow_bits, out))
    return out | (bits & -(1 << 31))


def _stochastic(p, grad, m, v, root, c, q) -> None:
    w = _moved(p, grad, m, v, root, c)
    p.copy_(bf16_stochastic_bits(w.view(torch.int32), q).view(torch.float32).to(p.dtype))


def _round_root(root: torch.Tensor, q: torch.Tensor) -> None:
    rg.stochastic_bits(root.view(torch.int32), q, inplace=True)


_UPDATE = {"nearest": _nearest, "stochastic": _stochastic, "remainder": _master}


_kernels: dict = {}


def _compiled(fn):
    if fn not in _kernels:
        _kernels[fn] = torch.compile(fn, dynamic=True, fullgraph=True, options=_OPTIONS)
    return _kernels[fn]


def eligible(opt) -> bool:
    """Whether :func:`step` gives ``opt`` (a LowPrecisionOptimizer) the generic step's bits (see the module)."""
    inner = opt.optimizer
    if type(inner) not in (torch.optim.Adam, torch.optim.AdamW) or rg.get_mode() == "off" or opt.state_format:
        return False
    if inner._optimizer_step_pre_hooks or inner._optimizer_step_post_hooks or any(
            torch_optimizer._global_optimizer_pre_hooks) or any(torch_optimizer._global_optimizer_post_hooks):
        return False
    for group in inner.param_groups:
        if any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach")):
            return False
        if any(torch.is_tensor(group[k]) for k in ("lr", "eps", "weight_decay")) or any(
                torch.is_tensor(b) for b in group["betas"]):
            return False
        if group["weight_decay"] and not group.get("decoupled_weight_decay", type(inner) is torch.optim.AdamW):
            return False
        for p in group["params"]:
            if (p not in opt._remedy or opt._remedy[p] not in _REMEDIES or p.device.type != "cpu"
                    or p.dtype != torch.bfloat16 or not p.is_contiguous()
                    or (p.grad is not None and (p.grad.is_sparse or p.grad.dtype != p.dtype))):
                return False
    remedies = {(p.dtype, opt._remedy[p]) for p in opt.lowprec_params}
    if any(_ready.get(key) is False for key in remedies) or opt.state_rounding != "nearest" or any(
            rg._native_dtype(torch.empty(0), opt.fmt, opt.overflow) != dtype for dtype, _ in remedies):
        return False     # (the state, and a weight rounded to nearest, cast to bf16 as the generic step does)
    if rg.get_mode() == "auto" and not all(_ready.get(key) for key in remedies):
        if _work["elements"] < rg.EAGER_BUDGET:     # the generic step until a run has moved that much
            _work["elements"] += sum(p.numel() for p in opt.lowprec_params)
            return False
    return all(_ready.get(key) or _check(opt, *key) for key in remedies)


def _constants(group: dict, step: float) -> torch.Tensor:
    """torch's scalars of one step, each rounded to float32 as its kernels round them; then -0.0."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    return torch.tensor([1 - lr * wd if wd else 1.0, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps,
                         -(lr / (1 - beta1 ** step)), -0.0], dtype=torch.float32)


#: Elements a tensor is stepped by: the float32 scratch that holds a chunk's root (1 MiB, one per device, kept from
#: step to step) stays in the cache.
CHUNK = 1 << 18
_scratch: dict = {}


def step(opt) -> None:
    """One step of ``opt`` (for which :func:`eligible` said yes): the inner optimizer's state and step counts, the
    stored weights, moments and remainders, and the generator's draws as :meth:`LowPrecisionOptimizer.step` leaves
    them. A tensor goes by chunks of :data:`CHUNK` elements (each element's arithmetic is its own, so the same bits)."""
    with torch.no_grad():
        _step(opt)


def _step(opt) -> None:
    inner, stored, draws = opt.optimizer, opt._stored, {}
    for run in runs_of(stored):     # the generic step's runs: one seed each, drawn by its SR members in their order
        drawing = [stored[i] for i in run if opt._remedy[stored[i]] == "stochastic"]
        seed, offset = rg.draw_seed(opt.generator) if drawing else 0, 0
        for p in drawing:
            draws[p], offset = (seed, offset), offset + p.numel()
    second, sr = _compiled(_into_root), _compiled(_round_root)
    inner._opt_called = True      # (what an LR scheduler's wrapper of the inner step records)
    for group in inner.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            state = inner.state[p]
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch_optimizer._get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            c, remedy, (seed, start) = _constants(group, state["step"].item()), opt._remedy[p], draws.get(p, (0, 0))
            few_bits = remedy == "stochastic" and opt.rand_bits is not None
            update = _compiled(_master if few_bits else _UPDATE[remedy])
            # flat aliases, not views (detach): a compiled kernel guards on a view's base, and would compile again
            flat = [t.reshape(-1).detach() for t in (p.data, state["exp_avg"], state["exp_avg_sq"], p.grad)]
            rem = opt._remainders[p].reshape(-1).detach() if remedy == "remainder" else None
            n = p.numel()
            if _scratch.get(p.device) is None or _scratch[p.device].numel() != CHUNK:
                _scratch[p.device] = torch.empty(CHUNK, dtype=torch.float32, device=p.device)
            scratch = _scratch[p.device].detach()
            for lo in range(0, n, CHUNK):
                part = slice(lo, min(n, lo + CHUNK))
                root = scratch[:part.stop - lo].detach()
                grad = flat[3][part].detach()
                second(grad, flat[2][part].detach(), c, root)
                root.sqrt_()     # torch's own root
                q = None if remedy != "stochastic" else rg.round_params(opt.fmt, opt.overflow, opt.rand_bits, seed,
                                                                        start + lo).tensor(p.device)
                update(flat[0][part].detach(), grad, flat[1][part].detach(), flat[2][part].detach(), root, c,
                       rem[part].detach() if remedy == "remainder" else None if few_bits else q)
                if few_bits:     # (few-bit SR: the general kernel, on the weight left in root's place)
                    sr(root, q)
                elif remedy == "remainder":      # (the generic step's split, eagerly: a bit cast compiles slowly)
                    storage.split_remainder_(root, rem[part])
                if few_bits or remedy == "remainder":
                    flat[0][part].copy_(root)      # (exact: on the grid)


def _check(opt, dtype: torch.dtype, remedy: str) -> bool:
    """Two steps of the generic and the fused path on a probe with ``opt``'s settings: the same bits, or never again."""
    gen = torch.Generator().manual_seed(1234)
    sizes = (4099, 33, 1)     # (a size of 1 compiles a kernel of its own)
    base = [(torch.randn(n, generator=gen) * 0.05).to(dtype) for n in sizes]
    grads = [[(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-7, 1, (n,), generator=gen)).to(dtype)
              for n in sizes] for _ in range(2)]
    group = {k: v for k, v in opt.optimizer.param_groups[0].items() if k != "params"}
    decoupled = group.get("decoupled_weight_decay", type(opt.optimizer) is torch.optim.AdamW)
    group.update(lr=1e-3, weight_decay=0.1 if decoupled else 0.0)    # (the user's betas and eps; a rate that moves)
    results, mode = [], rg.get_mode()
    try:
        for fused in (False, True):
            rg.set_mode(mode if fused else "off")     # ("off": the generic step, its rounding eagerly; the same bits)
            params = [torch.nn.Parameter(b.clone()) for b in base]
            inner = type(opt.optimizer)([{"params": params, **copy.deepcopy(group)}])
            kind = {"remainder": {"compensation": "remainder"}}.get(remedy, {"rounding": remedy})
            probe = type(opt)(inner, opt.fmt, generator=7, overflow=opt.overflow, rand_bits=opt.rand_bits,
                              **kind)
            for g in grads:
                for p, gi in zip(params, g):
                    p.grad = gi.clone()
                step(probe) if fused else probe.step()
            results.append([t.view(torch.int16) for t in params] + [
                v.view(torch.int16) for p in params for k, v in inner.state[p].items() if k != "step"] + [
                r for r in probe._remainders.values()] + [probe.generator.get_state()])
        same = all(torch.equal(a, b) for a, b in zip(*results))
    except Exception as error:     # no compiler, an unsupported platform
        same, why = False, f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:200]}"
    else:
        why = "its bits differ from the generic step's on a probe"
    finally:
        rg.set_mode(mode)
    _ready[(dtype, remedy)] = same
    if not same:
        warnings.warn(f"the fused Adam step ({remedy}, {dtype}) is not used: {why}; the generic step runs, same "
                      f"bits, slower", RuntimeWarning)
    return same
