"""What the watch and the package's stochastic-rounding and remainder optimizers cost a training step, on the CPU,
one thread, each ratio measured within one run in interleaved rounds (:func:`benchmarks.timing.median_times`).

Targets, stated before measuring (issue 51, item 5):

* **the watch** (``lp.watch`` at its defaults, a scheduler giving the run's length, 10,000 steps) costs at most
  **1.10x** a training step (zero_grad, forward, backward, AdamW step) on models of 1M parameters and more: a small
  GPT of 1.0M parameters (:mod:`lowprec_demo.book.models`), 5 stacked 1024x1024 Linear layers (5.2M) and 7 stacked
  2048x2048 ones (29.4M), each in float32 (the watch predicts) and really stored in bf16 (it observes);
* **what the default sample costs in accuracy**: the frozen fraction per tensor and step of the default sample against
  every element followed (and against the former default of 16,384), on the 1.0M GPT over 200 steps of AdamW and a
  cosine, predicted (float32) and observed (bf16);
* **the optimizers**: on seven 2048x2048 Linear layers really stored in bf16 (29.4M parameters), batch 16, the whole
  step of ``LowPrecisionOptimizer(AdamW, "bf16", rounding="stochastic")`` and of ``compensation="remainder"`` within
  **1.3x** plain bf16 AdamW's, and no slower than torchao's SR AdamW (torch-optimi's Kahan AdamW shown beside, and
  torch's AdamW on the same model in float32: the inner step the package's optimizers run on float32 working copies).

Run: ``python benchmarks/costs.py`` (``--quick``: fewer rounds, no files). Writes
``benchmarks/cpu-<date>-costs.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import unittest.mock

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowprec_demo as lp                                             # noqa: E402
from lowprec_demo.book.models import GPT, GPTConfig                   # noqa: E402
from lowprec_demo.monitor.freeze_watch import SAMPLE                  # noqa: E402
from lowprec_demo.optim import fused                                  # noqa: E402
from benchmarks.machine import cpu_label, machine_record              # noqa: E402
from benchmarks.timing import median_times                            # noqa: E402

WATCH_TARGET, OPTIMIZER_TARGET, RUN_STEPS = 1.10, 1.30, 10_000
BATCH, ACCURACY_STEPS = 16, 200
#: torch's AdamW on float32 weights: the arithmetic the package's optimizers run on float32 working copies
FLOAT32_ADAMW = "float32 AdamW (float32 weights)"
#: the package's optimizers with the fused step refused: the generic step (the inner AdamW on float32 working copies,
#: then the rounding), not the fused one (:mod:`lowprec_demo.optim.fused`)
GENERIC = ", generic step"


def make_model(name: str, dtype: torch.dtype):
    """``(model, loss(model))`` of a benchmark model, the same weights and batch every time."""
    torch.manual_seed(0)
    if name == "gpt-1M":
        model = GPT(GPTConfig(block_size=64, vocab_size=65, n_layer=4, n_head=4, n_embd=144),
                    torch.Generator().manual_seed(0)).to(dtype)
        g = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 65, (8, 64), generator=g), torch.randint(0, 65, (8, 64), generator=g)
        return model, lambda m: m(x, y)[1]
    layers, width = {"linear-5M": (5, 1024), "linear-30M": (7, 2048)}[name]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(dtype)
    x = torch.randn(BATCH, width, generator=torch.Generator().manual_seed(1)).to(dtype)
    return model, lambda m: m(x).float().pow(2).mean()


def _cosine(steps: int):
    return lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))


def _stepper(model, loss, opt, scheduler=None):
    def step():
        opt.zero_grad()
        loss(model).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
    return step


def watch_costs(models, repeats: int) -> list:
    """Per model and dtype: the median plain step, the median watched step (defaults), their ratio."""
    rows = []
    for name in models:
        for dtype in (torch.float32, torch.bfloat16):
            cases, watches = {}, []
            for case in ("plain", "watched"):
                model, loss = make_model(name, dtype)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
                sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(RUN_STEPS))
                if case == "watched":
                    watches.append(lp.watch(model, opt, formats=("bf16",), scheduler=sched, total_steps=RUN_STEPS))
                cases[case] = _stepper(model, loss, opt, sched)
                for _ in range(3):
                    cases[case]()
            times = median_times(cases, "cpu", repeats, min_seconds=0.3)
            w = watches[0]
            rows.append({"model": name, "params": sum(p.numel() for p in model.parameters()),
                         "dtype": str(dtype).replace("torch.", ""), "mode": w.mode,
                         "followed": sum(w.tracker.sample.counts), "plain_ms": 1e3 * times["plain"],
                         "watched_ms": 1e3 * times["watched"], "ratio": times["watched"] / times["plain"]})
            w.detach()
            print(f"watch  {name:10s} {rows[-1]['dtype']:8s} plain {rows[-1]['plain_ms']:7.1f} ms  watched "
                  f"{rows[-1]['watched_ms']:7.1f} ms  {rows[-1]['ratio']:.3f}x", flush=True)
    return rows


def _records(dtype: torch.dtype, sample) -> dict:
    """The watch's per-tensor frozen fractions, step by step, of one 200-step run (the same run for every sample)."""
    model, loss = make_model("gpt-1M", dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _cosine(ACCURACY_STEPS))
    w = lp.watch(model, opt, formats=("bf16",), scheduler=sched, total_steps=ACCURACY_STEPS, sample=sample)
    step = _stepper(model, loss, opt, sched)
    for _ in range(ACCURACY_STEPS):
        step()
    w.detach()
    rec = w.record("bf16")
    return {"by_tensor": dict(rec.by_tensor), "overall": list(rec.overall), "sizes": dict(w.sizes),
            "since": w.frozen_since("bf16")}


