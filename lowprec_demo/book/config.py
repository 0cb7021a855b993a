"""What defines a training run (:class:`TrainConfig`) and the learning-rate schedules (:func:`lr_factor`).

Example:
    >>> cfg = TrainConfig(steps=100, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    >>> lr_factor(79, cfg), lr_factor(99, cfg)
    (1.0, 0.0)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from lowprec_demo.formats import get_format

__all__ = ["TrainConfig", "lr_factor", "VARIANTS", "OPTIMIZERS", "SCHEDULES", "PARALLEL"]

VARIANTS = ("reference", "nearest", "stochastic", "kahan", "kahan_lp", "master", "nearest_state", "stochastic_state",
            "plan")
OPTIMIZERS = ("sgd", "adamw", "adam")
SCHEDULES = ("constant", "cosine", "wsd", "step")
PARALLEL = ("ddp", "fsdp")     # under torchrun: replicas (DDP) or shards (FSDP2's fully_shard)


@dataclass
class TrainConfig:
    """Everything that defines a training run, shared by its variants. ``lowprec_params``: ``"all"`` or ``"matrices"``;
    ``predict_formats``: formats predicted besides ``format``; ``threshold``: the frozen fraction of the freeze step;
    ``options``: the experiment's own; ``sr_seed``: stochastic rounding's seed (None: ``seed + 1``); ``parallel``:
    ``"ddp"`` or ``"fsdp"`` under torchrun. The ``"plan"`` variant follows a :class:`~lowprec_demo.optim.FreezePlan`
    made after ``plan_after`` of the run within ``plan_budget`` extra bytes per parameter."""

    format: str = "bf16"
    steps: int = 200
    lr: float = 0.1
    seed: int = 0
    optimizer: str = "sgd"
    momentum: float = 0.0
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    step_milestones: tuple = (0.5, 0.75)
    step_gamma: float = 0.1
    threshold: float = 0.5
    lowprec_params: str = "all"
    rand_bits: Optional[int] = None
    sr_seed: Optional[int] = None
    predict_formats: tuple = ()
    variants: tuple = ("reference", "nearest", "stochastic")
    eval_every: int = 0
    reference_dtype: str = "float32"
    device: str = "auto"
    parallel: str = "ddp"
    plan_after: float = 0.25
    plan_budget: float = 1.0
    options: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        get_format(self.format)
        for f in self.predict_formats:
            get_format(f)
        checks = (("optimizer", self.optimizer, OPTIMIZERS), ("schedule", self.schedule, SCHEDULES),
                  ("reference_dtype", self.reference_dtype, ("float32", "float64")),
                  ("lowprec_params", self.lowprec_params, ("all", "matrices")), ("parallel", self.parallel, PARALLEL))
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or "reference" not in self.variants:
            raise ValueError(f"variants must include 'reference' and be drawn from {', '.join(VARIANTS)}; "
                             f"got {list(self.variants)}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be a positive integer, got {self.steps!r}")
        if not (isinstance(self.lr, (int, float)) and self.lr > 0):
            raise ValueError(f"lr must be a positive number, got {self.lr!r}")
        if not 0 < self.threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {self.threshold}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction!r}")
        if not 0 < self.step_gamma <= 1:
            raise ValueError(f"step_gamma must be in (0, 1], got {self.step_gamma!r}")
        if any(not 0 < m < 1 for m in self.step_milestones):
            raise ValueError(f"step_milestones are fractions of the run in (0, 1), got {list(self.step_milestones)}")
        if not (isinstance(self.plan_after, (int, float)) and 0 < self.plan_after < 1):
            raise ValueError(f"plan_after is the fraction of the run watched before the plan is made, in (0, 1); "
                             f"got {self.plan_after!r}")
        if isinstance(self.plan_budget, bool) or not isinstance(self.plan_budget, (int, float)) or self.plan_budget < 0:
            raise ValueError(f"plan_budget is extra bytes per parameter, >= 0; got {self.plan_budget!r}")
        if "plan" in self.variants and self.lowprec_params != "all":
            raise ValueError("the plan variant plans every parameter: use it with lowprec_params='all'")
        if self.sr_seed is not None and (isinstance(self.sr_seed, bool) or not isinstance(self.sr_seed, int)
                                         or self.sr_seed < 0):
            raise ValueError(f"sr_seed must be None or a non-negative integer, got {self.sr_seed!r}")

    @property
    def formats(self) -> List[str]:
        """The main format first, then the other predicted formats (no duplicates)."""
        names = [get_format(self.format).name]
        for f in self.predict_formats:
            name = get_format(f).name
            if name not in names:
                names.append(name)
        return names

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for key in ("betas", "predict_formats", "step_milestones", "variants"):
            d[key] = list(d[key])
        return d


def lr_factor(step: int, config: TrainConfig) -> float:
    """The learning-rate multiplier at ``step``: a linear warmup over ``warmup_steps``, then 1
    (``constant``), a cosine to ``min_lr_ratio`` (``cosine``), a linear cooldown over the last
    ``decay_fraction`` (``wsd``), or ``step_gamma`` more from each of ``step_milestones`` (``step``).

    Example:
        >>> cfg = TrainConfig(steps=100, schedule="step", step_milestones=(0.5,), step_gamma=0.1)
        >>> lr_factor(49, cfg), lr_factor(50, cfg)
        (1.0, 0.1)
    """
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.schedule == "constant":
        return 1.0
    if config.schedule == "step":
        return config.step_gamma ** sum(step >= round(f * config.steps) for f in config.step_milestones)
    last = config.steps - 1
    if config.schedule == "wsd":
        start = max(config.warmup_steps, last - max(1, round(config.decay_fraction * config.steps)))
        if step <= start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, last - start))
        return 1.0 - (1.0 - config.min_lr_ratio) * progress
    return warmup_cosine(step, config.warmup_steps, last, config.min_lr_ratio)


def warmup_cosine(step: int, warmup: int, end: int, floor: float = 0.0) -> float:
    """The book's one warmup-cosine factor: ``(step + 1) / warmup`` over the first ``warmup`` steps, then a cosine from
    1 down to ``floor``, reached at step ``end``. :func:`lr_factor` ends it at a run's last step; the fine-tune
    (:mod:`lowprec_demo.book.finetune`) one step after its last, as Hugging Face's cosine schedule does.

    Example:
        >>> warmup_cosine(0, 2, 10), warmup_cosine(6, 2, 10), warmup_cosine(10, 2, 10, floor=0.1)
        (0.5, 0.5, 0.1)
    """
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, end - warmup))
    return floor + (1.0 - floor) * (0.5 * (1.0 + math.cos(math.pi * progress)))
