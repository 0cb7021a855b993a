"""Before the first step: will this run's weights freeze, and what closes the gap (:func:`preflight`)?

The preflight copies the model, optimizer and scheduler (one ``copy.deepcopy``, so that the copies refer to each
other), widens the copy's parameters and floating optimizer state to float32, and takes ``probe_steps`` steps on it
under a predict-mode :func:`~lowprec_demo.monitor.freeze_watch.watch` for the run's storage format. Per tensor, the
frozen share over the run is the mean, over the run's steps, of the fraction of its elements whose update round to
nearest would drop: at the probe's steps measured among the elements with a gradient, then the watch's forecast curve
(:func:`~lowprec_demo.monitor.forecast.forecast_curves`, the probe's update ratios carried along the schedule) among
those with an update, for the steps ahead. Elements without one (an embedding's unused rows) are not counted frozen:
they would not move in float32 either. The user's model, optimizer, scheduler and torch random state (CPU and CUDA)
are left as they were.

The verdict, ``needs_remedy``: the parameter-weighted predicted frozen share over the run is at least :data:`CUTOFF`
(0.45), chosen on 9 calibration bf16 fine-tunes (``benchmarks/preflight_heldout.py``: the largest multiple of 0.05 at
or below the lowest share, 0.452, of the 7 runs where plain bf16 lost at least 10 % of float32's loss improvement; the
one run where bf16 lost at most 2 %, 1000 steps at peak lr 1e-2, had 0.477 and is misjudged) and then fixed. On 12
held-out fine-tunes (``benchmarks/cpu-2026-12-06-preflight.md``: other pretraining and batch seeds, rates and lengths)
it recommended a remedy on all 7 where bf16 lost at least 10 %, and none on 1 of the 2 where bf16 lost at most 2 % (the
other, predicted 0.468, a false alarm). The frozen share does not see that at a high rate the weights that move can
make up for those that cannot: it errs toward a remedy there, where stochastic rounding costs step time, not bytes. The
cutoff was chosen on bf16 runs; for other formats it is the same number, unmeasured.

The recommendation: the watch's plan (:func:`~lowprec_demo.monitor.planning.make_plan`) made from the probe, as if
from step 0, in any format: master copies for the tensors that cannot move, Kahan buffers for those forecast to freeze
(earliest first) within ``budget`` extra bytes per parameter, stochastic rounding after that, round to nearest for the
tensors forecast to keep moving (``budget=0``: stochastic rounding wherever a remedy is due). Stochastic rounding alone
costs no byte and closed 99 % of plain bf16's gap on the bf16 fine-tune benchmark
(``benchmarks/cpu-2026-12-06-finetune-bf16.md``, where the plan from step 0 closed 99 % for 0.8 bytes); on runs from
scratch at a peak rate of 1e-3 it left a little more than the plan: chapter 8's transformer (stochastic rounding
everywhere ended 0.0016 nats above float32, the plan 0.0003, round to nearest 0.097) and chapter 9's nanoGPT (+0.0015
against -0.0002, three seeds). A narrower rule, stochastic rounding only for the tensors predicted frozen at least
:data:`CUTOFF` of the run and round to nearest for the rest, left 0.028 on chapter 8's run: tensors below the cutoff
still freeze as the schedule decays.

Example:
    >>> import torch, lowprec_demo as lp
    >>> model = torch.nn.Linear(8, 1).to(torch.bfloat16)
    >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    >>> x = torch.randn(16, 8, dtype=torch.bfloat16)
    >>> pf = lp.preflight(model, opt, total_steps=100, loss=lambda m: m(x.to(m.weight.dtype)).pow(2).mean())
    >>> pf.format, pf.needs_remedy
    ('bf16', True)
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from lowprec_demo.formats import format_of_dtype, get_format
from lowprec_demo.monitor.forecast import check_schedule, forecast_curves, schedule_length, unwrap_scheduler
from lowprec_demo.monitor.report import watch_format
from lowprec_demo.optim.plan import FreezePlan

__all__ = ["preflight", "Preflight", "CUTOFF", "PROBE_STEPS"]

CUTOFF = 0.45         # needs_remedy: the run's predicted frozen share at least this (the module docstring)
PROBE_STEPS = 20      # probe steps by default, at most the run's length
SHOWN = 12            # tensors listed by summary() at most


@dataclass
class Preflight:
    """What :func:`preflight` returns. ``format``: the storage format advised on; ``needs_remedy``: whether the run as
    a whole needs one (its predicted frozen share ``frozen_share`` at least ``cutoff``); ``plan``: the recommendation
    per tensor, a :class:`~lowprec_demo.optim.plan.FreezePlan` for ``LowPrecisionOptimizer(..., plan=)`` or
    :func:`~lowprec_demo.monitor.integrations.attach_plan` (it may fix a few tensors when ``needs_remedy`` is False);
    ``by_tensor``: per tensor ``{"size", "frozen_share", "remedy", "why"}``; ``bytes_per_parameter``: the plan's
    (:meth:`FreezePlan.bytes_per_parameter`); ``probe_steps`` and ``total_steps`` of the prediction."""
    format: str
    needs_remedy: bool
    plan: FreezePlan
    by_tensor: Dict[str, dict]
    frozen_share: float
    bytes_per_parameter: dict
    probe_steps: int
    total_steps: int
    cutoff: float = CUTOFF
    curve: Dict[int, float] = field(default_factory=dict, repr=False)   # overall frozen share per step of the run

    def summary(self, show: bool = True) -> str:
        """The verdict in one line, then the tensors that need something with remedy and bytes; printed unless
        ``show=False``, and returned."""
        b = self.bytes_per_parameter
        verdict = "needs a remedy" if self.needs_remedy else "needs no remedy"
        lines = [f"preflight for {self.format}: the run {verdict}: {self.frozen_share:.1%} of its updates predicted "
                 f"frozen over {self.total_steps} steps (cutoff {self.cutoff:.0%}; probed {self.probe_steps} steps); "
                 f"plan: {b['total']:.3g} bytes per parameter, {b['extra']:.3g} above round to nearest"]
        fixes = [(n, t) for n, t in self.by_tensor.items() if t["remedy"] != "nearest"]
        for n, t in fixes[:SHOWN]:
            extra = self.plan.extra_bytes(t["remedy"])
            lines.append(f"  {n} ({t['size']:,}): {t['remedy']}, +{extra:g} bytes each: {t['why']}")
        if len(fixes) > SHOWN:
            lines.append(f"  and {len(fixes) - SHOWN} more tensors (by_tensor, or plan.summary(), lists them all)")
        if not fixes:
            lines.append("  every tensor: round to nearest")
        text = "\n".join(lines)
        if show:
            print(text)
        return text

    def __str__(self) -> str:
        return self.summary(show=False)


def _storage_format(model, optimizer, formats) -> str:
    """The format advised on: ``formats``' (one), else a LowPrecisionOptimizer's, else the parameters' low-precision
    dtype, else bf16."""
    if formats is not None:
        given = [formats] if isinstance(formats, (str, torch.dtype)) or hasattr(formats, "man_bits") else list(formats)
        if len(given) != 1:
            raise ValueError(f"preflight advises on one storage format; got formats={formats!r}")
        return watch_format(given[0]).name      # a ValueError names the valid ones
    if getattr(optimizer, "fmt", None) is not None and hasattr(optimizer, "lowprec_params"):
        return optimizer.fmt.name
    low = [format_of_dtype(p.dtype) for p in model.parameters() if format_of_dtype(p.dtype)]
    return low[0] if low else "bf16"


def _innermost(optimizer):
    """The torch optimizer behind wrappers (accelerate's, a LowPrecisionOptimizer: it steps the model's parameters)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _own_step(opt) -> None:
    """A torch scheduler wraps its optimizer's ``step`` (an attribute that would call the original's, or one that
    ``copy.deepcopy`` drops): give the copy its own, marked as the scheduler expects."""
    if "step" in vars(opt):
        del opt.step
    bound = opt.step

    @functools.wraps(bound)
    def step(*args, **kwargs):
        opt._opt_called = True
        return bound(*args, **kwargs)
    step._wrapped_by_lr_sched = True
    opt.step = step