def watch_accuracy() -> list:
    """The default sample (and 16,384) against every element: absolute differences of the frozen fraction."""
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        full = _records(dtype, None)
        for sample in (SAMPLE, 1 << 14):
            got = _records(dtype, sample)
            sampled = [n for n, size in full["sizes"].items() if size > sample]
            diffs = [abs(a - b) for n in sampled for a, b in zip(got["by_tensor"][n], full["by_tensor"][n])]
            overall = [abs(a - b) for a, b in zip(got["overall"], full["overall"])]
            since = sum(got["since"][n] != full["since"][n] for n in full["since"])
            rows.append({"dtype": str(dtype).replace("torch.", ""), "sample": sample, "sampled_tensors": len(sampled),
                         "tensors": len(full["sizes"]), "max_abs_tensor": max(diffs, default=0.0),
                         "mean_abs_tensor": sum(diffs) / max(1, len(diffs)), "max_abs_overall": max(overall),
                         "frozen_since_differs": since, "frozen_since_of": len(full["since"])})
            print(f"accuracy {rows[-1]['dtype']} sample {sample}: per tensor max {rows[-1]['max_abs_tensor']:.4f} "
                  f"mean {rows[-1]['mean_abs_tensor']:.4f}; overall max {rows[-1]['max_abs_overall']:.4f}; "
                  f"frozen_since differs for {since} of {len(full['since'])}", flush=True)
    return rows


def _optimizers() -> dict:
    """The optimizers compared, each a function of the parameters."""
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-4)                          # noqa: E731
    cases = {"plain bf16 AdamW": adamw,
             "lp stochastic": lambda ps: lp.LowPrecisionOptimizer(adamw(ps), "bf16", rounding="stochastic",
                                                                  generator=0),
             "lp remainder": lambda ps: lp.LowPrecisionOptimizer(adamw(ps), "bf16", compensation="remainder"),
             f"lp stochastic{GENERIC}": lambda ps: lp.LowPrecisionOptimizer(adamw(ps), "bf16", rounding="stochastic",
                                                                             generator=0),
             f"lp remainder{GENERIC}": lambda ps: lp.LowPrecisionOptimizer(adamw(ps), "bf16", compensation="remainder"),
             FLOAT32_ADAMW: adamw}
    try:
        import torchao.optim as ao
        cases["torchao SR AdamW"] = lambda ps: (getattr(ao, "AdamW", None) or ao._AdamW)(
            ps, lr=1e-4, bf16_stochastic_round=True)
    except ImportError:
        pass
    try:
        import optimi
        cases["optimi Kahan AdamW"] = lambda ps: optimi.AdamW(ps, lr=1e-4, kahan_sum=True)
    except ImportError:
        pass
    return cases


def _generic(step):
    """``step`` with the fused step refused: the generic one (its rounding compiled as usual)."""
    def generic_step():
        with unittest.mock.patch.object(fused, "eligible", lambda opt: False):
            step()
    return generic_step


def optimizer_costs(repeats: int) -> list:
    """The whole step of each optimizer on the 29.4M-parameter bf16 model, and its ratio to plain bf16 AdamW."""
    cases = {}
    for name, build in _optimizers().items():
        model, loss = make_model("linear-30M", torch.float32 if name == FLOAT32_ADAMW else torch.bfloat16)
        cases[name] = _stepper(model, loss, build(model.parameters()))
        if name.endswith(GENERIC):
            cases[name] = _generic(cases[name])
        for _ in range(8):   # (torchao and the fused step compile their kernels in the first steps: 2**27 elements)
            cases[name]()
    times = median_times(cases, "cpu", repeats)
    plain = times["plain bf16 AdamW"]
    rows = [{"optimizer": name, "step_ms": 1e3 * t, "ratio": t / plain} for name, t in times.items()]
    for row in rows:
        print(f"optimizer {row['optimizer']:20s} {row['step_ms']:7.1f} ms  {row['ratio']:.2f}x", flush=True)
    return rows


