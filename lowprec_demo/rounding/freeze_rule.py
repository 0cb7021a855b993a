"""The freeze rule, written once: whether an update leaves a stored weight in place, and how likely SR moves it.

For a stored weight ``w`` (a value of the format's grid) and an update ``d``, the gap on the update's side is
``2**(max(floor(log2|w|), e_min) - m)``, halved moving toward zero from a power of two (inf included; never below the
subnormal spacing). Round to nearest freezes ``w`` when ``|d| < gap / 2``, or ``|d| == gap / 2`` with ``w`` an even
multiple of the gap; a *stuck* weight stays whatever the update (``+-max`` of a saturating format under an outward
update, inf under a finite one or one of its own sign); a NaN weight or update never freezes. Stochastic rounding
moves it with probability ``min(1, |d| / gap)`` (0 when stuck), with k random bits
``round_half_even(p * 2**k) / 2**k``, so an update below ``2**-(k+1)`` gaps never moves.

:func:`freeze_elements` is the rule on bit patterns; :func:`would_freeze`, :func:`move_probability` and
:func:`update_ulp_ratio` apply it to any float tensors, and :func:`step_codes` to a step of float32 tensors in one
kernel pass (compiled by :func:`~lowprec_demo.rounding.round_to_grid.run`), giving each element a code
(:func:`element_codes`) that one :func:`torch.bincount` counts for the predictor and the watch alike
(``tests/test_freeze_rule_callers.py`` runs every caller against an exact ``Fraction`` reference).

Example:
    >>> w, d = torch.tensor([1.0, 1.0, 448.0]), torch.tensor([2**-9, -2**-9, 32.0])
    >>> would_freeze(w, d, "e4m3").tolist(), update_ulp_ratio(w, d, "e4m3").tolist()
    ([True, True, True], [0.015625, 0.03125, 1.0])
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional, Union

import torch

from lowprec_demo.formats import FloatFormat, check_overflow_policy, get_format
from lowprec_demo.rounding.round_to_grid import (_NARROW, LAYOUTS, BitLayout, _check_narrow, cached_tensor,
                                                 check_rand_bits, check_tensor, grid_bits, quantize, rne_magnitude, run)

__all__ = ["ulp", "would_freeze", "move_probability", "update_ulp_ratio", "decay_rounds_back", "gap_value",
           "FIRST_EDGE", "LAST_EDGE", "PER_OCTAVE", "BINS", "RuleParams", "rule_params", "freeze_elements", "move_share",
           "bin_thresholds", "element_codes", "step_codes", "fits"]

# the one binning of log2(|d| / gap) (less log2(lr) where the watch divides by the learning rate): eighths of an
# octave from 2**-64 to 2**32, a bin below and one above; a NaN ratio takes one more slot (BINS) of its own
FIRST_EDGE, LAST_EDGE, PER_OCTAVE = -64, 32, 8
BINS = (LAST_EDGE - FIRST_EDGE) * PER_OCTAVE + 2
_F32 = LAYOUTS[torch.float32]


class RuleParams(NamedTuple):
    """What the freeze rule needs of a format, as integers of a :class:`BitLayout`; the first four are those of
    :class:`~lowprec_demo.rounding.round_to_grid.RoundParams` (the step kernel rounds the old weight with them)."""
    man_bits: int
    emin_biased: int
    max_bits: int
    overflow_bits: int
    stuck_bits: int        # the weight every outward update leaves in place (-1: none)
    rand_bits: int         # k, SR's random bits for the move probability (0: full resolution)
    stuck_limit: int       # the bits of inf where any finite update leaves inf in place, else 0

    def tensor(self, device=None, layout: BitLayout = _F32) -> torch.Tensor:
        return torch.tensor(self, dtype=layout.itype, device=device)

    @classmethod
    def read(cls, p: torch.Tensor) -> "RuleParams":
        return cls(*[p[i] for i in range(len(cls._fields))])


@functools.lru_cache(maxsize=256)
def rule_params(fmt: FloatFormat, rand_bits: Optional[int] = None, layout: BitLayout = _F32,
                overflow: Optional[str] = None) -> RuleParams:
    """The rule's parameters for k = ``rand_bits`` random bits (None: full resolution) and the policy ``overflow``
    (None: the format's own), whose stuck weight is max (saturate), inf (inf) or none (nan)."""
    overflow = fmt.overflow if overflow is None else overflow
    grid = grid_bits(fmt, overflow, layout)
    stuck = {"saturate": grid[2], "inf": layout.inf_bits, "nan": -1}[overflow]
    return RuleParams(*grid, stuck, 0 if rand_bits is None else rand_bits, layout.inf_bits if overflow == "inf" else 0)


def freeze_elements(wu: torch.Tensor, signed: torch.Tensor, d: torch.Tensor, q: RuleParams,
                    layout: BitLayout = _F32, divide: bool = False):
    """The rule for stored magnitudes ``wu`` (bit patterns of ``q(w)``, at most those of inf), the signs of ``signed``
    (bit patterns of anything with w's sign) and the updates ``d`` (floats of ``layout``), with the parameters ``q`` of
    :func:`rule_params` (Python integers or 0-dim tensors). Returns ``(frozen, ratio, stuck)``: whether round to nearest
    keeps ``q(w)``, ``|d| / gap`` on the update's side (exact but below the smallest normal, where two factors of a huge
    gap can round twice, unless ``divide``: one division; 0 or NaN at an infinite gap), and whether the weight is stuck.

    Example:
        >>> w, d = torch.tensor([1.0, 1.0, 448.0]), torch.tensor([2**-9, -2**-9, 32.0])
        >>> q = rule_params(get_format("e4m3"))
        >>> frozen, ratio, stuck = freeze_elements(w.view(torch.int32) & 0x7FFFFFFF, w.view(torch.int32), d, q)
        >>> frozen.tolist(), stuck.tolist()
        ([True, True, True], [False, False, True])
    """
    inf_bits, half_bits, shift, bias = layout.inf_bits, layout.half_bits, layout.man_bits, layout.bias
    db = d.view(layout.itype)
    du = db & layout.abs_mask
    opposite = (signed ^ db) < 0            # w and d point different ways
    inward = opposite & ((wu & ((1 << shift) - 1)) == 0) & (wu != 0)   # toward zero from a power of two
    # the biased exponent of the gap: max(exponent of w - inward, e_min) - m
    gap_exp = torch.clamp((wu >> shift) - inward.to(wu.dtype), min=q.emin_biased) - q.man_bits
    # 2**-gap as two normal powers of two whose product it is, each as large as the layout allows
    neg_g = bias - gap_exp
    first = torch.clamp(neg_g, min=1 - bias, max=bias)
    scales = [((first + bias) << shift).view(layout.dtype), ((neg_g - first + bias) << shift).view(layout.dtype)]
    if divide:
        ratio = d.abs() / gap_value(gap_exp, layout)
    else:
        ratio = d.abs() * scales[0] * scales[1]
    ratio = torch.where(gap_exp >= 2 * bias + 1, torch.where(du < inf_bits, 0.0, float("nan")), ratio)
    rb = ratio.view(layout.itype)
    # |w| / gap, an integer below 2**(m + 2), comes exactly from the same factors (the first product is normal, or 0:
    # |w| >= gap or w = 0); it is even when its half is whole. (At inf the half is inf and counts as even: a finite
    # update leaves inf in place anyway.)
    half_multiple = wu.view(layout.dtype) * scales[0] * scales[1] * 0.5
    frozen = (rb < half_bits) | ((rb == half_bits) & (torch.round(half_multiple) == half_multiple))
    stuck = (wu == q.stuck_bits) & (~opposite | (du < q.stuck_limit)) & (du <= inf_bits)   # (NaN updates: never)
    frozen = (frozen | stuck) & (torch.maximum(wu, du) <= inf_bits)       # NaN never
    return frozen, ratio, stuck


def move_share(ratio: torch.Tensor, stuck: torch.Tensor, k) -> torch.Tensor:
    """The move probability of stochastic rounding from :func:`freeze_elements`' ratio and stuck flags: ``min(1,
    ratio)``, 0 where stuck, resolved to ``k`` random bits where ``k > 0`` (an int or a 0-dim integer tensor, at most
    32); NaN stays NaN."""
    probability = torch.where(stuck, 0.0, torch.clamp(ratio, max=1.0))
    if isinstance(k, int):
        return probability if k == 0 else torch.round(probability * 2.0**k) * 2.0**-k
    f32 = torch.float32   # 2**k and 2**-k as float32 bit patterns (k <= 32)
    resolved = torch.round(probability * ((k + 127) << 23).view(f32)) * ((127 - k) << 23).view(f32)
    return torch.where(k > 0, resolved.to(probability.dtype), probability)


# --- the rule on float tensors ----------------------------------------------------------------------
def _rule(w: torch.Tensor, d: torch.Tensor, fmt: FloatFormat, overflow: Optional[str] = None) -> tuple:
    """``(frozen, ratio, stuck)`` of the rule at ``q(w)`` for ``d`` (broadcast, promoted)."""
    check_tensor(w, "w")
    check_tensor(d, "d")
    wide = [t.float() if t.dtype in (torch.float16, torch.bfloat16) else t for t in (w, d)]
    dtype = torch.promote_types(wide[0].dtype, wide[1].dtype)
    w, d = torch.broadcast_tensors(w.detach().to(dtype), d.detach().to(dtype))
    w = quantize(w, fmt)
    layout = LAYOUTS[w.dtype]
    signed = w.contiguous().view(layout.itype)
    return freeze_elements(signed & layout.abs_mask, signed, d.contiguous(), rule_params(fmt, None, layout, overflow),
                           layout, divide=True)


def update_ulp_ratio(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """``|d| / gap``: the update in grid spacings on its own side of ``q(w)``; round to nearest freezes below 1/2.

    Example:
        >>> update_ulp_ratio(torch.tensor([1.0, 1.0]), torch.tensor([2**-9, -2**-9]), "bf16").tolist()
        [0.25, 0.5]
    """
    return _rule(w, d, get_format(fmt))[1]


def would_freeze(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat],
                 overflow: Optional[str] = None) -> torch.Tensor:
    """Whether round-to-nearest of the exact sum ``q(w) + d`` gives back ``q(w)``: ``|d|`` below half the gap on d's
    side, ties to even; stuck weights stay, NaN never freezes.

    Example:
        >>> would_freeze(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([2**-8, -2**-9, -2**-9 - 2**-12]), "bf16").tolist()
        [True, True, False]
    """
    fmt = get_format(fmt)
    overflow = fmt.overflow if overflow is None else overflow
    check_overflow_policy(fmt, overflow)
    return _rule(w, d, fmt, overflow)[0]


def move_probability(w: torch.Tensor, d: torch.Tensor, fmt: Union[str, FloatFormat],
                     rand_bits: Optional[int] = None) -> torch.Tensor:
    """Probability that stochastic rounding of ``q(w) + d`` differs from ``q(w)``: ``min(1, |d|/gap)`` resolved to k =
    ``rand_bits`` bits, 0 for a stuck weight.

    Example:
        >>> move_probability(torch.tensor([1.0]), torch.tensor([2**-10]), "bf16").tolist()
        [0.125]
    """
    check_rand_bits(rand_bits)
    _, ratio, stuck = _rule(w, d, get_format(fmt))
    return move_share(ratio, stuck, rand_bits or 0)


def decay_rounds_back(beta: Optional[float], fmt: Union[str, FloatFormat]) -> bool:
    """Whether a moving average ``v <- beta * v + (1 - beta) * x`` kept on ``fmt``'s grid with round to nearest can stop
    decaying: ``1 - beta`` below ``2**-(m+1)``, the largest half gap relative to the value (then values just above a
    power of two round back once the input is small; below ``2**-(m+2)`` every value). False for None or 0.

    Example:
        >>> decay_rounds_back(0.999, "bf16"), decay_rounds_back(0.9, "bf16")   # Adam's beta2, beta1
        (True, False)
    """
    return bool(beta) and 1 - beta < 2.0 ** -(get_format(fmt).man_bits + 1)


def gap_value(gap_exp: torch.Tensor, layout: BitLayout = _F32) -> torch.Tensor:
    """The gap ``2**(gap_exp - bias)`` for biased gap exponents, exactly (subnormal gaps too: a biased exponent of 0 or
    less), as floats of ``layout``; inf from ``2 * bias + 1`` on."""
    man = layout.man_bits
    normal = torch.clamp(gap_exp, min=1, max=2 * layout.bias + 1) << man
    subnormal = torch.ones_like(gap_exp) << torch.clamp(gap_exp - 1 + man, min=0)
    return torch.where(gap_exp >= 1, normal, subnormal).view(layout.dtype)


def ulp(x: torch.Tensor, fmt: Union[str, FloatFormat]) -> torch.Tensor:
    """The spacing of ``fmt``'s grid at ``x``, ``2**(max(floor(log2|x|), e_min) - m)``, exactly; NaN for inf and NaN.

    Example:
        >>> ulp(torch.tensor([1.0, 1.5, 0.0]), "bf16").tolist()
        [0.0078125, 0.0078125, 9.183549615799121e-41]
    """
    fmt = get_format(fmt)
    check_tensor(x)
    _check_narrow(x.dtype, fmt)
    a = x.detach()
    a = a.float() if a.dtype in _NARROW else a
    layout = LAYOUTS[a.dtype]
    exponent = (a.view(layout.itype) & layout.abs_mask) >> layout.man_bits
    out = gap_value(exponent.clamp_(min=fmt.e_min + layout.bias) - fmt.man_bits, layout)
    return out.masked_fill_(~torch.isfinite(a), math.nan).to(x.dtype)


# --- a step's codes: one kernel pass over float32 tensors -------------------------------------------
def bin_thresholds(log_lr: Optional[torch.Tensor] = None, device=None) -> torch.Tensor:
    """The shift of :func:`element_codes`' bins by ``log2(lr)``, as it takes it: float32 ``[a, t_0, ..., t_7]`` per
    value of ``log_lr`` (float32, 0-dim or one per tensor; None: no shift), with ``a = floor(8 log_lr)`` and ``t_j``
    the largest float32 at most ``2 ** ((j + f) / 8)``, ``f = 8 log_lr - a``: a mantissa ``m`` in [1, 2) is above
    ``t_j`` exactly when it is above ``2 ** ((j + f) / 8)``, so ``ceil(8 (log2 m - log_lr)) = #{j: m > t_j} - a``.

    Example:
        >>> bin_thresholds()[:3].tolist(), bin_thresholds(torch.tensor([-0.5, -3.0])).shape
        ([0.0, 1.0, 1.0905076265335083], torch.Size([2, 9]))
    """
    if log_lr is None:    # no shift: the same thresholds every step, made once per device
        key = str(torch.device("cpu") if device is None else torch.device(device))
        if key not in _UNSHIFTED:
            _UNSHIFTED[key] = bin_thresholds(torch.zeros((), device=device))
        return _UNSHIFTED[key]
    if log_lr.dim() and log_lr.numel() == 1:    # one tensor's rate: one row for all (a row per tensor of one
        log_lr = log_lr.reshape(())             # would compile a kernel version of its own)
    eighths = log_lr.double() * PER_OCTAVE                  # (a float32 times 8: exact)
    a = torch.floor(eighths)
    f = eighths - a
    exact = torch.exp2((torch.arange(PER_OCTAVE, dtype=torch.float64, device=log_lr.device) + f.unsqueeze(-1))
                       / PER_OCTAVE)
    t = exact.float()
    t = torch.where(t.double() > exact, torch.nextafter(t, torch.zeros_like(t)), t)   # rounded down
    return torch.cat([a.float().unsqueeze(-1), t], -1)


_UNSHIFTED: dict = {}


def element_codes(frozen: torch.Tensor, ratio: torch.Tensor, flag, tensor_id, bins: torch.Tensor) -> torch.Tensor:
    """The code of every element for one ``bincount`` of a step: ``((tensor_id * (BINS + 1) + at) << 2) | frozen << 1
    | flag`` (int32), with ``at`` the bin of ``y = log2(ratio) - log_lr[tensor_id]`` among :data:`BINS` bins an
    eighth of an octave wide from :data:`FIRST_EDGE` (bin 0 up to it, ratio 0 included; the last above
    :data:`LAST_EDGE`, inf included; NaN in slot ``BINS``), the shift by ``log_lr`` given as :func:`bin_thresholds` (one
    row for all, or a row per tensor; ``bin_thresholds()``: no shift). ``flag`` (0/1 int32, or 0) is the watch's
    gradient flag.

    ``ceil(8 y)`` is ``8 * floor(log2 ratio)``, exact from the exponent bits, plus ``ceil(8 * (log2(m) - log_lr))`` for
    the mantissa ``m`` in [1, 2): the count of thresholds below ``m`` less the shift's whole eighths, found in three
    comparisons. Every bin is exact; a subnormal ratio (below ``2**-126``) counts in bin 0, its bin wherever
    ``log_lr >= -62``.

    Example:
        >>> one = torch.ones(1)
        >>> code = element_codes(one.bool(), one * 0.25, 1, torch.zeros(1, dtype=torch.int32), bin_thresholds())
        >>> ((code >> 2) % (BINS + 1)).item() == 8 * (-2 - FIRST_EDGE), (code & 3).item()
        (True, 3)
    """
    rb = ratio.view(torch.int32) & 0x7FFFFFFF
    m = ((rb & 0x7FFFFF) | (127 << 23)).view(torch.float32)
    t = bins if bins.dim() == 1 else bins[tensor_id]
    # #{j: m > t_j} by a binary search over the sorted t_1..t_7, plus m > t_0
    upper = m > t[..., 5]
    half = m > torch.where(upper, t[..., 7], t[..., 3])
    last = m > torch.where(upper, torch.where(half, t[..., 8], t[..., 6]), torch.where(half, t[..., 4], t[..., 2]))
    above = (upper.to(torch.int32) * 4 + half.to(torch.int32) * 2 + last.to(torch.int32)
             + (m > t[..., 1]).to(torch.int32))
    at = ((rb >> 23) - (127 + FIRST_EDGE)) * PER_OCTAVE + above - t[..., 0].to(torch.int32)
    at = torch.where(rb < (1 << 23), 0, torch.clamp(at, 0, BINS - 1))     # 0 and the subnormals in bin 0
    at = torch.where(rb > _F32.inf_bits, BINS, at)
    return ((tensor_id * (BINS + 1) + at) << 2) | (frozen.to(torch.int32) << 1) | flag


def _step_kernel(old: torch.Tensor, new: torch.Tensor, grad: Optional[torch.Tensor], tensor_id, bins, p):
    """The rule at ``q(old)`` for ``new - old`` (flat float32), its codes and move probabilities, in one pass."""
    q = RuleParams.read(p)
    ob = old.view(torch.int32)
    wu = rne_magnitude(torch.clamp(ob & 0x7FFFFFFF, max=_F32.inf_bits), q)
    frozen, ratio, stuck = freeze_elements(wu, ob, new - old, q, _F32)
    flag = 0 if grad is None else (grad != 0).to(torch.int32)
    return element_codes(frozen, ratio, flag, tensor_id, bins), move_share(ratio, stuck, q.rand_bits)


def step_codes(old: torch.Tensor, new: torch.Tensor, grad: Optional[torch.Tensor], tensor_id: torch.Tensor,
               log_lr: Optional[torch.Tensor], fmt: FloatFormat, rand_bits: Optional[int] = None):
    """The codes (:func:`element_codes`) and move probabilities (resolved to ``rand_bits``, None: full) of the update
    ``new - old`` at ``q(old)`` of flat float32 tensors (where :func:`fits`), in one kernel pass: ``grad`` the
    gradients or None (no flag), ``tensor_id`` int32 per element or 0-dim, ``log_lr`` float32 per tensor, 0-dim (one
    for all) or None (no shift).

    Example:
        >>> old = torch.ones(4); new = old + torch.tensor([1e-3, 1e-2, 0.0, 1.0])
        >>> code, moves = step_codes(old, new, None, torch.zeros((), dtype=torch.int32), None, get_format("bf16"))
        >>> (code & 2).bool().tolist()
        [True, False, True, False]
    """
    p = cached_tensor(rule_params(fmt, rand_bits), torch.int32, old.device)
    return run(_step_kernel, old, new, grad, tensor_id, bin_thresholds(log_lr, old.device), p)


def fits(x: torch.Tensor, fmt: FloatFormat) -> bool:
    """Whether :func:`step_codes` handles this tensor and format: float32 values, a format float32 holds."""
    return x.dtype == torch.float32 and fmt.e_max + 1 <= 128
