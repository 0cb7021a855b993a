"""The practitioner's bf16 fine-tune: a small GPT pretrained in float32 on the first 85 % of a text, cast with
``model.to(torch.bfloat16)`` and fine-tuned on the last 15 % (later plays of Tiny Shakespeare, or later modules of the
offline stand-in) with AdamW at a fine-tuning learning rate (Hugging Face's default 5e-5), warmup then cosine to 0.
Most of Adam's updates lie below half a bf16 ulp of their weight, so round to nearest leaves the weights in place and
the fine-tune recovers only part of float32's loss improvement. :data:`VARIANTS`: the float32 reference, plain bf16,
two libraries' remedies (torchao's stochastic rounding, torch-optimi's Kahan summation) and this package's, all on
bf16 storage. Batches depend on the seed alone; the loss is that of a fixed held-out batch set of the fine-tune text,
the weights each variant stores evaluated in float32 (so that only the weights differ).

Example:
    >>> r = finetune("bf16", seed=0, steps=20)                                              # doctest: +SKIP
    >>> r["final_loss"], r["bytes_per_parameter_held"], r["model"].lm_head.weight.dtype     # doctest: +SKIP
    (2.13..., 6.0..., torch.bfloat16)
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

import lowprec_demo as lp
from lowprec_demo.book.config import warmup_cosine
from lowprec_demo.book.data.batches import TokenBatches
from lowprec_demo.book.experiments.language import decay_groups
from lowprec_demo.book.models import GPT, gpt_config
from lowprec_demo.book.training import train_steps
from lowprec_demo.optim.plan import CLASSIC_REMEDIES, PLAN_REMEDIES

__all__ = ["SETTINGS", "VARIANTS", "Variant", "FinetuneData", "pretrained", "finetune", "heldout_loss", "held_bytes"]

SETTINGS = {   # per mode (quick: True): model shape, batch, pretraining and fine-tuning lengths
    True: dict(shape=dict(n_layer=2, n_head=4, n_embd=64, block_size=64), batch_size=8, pretrain_steps=1200,
               pretrain_lr=3e-3, steps=300, eval_batches=32),
    False: dict(shape=dict(n_layer=4, n_head=4, n_embd=128, block_size=64), batch_size=16, pretrain_steps=3000,
                pretrain_lr=2e-3, steps=1000, eval_batches=64),
}
BETAS, EPS, WEIGHT_DECAY, PRETRAIN_FRACTION, HELDOUT_SEED = (0.9, 0.999), 1e-8, 0.1, 0.85, 12345


@dataclass
class FinetuneData:
    """The two texts as tokens and the fine-tune text's held-out batches (from its last 10 %)."""
    pretrain: torch.Tensor
    finetune: torch.Tensor
    heldout: list                   # [(x, y)], the same for every seed
    source: str
    block_size: int
    batch_size: int
    start_loss: float = math.nan    # the pretrained float32 model's held-out loss

    def batches(self, seed: int) -> TokenBatches:   # the fine-tune's training batches of ``seed``
        return TokenBatches(self.finetune, self.block_size, self.batch_size, seed=seed)


def _schedule(steps: int, warmup: int, floor: float = 0.0) -> Callable[[int], float]:
    """The book's warmup-cosine as a factor of the peak learning rate per step, at ``floor`` one step after the last."""
    return lambda step: warmup_cosine(step, warmup, steps, floor)


def _groups(model: torch.nn.Module) -> list:   # weight decay on matrices only (nanoGPT's groups)
    return decay_groups(model, WEIGHT_DECAY)


_PRETRAINED: dict = {}   # (seed, settings, corpus) -> pretrained()'s result


def pretrained(seed: int = 0, quick: bool = True):
    """``(float32 state_dict, GPTConfig, FinetuneData)`` of the model pretrained in float32 on the first text
    (AdamW, warmup, cosine to a tenth), cached in memory per process."""
    from lowprec_demo.book.experiments.nanogpt import char_tokens
    tokens, tokenizer, source = char_tokens()
    s = SETTINGS[quick]
    key = (seed, repr(s), source)
    if key not in _PRETRAINED:
        cut, block = int(len(tokens) * PRETRAIN_FRACTION), s["shape"]["block_size"]
        heldout_of = TokenBatches(tokens[cut:], block, s["batch_size"], seed=HELDOUT_SEED)
        data = FinetuneData(tokens[:cut], tokens[cut:], [heldout_of.get_batch(i, "val") for i in
                                                         range(s["eval_batches"])], source, block, s["batch_size"])
        config = gpt_config("nanogpt-quick", vocab_size=tokenizer.vocab_size, **s["shape"])
        model = GPT(config, generator=torch.Generator().manual_seed(seed))
        opt = torch.optim.AdamW(_groups(model), lr=s["pretrain_lr"], betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _schedule(s["pretrain_steps"], 20, 0.1))
        batches = TokenBatches(data.pretrain, block, s["batch_size"], seed=seed, val_fraction=0.0)
        for _ in train_steps(model, opt, s["pretrain_steps"], batches.get_batch, lambda b: model(*b)[1], sched):
            pass
        data.start_loss = heldout_loss(model, data)
        _PRETRAINED[key] = ({k: v.detach().clone() for k, v in model.state_dict().items()}, config, data)
    return _PRETRAINED[key]


