"""One training loop for every chapter.

``train_variants`` trains, from the same initialisation and on the same batches:

* ``"reference"``: float32 (or float64) weights, with a :class:`FreezePredictor` predicting, for
  one or several formats, which elements would freeze;
* ``"nearest"``: stored weights on the format's grid, round to nearest, with a
  :class:`FreezeObserver` recording which elements really froze;
* ``"stochastic"``: the same with stochastic rounding;
* ``"kahan"``: nearest rounding with Kahan compensation, the buffer in float32 (optional);

and the other remedies of :func:`variant_wrapper` (optional): ``"kahan_lp"`` (the Kahan buffer on
the format's grid too), ``"master"`` (float32 master weights, the forward pass on the format's
grid), ``"nearest_state"`` and ``"stochastic_state"`` (the optimizer's state on the format's grid
too, rounded like the weights).

An experiment describes itself as a :class:`Task` (model, batches, loss, evaluation); the loop
owns the optimizer, the learning-rate schedule, rounding, tracking and progress bars, and returns
a :class:`TrainResult` that the plotting helpers and the command line take. ``train_formats`` runs
one reference for several formats at once (the reference predicts them all).

The reference and the round-to-nearest runs are stepped in lockstep (the same step of each, in
turn), so that the predicted and observed frozen masks of every step are compared element by
element without keeping either beyond the step (``TrainResult.agreement``); the result is the
same as running them one after the other. Beside the prediction, the result holds baselines
that do not use the reference trajectory (``TrainResult.baselines``): the schedule rule, and
the trivial "always frozen" and "never frozen".

Under ``torchrun --nproc_per_node=N`` the same functions train data-parallel: each process a
replica on its share of every batch, gradients averaged (DistributedDataParallel), stochastic
rounding seeded alike everywhere so the replicas stay bit-identical; with ``parallel="fsdp"``
each process holds a shard of every parameter instead (FSDP2's ``fully_shard``), rounded with
the whole tensor's random bits (:mod:`lowprec_demo.sharding`), and the trackers compare the
whole tensors, gathered at every step.

The configuration lives in :mod:`lowprec_demo.config`, the results in
:mod:`lowprec_demo.results`, data parallelism in :mod:`lowprec_demo.distributed`;
``run_formats`` (a named experiment through ``train_formats``) in :mod:`lowprec_demo.experiments`.

Example:
    >>> from lowprec_demo.experiments import run_experiment
    >>> result = run_experiment("quadratic", fmt="bf16", steps=50, progress=False)
    >>> sorted(result.runs)
    ['nearest', 'reference', 'stochastic']
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import torch

from lowprec_demo.book.config import VARIANTS, TrainConfig, lr_factor
from lowprec_demo.book.distributed import (DataParallel, Distributed, init_distributed, mean_over_ranks, replicas_identical, shard_model, whole_tensors)
from lowprec_demo.formats import get_format
from lowprec_demo.optim.plan import FreezePlan
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer, bytes_per_parameter, select_params
from lowprec_demo.freeze.agreement import mask_mismatch, stratified_chance_mismatch
from lowprec_demo.freeze.prediction import FreezeObserver, FreezePredictor
from lowprec_demo.book.results import RunRecord, TrainResult, provenance
from lowprec_demo.book.runtime import pick_device, progress_bar
from lowprec_demo.monitor.freeze_watch import FreezeWatch

__all__ = ["Task", "train_variants", "train_formats", "train_plan", "plan_step", "Variants", "variant_wrapper", "fit_steps"]


def variant_wrapper(variant: str, fmt: str) -> dict:
    """The :class:`LowPrecisionOptimizer` keyword arguments of a low-precision variant in format
    ``fmt``: ``nearest``, ``stochastic``, ``kahan`` (float32 buffer), ``kahan_lp`` (the buffer on
    ``fmt``'s grid), ``master`` (float32 master weights), ``nearest_state`` and
    ``stochastic_state`` (the optimizer's state on ``fmt``'s grid, rounded like the weights).

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
    """What an experiment provides to the training loop.

    Attributes:
        make_model: ``f(generator) -> nn.Module`` building the model with a seeded initialisation
            (float32, on the CPU; the loop moves it).
        batch: ``f(step) -> batch`` (tensors on the device), the same for every variant.
        loss: ``f(model, batch) -> scalar tensor``.
        evaluate: optional ``f(model) -> dict of floats`` (e.g. validation loss, accuracy).
        param_groups: optional ``f(model, config) -> list of dicts`` for the optimizer (e.g. weight
            decay only on matrices); default: one group.
        shard: optional ``f(batch, rank, world_size) -> this process's share of the batch`` for
            data-parallel training under torchrun (e.g. an equal block of rows); without it every
            process computes the loss of the whole batch (correct, but no faster).
        description: one line for the output, e.g. which data was used.
    """

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


def lowprec_named_params(model: torch.nn.Module, config: TrainConfig) -> Dict[str, torch.Tensor]:
    """The parameters the config keeps in low precision (``config.lowprec_params``), by name."""
    chosen = {id(p) for p in select_params(model.parameters(), config.lowprec_params)}
    return {n: p for n, p in model.named_parameters() if id(p) in chosen}


# ------------------------------------------------------------------------------------------------
# The loop
# ------------------------------------------------------------------------------------------------
def _run_steps(variant: str, model: torch.nn.Module, task: Task, config: TrainConfig, device: str,
               predictor_formats: Sequence[str], progress: bool, dist_info: Distributed = Distributed(),
               keep_masks: bool = False, position: Optional[int] = None, plan: Optional[FreezePlan] = None,
               plan_at: Optional[int] = None):
    """One variant's run, as a generator: yields its tracker after every step (masks included
    with ``keep_masks``) and returns ``(record, predictor, model)``. The reference with
    ``plan_at=k``: a freeze watch makes a plan after step k - 1 (``record.plan``); the ``"plan"``
    variant stores its weights with ``plan``."""
    dtype = torch.float64 if (variant == "reference" and config.reference_dtype == "float64") else torch.float32
    model = model.to(device=device, dtype=dtype)
    net = model
    sharded = dist_info.enabled and config.parallel == "fsdp"
    if sharded:             # FSDP2: each process a shard of every parameter, gradients averaged
        net = model = shard_model(model)
    elif dist_info.enabled:   # gradients are averaged over processes, each on its share of the batch
        net = DataParallel(model, device_ids=[dist_info.local_rank] if device.startswith("cuda") else None)
    opt = make_optimizer(model, task, config)
    tracked = lowprec_named_params(model, config)
    # the trackers compare whole tensors: gathered from the shards at every step under FSDP2
    source = whole_tensors(tracked) if sharded else tracked
    predictor = observer = None
    if variant == "reference":
        predictor = FreezePredictor(source, predictor_formats, rand_bits=config.rand_bits, keep_masks=keep_masks,
                                    fit_steps=fit_steps(config))
    else:
        # the same seed on every process: stochastic rounding draws the same bits everywhere,
        # so data-parallel replicas stay bit-identical
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
    if plan_at is not None:   # the watch a practitioner would put on the fp32 run, for the plan
        planner = FreezeWatch(model, opt, formats=(config.format,), scheduler=sched, total_steps=config.steps)
    start = datetime.now()
    bar = progress_bar(range(config.steps), desc=f"{variant:>10}", disable=not progress, position=position)
    for step in bar:
        model.train()
        batch = task.batch(step)
        if dist_info.enabled and task.shard is not None:
            batch = task.shard(batch, dist_info.rank, dist_info.world_size)
        loss = task.loss(net, batch)
        loss_value = mean_over_ranks(loss.detach(), dist_info)
        if not torch.isfinite(loss_value):
            raise FloatingPointError(f"{variant}: loss became {loss_value.item()} at step {step}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        tracker = predictor or observer
        tracker.before_step()
        record.lr.append(opt.param_groups[0]["lr"])
        opt.step()
        tracker.after_step()
        sched.step()
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
    """Run a generator of :func:`_run_steps` to its end and return its value."""
    while True:
        try:
            next(run)
        except StopIteration as stop:
            return stop.value


def _run_one(*args, **kwargs):
    return _finish(_run_steps(*args, **kwargs))


def _lockstep(reference, nearest: Dict[str, Any]):
    """Step the reference run and the round-to-nearest run of each format in turn, comparing
    their frozen masks at every step; returns the reference's value, each nearest run's value
    and each format's agreement curves."""
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
    """The number of reference steps the plan variant's freeze watch sees before the plan is
    made: ``plan_after`` of the run, at least 11 (the diagnoses' patience plus one)."""
    return min(config.steps, max(11, round(config.plan_after * config.steps)))


def fit_steps(config: TrainConfig) -> int:
    """The first steps whose updates the fitted schedule rule measures: the warmup, or the first
    2 % of a run without one (at least one step).

    Example:
        >>> fit_steps(TrainConfig(steps=600, warmup_steps=10)), fit_steps(TrainConfig(steps=600))
        (10, 12)
    """
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
        if parallel == "ddp":    # (FSDP2 keeps no replicas: each process holds a shard)
            p["distributed"]["replicas_identical"] = identical
    return p


def _replicas(dist_info: Distributed, config: TrainConfig) -> bool:
    """Whether the processes hold replicas to compare (DDP under torchrun)."""
    return dist_info.enabled and config.parallel == "ddp"


def train_variants(experiment: str, task: Task, config: TrainConfig, progress: bool = True) -> TrainResult:
    """Train the reference and every low-precision variant of ``config.variants`` from one
    initialisation on the same batches, predicting and observing freezes.

    Under ``torchrun`` with several processes, each trains a replica on its share of every batch
    (``task.shard``; the whole batch when the task has none) and gradients are averaged, so the
    global batch is the one a single process uses; every process returns the same result, and
    ``provenance["distributed"]`` records whether the replicas ended bit-identical.

    Example: see the module docstring (``run_experiment`` builds the task and config)."""
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
    """The ``"plan"`` variant of ``config`` with a given ``plan`` (a control: the same budget in
    another order, another budget), from the same initialisation on the same batches as
    :func:`train_variants` (one process)."""
    _, device, progress = _setup(config, progress)
    init = task.make_model(torch.Generator().manual_seed(config.seed))
    record, _, _ = _run_one("plan", init, task, config, device, config.formats, progress, plan=plan)
    return record


Variants = Union[Sequence[str], Dict[str, Sequence[str]]]


def train_formats(experiment: str, task: Task, config: TrainConfig, formats: Sequence[str],
                  variants: Variants = ("nearest",), progress: bool = True) -> Dict[str, TrainResult]:
    """One reference run predicting every format of ``formats`` at once, then the low-precision
    ``variants`` in each format, all from one initialisation on the same batches. Returns one
    TrainResult per format (keyed by format name) that share the reference run: the same as
    ``train_variants`` per format, for one reference run instead of one per format.

    ``variants`` is a list for every format, or a dict ``{format: list}`` (formats left out get
    ``("nearest",)``).

    Example:
        >>> results = run_formats("quadratic", ["e8m3", "bf16"], steps=50, progress=False)
        >>> sorted(results)
        ['bf16', 'e8m3']
    """
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
    # the reference in lockstep with every format's nearest run (masks compared step by step)
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
