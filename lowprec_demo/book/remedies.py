"""The remedies for the freeze side by side, from one initialisation on the same batches:
:func:`compare_remedies` trains the reference and every variant of the loop, few-bit stochastic rounding ``sr{k}``
(which freezes again once ``|d|/gap < 2**-(k+1)``) and ``floor`` (round to nearest under a raised schedule floor);
:meth:`RemedyComparison.rows` sets each one's final loss and bytes per parameter beside what the reference predicted.

Example:
    >>> c = compare_remedies("quadratic", steps=40, fewbit=(4,), progress=False)
    >>> [r["remedy"] for r in c.rows()][:3]
    ['fp32', 'nearest', 'stochastic']
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from lowprec_demo.book.config import VARIANTS, lr_factor
from lowprec_demo.book.experiments import get_experiment, make_config
from lowprec_demo.book.results import TrainResult
from lowprec_demo.book.training import train_plan, train_variants
from lowprec_demo.freeze import freeze_step
from lowprec_demo.optim import FreezePlan
from lowprec_demo.rounding import decay_rounds_back

__all__ = ["compare_remedies", "RemedyComparison", "REMEDIES", "REMEDY_LABELS", "BENCH_VARIANT", "FINETUNE_ADVICE",
           "advice_table"]

REMEDIES = VARIANTS[1:]   # every variant of the training loop but the reference
REMEDY_LABELS = {
    "fp32": "fp32 (reference)", "nearest": "round to nearest", "stochastic": "stochastic rounding",
    "kahan": "Kahan, fp32 buffer", "kahan_lp": "Kahan, buffer in the format", "master": "fp32 master weights",
    "nearest_state": "nearest, Adam state in the format", "stochastic_state": "SR, Adam state in the format",
    "floor": "nearest, lr floor", "plan": "freeze plan",
}
# the benchmark variant whose step a remedy takes, where the names differ
BENCH_VARIANT = {"fp32": "plain", "floor": "nearest", "sr": "stochastic"}


def _metric(result: TrainResult) -> str:
    keys = [k for k in result.runs["reference"].final_eval if k != "step"]
    if not keys:
        raise ValueError(f"{result.experiment} has no evaluation: remedies are compared on it")
    return "val_loss" if "val_loss" in keys else ("test_loss" if "test_loss" in keys else keys[0])


@dataclass
class RemedyComparison:
    """Runs of :func:`compare_remedies`: ``main`` (reference and every remedy), ``fewbit`` (per k: a reference
    predicting k-bit SR and the SR run), ``floor`` (reference and nearest under the floor ``floor_ratio``)."""

    main: TrainResult
    fewbit: Dict[int, TrainResult] = field(default_factory=dict)
    floor: Optional[TrainResult] = None
    floor_ratio: Optional[float] = None

    @property
    def metric(self) -> str:
        """The evaluation compared (``val_loss``, ``test_loss`` ...)."""
        return _metric(self.main)

    @property
    def threshold(self) -> float:
        return self.main.config.threshold

    def plan(self) -> "FreezePlan":
        """The freeze plan the reference run's watch made for the ``plan`` variant."""
        if self.main.runs["reference"].plan is None:
            raise ValueError("this comparison has no plan variant: include 'plan' in remedies")
        return FreezePlan.from_dict(self.main.runs["reference"].plan)

    def plan_gap(self, plan: "FreezePlan") -> float:
        """Final loss minus the reference's of the variant trained with ``plan``, not the watch's (a control)."""
        config = self.main.config
        record = train_plan(get_experiment(self.main.experiment).build(config), config, plan)
        return float(record.final_eval[self.metric]) - self.reference_loss

    def final(self, result: TrainResult, variant: str) -> float:
        return float(result.runs[variant].final_eval[self.metric])

    @property
    def reference_loss(self) -> float:
        return self.final(self.main, "reference")

    def state_freezes(self) -> bool:
        """Whether Adam's second moment cannot decay on the format's grid under round to nearest
        (``beta2 * v`` rounds back to ``v``: ``1 - beta2`` below ``2**-(m+1)``)."""
        cfg = self.main.config
        return cfg.optimizer != "sgd" and decay_rounds_back(cfg.betas[1], cfg.format)

    def moved(self, k: Optional[int] = None) -> tuple:
        """(predicted, observed) share of elements stochastic rounding (exact, or with ``k`` random bits) moves at
        each step: the reference's ``move_fraction``, and the share of elements whose stored value changed."""
        r = self.main if k is None else self.fewbit[k]
        return list(r.prediction.move_fraction), [1 - f for f in r.runs["stochastic"].frozen.overall]

    def moved_error(self, k: Optional[int] = None) -> float:
        """The mean absolute difference of :meth:`moved`'s two curves over the run."""
        pred, obs = self.moved(k)
        return sum(abs(a - b) for a, b in zip(pred, obs)) / len(obs)

    def stop_steps(self, k: Optional[int] = None) -> tuple:
        """(predicted, observed) step from which stochastic rounding (exact, or with ``k`` bits) moves at most
        ``1 - threshold`` of the elements: where it stops as round to nearest does (None: not within the run)."""
        pred, obs = self.moved(k)
        return (freeze_step([1 - m for m in pred], self.threshold), freeze_step([1 - m for m in obs], self.threshold))

    def rows(self, bench: Optional[dict] = None) -> List[dict]:
        """One dict per remedy: ``remedy``, ``label``, ``loss``, ``gap`` (minus the reference's),
        ``relative`` (over it), ``bytes`` (per parameter), ``time`` (the step-time ratio from
        ``bench``, a training entry of the benchmark's JSON for this model, when given),
        ``predicted`` and ``observed`` (what the reference said beforehand, what the run did)."""
        ref = self.reference_loss
        main = self.main
        rows = []

        def add(name, result, variant, predicted="", observed="", label=None):
            rec = result.runs[variant]
            key = "sr" if name.startswith("sr") and name[2:].isdigit() else name
            ratio = (bench or {}).get("ratio", {}).get(BENCH_VARIANT.get(key, key)) if bench else None
            loss = self.final(result, variant)
            rows.append({"remedy": name, "label": label or REMEDY_LABELS[name], "loss": loss, "gap": loss - ref,
                         "relative": (loss - ref) / abs(ref) if ref else math.nan,
                         "bytes": rec.bytes_per_param.get("total", math.nan),
                         "time": ratio, "predicted": predicted, "observed": observed})

        frozen_end = main.prediction.overall[-1]
        add("fp32", main, "reference")
        p, o = main.predicted_freeze_step(), main.observed_freeze_step()
        add("nearest", main, "nearest", f"freeze at step {p}, {frozen_end:.0%} frozen at the end",
            f"freeze at step {o}, {main.runs['nearest'].frozen.overall[-1]:.0%} frozen at the end")
        for k in [None, *sorted(self.fewbit)]:
            pred, obs = self.moved(k)
            (ps, os_), mp, mo = self.stop_steps(k), sum(pred) / len(pred), sum(obs) / len(obs)
            add("stochastic" if k is None else f"sr{k}", main if k is None else self.fewbit[k], "stochastic",
                f"moves {mp:.1%} a step, stops at step {ps}", f"moved {mo:.1%}, stopped at step {os_}",
                label=None if k is None else f"SR with {k} random bits")
        for name in ("kahan", "kahan_lp", "master"):
            if name in main.runs:
                add(name, main, name, "no update lost", "")
        for name in ("nearest_state", "stochastic_state"):
            if name in main.runs:
                said = "second moment cannot decay" if self.state_freezes() else "second moment can decay"
                add(name, main, name, said if name == "nearest_state" else "unbiased: decays on average", "")
        if "plan" in main.runs:
            plan = self.plan()
            counts = ", ".join(f"{r} {e / sum(plan.sizes.values()):.0%}" for r, (t, e) in plan.counts().items() if t)
            add("plan", main, "plan", f"made at step {plan.step}: {counts} of the elements", "")
        if self.floor is not None:
            pf = max(self.floor.prediction.overall)
            of = max(self.floor.runs["nearest"].frozen.overall)
            add("floor", self.floor, "nearest", f"at most {pf:.0%} frozen", f"at most {of:.0%} frozen",
                label=f"nearest, lr floor {self.floor_ratio:.3g} x peak")
        return rows

    def table(self, bench: Optional[dict] = None) -> str:
        """:meth:`rows` as a Markdown table."""
        head = ["remedy", f"final {self.metric} - fp32", "relative", "bytes / parameter", "step time / fp32 step",
                "the fp32 run predicted", "observed"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows(bench):
            t = "-" if r["time"] is None else f"{r['time']:.2f}"
            lines.append(f"| {r['label']} | {r['gap']:+.4f} | {r['relative']:+.1%} | {r['bytes']:g} | {t} | "
                         f"{r['predicted']} | {r['observed']} |")
        return "\n".join(lines)


def floor_ratio(result: TrainResult, factor: float = 2.0) -> Optional[float]:
    """The schedule floor (a fraction of the peak) ``factor`` times the LR factor at the predicted freeze step, at most
    1; None if nothing freezes or the schedule has no floor (``min_lr_ratio`` of ``cosine`` and ``wsd``)."""
    step = result.predicted_freeze_step()
    if step is None or result.config.schedule not in ("cosine", "wsd"):
        return None
    return min(1.0, factor * lr_factor(step, result.config))


def compare_remedies(experiment: str, remedies: Sequence[str] = REMEDIES, fewbit: Sequence[int] = (2, 4, 6, 8),
                     floor_factor: Optional[float] = 2.0, progress: bool = True, **overrides) -> RemedyComparison:
    """Train ``experiment`` (``overrides`` as for :func:`~lowprec_demo.book.experiments.run_experiment`) with every
    remedy of ``remedies``, few-bit SR with each k of ``fewbit`` and, unless ``floor_factor`` is None, round to
    nearest under a raised floor (:func:`floor_ratio`), all from one initialisation on the same batches."""
    unknown = [r for r in remedies if r not in REMEDIES]
    if unknown:
        raise ValueError(f"remedies must be drawn from {', '.join(REMEDIES)}; got {unknown}")
    bad = [k for k in fewbit if not (isinstance(k, int) and 1 <= k <= 31)]
    if bad:
        raise ValueError(f"fewbit: random bits are integers from 1 to 31; got {bad}")
    exp = get_experiment(experiment)

    def run(**more) -> TrainResult:
        config = make_config(experiment, **{**overrides, **more})
        return train_variants(experiment, exp.build(config), config, progress=progress)

    main = run(variants=("reference", *remedies))
    comparison = RemedyComparison(main=main)
    for k in fewbit:
        comparison.fewbit[k] = run(variants=("reference", "stochastic"), rand_bits=k)
    if floor_factor is not None:
        ratio = floor_ratio(main, floor_factor)
        if ratio is not None:
            comparison.floor_ratio = ratio
            comparison.floor = run(variants=("reference", "nearest"), min_lr_ratio=ratio)
    return comparison


# The bf16 fine-tune's remedies, as chapter 9 and the README table them: (variant of
# :data:`lowprec_demo.book.finetune.VARIANTS`, label, from when it acts)
FINETUNE_ADVICE = (
    ("bf16", "none: plain bf16 (round to nearest)", ""),
    ("lp_stochastic", "stochastic rounding", "step 0"),
    ("lp_kahan", "Kahan summation, bf16 buffer", "step 0"),
    ("lp_remainder", "16-bit remainder (an exact fp32 master)", "step 0"),
    ("lp_master", "fp32 master weights", "step 0"),
    ("lp_preflight", "the preflight's plan (`plan_after=0`)", "step 0"),
    ("lp_plan", "the watch's plan, made mid-run (`plan_after=k`)", "a tenth in"),
)


def advice_table(values: Dict[str, dict]) -> str:
    """The fine-tune advice as a Markdown table, one row per variant of :data:`FINETUNE_ADVICE` that ``values``
    holds: ``{variant: {"closed": share of plain bf16's loss gap to fp32 closed, "bytes": bytes per parameter held,
    "time": step time over plain bf16's (or None)}}``."""
    lines = ["| remedy | from | gap closed | bytes per parameter | step time |", "| --- | --- | --- | --- | --- |"]
    for name, label, start in FINETUNE_ADVICE:
        if name in values:
            v = values[name]
            time = "" if v.get("time") is None else f"{v['time']:.2f}"
            lines.append(f"| {label} | {start} | {v['closed']:.0%} | {v['bytes']:.3g} | {time} |")
    return "\n".join(lines)
