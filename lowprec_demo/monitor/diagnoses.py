"""The freeze watch's diagnoses: what cannot move, and why, with the numbers and the remedy.
Kinds (:data:`DIAGNOSIS_KINDS`): ``cannot_move`` / ``frozen``, a tensor with a gradient held still (at least
:data:`LOCKED` of it) on each of the last ``patience`` watched steps, since the first or not; ``weight_decay``,
decoupled weight decay with ``lr * wd`` below half the relative gap ``2^-(m+1)``, so that ``w (1 - lr wd)`` rounds
back to ``w``; ``state_decay``, a moving average whose ``beta * v`` rounds back to ``v``; ``counter``, a float step
counter that stopped counting or will within the run; ``idle``, a tensor or an embedding's rows never with a gradient.

Example:
    >>> str(Diagnosis("idle", "w", "w got no gradient"))
    '[idle] w got no gradient'
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

import torch

from lowprec_demo.formats import format_of_dtype, get_format
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.rounding import decay_rounds_back
from lowprec_demo.monitor.forecast import update_ratios

__all__ = ["Diagnosis", "DIAGNOSIS_KINDS", "LOCKED", "diagnose", "group_lines", "state_counters"]

DIAGNOSIS_KINDS = ("cannot_move", "weight_decay", "state_decay", "counter", "idle", "frozen")
LOCKED = 0.99            # "cannot move" / "frozen": at least this fraction of a tensor held still


@dataclass
class Diagnosis:
    """One finding: ``kind``, ``tensor`` (None: whole model), ``message`` with the remedy, ``numbers`` behind it."""

    kind: str
    tensor: Optional[str]
    message: str
    numbers: dict = field(default_factory=dict)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


def diagnose(watch) -> List[Diagnosis]:
    """The diagnoses of a :class:`~lowprec_demo.monitor.freeze_watch.FreezeWatch`: held tensors
    per format, then weight decay, optimizer state, counters and idle tensors."""
    if not watch.steps:
        return []
    out: List[Diagnosis] = []
    k = watch.patience         # the held tensors: once as many steps as that were watched
    for f in watch.formats if len(watch.steps) >= k else ():
        for n in watch.tracked:
            held, with_grad = watch.records[f].by_tensor[n], [1 - x for x in watch.idle[n]]
            if min(held[-k:]) < LOCKED or max(with_grad[-k:]) <= 0.01:
                continue
            always = min(held) >= LOCKED          # held since the first watched step
            span = len(held) if always else k
            head = f"{n} ({watch.sizes[n]:,} elements)"
            remedy = "Remedy: keep it in float32 (master weights), or use stochastic rounding."
            if watch.mode == "predict" and always:
                top = update_ratios(watch, f, q=LOCKED)[n]        # the largest steps per unit of lr, in gaps
                lr = max(lrs[watch.group_of[n]] for lrs in watch.lrs)
                above = 0.5 / top if top else math.inf
                out.append(Diagnosis("cannot_move", n, (
                    f"{head} cannot move in {f}: on every one of the {span} watched steps at least {min(held):.1%} of "
                    f"its updates were below half the gap of its stored values, while its gradient is not zero. Its "
                    f"steps are at most about {top:.3g} gaps per unit of learning rate (99th percentile), so it moves "
                    f"only above a learning rate of {above:.2e}; the largest so far is {lr:.2e}. {remedy}"),
                    {"format": f, "frozen": min(held), "steps": span, "ratio_p99": top, "max_lr": lr,
                     "moves_above_lr": above, "with_gradient": min(with_grad)}))
            elif always:      # observed: held on every watched step
                out.append(Diagnosis("cannot_move", n, (
                    f"{head} cannot move in {f}: on every one of the {span} watched steps at least {min(held):.1%} of "
                    f"it was unchanged by the step, while at least {min(with_grad):.0%} of its elements had a nonzero "
                    f"gradient: its updates are below half the gap of its stored values. {remedy}"),
                    {"format": f, "frozen": min(held), "steps": span, "since_start": True,
                     "with_gradient": min(with_grad)}))
            else:
                verb = "would have been" if watch.mode == "predict" else "has been"
                out.append(Diagnosis("frozen", n, (
                    f"{head} {verb} frozen in {f} for the last {span} watched steps: at least {min(held[-k:]):.1%} of "
                    f"it unchanged by every step, while at least {min(with_grad[-k:]):.0%} of its elements had a "
                    f"nonzero gradient at each of them. Remedy: float32 master weights, or stochastic rounding."),
                    {"format": f, "frozen": min(held[-k:]), "steps": span, "since_start": always,
                     "with_gradient": min(with_grad[-k:])}))
    out += _weight_decay(watch) + _state_decay(watch) + _counters(watch) + _idle(watch)
    return out


def _weight_decay(watch) -> List[Diagnosis]:
    """Per param group and format, decoupled weight decay whose largest ``lr * wd`` rounds away."""
    out, optimizer = [], watch.optimizer
    for gi, group in enumerate(optimizer.param_groups):
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        stepper = optimizer.optimizer if isinstance(optimizer, LowPrecisionOptimizer) else optimizer
        decoupled = isinstance(stepper, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay", False))
        if wd <= 0 or not decoupled:
            continue
        lr = max(lrs[gi] for lrs in watch.lrs)
        names = [n for n in watch.tracked if watch.group_of[n] == gi]
        for fmt in watch.stored_formats:
            m = fmt.man_bits
            upper, lower = 2.0 ** -(m + 1), 2.0 ** -(m + 2)
            if lr * wd >= upper or not names:
                continue
            where = "on no weight" if lr * wd < lower else "only on weights in the upper part of their binade"
            out.append(Diagnosis("weight_decay", None, (
                f"weight decay cannot act in {fmt.name} ({where}): lr * weight_decay = {lr * wd:.2e} at the largest "
                f"learning rate so far, below half the relative gap 2^-{m + 1} = {upper:.2e} (2^-{m + 2} = {lower:.2e} "
                f"at a power of two, where the gap below is half as wide), so w (1 - lr wd) rounds back to w; it works "
                f"only through the gradient step it is added to. Remedy: float32 master weights, or stochastic "
                f"rounding. Param group {gi}, {len(names)} tensors."),
                {"format": fmt.name, "group": gi, "lr": lr, "weight_decay": wd, "product": lr * wd,
                 "half_relative_gap": upper, "at_power_of_two": lower}))
    return out


def _state(watch, name: str) -> dict:
    """The optimizer's state of a tensor (``{}`` before its first step)."""
    return watch.optimizer.state.get(watch.params[name], {})


