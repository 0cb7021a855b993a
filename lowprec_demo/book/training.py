"""One training loop for every chapter: :func:`train_variants` trains the reference (a :class:`FreezePredictor`
predicting which elements would freeze) and the low-precision variants (:func:`variant_wrapper`, each with a
:class:`FreezeObserver`) of a :class:`Task` from one initialisation on the same batches, the reference and round to
nearest in lockstep so that their masks are compared element by element at every step. Under ``torchrun`` it trains
data-parallel (DDP, replicas kept bit-identical) or sharded (``parallel="fsdp"``, whole tensors compared).

Example:
    >>> from lowprec_demo.book.experiments import run_experiment
    >>> sorted(run_experiment("quadratic", fmt="bf16", steps=50, progress=False).runs)
    ['nearest', 'reference', 'stochastic']
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from lowprec_demo.book.config import VARIANTS, TrainConfig, lr_factor
from lowprec_demo.book.distributed import (DataParallel, Distributed, init_distributed, mean_over_ranks,
                                           replicas_identical, shard_model, whole_tensors)
from lowprec_demo.book.results import RunRecord, TrainResult, provenance
from lowprec_demo.book.runtime import pick_device, progress_bar
from lowprec_demo.formats import get_format
from lowprec_demo.freeze import FreezeObserver, FreezePredictor, mask_mismatch, stratified_chance_mismatch
from lowprec_demo.monitor import FreezeWatch
from lowprec_demo.optim import FreezePlan, LowPrecisionOptimizer, bytes_per_parameter, select_params

__all__ = ["Task", "train_steps", "train_variants", "train_formats", "train_plan", "plan_step", "Variants", "variant_wrapper",
           "fit_steps"]


def variant_wrapper(variant: str, fmt: str) -> dict:
    """The :class:`LowPrecisionOptimizer` keyword arguments of a low-precision variant in format ``fmt``.

    Example:
        >>> variant_wrapper("kahan_lp", "bf16")
        {'compensation': 'kahan', 'compensation_format': 'bf16'}
    """
    wrappers = {
        "nearest": {},
        "stochastic": {"rounding": "stochastic"},
        "kahan": {"compensation": "kahan"},
        "kahan_lp": {"compensation": "kahan", "compensation_format": fmt},
        "master": {"master_weights": True},
        "nearest_state": {"state_format": fmt},
        "stochastic_state": {"rounding": "stochastic", "state_format": fmt, "state_rounding": "stochastic"},
        "plan": {},     # the plan itself comes from the reference run (see train_variants)
    }
    if variant not in wrappers:
        raise ValueError(f"variant must be one of {', '.join(wrappers)}; got {variant!r}")
    return wrappers[variant]


@dataclass
class Task:
    """What an experiment gives the loop: ``make_model(generator)`` (float32, CPU), ``batch(step)``,
    ``loss(model, batch)``, and optionally ``evaluate(model) -> {metric: float}``, ``param_groups(model, config)``,
    ``shard(batch, rank, world_size)`` (this process's share under torchrun) and a one-line ``description``."""

    make_model: Callable[[torch.Generator], torch.nn.Module]
    batch: Callable[[int], Any]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    evaluate: Optional[Callable[[torch.nn.Module], Dict[str, float]]] = None
    param_groups: Optional[Callable[[torch.nn.Module, TrainConfig], list]] = None
    shard: Optional[Callable[[Any, int, int], Any]] = None
    description: str = ""


def make_optimizer(model: torch.nn.Module, task: Task, config: TrainConfig) -> torch.optim.Optimizer:
    """The plain optimizer every variant of a run starts from: the config's SGD, Adam or AdamW
    (``foreach=False``) over the task's parameter groups (one group when it has none)."""
    groups = task.param_groups(model, config) if task.param_groups else [{"params": list(model.parameters())}]
    if config.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    cls = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    return cls(groups, lr=config.lr, betas=tuple(config.betas), eps=config.eps, weight_decay=config.weight_decay,
               foreach=False)


def train_steps(model: torch.nn.Module, optimizer, steps: Union[int, Iterable[int]], batch: Callable[[int], Any],
                loss: Callable[[Any], torch.Tensor], scheduler=None, before_step: Optional[Callable[[], None]] = None,
                after_step: Optional[Callable[[], None]] = None) -> Iterator[Tuple[int, torch.Tensor]]:
    """The book's one training loop, as a generator: for each step (``range(steps)``, or the steps an iterable such as
    a progress bar gives), the step's ``batch``, its ``loss``, ``zero_grad``, ``backward``, ``before_step()``,
    ``optimizer.step()``, ``after_step()`` (a tracker's snapshots around the step) and the scheduler's step; then it
    yields ``(step, loss)`` for the caller's bookkeeping. The chapters' runs and the fine-tune train through it.

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2)); opt = torch.optim.SGD([w], lr=0.5)
        >>> [round(l.item(), 3) for _, l in train_steps(torch.nn.Module(), opt, 3, lambda s: s, lambda b: (w ** 2).sum())]
        [2.0, 0.0, 0.0]
    """
    for step in range(steps) if isinstance(steps, int) else steps:
        model.train()
        value = loss(batch(step))
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        if before_step is not None:
            before_step()
        optimizer.step()
        if after_step is not None:
            after_step()
        if scheduler is not None:
            scheduler.step()
        yield step, value


def lowprec_named_params(model: torch.nn.Module, config: TrainConfig) -> Dict[str, torch.Tensor]:
    """The parameters the config keeps in low precision (``config.lowprec_params``), by name."""
    chosen = {id(p) for p in select_params(model.parameters(), config.lowprec_params)}
    return {n: p for n, p in model.named_parameters() if id(p) in chosen}


def _run_steps(variant: str, model: torch.nn.Module, task: Task, config: TrainConfig, device: str,
               predictor_formats: Sequence[str], progress: bool, dist_info: Distributed = Distributed(),
               keep_masks: bool = False, position: Optional[int] = None, plan: Optional[FreezePlan] = None,
               plan_at: Optional[int] = None):
    """One variant's run as a generator: yields its tracker after every step and returns
    ``(record, predictor, model)``. With ``plan_at=k`` the reference's freeze watch makes a plan
    after step k - 1 (``record.plan``); the ``"plan"`` variant stores its weights with ``plan``."""
    dtype = torch.float64 if (variant == "reference" and config.reference_dtype == "float64") else torch.float32
    model = model.to(device=device, dtype=dtype)
    net = model
    sharded = dist_info.enabled and config.parallel == "fsdp"
    if sharded:
        net = model = shard_model(model)
    elif dist_info.enabled:
        net = DataParallel(model, device_ids=[dist_info.local_rank] if device.startswith("cuda") else None)
    opt = make_optimizer(model, task, config)
    tracked = lowprec_named_params(model, config)
    source = whole_tensors(tracked) if sharded else tracked
    predictor = observer = None
    if variant == "reference":
        predictor = FreezePredictor(source, predictor_formats, rand_bits=config.rand_bits, keep_masks=keep_masks,
                                    fit_steps=fit_steps(config))
    else:
        # the same seed on every process, so that data-parallel replicas stay bit-identical
        gen = torch.Generator().manual_seed(config.seed + 1 if config.sr_seed is None else config.sr_seed)
        if variant == "plan":
            if plan is None:
                raise ValueError("the plan variant needs the plan the reference run makes")
            opt = LowPrecisionOptimizer(opt, config.format, generator=gen, rand_bits=config.rand_bits, plan=plan,
                                        model=model)
        else:
            opt = LowPrecisionOptimizer(opt, config.format, generator=gen, rand_bits=config.rand_bits,
                                        params=list(tracked.values()), **variant_wrapper(variant, config.format))
        observer = FreezeObserver(source, config.format, keep_masks=keep_masks)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
    record = RunRecord(variant=variant)
    planner = None
    if plan_at is not None:
        planner = FreezeWatch(model, opt, formats=(config.format,), scheduler=sched, total_steps=config.steps)
    start = datetime.now()
    bar = progress_bar(range(config.steps), desc=f"{variant:>10}", disable=not progress, position=position)
    tracker = predictor or observer
    shard = task.shard if dist_info.enabled and task.shard is not None else None

    def batch(step):
        return task.batch(step) if shard is None else shard(task.batch(step), dist_info.rank, dist_info.world_size)

    def before_step():
        tracker.before_step()
        record.lr.append(opt.param_groups[0]["lr"])

    for step, loss in train_steps(model, opt, bar, batch, lambda b: task.loss(net, b), sched, before_step,
                                  tracker.after_step):
        loss_value = mean_over_ranks(loss.detach(), dist_info)
        if not torch.isfinite(loss_value):
            raise FloatingPointError(f"{variant}: loss became {loss_value.item()} at step {step}")
        if planner is not None and step == plan_at - 1:
            record.plan = planner.plan(config.format, budget=config.plan_budget).to_dict()
            planner.detach()
            planner = None
        record.loss.append(float(loss_value.item()))
        last = step == config.steps - 1
        if task.evaluate and ((config.eval_every and (step + 1) % config.eval_every == 0) or last):
            model.eval()
            with torch.no_grad():
                metrics = task.evaluate(model)
            record.evals.append({"step": step + 1, **{k: float(v) for k, v in metrics.items()}})
        if progress and (step % 10 == 0 or last):
            post = {"loss": f"{record.loss[-1]:.4g}"}
            if observer is not None:
                post["frozen"] = f"{observer.record().overall[-1]:.3f}"
            bar.set_postfix(post)
        yield tracker
    record.seconds = (datetime.now() - start).total_seconds()
    record.bytes_per_param = bytes_per_parameter(opt)
    if observer is not None:
        record.frozen = observer.record()
    return record, predictor, model


def _finish(run):
    """Run a :func:`_run_steps` generator to its end; its return value."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value


def _run_one(*args, **kwargs):
    return _finish(_run_steps(*args, **kwargs))


def _lockstep(reference, nearest: Dict[str, Any]):
    """Step the reference and each format's round-to-nearest run in turn, comparing their frozen
    masks at every step; returns their values and each format's agreement curves."""
    agreement = {name: {"element_mismatch": [], "chance_mismatch": [], "stratified_chance_mismatch": []}
                 for name in nearest}
    while True:
        try:
            predictor = next(reference)
        except StopIteration as stop:
            ref_value = stop.value
            break
        weights = predictor.tensors()
        for name, run in nearest.items():
            observer = next(run)
            mismatch, chance = mask_mismatch(predictor.masks[name], observer.masks[name])
            agreement[name]["element_mismatch"].append(mismatch)
            agreement[name]["chance_mismatch"].append(chance)
            agreement[name]["stratified_chance_mismatch"].append(
                stratified_chance_mismatch(predictor.masks[name], observer.masks[name], weights))
    return ref_value, {name: _finish(run) for name, run in nearest.items()}, agreement


def plan_step(config: TrainConfig) -> int:
    """The reference steps the plan variant's watch sees before the plan is made: ``plan_after``
    of the run, at least 11 (the diagnoses' patience plus one)."""
    return min(config.steps, max(11, round(config.plan_after * config.steps)))


def fit_steps(config: TrainConfig) -> int:
    """The first steps the fitted schedule rule measures: the warmup, else 2 % of the run (at least 1)."""
    return min(config.steps, config.warmup_steps if config.warmup_steps > 0 else max(1, config.steps // 50))


def _setup(config: TrainConfig, progress: bool):
    dist_info = init_distributed(config.device)
    device = pick_device(config.device)
    if device == "cuda" and dist_info.enabled:
        device = f"cuda:{dist_info.local_rank}"
    return dist_info, device, progress and dist_info.is_main


def _provenance(device: str, dist_info: Distributed, identical: Dict[str, bool], parallel: str = "ddp") -> dict:
    p = provenance(device)
    if dist_info.enabled:
        p["distributed"] = {"world_size": dist_info.world_size, "backend": dist_info.backend, "parallel": parallel}
        if parallel == "ddp":    # FSDP2 keeps no replicas
            p["distributed"]["replicas_identical"] = identical
    return p


def _replicas(dist_info: Distributed, config: TrainConfig) -> bool:   # DDP: replicas to compare
    return dist_info.enabled and config.parallel == "ddp"


def train_variants(experiment: str, task: Task, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train the reference and every low-precision variant of ``config.variants``, predicting and observing freezes.
    Under ``torchrun`` the global batch is the one a single process uses, every process returns the same result, and
    ``provenance["distributed"]`` records whether the replicas ended bit-identical."""
    dist_info, device, progress = _setup(config, progress)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    runs: Dict[str, RunRecord] = {}
    identical: Dict[str, bool] = {}
    agreement: Dict[str, List[float]] = {}
    fmt = get_format(config.format).name
    plan_at = plan_step(config) if "plan" in config.variants else None

    def start(variant, **kwargs):
        if variant == "reference":
            kwargs["plan_at"] = plan_at
        if variant == "plan":
            kwargs["plan"] = FreezePlan.from_dict(runs["reference"].plan)
        return _run_steps(variant, copy.deepcopy(init), task, config, device, config.formats, progress, dist_info,
                          **kwargs)

    def keep(variant, record, model):
        runs[variant] = record
        if _replicas(dist_info, config):
            identical[variant] = replicas_identical(model, dist_info)

    if "nearest" in config.variants:   # the reference and nearest runs in lockstep
        (record, predictor, model), nearest, curves = _lockstep(
            start("reference", keep_masks=True), {fmt: start("nearest", keep_masks=True, position=1)})
        keep("reference", record, model)
        keep("nearest", nearest[fmt][0], nearest[fmt][2])
        agreement = curves[fmt]
        del model, nearest
    else:
        record, predictor, model = _finish(start("reference"))
        keep("reference", record, model)
        del model
    for variant in config.variants:
        if variant not in runs:
            record, _, model = _finish(start(variant))
            keep(variant, record, model)
            del model
    runs = {v: runs[v] for v in config.variants}
    return TrainResult(experiment=experiment, config=config, runs=runs, predictions=dict(predictor.records),
                       provenance=_provenance(device, dist_info, identical, config.parallel),
                       description=task.description,
                       baselines=predictor.baselines(fmt, runs["reference"].lr), agreement=agreement)


def train_plan(task: Task, config: TrainConfig, plan: FreezePlan, progress: bool = False) -> RunRecord:
    """The ``"plan"`` variant with a given ``plan`` (a control), from the same initialisation and
    batches as :func:`train_variants` (one process)."""
    _, device, progress = _setup(config, progress)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    record, _, _ = _run_one("plan", init, task, config, device, config.formats, progress, plan=plan)
    return record


Variants = Union[Sequence[str], Dict[str, Sequence[str]]]


def train_formats(experiment: str, task: Task, config: TrainConfig, formats: Sequence[str],
                  variants: Variants = ("nearest",), progress: bool = True) -> Dict[str, TrainResult]:
    """One reference run predicting every format of ``formats``, then ``variants`` in each (a list, or
    ``{format: list}``, ``("nearest",)`` for the rest): a TrainResult per format, sharing the reference."""
    names = [get_format(f).name for f in formats]
    if not names:
        raise ValueError("give at least one format")
    if isinstance(variants, dict):
        chosen = {get_format(f).name: tuple(v) for f, v in variants.items()}
        per_format = {n: chosen.get(n, ("nearest",)) for n in names}
    else:
        per_format = {n: tuple(variants) for n in names}
    bad = [v for vs in per_format.values() for v in vs if v not in VARIANTS or v == "reference"]
    if bad:
        raise ValueError(f"variants are the low-precision runs, drawn from {', '.join(VARIANTS[1:])}; got {bad}")
    dist_info, device, progress = _setup(config, progress)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    ref_config = dataclasses.replace(config, format=names[0], predict_formats=tuple(names[1:]),
                                     variants=("reference",))
    configs = {name: dataclasses.replace(config, format=name, predict_formats=tuple(n for n in names if n != name),
                                         variants=("reference", *per_format[name])) for name in names}
    lockstep = [name for name in names if "nearest" in per_format[name]]
    reference = _run_steps("reference", copy.deepcopy(init), task, ref_config, device, ref_config.formats, progress,
                           dist_info, keep_masks=bool(lockstep))
    nearest = {name: _run_steps("nearest", copy.deepcopy(init), task, configs[name], device, configs[name].formats,
                                progress, dist_info, keep_masks=True, position=i + 1)
               for i, name in enumerate(lockstep)}
    (ref_record, predictor, model), near_values, agreement = _lockstep(reference, nearest)
    identical = {"reference": replicas_identical(model, dist_info)} if _replicas(dist_info, config) else {}
    del model
    results: Dict[str, TrainResult] = {}
    for name in names:
        cfg = configs[name]
        runs = {"reference": ref_record}
        ident = dict(identical)
        for variant in per_format[name]:
            if variant == "nearest":
                record, _, model = near_values.pop(name)
            else:
                record, _, model = _run_one(variant, copy.deepcopy(init), task, cfg, device, cfg.formats, progress,
                                            dist_info)
            runs[variant] = record
            if _replicas(dist_info, config):
                ident[variant] = replicas_identical(model, dist_info)
            del model
        results[name] = TrainResult(experiment=experiment, config=cfg, runs=runs, predictions=dict(predictor.records),
                                    provenance=_provenance(device, dist_info, ident, config.parallel),
                                    description=task.description,
                                    baselines=predictor.baselines(name, ref_record.lr),
                                    agreement=agreement.get(name, {}))
    return results