def _adamw(model, lr, seed):
    return torch.optim.AdamW(_groups(model), lr=lr, betas=BETAS, eps=EPS)


def _torchao_sr(model, lr, seed):
    import torchao.optim as ao   # 0.18 names its AdamW with bf16_stochastic_round ``_AdamW``
    return (getattr(ao, "AdamW", None) or ao._AdamW)(_groups(model), lr=lr, betas=BETAS, eps=EPS,
                                                     bf16_stochastic_round=True)


def _optimi_kahan(model, lr, seed):
    import optimi   # its state in the parameters' dtype (bf16), and the Kahan buffer too
    return optimi.AdamW(_groups(model), lr=lr, betas=BETAS, eps=EPS, kahan_sum=True)


def _ours(**options) -> Callable:   # this package's wrapper of torch's AdamW, Adam's moments stored in bf16
    def build(model, lr, seed):
        kw = {"generator": seed} if options.get("rounding") == "stochastic" else {}
        return lp.LowPrecisionOptimizer(_adamw(model, lr, seed), "bf16", state_format="bf16", **options, **kw)
    return build


@dataclass(frozen=True)
class Variant:
    """The model's ``dtype``, its optimizer's ``build(model, lr, seed)``, the fraction of the run watched before a
    freeze plan is made and attached (``plan_at``; None: no plan)."""
    dtype: torch.dtype
    build: Callable
    plan_at: Optional[float] = None
    restart: bool = False       # the plan applied from the start of a second run (the first one a probe)
    remedies: tuple = CLASSIC_REMEDIES      # those the plan may give
    preflight: bool = False     # the plan of lp.preflight (a probe on a float32 copy), applied from the first step


BF16 = torch.bfloat16
VARIANTS = {   # name -> Variant; lp_*: this package's LowPrecisionOptimizer on real bf16 storage
    "fp32": Variant(torch.float32, _adamw), "bf16": Variant(BF16, _adamw),
    "torchao_sr": Variant(BF16, _torchao_sr), "optimi_kahan": Variant(BF16, _optimi_kahan),
    "lp_nearest": Variant(BF16, _ours(rounding="nearest")),
    "lp_stochastic": Variant(BF16, _ours(rounding="stochastic")),
    "lp_kahan": Variant(BF16, _ours(compensation="kahan", compensation_format="bf16")),
    "lp_master": Variant(BF16, _ours(master_weights=True)),
    "lp_remainder": Variant(BF16, _ours(compensation="remainder")),      # bf16 + a 16-bit remainder: exact fp32
    "lp_feedback": Variant(BF16, _ours(compensation="feedback")),        # ECO: the error fed into Adam's moment
    "lp_plan": Variant(BF16, _adamw, plan_at=0.1),     # plain bf16, then the watch's plan (budget 1 byte/parameter)
    "lp_plan_restart": Variant(BF16, _adamw, plan_at=0.1, restart=True),   # that plan, from the start again
    "lp_plan_remainder": Variant(BF16, _adamw, plan_at=0.1, restart=True, remedies=PLAN_REMEDIES),
    "lp_preflight": Variant(BF16, _adamw, preflight=True),     # plan_after=0: the preflight's plan from step 0
}

_EVALUATORS: dict = {}   # a float32 GPT per config, for heldout_loss


@torch.no_grad()
def heldout_loss(model: GPT, data: FinetuneData) -> float:
    """The mean loss over the held-out batches of the weights ``model`` stores, evaluated in float32."""
    evaluator = _EVALUATORS.setdefault(repr(model.config), GPT(model.config).eval())
    evaluator.load_state_dict(model.state_dict())   # copy_ widens bf16 exactly
    return statistics.fmean(float(evaluator(x, y)[1]) for x, y in data.heldout)


def held_bytes(model: torch.nn.Module, *optimizers) -> float:
    """Bytes per parameter the process holds for training: the parameters and every tensor reachable from the
    optimizers (their state, a wrapper's masters, buffers and packs), each storage once."""
    storages, seen, owners = {}, set(), ("lowprec_demo", "torchao", "optimi")

    def walk(obj, depth=0):
        if torch.is_tensor(obj):
            s = obj.untyped_storage()
            storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())
        elif id(obj) not in seen and depth < 12:
            seen.add(id(obj))
            mine = isinstance(obj, torch.optim.Optimizer) or type(obj).__module__.startswith(owners)
            items = ([*obj.keys(), *obj.values()] if isinstance(obj, dict) else obj
                     if isinstance(obj, (list, tuple, set)) else vars(obj).values() if mine else ())
            for item in items:
                walk(item, depth + 1)

    walk([list(model.parameters()), *optimizers])
    return sum(storages.values()) / sum(p.numel() for p in model.parameters())