@torch.no_grad()
def _widen(model, opt) -> None:
    """The copy's floating parameters and optimizer state in float32 (float64 kept), in place of the originals."""
    for p in model.parameters():
        if p.is_floating_point() and p.element_size() < 4:
            p.data = p.data.float()
    for state in opt.state.values():
        for k, v in state.items():
            if torch.is_tensor(v) and v.is_floating_point() and v.element_size() < 4:
                state[k] = v.float()


def _checks(model, optimizer, loss, probe_steps, budget, progress) -> None:
    if loss is None or not callable(loss):
        raise TypeError(f"preflight needs loss=, a callable loss(model) -> scalar tensor of the next batch (it is "
                        f"called on the preflight's copy of the model, once per probe step); got {loss!r}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(_innermost(optimizer), torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if probe_steps is not None and (isinstance(probe_steps, bool) or not isinstance(probe_steps, int)
                                    or probe_steps < 1):
        raise ValueError(f"probe_steps must be a whole number of steps >= 1, or None ({PROBE_STEPS} at most), got "
                         f"{probe_steps!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise ValueError(f"budget must be a number of bytes per parameter >= 0, got {budget!r}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")


def preflight(model: torch.nn.Module, optimizer, scheduler=None, total_steps: Optional[int] = None, formats=None, *,
              loss=None, probe_steps: Optional[int] = None, budget: float = 1.0, progress: bool = False) -> Preflight:
    """Advise, before the first step, whether the run ``model``/``optimizer``/``scheduler`` needs a remedy against
    the freeze in its storage format, and which per tensor (the module docstring's rules). Returns a
    :class:`Preflight`; the arguments are left untouched, the torch random state (CPU and CUDA) too.

    ``loss(model)``: the loss of the next batch (a scalar tensor) on the model given, the preflight's copy; it is
    called once per probe step, then ``backward()`` and the copies' ``step()``. The copy's parameters are float32:
    floating inputs should be cast to ``next(model.parameters()).dtype``. ``total_steps``: the run's length
    (None: the scheduler's, where it says it). ``formats``: one storage format (a name or the torch dtype; None: a
    ``LowPrecisionOptimizer``'s, else the parameters' low-precision dtype, else bf16). ``probe_steps``: the steps
    taken on the copy (None: :data:`PROBE_STEPS`, at most ``total_steps``). ``budget``: extra bytes per parameter a
    plan for a format of fewer than 7 mantissa bits may spend. ``progress``: the watch's progress bar.

    Cost: the time of ``probe_steps`` float32 steps of the model with the watch (a few hundredths of a step more
    with its default sample), and the memory of a float32 copy of the model, its gradients and optimizer state,
    freed on return. Bad input raises before the copy is made."""
    from lowprec_demo.monitor.freeze_watch import watch
    _checks(model, optimizer, loss, probe_steps, budget, progress)
    fmt = _storage_format(model, optimizer, formats)
    check_schedule(scheduler)
    total = total_steps if total_steps is not None else schedule_length(unwrap_scheduler(scheduler))
    if total is None:
        raise ValueError("preflight needs the run's length: pass total_steps= (the run's optimizer steps); the "
                         f"scheduler ({type(scheduler).__name__}) does not say it")
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total_steps must be a whole number of optimizer steps >= 1, got {total!r}")
    probe = min(total, PROBE_STEPS if probe_steps is None else probe_steps)
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        # the torch optimizer that steps the model's parameters (a wrapper's deep copy keeps its param_groups only)
        m, inner, s = copy.deepcopy((model, _innermost(optimizer), scheduler))
        stepped = {id(inner): inner, id(getattr(s, "optimizer", inner)): getattr(s, "optimizer", inner)}.values()
        for opt in stepped:
            _own_step(opt)
            for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):   # the user's watches
                getattr(opt, hooks, {}).clear()      # (accelerate's wrapper has none)
        _widen(m, inner)
        w = watch(m, inner, formats=(fmt,), scheduler=s, total_steps=total, progress=progress)
        try:
            for _ in range(probe):
                inner.zero_grad(set_to_none=True)
                try:
                    value = loss(m)
                except RuntimeError as error:
                    if "dtype" not in str(error):
                        raise
                    raise RuntimeError(f"{error}; the preflight's copy of the model is float32: cast floating inputs "
                                       f"to the parameters' dtype in loss (next(model.parameters()).dtype)") from error
                if not torch.is_tensor(value) or value.numel() != 1:
                    raise ValueError(f"loss(model) must return a scalar tensor, got "
                                     f"{type(value).__name__}{tuple(value.shape) if torch.is_tensor(value) else ''}")
                value.backward()
                inner.step()
                for opt in stepped:
                    opt._opt_called = True
                if s is not None and hasattr(s, "step"):
                    s.step()
        finally:
            w.detach()
        return _advise(w, fmt, total, probe, float(budget))