def state_counters(optimizer, params: Dict[str, torch.Tensor]) -> Dict[tuple, float]:
    """The optimizer's 0-dimensional float state (Adam's ``step``), ``{(tensor, key): value}``: what ``counter``
    diagnoses follow."""
    found = [((n, key), value) for n, p in params.items() for key, value in optimizer.state.get(p, {}).items()
             if torch.is_tensor(value) and value.dim() == 0 and value.is_floating_point()]
    if not found:
        return {}
    try:      # (float types widen exactly)
        values = torch.stack([v for _, v in found]).tolist()
    except RuntimeError:     # on several devices
        values = [float(v) for _, v in found]
    return {key: v for (key, _), v in zip(found, values)}


def _state_decay(watch) -> List[Diagnosis]:
    """Moving averages whose ``beta * v`` rounds back to ``v``, once per state and format."""
    out, seen, optimizer = [], set(), watch.optimizer
    for n in watch.tracked:
        group = optimizer.param_groups[watch.group_of[n]]
        betas = group.get("betas", (None, None))
        rates = {"exp_avg": betas[0], "exp_avg_sq": betas[1], "momentum_buffer": group.get("momentum")}
        for key, value in _state(watch, n).items():
            beta = rates.get(key)
            if not torch.is_tensor(value) or value.dim() == 0 or not beta:
                continue
            on_grid = isinstance(optimizer, LowPrecisionOptimizer) and optimizer.state_format is not None
            name = optimizer.state_format.name if on_grid else format_of_dtype(value.dtype)
            if name is None or not decay_rounds_back(beta, name) or (key, name) in seen:
                continue
            seen.add((key, name))
            m = get_format(name).man_bits
            tensors = [t for t in watch.tracked if key in _state(watch, t)]
            lower = 2.0 ** -(m + 2)
            where = "on every value" if 1 - beta < lower else \
                "on the values just above a power of two, whose relative half gap is smallest"
            out.append(Diagnosis("state_decay", None, (
                f"the optimizer state {key!r} is stored in {name}, and its moving average cannot decay ({where}): "
                f"1 - beta = {1 - beta:.3g} is below half the relative gap, which lies between 2^-{m + 2} = "
                f"{lower:.2e} and 2^-{m + 1} = {2.0 ** -(m + 1):.2e}, so beta * v rounds back to v once the new input "
                f"is small. Remedy: keep the optimizer state in float32, use stochastic rounding for it, or a smaller "
                f"beta. {len(tensors)} tensors."),
                {"state": key, "format": name, "beta": beta, "one_minus_beta": 1 - beta,
                 "half_relative_gap": 2.0 ** -(m + 1), "tensors": len(tensors)}))
    return out