def finetune(variant, seed: int = 0, lr: float = 5e-5, steps: Optional[int] = None, quick: bool = True,
             watch: Optional[dict] = None, pretrain_seed: int = 0, before_run: Optional[Callable] = None) -> dict:
    """Fine-tune a copy of :func:`pretrained` stored as ``variant`` (a name of :data:`VARIANTS`, or a Variant) says,
    for ``steps`` (the mode's default) with peak ``lr``: 5 % warmup, cosine to 0. ``watch``: options of
    :func:`lowprec_demo.watch` to watch the whole run (``result["watch"]``). ``before_run(model, optimizer,
    scheduler, loss)`` is called before the first step (``loss(m)``: the loss on ``m`` of the run's next batch, from
    its first; what :func:`lowprec_demo.preflight` takes). Returns ``final_loss``, ``start_loss``
    (the float32 model's), ``losses`` (per step), ``bytes_per_parameter_held`` (:func:`held_bytes`),
    ``bytes_per_parameter`` (the package's count), ``step_ms`` (median), ``model``, ``optimizer``, ``plan`` and
    ``step`` (one more step, for timing)."""
    spec = VARIANTS[variant] if isinstance(variant, str) else variant
    state, config, data = pretrained(pretrain_seed, quick)
    steps = SETTINGS[quick]["steps"] if steps is None else steps
    probe = None
    if spec.restart:    # a probe run makes the plan; the fine-tune starts again from the pretrained weights with it
        probe = finetune(Variant(BF16, _adamw, spec.plan_at, remedies=spec.remedies), seed, lr, steps, quick, None,
                         pretrain_seed)["plan"]
        spec = Variant(BF16, lambda model, lr, seed: lp.LowPrecisionOptimizer(_adamw(model, lr, seed), "bf16",
                                                                              plan=probe, model=model, generator=seed))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)     # torchao draws its random bits from torch's generator
        model = GPT(config, generator=torch.Generator().manual_seed(0))
        model.load_state_dict(state), model.to(spec.dtype)     # the practitioner's cast
        opt = spec.build(model, lr, seed)
        sched = torch.optim.lr_scheduler.LambdaLR(getattr(opt, "optimizer", opt), _schedule(steps, max(1, steps // 20)))
        watcher = None if watch is None else lp.watch(model, opt, scheduler=sched, total_steps=steps, **watch)
        plan_at = None if spec.plan_at is None else max(1, round(spec.plan_at * steps))
        planner = lp.watch(model, opt, formats=("bf16",), scheduler=sched, total_steps=steps) if plan_at else None
        plan = attached = None
        batches, losses, times = data.batches(seed), [], []
        if before_run is not None:
            at = itertools.count()
            before_run(model, opt, sched, lambda m: m(*batches.get_batch(next(at)))[1])
        if spec.preflight:   # probe steps on the run's first batches, on a float32 copy; then the plan from step 0
            at = itertools.count()
            plan = lp.preflight(model, opt, sched, steps, loss=lambda m: m(*batches.get_batch(next(at)))[1]).plan
            attached = lp.attach_plan(opt, plan, model=model, generator=seed)
        start = time.perf_counter()
        for i, loss in train_steps(model, opt, steps, batches.get_batch, lambda b: model(*b)[1], sched):
            times.append(time.perf_counter() - start)      # the step and the scheduler's, not the bookkeeping
            losses.append(loss.item())
            if i + 1 == plan_at:     # the plan from the watched bf16 steps, applied through opt's step hooks
                plan = planner.plan("bf16", budget=1.0, remedies=spec.remedies)
                attached = lp.attach_plan(opt, plan, model=model)
                planner.detach()
            start = time.perf_counter()
        watcher is not None and watcher.detach()
    one = batches.get_batch(0)

    def step():   # one more step on the first batch, for timing
        return next(train_steps(model, opt, 1, lambda _: one, lambda b: model(*b)[1]))[1].item()
    return dict(variant=variant, seed=seed, lr=lr, steps=steps, final_loss=heldout_loss(model, data),
                start_loss=data.start_loss, losses=losses, bytes_per_parameter_held=held_bytes(model, attached or opt),
                bytes_per_parameter=lp.bytes_per_parameter(attached or opt)["total"],
                step_ms=1e3 * statistics.median(times), model=model, optimizer=opt, plan=plan or probe, watch=watcher,
                step=step)