def write_report(result: dict, stem: str) -> None:
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    m = result["machine"]
    lines = [f"# Costs: the watch's defaults and the SR / remainder optimizers ({result['date']})", "",
             f"Command: `{result['command']}`; {m['device_name']} ({cpu_label(m['cpu'] or {})}), "
             f"{m['threads']} thread, torch {m['torch']}, load average at the start {m['load_average_start']}; "
             f"{result['seconds']:.0f} s.", "",
             f"Targets stated before measuring: the watch at its defaults (sample {SAMPLE}, every step, a "
             f"{RUN_STEPS:,}-step run) <= {WATCH_TARGET}x a training step from 1M parameters up; the package's SR and "
             f"remainder optimizers on 29.4M bf16 parameters <= {OPTIMIZER_TARGET}x plain bf16 AdamW's whole step and "
             f"no slower than torchao's SR AdamW.", "",
             "## The watch at its defaults", "",
             "| model | parameters | dtype | mode | followed | plain step (ms) | watched (ms) | ratio | target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["watch"]:
        lines.append(f"| {r['model']} | {r['params']:,} | {r['dtype']} | {r['mode']} | {r['followed']:,} | "
                     f"{r['plain_ms']:.1f} | {r['watched_ms']:.1f} | {r['ratio']:.3f} | "
                     f"{'met' if r['ratio'] <= WATCH_TARGET else 'missed'} |")
    lines += ["", f"## What the sample costs in accuracy (gpt-1M, {ACCURACY_STEPS} steps, AdamW lr 1e-3, cosine)", "",
              "Absolute difference of the bf16 frozen fraction from the watch that follows every element, over every "
              "(sampled tensor, step) and over the model's overall fraction; and the tensors whose `frozen_since` "
              "(threshold 0.5) differs.", "",
              "| dtype | sample | tensors sampled | per tensor, max | per tensor, mean | overall, max | "
              "frozen_since differs |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["accuracy"]:
        lines.append(f"| {r['dtype']} | {r['sample']:,} | {r['sampled_tensors']} of {r['tensors']} | "
                     f"{r['max_abs_tensor']:.4f} | {r['mean_abs_tensor']:.4f} | {r['max_abs_overall']:.4f} | "
                     f"{r['frozen_since_differs']} of {r['frozen_since_of']} |")
    lines += ["", "## The optimizers on 29.4M parameters stored in bf16 (7 x 2048x2048 Linear, batch 16)", "",
              "| optimizer | whole step (ms) | ratio to plain bf16 AdamW |", "| --- | --- | --- |"]
    lines += [f"| {r['optimizer']} | {r['step_ms']:.1f} | {r['ratio']:.2f} |" for r in result["optimizers"]]
    ratio = {r["optimizer"]: r["ratio"] for r in result["optimizers"]}
    for name in ("lp stochastic", "lp remainder"):
        within, faster = ratio[name] <= OPTIMIZER_TARGET, ratio[name] <= ratio.get("torchao SR AdamW", math.inf)
        lines.append(f"\n{name}: {ratio[name]:.2f}x, {'within' if within else 'above'} {OPTIMIZER_TARGET}x "
                     f"(target {'met' if within else 'missed'}); {'no slower' if faster else 'slower'} than torchao's "
                     f"SR AdamW ({'met' if faster else 'missed'}).")
    if FLOAT32_ADAMW in ratio and "lp stochastic" + GENERIC in ratio:
        generic = {name: ratio[name + GENERIC] for name in ("lp stochastic", "lp remainder")}
        lines.append(f"\nThe generic step runs the user's torch AdamW on float32 working copies, whose step on float32 "
                     f"weights alone is {ratio[FLOAT32_ADAMW]:.2f}x plain bf16 AdamW's whole step here: "
                     f"{generic['lp stochastic']:.2f}x with SR, {generic['lp remainder']:.2f}x with the remainder. The "
                     f"fused step (`lowprec_demo.optim.fused`, the default once 2**27 elements have been stepped) "
                     f"reads the 2-byte weights and moments once, to the same bits.")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and no files written")
    parser.add_argument("--part", choices=("all", "watch", "accuracy", "optimizers"), default="all")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.time()
    repeats = 3 if args.quick else 9
    result = {"date": datetime.date.today().isoformat(), "machine": machine_record("cpu"),
              "command": "python benchmarks/costs.py" + (" --quick" if args.quick else "")
              + ("" if args.part == "all" else f" --part {args.part}"),
              "targets": {"watch": WATCH_TARGET, "optimizers": OPTIMIZER_TARGET}, "sample": SAMPLE}
    if args.part in ("all", "watch"):
        result["watch"] = watch_costs(("gpt-1M", "linear-5M", "linear-30M"), repeats)
    if args.part in ("all", "accuracy"):
        result["accuracy"] = watch_accuracy()
    if args.part in ("all", "optimizers"):
        result["optimizers"] = optimizer_costs(repeats)
    result["seconds"] = time.time() - start
    if not args.quick and args.part == "all":
        write_report(result, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"cpu-{result['date']}-costs"))
    return result


if __name__ == "__main__":
    main()
