"""A freeze plan: a remedy only for the tensors that need one (:class:`FreezePlan`: per tensor one of
:data:`PLAN_REMEDIES` and why, with the budget of extra bytes), applied by ``LowPrecisionOptimizer(optimizer, fmt,
plan=plan)`` or :func:`~lowprec_demo.monitor.integrations.attach_plan`, saved and read back (:func:`load_plan`). The
freeze watch makes one from what it saw (``watch.plan(fmt)``, :func:`lowprec_demo.monitor.planning.make_plan`).

Example:
    >>> p = FreezePlan("bf16", {"w": "master", "b": "nearest"}, sizes={"w": 10, "b": 30})
    >>> p.bytes_per_parameter()["extra"]      # 10 of 40 elements with 4 bytes more
    1.0
    >>> p.remedy("b")
    'nearest'
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from lowprec_demo.formats import get_format
from lowprec_demo.common.output import atomic_write_json

__all__ = ["FreezePlan", "PLAN_REMEDIES", "CLASSIC_REMEDIES", "load_plan", "kahan_buffer_format", "resolve_plan"]

PLAN_REMEDIES = ("nearest", "stochastic", "kahan", "master", "remainder", "feedback")
CLASSIC_REMEDIES = PLAN_REMEDIES[:4]     # a plan's default choice


def kahan_buffer_format(fmt) -> Optional[str]:
    """A plan's Kahan buffer format: the weights' own with 7 mantissa bits or more (bf16: 2 bytes, as
    torch-optimi keeps it), else None (float32: 3 mantissa bits keep too little of the residual)."""
    f = get_format(fmt)
    return f.name if f.man_bits >= 7 else None


@dataclass
class FreezePlan:
    """For the storage ``format``, per tensor (by parameter name, in the optimizer's order) the remedy (``remedies``),
    why (``reasons``), ``sizes``, ``shapes`` and ``positions`` among the optimizer's parameters (to find them without
    the model); ``kahan_format`` (None: float32); the extra bytes per parameter allowed (``budget``); ``needs``, in
    order of need, ``{"tensor", "remedy" (the one it should get), "why"}``; the watched ``step`` and ``total_steps``."""

    format: str
    remedies: Dict[str, str]
    reasons: Dict[str, str] = field(default_factory=dict)
    sizes: Dict[str, int] = field(default_factory=dict)
    shapes: Dict[str, List[int]] = field(default_factory=dict)
    positions: Dict[str, int] = field(default_factory=dict)
    kahan_format: Optional[str] = "auto"
    budget: Optional[float] = None
    step: Optional[int] = None
    total_steps: Optional[int] = None
    needs: List[dict] = field(default_factory=list)
    fallback: str = "stochastic"      # once the budget is spent

    def __post_init__(self) -> None:
        self.format = get_format(self.format).name            # a ValueError names the valid formats
        if not isinstance(self.remedies, dict) or not self.remedies:
            raise ValueError("a plan needs at least one tensor: remedies={name: remedy}")
        if bad := {n: r for n, r in self.remedies.items() if r not in PLAN_REMEDIES}:
            raise ValueError(f"a plan's remedies must be one of {', '.join(PLAN_REMEDIES)}; got {bad}")
        if self.kahan_format is not None:
            self.kahan_format = (kahan_buffer_format(self.format) if self.kahan_format == "auto"
                                 else get_format(self.kahan_format).name)
        if (missing := [n for n in self.remedies if n not in self.sizes]) and self.sizes:
            raise ValueError(f"sizes has no entry for {missing}")

    def allocate(self, order: Optional[List[str]] = None) -> "FreezePlan":
        """A plan with the budget given out along ``order`` (of the tensors of ``needs``; None: theirs;
        another makes a control): each takes its remedy while the bytes left allow (a master copy
        falls back to a Kahan buffer), stochastic rounding after that; the others keep theirs."""
        if self.budget is None:
            raise ValueError("allocate needs the plan's budget (a plan made by watch.plan)")
        by = {d["tensor"]: d for d in self.needs}
        order = list(by) if order is None else list(order)
        if sorted(order) != sorted(by):
            raise ValueError("order must list exactly the tensors of needs")
        out = FreezePlan(**asdict(self))
        left = float(self.budget) * sum(self.sizes.values())
        for n in order:
            preferred, size = by[n]["remedy"], self.sizes[n]
            options = [preferred] + (["kahan"] if preferred == "master" else [])
            chosen = next((r for r in options if self.extra_bytes(r) * size <= left + 1e-9), self.fallback)
            left -= self.extra_bytes(chosen) * size
            out.remedies[n] = chosen
            out.reasons[n] = by[n]["why"] + ("" if chosen == preferred else f"; {chosen}" + (
                " (the budget is spent)" if chosen == self.fallback else " (a master copy would exceed the budget)"))
        return out

    def remedy(self, name: str) -> str:
        """The remedy of tensor ``name``; a KeyError names the plan's tensors."""
        if name not in self.remedies:
            raise KeyError(f"the plan has no tensor {name!r}; it has {', '.join(self.remedies)}")
        return self.remedies[name]

    def tensors(self, remedy: str) -> List[str]:
        """The tensors given ``remedy``."""
        if remedy not in PLAN_REMEDIES:
            raise ValueError(f"remedy must be one of {', '.join(PLAN_REMEDIES)}; got {remedy!r}")
        return [n for n, r in self.remedies.items() if r == remedy]

    def extra_bytes(self, remedy: str) -> float:
        """What ``remedy`` stores per element beyond the weight itself."""
        if remedy == "kahan":
            return get_format(self.kahan_format).bits / 8 if self.kahan_format else 4.0
        return {"master": 4.0, "remainder": 2.0}.get(remedy, 0.0)     # a float32 master copy, its low 16 bits

    def bytes_per_parameter(self) -> dict:
        """Per element of the plan's tensors: ``weights``, ``master``, ``compensation``, ``extra`` (their
        sum: beyond round to nearest everywhere), ``total`` (the optimizer's state left out)."""
        sizes = self.sizes or {n: 1 for n in self.remedies}
        count = sum(sizes.values())
        out = {"weights": get_format(self.format).bits / 8, "master": 0.0, "compensation": 0.0}
        for n, r in self.remedies.items():
            if r in ("master", "remainder", "kahan"):
                out["compensation" if r == "kahan" else "master"] += sizes[n] * self.extra_bytes(r) / count
        out["extra"] = out["master"] + out["compensation"]
        out["total"] = out["weights"] + out["extra"]
        return out

    def counts(self) -> Dict[str, tuple]:
        """Per remedy: (tensors, elements)."""
        sizes = self.sizes or {n: 1 for n in self.remedies}
        return {r: (len(self.tensors(r)), sum(sizes[n] for n in self.tensors(r))) for r in PLAN_REMEDIES}

    def summary(self, show: bool = True) -> str:
        """A table (tensor, size, remedy, reason) and the bytes, printed unless ``show=False``."""
        b = self.bytes_per_parameter()
        made = f" at step {self.step} of {self.total_steps}" if self.step is not None else ""
        lines = [f"freeze plan for {self.format}{made}: {b['extra']:.3g} bytes per parameter above round to nearest"
                 + (f" (budget {self.budget:g})" if self.budget is not None else ""),
                 "  " + ", ".join(f"{r}: {t} tensors, {e:,} elements" for r, (t, e) in self.counts().items() if t),
                 "| tensor | elements | remedy | why |", "|---|---|---|---|"]
        lines += [f"| {n} | {self.sizes.get(n, 0):,} | {r} | {self.reasons.get(n, '')} |"
                  for n, r in self.remedies.items()]
        text = "\n".join(lines)
        if show:
            print(text)
        return text

    def to_dict(self) -> dict:
        return {"kind": "lowprec_demo.freeze_plan", **asdict(self),
                "shapes": {n: list(s) for n, s in self.shapes.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "FreezePlan":
        if not isinstance(d, dict) or d.get("kind") != "lowprec_demo.freeze_plan":
            raise ValueError("not a freeze plan (a dict written by FreezePlan.to_dict, kind 'lowprec_demo.freeze_plan')")
        return cls(d["format"], d["remedies"], d.get("reasons", {}), needs=[dict(x) for x in d.get("needs", [])],
                   **{k: {n: f(v) for n, v in d.get(k, {}).items()} for k, f in (("sizes", int), ("shapes", list),
                                                                                ("positions", int))},
                   **{k: d.get(k) for k in ("kahan_format", "budget", "step", "total_steps")},
                   fallback=d.get("fallback", "stochastic"))

    def save(self, path) -> Path:
        """Write the plan as JSON, atomically."""
        return atomic_write_json(path, self.to_dict())


def load_plan(path) -> FreezePlan:
    """A plan written by :meth:`FreezePlan.save`."""
    return FreezePlan.from_dict(json.loads(Path(path).read_text()))


def resolve_plan(plan: FreezePlan, optimizer_params: list, model=None) -> Dict[int, str]:
    """``{id(param): remedy}`` of the plan's tensors: by name in ``model``, else by recorded position
    among the optimizer's non-empty parameters; each checked against its recorded shape."""
    out = {}
    if model is not None:
        named = dict(model.named_parameters())
        in_opt = {id(p) for p in optimizer_params}
        for n, r in plan.remedies.items():
            if n not in named:
                raise ValueError(f"the plan names {n!r}, which is not a parameter of the model; the model has "
                                 f"{', '.join(list(named)[:8])}{', ...' if len(named) > 8 else ''}")
            if id(named[n]) not in in_opt:
                raise ValueError(f"the plan names {n!r}, which the optimizer does not train")
            if n in plan.shapes and list(named[n].shape) != list(plan.shapes[n]):
                raise ValueError(f"the plan was made for {n!r} of shape {plan.shapes[n]}; the model's is "
                                 f"{list(named[n].shape)}")
            out[id(named[n])] = r
        return out
    order = [p for p in optimizer_params if p.numel() > 0]
    for n, r in plan.remedies.items():
        i = plan.positions.get(n)
        if i is None:
            raise ValueError(f"the plan does not record where {n!r} sits among the optimizer's parameters: pass "
                             f"model= so that it is found by name")
        if i >= len(order) or (n in plan.shapes and list(order[i].shape) != list(plan.shapes[n])):
            got = list(order[i].shape) if i < len(order) else "none"
            raise ValueError(f"the plan's {n!r} (parameter {i}, shape {plan.shapes.get(n)}) does not match this "
                             f"optimizer's parameter {i} (shape {got}): pass model= so that tensors are found by name")
        out[id(order[i])] = r
    return out
