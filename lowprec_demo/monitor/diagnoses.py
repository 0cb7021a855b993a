"""The freeze watch's diagnoses: what cannot move, and why, in plain words with the numbers and
the remedy.

Each kind of :data:`DIAGNOSIS_KINDS` has its rule:

* ``cannot_move`` / ``frozen``: a tensor with a gradient held still (at least :data:`LOCKED` of
  it) on each of the last ``patience`` watched steps: ``cannot_move`` when that has held on
  every watched step since the first (in both modes; in prediction mode with the learning rate
  it would need), ``frozen`` when it moved before;
* ``weight_decay``: decoupled weight decay with ``lr * weight_decay`` below half the relative gap
  ``2^-(m+1)``, so that ``w (1 - lr wd)`` rounds back to ``w``;
* ``state_decay``: an optimizer moving average stored in a format where ``beta * v`` rounds back
  to ``v``;
* ``counter``: a float step counter that stopped counting, or will at ``2^(m+1)`` within the run;
* ``idle``: a tensor, or rows of an embedding, with no gradient on any watched step.

:func:`group_lines` writes them for a reader: one line for the tensors that share a diagnosis.

:func:`diagnose` takes a :class:`~lowprec_demo.watch.FreezeWatch` and reads what it measured
through its public methods; ``FreezeWatch.diagnoses()`` answers with it.

Example:
    >>> str(Diagnosis("idle", "w", "w got no gradient"))
    '[idle] w got no gradient'
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from lowprec_demo.formats import format_of_dtype, get_format
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.rounding.core import decay_rounds_back
from lowprec_demo.monitor.forecast import update_ratios

__all__ = ["Diagnosis", "DIAGNOSIS_KINDS", "LOCKED", "diagnose", "group_lines"]

DIAGNOSIS_KINDS = ("cannot_move", "weight_decay", "state_decay", "counter", "idle", "frozen")
LOCKED = 0.99            # "cannot move" / "frozen": at least this fraction of a tensor held still


@dataclass
class Diagnosis:
    """One finding of the watch: ``kind`` (one of :data:`DIAGNOSIS_KINDS`), ``tensor`` (a name,
    or None for the whole model), a plain-words ``message`` with its remedy, and the ``numbers``
    behind it."""

    kind: str
    tensor: Optional[str]
    message: str
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


def diagnose(watch) -> List[Diagnosis]:
    """What cannot move in a watched run, and why, each with its numbers and the remedy the
    book measures: the held tensors per format first, then weight decay, optimizer state,
    counters and idle tensors. Nothing before the first watched step.
    Example: ``diagnose(watch)`` -> ``[Diagnosis("frozen", "fc.bias", ...), ...]``."""
    out: List[Diagnosis] = []
    if not watch.steps:
        return out
    k = min(watch.patience, len(watch.steps))
    for f in watch.formats:
        rec = watch.records[f]
        for n in watch.tracked:
            held, with_grad = rec.by_tensor[n], [1 - x for x in watch.idle[n]]
            if len(watch.steps) < watch.patience or min(held[-k:]) < LOCKED or max(with_grad[-k:]) <= 0.01:
                continue
            always = min(held) >= LOCKED          # held since the first watched step
            span = len(held) if always else k
            if watch.mode == "predict" and always:
                top = update_ratios(watch, f, q=LOCKED)[n]        # the largest steps per unit of lr, in gaps
                lr = max(lrs[watch.param_group_of(n)] for lrs in watch.lrs)
                out.append(Diagnosis("cannot_move", n, (
                    f"{n} ({watch.sizes[n]:,} elements) cannot move in {f}: on every one of the {span} watched steps "
                    f"at least {min(held):.1%} of its updates were below half the gap of its stored values, while its "
                    f"gradient is not zero. Its steps are at most about {top:.3g} gaps per unit of learning rate "
                    f"(99th percentile), so it moves only above a learning rate of {0.5 / top if top else math.inf:.2e}; "
                    f"the largest so far is {lr:.2e}. Remedy: keep it in float32 (master weights), or use stochastic "
                    f"rounding."),
                    {"format": f, "frozen": min(held), "steps": span, "ratio_p99": top, "max_lr": lr,
                     "moves_above_lr": 0.5 / top if top else math.inf, "with_gradient": min(with_grad)}))
                continue
            if always:      # observed: held on every watched step
                out.append(Diagnosis("cannot_move", n, (
                    f"{n} ({watch.sizes[n]:,} elements) cannot move in {f}: on every one of the {span} watched steps "
                    f"at least {min(held):.1%} of it was unchanged by the step, while at least {min(with_grad):.0%} "
                    f"of its elements had a nonzero gradient: its updates are below half the gap of its stored "
                    f"values. Remedy: keep it in float32 (master weights), or use stochastic rounding."),
                    {"format": f, "frozen": min(held), "steps": span, "since_start": True,
                     "with_gradient": min(with_grad)}))
                continue
            verb = "would have been" if watch.mode == "predict" else "has been"
            out.append(Diagnosis("frozen", n, (
                f"{n} ({watch.sizes[n]:,} elements) {verb} frozen in {f} for the last {span} watched steps: at least "
                f"{min(held[-k:]):.1%} of it unchanged by every step, while at least {min(with_grad[-k:]):.0%} of its "
                f"elements had a nonzero gradient at each of them. Remedy: float32 master weights, or stochastic rounding."),
                {"format": f, "frozen": min(held[-k:]), "steps": span, "since_start": always,
                 "with_gradient": min(with_grad[-k:])}))
    out += _weight_decay(watch) + _state_decay(watch) + _counters(watch) + _idle(watch)
    return out


def _weight_decay(watch) -> List[Diagnosis]:
    """Decoupled weight decay (AdamW, or ``decoupled_weight_decay``) that rounds away: per param
    group and stored format, ``lr * wd`` at the largest learning rate so far below ``2^-(m+1)``."""
    out = []
    optimizer = watch.optimizer
    for gi, group in enumerate(optimizer.param_groups):
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        stepper = optimizer.optimizer if isinstance(optimizer, LowPrecisionOptimizer) else optimizer
        decoupled = isinstance(stepper, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        if wd <= 0 or not decoupled:
            continue
        lr = max(lrs[gi] for lrs in watch.lrs)
        names = [n for n in watch.tracked if watch.param_group_of(n) == gi]
        for fmt in watch.stored_formats():
            m = fmt.man_bits
            upper, lower = 2.0 ** -(m + 1), 2.0 ** -(m + 2)
            if lr * wd >= upper or not names:
                continue
            where = "on no weight" if lr * wd < lower else "only on weights in the upper part of their binade"
            out.append(Diagnosis("weight_decay", None, (
                f"weight decay cannot act in {fmt.name} ({where}): lr * weight_decay = {lr * wd:.2e} at the largest "
                f"learning rate so far, below half the relative gap 2^-{m + 1} = {upper:.2e} (2^-{m + 2} = "
                f"{lower:.2e} at a power of two, where the gap below is half as wide), so w (1 - lr wd) rounds back to w; it works only "
                f"through the gradient step it is added to. Remedy: float32 master weights, or stochastic "
                f"rounding. Param group {gi}, {len(names)} tensors."),
                {"format": fmt.name, "group": gi, "lr": lr, "weight_decay": wd, "product": lr * wd,
                 "half_relative_gap": upper, "at_power_of_two": lower}))
    return out


def _state_decay(watch) -> List[Diagnosis]:
    """Optimizer moving averages (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``) stored in a
    format where ``beta * v`` rounds back to ``v`` (:func:`~lowprec_demo.rounding.decay_rounds_back`),
    once per state and format."""
    out, seen = [], set()
    optimizer = watch.optimizer
    for n in watch.tracked:
        group = optimizer.param_groups[watch.param_group_of(n)]
        betas = group.get("betas", (None, None))
        rates = {"exp_avg": betas[0], "exp_avg_sq": betas[1], "momentum_buffer": group.get("momentum")}
        for key, value in watch.optimizer_state(n).items():
            beta = rates.get(key)
            if not torch.is_tensor(value) or value.dim() == 0 or not beta:
                continue
            name = format_of_dtype(value.dtype)
            if isinstance(optimizer, LowPrecisionOptimizer) and optimizer.state_format is not None:
                name = optimizer.state_format.name
            if name is None:
                continue
            m = get_format(name).man_bits
            if decay_rounds_back(beta, name) and (key, name) not in seen:
                seen.add((key, name))
                tensors = [t for t in watch.tracked if key in watch.optimizer_state(t)]
                lower = 2.0 ** -(m + 2)
                where = ("on every value" if 1 - beta < lower else
                         "on the values just above a power of two, whose relative half gap is smallest")
                out.append(Diagnosis("state_decay", None, (
                    f"the optimizer state {key!r} is stored in {name}, and its moving average cannot decay "
                    f"({where}): 1 - beta = {1 - beta:.3g} is below half the relative gap, which lies between "
                    f"2^-{m + 2} = {lower:.2e} and 2^-{m + 1} = {2.0 ** -(m + 1):.2e}, so beta * v rounds back to v "
                    f"once the new input is small. Remedy: keep the optimizer state in float32, use stochastic "
                    f"rounding for it, or a smaller beta. {len(tensors)} tensors."),
                    {"state": key, "format": name, "beta": beta, "one_minus_beta": 1 - beta,
                     "half_relative_gap": 2.0 ** -(m + 1), "tensors": len(tensors)}))
    return out


def _counters(watch) -> List[Diagnosis]:
    """Float step counters in the optimizer state that stood still, or that the run's length
    takes past ``2^(m+1)``, where ``v + 1`` rounds back to ``v``; once per state and format."""
    out, seen = [], set()
    for (n, key), (value, stuck) in watch.counters().items():
        state = watch.optimizer_state(n).get(key)
        if state is None:
            continue
        name = format_of_dtype(state.dtype) or {torch.float32: "fp32", torch.float64: "fp64"}.get(state.dtype)
        if name is None or (key, name) in seen:
            continue
        stop = 2.0 ** (get_format(name).man_bits + 1)     # v + 1 rounds back to v from here on
        reaches = watch.total_steps is not None and watch.total_steps > stop
        if stuck or reaches:
            seen.add((key, name))
            out.append(Diagnosis("counter", n, (
                f"the counter {key!r} of the optimizer state is stored in {name}, where counting by one stops at "
                f"{stop:,.0f} (v + 1 rounds back to v); " + (
                    f"it stood still on {stuck} steps already. " if stuck else
                    f"this run has {watch.total_steps:,} steps. ") +
                "Adam's bias correction then uses a wrong step. Remedy: keep counters as integers or in float32."),
                {"state": key, "format": name, "stops_at": stop, "stuck_steps": stuck, "value": value}))
    return out


def _idle(watch) -> List[Diagnosis]:
    """Tensors with no gradient on any watched step, and the rows of an embedding that never had
    one: idle, not frozen."""
    out = []
    rows_seen = watch.rows_with_gradient()
    for n in watch.tracked:
        if watch.idle[n] and min(watch.idle[n]) >= 1.0:
            out.append(Diagnosis("idle", n, (
                f"{n} ({watch.sizes[n]:,} elements) got no gradient on any of the {len(watch.steps)} watched steps: it "
                f"is idle, not frozen (is it used in the forward pass, or detached?)."),
                {"watched_steps": len(watch.steps), "elements": watch.sizes[n]}))
        elif n in rows_seen:
            rows = rows_seen[n]
            never = int((~rows).sum())
            if never:
                out.append(Diagnosis("idle", n, (
                    f"{never} of the {rows.numel()} rows of {n} got no gradient on any watched step: no input "
                    f"selected them where a loss was computed (a token that never occurs, or a position from which "
                    f"no label is predicted, such as a position embedding's last); they are idle, not frozen."),
                    {"rows": rows.numel(), "idle_rows": never, "watched_steps": len(watch.steps)}))
    return out


GROUPED = ("cannot_move", "frozen", "idle")     # the per-tensor kinds that group_lines gathers
NAMES_SHOWN = 4                                 # tensor names written out in a group's line


def group_lines(diagnoses) -> List[str]:
    """The diagnoses as a reader takes them in: one line per diagnosis that stands alone, and one
    line for the tensors that share one (the same kind, format and watched steps, e.g. the 28
    tensors frozen in bf16 for the last 10 steps), naming the first :data:`NAMES_SHOWN` tensors
    and the range of the numbers; the per-tensor messages stay in ``watch.diagnoses()`` and the
    summary's table. Takes :class:`Diagnosis` objects or their dicts (a saved report's).
    Example: ``group_lines([Diagnosis("idle", "w", "w got no gradient")])`` -> ``['[idle] w got no gradient']``."""
    items = [d if isinstance(d, dict) else {"kind": d.kind, "tensor": d.tensor, "message": d.message,
                                             "numbers": d.numbers} for d in diagnoses]
    groups, order = {}, []
    for d in items:
        nums = d.get("numbers") or {}
        if d["kind"] in GROUPED and d.get("tensor") is not None:
            # an idle tensor (no gradient at all) and idle rows of an embedding are different findings
            key = (d["kind"], nums.get("format"), nums.get("steps", nums.get("watched_steps")), "idle_rows" in nums)
        else:
            key = ("single", id(d))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(d)
    lines = []
    for key in order:
        members = groups[key]
        if len(members) == 1:
            d = members[0]
            lines.append(f"[{d['kind']}] {d['message']}")
            continue
        lines.append(_group_line(key, members))
    return lines


def _group_line(key, members: List[dict]) -> str:
    kind, fmt, steps, rows = key
    names = [d["tensor"] for d in members]
    shown = ", ".join(names[:NAMES_SHOWN]) + (f", ... and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN
                                               else "")
    nums = [d["numbers"] for d in members]

    def lowest(key):
        values = [x[key] for x in nums if isinstance(x.get(key), (int, float))]
        return min(values) if values else math.nan

    head = f"[{kind}] {len(members)} tensors: {shown}"
    if kind == "cannot_move":
        return (f"{head}. They cannot move in {fmt}: on every one of the {steps} watched steps at least "
                f"{lowest('frozen'):.1%} of each was held (updates below half the gap of its stored values), while "
                f"their gradients are not zero. Remedy: keep them in float32 (master weights), or use stochastic "
                f"rounding.")
    if kind == "frozen":
        return (f"{head}. Each held in {fmt} for the last {steps} watched steps (at least {lowest('frozen'):.1%} "
                f"unchanged by every step, updates below half a gap), while at least {lowest('with_gradient'):.0%} of "
                f"its elements had a nonzero gradient. Remedy: float32 master weights, or stochastic rounding.")
    if rows:
        idle = sum(x.get("idle_rows", 0) for x in nums)
        return (f"{head}. {idle:,} of their rows got no gradient on any of the {steps} watched steps: no input selected "
                f"them where a loss was computed (a token that never occurs, or a position from which no label is "
                f"predicted); they are idle, not frozen.")
    return (f"{head}. None got a gradient on any of the {steps} watched steps: they are idle, not frozen (are they "
            f"used in the forward pass, or detached?).")