def _counters(watch) -> List[Diagnosis]:
    """Float step counters stuck, or taken past ``2^(m+1)`` by the run; once per state and format."""
    out, seen = [], set()
    for (n, key), (value, stuck) in watch.counters.items():
        state = _state(watch, n).get(key)
        name = None if state is None else format_of_dtype(state.dtype) or {
            torch.float32: "fp32", torch.float64: "fp64"}.get(state.dtype)
        if name is None or (key, name) in seen:
            continue
        stop = 2.0 ** (get_format(name).man_bits + 1)     # v + 1 rounds back to v from here on
        if stuck or watch.total_steps is not None and watch.total_steps > stop:
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
    """Tensors, and an embedding's rows, with no gradient on any watched step."""
    out = []
    rows_seen = watch.rows_seen
    for n in watch.tracked:
        if watch.idle[n] and min(watch.idle[n]) >= 1.0:
            out.append(Diagnosis("idle", n, (
                f"{n} ({watch.sizes[n]:,} elements) got no gradient on any of the {len(watch.steps)} watched steps: it "
                f"is idle, not frozen (is it used in the forward pass, or detached?)."),
                {"watched_steps": len(watch.steps), "elements": watch.sizes[n]}))
        elif n in rows_seen and int((~rows_seen[n]).sum()):
            rows, never = rows_seen[n], int((~rows_seen[n]).sum())
            out.append(Diagnosis("idle", n, (
                f"{never} of the {rows.numel()} rows of {n} got no gradient on any watched step: no input selected "
                f"them where a loss was computed (a token that never occurs, or a position from which no label is "
                f"predicted, such as a position embedding's last); they are idle, not frozen."),
                {"rows": rows.numel(), "idle_rows": never, "watched_steps": len(watch.steps)}))
    return out


GROUPED = ("cannot_move", "frozen", "idle")     # the per-tensor kinds that group_lines gathers
NAMES_SHOWN = 4                                 # tensor names written out in a group's line


def group_lines(diagnoses) -> List[str]:
    """One line per diagnosis that stands alone, and one for the tensors that share one (kind,
    format and watched steps), naming the first :data:`NAMES_SHOWN`; takes dicts (a report's) too.
    Example: ``group_lines([Diagnosis("idle", "w", "w got no gradient")])`` -> ``['[idle] w got no gradient']``."""
    groups = {}
    for d in diagnoses:
        d = d if isinstance(d, dict) else asdict(d)
        nums = d.get("numbers") or {}
        # an idle tensor (no gradient at all) and idle rows of an embedding are different findings
        key = (d["kind"], nums.get("format"), nums.get("steps", nums.get("watched_steps")), "idle_rows" in nums) \
            if d["kind"] in GROUPED and d.get("tensor") is not None else ("single", id(d))
        groups.setdefault(key, []).append(d)
    return [f"[{m[0]['kind']}] {m[0]['message']}" if len(m) == 1 else _group_line(key, m) for key, m in groups.items()]


def _group_line(key, members: List[dict]) -> str:
    kind, fmt, steps, rows = key
    names, nums = [d["tensor"] for d in members], [d["numbers"] for d in members]
    more = f", ... and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    head = f"[{kind}] {len(members)} tensors: {', '.join(names[:NAMES_SHOWN])}{more}"

    def lowest(key):
        return min([x[key] for x in nums if isinstance(x.get(key), (int, float))], default=math.nan)

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