def _advise(w, fmt: str, total: int, probe: int, budget: float) -> Preflight:
    """The Preflight from the probe's watch: measured points, then the forecast curves to the run's end."""
    ahead = forecast_curves(w, fmt, total) if total > w.steps[-1] + 1 else {n: {} for n in [*w.tracked, "overall"]}
    none = w.ratios.recent[fmt][:, 0].tolist()     # per tensor, the share of zero updates (the first bin)
    per_step = {}
    for j, n in enumerate(w.tracked):     # measured: among elements with a gradient; ahead: with an update
        measured = [f / (1 - i) if i < 1 else 0.0 for f, i in zip(w.frozen_with_grad[n], w.idle[n])]
        z = none[j]
        future = [min(1.0, max(0.0, (f - z) / (1 - z))) if z < 1 else 0.0 for f in ahead[n].values()]
        per_step[n] = dict(zip([*w.steps, *ahead[n]], measured + future))
    share = {n: sum(v.values()) / len(v) for n, v in per_step.items()}
    size = sum(w.sizes[n] for n in w.tracked)
    overall = sum(share[n] * w.sizes[n] for n in w.tracked) / size
    curve = {t: sum(per_step[n][t] * w.sizes[n] for n in w.tracked) / size for t in per_step[w.tracked[0]]}
    plan = w.plan(fmt, budget=budget)     # the watch's plan from the probe (the module docstring says why)
    plan.step = 0
    by_tensor = {n: {"size": w.sizes[n], "frozen_share": share[n], "remedy": plan.remedies[n],
                     "why": plan.reasons.get(n, "")} for n in w.tracked}
    return Preflight(fmt, bool(overall >= CUTOFF), plan, by_tensor, overall, plan.bytes_per_parameter(), probe, total,
                     CUTOFF, curve)

