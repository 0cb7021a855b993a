"""The practitioner's bf16 fine-tune side by side: ``python benchmarks/finetune_bf16.py``.

Every variant of :data:`lowprec_demo.book.finetune.VARIANTS` fine-tunes the same float32-pretrained GPT (cast to bf16
for all but the reference) for each seed. Per variant: the final held-out loss minus float32's (mean, and min-max over
the seeds), the fraction of float32's loss improvement it makes, the bytes per parameter the process holds for
training (parameters plus every tensor reachable from the optimizer and its wrapper, :func:`finetune.held_bytes`; the
package's own count, :func:`lowprec_demo.bytes_per_parameter`, beside it), and the median time of a
whole training step, measured after the runs in interleaved rounds (every variant once per round,
:func:`timing.median_times`) so that ratios are fair; the step of our stochastic rounding against torchao's is the
median of the per-round ratios. The remainder variant is compared bit for bit with float32 master weights.

Targets, stated before measuring (not tuned toward):

* ``lp_stochastic``'s step within 1.1 times ``torchao_sr``'s;
* the plan's loss within the seed spread of the best remedy (its mean at most the best's worst seed), at no more than
  1 byte per parameter held above plain bf16 (``lp_plan``: made by the watch on the bf16 run after a tenth of it and
  applied from there; ``lp_plan_restart``: the same plan applied from the start of a second run, the first a probe;
  ``lp_plan_remainder``: that, the plan free to give the 16-bit remainder);
* ``lp_remainder``'s final weights bit-equal to ``lp_master``'s, every seed.

A variant that raises is reported with its message. ``--out PREFIX`` writes ``PREFIX.json`` and ``PREFIX.md``.

Example:
    ``python benchmarks/finetune_bf16.py --seeds 0,1,2 --out benchmarks/cpu-2026-12-06-finetune-bf16``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

from lowprec_demo.book import finetune as ft
from machine import cpu_label, load_average, machine_record, save_run
from timing import median_times

TARGETS = {"sr_step_ratio": 1.1, "plan_extra_bytes": 1.0}


def _set_lr(opt, lr: float) -> None:
    """The peak learning rate back for the timing rounds (the schedule ended at 0)."""
    for group in opt.param_groups:
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def _bits(model) -> list:
    return [p.detach().view(torch.int16).clone() if p.dtype == torch.bfloat16 else p.detach().clone()
            for p in model.parameters()]


def run(variants, seeds, lr, steps, quick, repeats) -> dict:
    torch.set_num_threads(1)
    start = time.time()
    _, _, data = ft.pretrained(0, quick)
    pretrain_s = time.time() - start
    runs, errors, timed, bits = {v: [] for v in variants}, {}, {}, {}
    for seed in seeds:
        for v in variants:
            if v in errors:
                continue
            try:
                t0 = time.time()
                r = ft.finetune(v, seed, lr=lr, steps=steps, quick=quick)
            except Exception as exc:     # a variant the package does not support yet: report it, go on
                errors[v] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc(limit=2)
                continue
            runs[v].append(dict(seed=seed, final_loss=r["final_loss"], held=r["bytes_per_parameter_held"],
                                nominal=r["bytes_per_parameter"], step_ms_in_run=r["step_ms"], wall_s=time.time() - t0,
                                plan=None if r["plan"] is None else r["plan"].summary(show=False)))
            if v in ("lp_master", "lp_remainder"):
                bits.setdefault(seed, {})[v] = _bits(r["model"])
            if seed == seeds[0]:
                _set_lr(r["optimizer"], lr)
                timed[v] = r["step"]
            print(f"seed {seed} {v:14s} loss {r['final_loss']:.5f} held {r['bytes_per_parameter_held']:.2f} B/param "
                  f"step {r['step_ms']:.2f} ms ({time.time() - t0:.1f} s)", flush=True)
    rounds: dict = {}
    medians = median_times(timed, "cpu", repeats, warmup=2, min_seconds=0.05, per_round=rounds)
    ref = statistics.fmean(r["final_loss"] for r in runs["fp32"]) if runs.get("fp32") else None
    rows = []
    for v in variants:
        rs = runs[v]
        if not rs:
            rows.append(dict(variant=v, error=errors.get(v)))
            continue
        by_seed = {r["seed"]: r["final_loss"] for r in runs.get("fp32", [])}
        deltas = [r["final_loss"] - by_seed[r["seed"]] for r in rs if r["seed"] in by_seed]
        loss = statistics.fmean(r["final_loss"] for r in rs)
        rows.append(dict(variant=v, seeds=[r["seed"] for r in rs], final_loss=loss, delta_mean=statistics.fmean(deltas),
                         delta_min=min(deltas), delta_max=max(deltas),
                         fraction=(data.start_loss - loss) / (data.start_loss - ref) if ref is not None else None,
                         held=statistics.fmean(r["held"] for r in rs),
                         nominal=statistics.fmean(r["nominal"] for r in rs),
                         step_ms=1e3 * medians[v] if v in medians else None,
                         step_ms_in_run=statistics.median(r["step_ms_in_run"] for r in rs),
                         runs=rs, error=errors.get(v)))
    return dict(rows=rows, errors=errors, rounds={k: [1e3 * t for t in ts] for k, ts in rounds.items()},
                bit_equal=_bit_equal(bits), start_loss=data.start_loss, source=data.source, pretrain_s=pretrain_s,
                verdicts=_verdicts(rows, rounds, _bit_equal(bits)))


def _bit_equal(bits: dict) -> dict:
    out = {}
    for seed, got in bits.items():
        if len(got) == 2:
            a, b = got["lp_master"], got["lp_remainder"]
            out[seed] = dict(equal=all(torch.equal(x, y) for x, y in zip(a, b)), elements=sum(x.numel() for x in a),
                             differing=int(sum((x != y).sum() for x, y in zip(a, b))))
    return out


def _verdicts(rows, rounds, bit_equal) -> dict:
    by = {r["variant"]: r for r in rows if "delta_mean" in r}
    out = {}
    if "lp_stochastic" in rounds and "torchao_sr" in rounds:
        ratios = [a / b for a, b in zip(rounds["lp_stochastic"], rounds["torchao_sr"])]
        ratio = statistics.median(ratios)
        out["sr_step_ratio"] = dict(measured=ratio, quartiles=statistics.quantiles(ratios, n=4)[::2],
                                    target=TARGETS["sr_step_ratio"], met=ratio <= TARGETS["sr_step_ratio"])
    plans = [v for v in ("lp_plan", "lp_plan_restart", "lp_plan_remainder") if v in by]
    remedies = [v for v in by if v not in ("fp32", "bf16", "lp_nearest", *plans)]
    for name in plans if "bf16" in by and remedies else ():
        best = min(remedies, key=lambda v: by[v]["delta_mean"])
        plan, extra = by[name], by[name]["held"] - by["bf16"]["held"]
        out[name] = dict(best=best, best_spread=[by[best]["delta_min"], by[best]["delta_max"]],
                         plan_delta=plan["delta_mean"], extra_bytes_held=extra,
                         extra_bytes_nominal=plan["nominal"] - by["bf16"]["nominal"],
                         met=plan["delta_mean"] <= by[best]["delta_max"] and extra <= TARGETS["plan_extra_bytes"])
    if bit_equal:
        out["remainder_bit_equal_master"] = dict(per_seed=bit_equal, met=all(b["equal"] for b in bit_equal.values()))
    return out


def _fmt(x, digits=4):
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    m = result["machine"]
    cpu = f", {cpu_label(m['cpu'])}" if m.get("cpu") else ""
    s = result["settings"]
    out = [f"# The practitioner's bf16 fine-tune, {m['date']}",
           f"{m['device_name']}{cpu} (cpu, {m['threads']} thread of {m['cpu_count']} cores), torch {m['torch']}, "
           f"load average {m['load_average_start']} at start, {m.get('load_average_end')} at end, lowprec_demo "
           f"{m.get('package_version')} at commit {m.get('git_commit') or 'unknown'}", "",
           f"Command: `{result['command']}`", "",
           f"Pretrained in float32 on the first 85 % of {result['source']}, held-out loss {result['start_loss']:.4f}; "
           f"fine-tuned on the last 15 %, {s['steps']} steps of AdamW at peak lr {s['lr']:g} (5 % warmup, cosine "
           f"to 0), "
           f"seeds {s['seeds']}; losses on a fixed held-out batch set, weights evaluated in float32. Step times: "
           f"median of {s['repeats']} interleaved rounds, seed {s['seeds'][0]}'s models after their run.", "",
           "| variant | loss - fp32 (mean) | min to max over seeds | of fp32's improvement | bytes/param held | "
           "package's count | step ms | step / bf16's | status |", "|" + " --- |" * 9]
    rows = {r["variant"]: r for r in result["rows"]}
    bf16_ms = rows.get("bf16", {}).get("step_ms")
    for r in result["rows"]:
        if "delta_mean" not in r:
            out.append(f"| {r['variant']} | - | - | - | - | - | - | - | failed: {r['error']} |")
            continue
        ratio = None if not (bf16_ms and r["step_ms"]) else r["step_ms"] / bf16_ms
        out.append(f"| {r['variant']} | {r['delta_mean']:+.4f} | {r['delta_min']:+.4f} to {r['delta_max']:+.4f} | "
                   f"{_fmt(100 * r['fraction'] if r['fraction'] is not None else None, 0)} % | {r['held']:.2f} | "
                   f"{r['nominal']:.2f} | {_fmt(r['step_ms'], 2)} | {_fmt(ratio, 2)} | ok |")
    out += ["", "## Targets", ""]
    v = result["verdicts"]
    if "sr_step_ratio" in v:
        x = v["sr_step_ratio"]
        out.append(f"* lp_stochastic's step / torchao_sr's: {x['measured']:.3f} (quartiles of the per-round ratios "
                   f"{x['quartiles'][0]:.3f} to {x['quartiles'][1]:.3f}); target <= {x['target']}: "
                   f"{'met' if x['met'] else 'NOT met'}")
    for name in (n for n in ("lp_plan", "lp_plan_restart", "lp_plan_remainder") if n in v):
        x = v[name]
        out.append(f"* {name}: loss - fp32 {x['plan_delta']:+.4f} against the best remedy ({x['best']}) "
                   f"{x['best_spread'][0]:+.4f} to {x['best_spread'][1]:+.4f}; {x['extra_bytes_held']:.2f} bytes/param "
                   f"held above plain bf16 (package's count: {_fmt(x['extra_bytes_nominal'], 2)}); target within the "
                   f"spread at <= 1 byte: {'met' if x['met'] else 'NOT met'}")
    if "remainder_bit_equal_master" in v:
        x = v["remainder_bit_equal_master"]
        per = ", ".join(f"seed {seed}: " + ("equal" if b["equal"] else f"{b['differing']} of {b['elements']} differ")
                        for seed, b in x["per_seed"].items())
        out.append(f"* lp_remainder's final weights bit-equal to lp_master's: {per}: "
                   f"{'met' if x['met'] else 'NOT met'}. (A stored bf16 weight rounded to nearest and 16 bits cannot "
                   f"hold every float32 master: an even stored weight has 2^16 + 1 masters that round to it. The one "
                   f"left out, exactly halfway above, about one element-step in 2^17, is kept a float32 ulp nearer "
                   f"the stored weight; from there the two runs may part.)")
    return "\n".join(out) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(ft.VARIANTS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--full", action="store_true", help="the full-size model (default: quick)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--out", default=None, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    seeds, variants = [int(s) for s in args.seeds.split(",")], args.variants.split(",")
    machine = machine_record("cpu")
    result = run(variants, seeds, args.lr, args.steps, not args.full, args.repeats)
    machine["threads"], machine["load_average_end"] = torch.get_num_threads(), load_average()
    steps = args.steps or ft.SETTINGS[not args.full]["steps"]
    result.update(machine=machine, command="python " + " ".join(sys.argv),
                  settings=dict(seeds=seeds, lr=args.lr, steps=steps, quick=not args.full, repeats=args.repeats,
                                targets=TARGETS))
    text = markdown(result)
    print(text)
    if args.out:
        save_run(args.out, result, text)


if __name__ == "__main__":
    main()
