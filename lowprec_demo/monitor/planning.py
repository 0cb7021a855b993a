"""Making a freeze plan from what a freeze watch saw (:func:`make_plan`, ``watch.plan(fmt)``): the
:class:`~lowprec_demo.optim.plan.FreezePlan` that ``LowPrecisionOptimizer(..., plan=)`` applies.

:func:`make_plan` gives each tensor the freeze watch follows one of
:data:`~lowprec_demo.optim.plan.PLAN_REMEDIES` with the reason, serving them in order of need (those that cannot move,
then those frozen now, then by forecast freeze step, the smaller first at a tie) while the
``budget`` of extra bytes per watched parameter (``plan.bytes_per_parameter()["extra"]``) lasts:

* ``"master"``, a float32 master copy (4 bytes an element), to the tensors that cannot move at
  all (every update below half a gap): it keeps every update, where a Kahan buffer on the format's grid loses those
  below ``2^-(m+2)`` of a gap and stochastic rounding moves the weight a whole gap on the rare step it moves;
* ``"kahan"``, Kahan compensation (:func:`~lowprec_demo.optim.plan.kahan_buffer_format`), to those frozen now or
  forecast to freeze before the run ends;
* ``"stochastic"`` (no byte more) to those left once the budget is spent, ``"nearest"`` to the others.

``remedies`` widens the choice: with ``"remainder"`` (bf16 only) the tensors that need a master copy or a Kahan buffer
get the 16-bit remainder instead (an exact float32 master for 2 bytes); with ``"feedback"`` and no ``"stochastic"``,
error feedback takes stochastic rounding's place (:mod:`~lowprec_demo.optim.storage`).
"""

from __future__ import annotations

from typing import Optional

from lowprec_demo.optim.plan import CLASSIC_REMEDIES, PLAN_REMEDIES, FreezePlan

__all__ = ["make_plan"]


def make_plan(watch, fmt=None, budget: float = 1.0, threshold: Optional[float] = None,
              total_steps: Optional[int] = None, kahan_format="auto", remedies=CLASSIC_REMEDIES) -> FreezePlan:
    """The plan (the module docstring's rule) of a watch for ``fmt`` (None: its first), from its diagnoses and
    forecast; ``kahan_format``: ``"auto"``, a format, None (float32); ``remedies``: those it may give."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget >= 0:
        raise ValueError(f"budget must be a number of bytes per parameter >= 0, got {budget!r}")
    if isinstance(remedies, str) or not set(remedies) <= set(PLAN_REMEDIES) or "nearest" not in remedies:
        raise ValueError(f"remedies must be some of {', '.join(PLAN_REMEDIES)}, 'nearest' among them; got {remedies!r}")
    from lowprec_demo.monitor.report import no_step_yet
    no_step_yet(watch, "plan()")
    f = watch.record(fmt).format
    exact = "remainder" if "remainder" in remedies else None
    if exact and f != "bf16":
        raise ValueError(f"the remainder remedy keeps a float32 master as bf16 plus 16 bits; this plan is for {f}")
    fallback = next((r for r in ("stochastic", "feedback") if r in remedies), "nearest")
    fc = watch.forecast(f, threshold, total_steps, relative=None)     # the threshold's, on a fine-tune too
    total = total_steps if total_steps is not None else watch.total_steps
    plan = FreezePlan(f, {n: "nearest" for n in watch.tracked}, {}, {n: watch.sizes[n] for n in watch.tracked},
                      {n: list(watch.params[n].shape) for n in watch.tracked},
                      {n: watch.names.index(n) for n in watch.tracked}, kahan_format, float(budget), watch.steps[-1],
                      total, fallback=fallback)
    held = {d.tensor: d for d in watch.diagnoses()
            if d.kind in ("cannot_move", "frozen") and d.numbers.get("format") == f}
    needs = []      # (order of need, size, name, preferred remedy, why)
    for n in watch.tracked:
        band, numbers = fc["by_tensor"][n], held[n].numbers if n in held else {}
        if n in held and held[n].kind == "cannot_move":
            needs.append(((0, 0), watch.sizes[n], n, "master", f"cannot move: at least {numbers['frozen']:.1%} of "
                          f"its updates below half a gap on every watched step"))
        elif n in held:
            needs.append(((1, 0), watch.sizes[n], n, "kahan", f"frozen now: {numbers['frozen']:.1%} held for the "
                          f"last {numbers['steps']} watched steps"))
        elif band["low"] is not None:
            at = band["low"] if band["step"] is None else band["step"]
            high = "the end" if band["high"] is None else band["high"]
            why = (f"frozen since step {at} (at least {watch.threshold:.0%} held from then on)" if at <= watch.steps[-1]
                   else f"forecast to freeze after the run, the band's early edge at step {band['low']} of {total}"
                   if band["step"] is None else
                   f"forecast to freeze at step {at} (band {band['low']}-{high}) of {total}")
            needs.append(((2, at), watch.sizes[n], n, "kahan", why))
        else:
            plan.reasons[n] = f"forecast not to freeze within the run's {total} steps"
    plan.needs = [{"tensor": n, "remedy": exact or preferred, "why": why}
                  for _, _, n, preferred, why in sorted(needs, key=lambda x: (x[0], x[1]))]
    return plan.allocate()
