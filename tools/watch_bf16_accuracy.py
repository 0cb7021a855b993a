"""How well the freeze watch forecasts a fine-tune stored in bf16 (observation mode, the update read from AdamW's state).

A small GPT (``lowprec_demo.book.models``, 2 layers, 64 wide) is pretrained in float32 on the first 85 % of the
character corpus (Tiny Shakespeare, or the offline stand-in), cast with ``model.to(torch.bfloat16)`` and fine-tuned on
the rest with AdamW (weight decay 0.1 on matrices) at a peak lr of 2e-5 and 1e-4, cosine to 0 over 200 steps, 3 seeds
(the batches). Measured:

(i)  per watched step, the frozen share the update meant predicts (``watch.expected_record()``, the rule
     ``q(w + d) == w``) against the observed one (weights the step left bit for bit the same): max |difference|, overall
     and over tensors;
(ii) the forecast made at 10 %, 25 % and 50 % of the run (``watch.forecast()``, threshold 0.5) against the observed
     freeze step at the end (``watch.frozen_since()``), overall and per tensor ("none": never frozen within the run).

    python tools/watch_bf16_accuracy.py              # writes benchmarks/watch-bf16-forecast.{md,json}
    python tools/watch_bf16_accuracy.py --steps 60 --seeds 1 --out /tmp/x    # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import lowprec_demo as lp                                                    # noqa: E402
from lowprec_demo.book.data.batches import TokenBatches                     # noqa: E402
from lowprec_demo.book.experiments.nanogpt import char_tokens               # noqa: E402
from lowprec_demo.book.models import GPT, gpt_config                        # noqa: E402
from lowprec_demo.freeze.records import steps_agree                         # noqa: E402

SHAPE = dict(n_layer=2, n_head=4, n_embd=64, block_size=64)
BATCH, PRETRAIN_STEPS, PRETRAIN_LR, SPLIT = 8, 600, 1e-3, 0.85
LRS, AT = (2e-5, 1e-4), (0.10, 0.25, 0.50)


def groups(model):
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def pretrain():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the offline corpus says so on every call; its name is recorded
        tokens, tokenizer, source = char_tokens()
    cut = int(len(tokens) * SPLIT)
    config = gpt_config("nanogpt-quick", vocab_size=tokenizer.vocab_size, **SHAPE)
    model = GPT(config, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(groups(model), lr=PRETRAIN_LR, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, PRETRAIN_STEPS, eta_min=PRETRAIN_LR / 10)
    batches = TokenBatches(tokens[:cut], SHAPE["block_size"], BATCH, seed=0, val_fraction=0.0)
    for step in range(PRETRAIN_STEPS):
        opt.zero_grad(set_to_none=True)
        model(*batches.get_batch(step))[1].backward()
        opt.step()
        sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, config, tokens[cut:], source


def finetune(state, config, tokens, lr, seed, steps):
    model = GPT(config)
    model.load_state_dict(state)
    model.to(torch.bfloat16)
    opt = torch.optim.AdamW(groups(model), lr=lr, betas=(0.9, 0.999), eps=1e-8)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    w = lp.watch(model, opt, scheduler=sched)
    batches = TokenBatches(tokens, SHAPE["block_size"], BATCH, seed=seed, val_fraction=0.0)
    forecasts = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(*batches.get_batch(step))[1].backward()
        opt.step()
        sched.step()
        for at in AT:
            if step + 1 == round(at * steps):
                forecasts[at] = w.forecast()
    w.detach()
    obs, exp = w.record(), w.expected_record()
    tensor_gaps = {n: max(abs(a - b) for a, b in zip(exp.by_tensor[n], obs.by_tensor[n])) for n in w.tracked}
    return {"lr": lr, "seed": seed, "steps": steps, "observed": obs.overall, "expected": exp.overall,
            "max_gap": max(abs(a - b) for a, b in zip(exp.overall, obs.overall)),
            "max_gap_tensor": max(tensor_gaps.items(), key=lambda kv: kv[1]),
            "frozen_at_end": obs.overall[-1], "observed_freeze": w.frozen_since(),
            "forecasts": {str(at): f for at, f in forecasts.items()}, "sizes": w.sizes}


def agreement(run, at):
    """Per forecast point: overall and per-tensor forecast vs observed freeze step (``steps_agree``: within
    max(2 steps, 2 % of the run), both none agree), counting the tensors not yet frozen when it was made apart."""
    f, obs, steps = run["forecasts"][str(at)], run["observed_freeze"], run["steps"]
    made = round(at * steps) - 1
    rows = {"overall": (f["overall"], f["low"], f["high"], obs["overall"])}
    rows |= {n: (b["step"], b["low"], b["high"], obs[n]) for n, b in f["by_tensor"].items()}
    open_ = [n for n, (*_, o) in rows.items() if n != "overall" and (o is None or o > made)]
    ok = {n: steps_agree(p, o, steps) for n, (p, _, _, o) in rows.items()}
    in_band = {n: (o is None and h is None) or (o is not None and lo is not None and lo <= o <= (steps if h is None
                                                                                               else h))
               for n, (p, lo, h, o) in rows.items()}
    errors = [abs((steps if p is None else p) - (steps if o is None else o))     # none: counted as the run's end
              for n, (p, _, _, o) in rows.items() if n in open_]
    return {"overall": rows["overall"], "overall_agrees": ok["overall"], "tensors": len(rows) - 1,
            "tensors_agree": sum(ok[n] for n in rows if n != "overall"), "open": len(open_),
            "open_agree": sum(ok[n] for n in open_), "open_in_band": sum(in_band[n] for n in open_),
            "open_within_10pct": sum(e <= 0.1 * steps for e in errors),
            "open_median_error": sorted(errors)[len(errors) // 2] if errors else None,
            "open_misses": {n: rows[n][0::3] for n in open_ if not ok[n]}}


def show(x):
    return "none" if x is None else str(x)


def markdown(meta, runs) -> str:
    lines = ["# Freeze watch on a bf16-stored fine-tune: expected vs observed, and the forecast",
             "", f"{meta['date']}; {meta['cpu']} ({meta['threads']} threads), torch {meta['torch']}, commit "
             f"{meta['commit']}; data: {meta['source']}; run time {meta['seconds']:.0f} s.", "",
             f"GPT {SHAPE} pretrained in float32 ({PRETRAIN_STEPS} steps, AdamW {PRETRAIN_LR:g}), then "
             f"`model.to(torch.bfloat16)` and fine-tuned with torch's AdamW (wd 0.1 on matrices), cosine to 0 over "
             f"{runs[0]['steps']} steps; the watch in observation mode reads the update meant from AdamW's state.", "",
             "## (i) Frozen share per watched step: expected (update meant, rule q(w + d) == w) vs observed", "",
             "| peak lr | seed | max abs diff, overall | largest per-tensor max abs diff | frozen at the end |",
             "|---|---|---|---|---|"]
    for r in runs:
        n, g = r["max_gap_tensor"]
        lines.append(f"| {r['lr']:g} | {r['seed']} | {r['max_gap']:.4f} | {g:.4f} ({n}) | {r['frozen_at_end']:.3f} |")
    lines += ["", f"Worst over all runs, overall: {max(r['max_gap'] for r in runs):.4f}.", "",
              "## (ii) Forecast at 10 %, 25 %, 50 % of the run vs the observed freeze step (threshold 0.5)", "",
              "Overall: forecast step (band) / observed. Tensors: forecasts within max(2 steps, 2 % of the run) of "
              "the observed step (both none agree), among all tensors and among those not yet frozen when the "
              "forecast was made (*open*), with how many of those the band holds, how many are within 10 % of the "
              "run, and their median error in steps.", "",
              "| peak lr | seed | made at | overall forecast (band) | observed | agrees | tensors agree | open agree "
              "| open in band | open within 10 % | open median error |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        for at in AT:
            a = agreement(r, at)
            p, lo, hi, o = a["overall"]
            lines.append(f"| {r['lr']:g} | {r['seed']} | step {round(at * r['steps']) - 1} ({at:.0%}) | {show(p)} "
                         f"({show(lo)}-{'end' if hi is None else hi}) | {show(o)} | {'yes' if a['overall_agrees'] else 'no'} "
                         f"| {a['tensors_agree']}/{a['tensors']} | {a['open_agree']}/{a['open']} | "
                         f"{a['open_in_band']}/{a['open']} | {a['open_within_10pct']}/{a['open']} | "
                         f"{show(a['open_median_error'])} |")
    last = max((r["observed_freeze"]["overall"] for r in runs), key=lambda x: -1 if x is None else x)
    lines += ["", f"The observed overall freeze step is {show(last)} at the latest (of {runs[0]['steps']} steps): "
              f"where the whole model passes the threshold within the first steps, the overall forecast has little to "
              f"predict, and the tensors still open when the forecast is made are the test."]
    misses = [(r["lr"], r["seed"], at, agreement(r, at)["open_misses"]) for r in runs for at in AT]
    lines += ["", "Open tensors whose forecast missed (forecast, observed):", ""]
    lines += [f"- lr {lr:g}, seed {seed}, at {at:.0%}: " + ", ".join(f"{n} ({show(p)}, {show(o)})"
                                                                     for n, (p, o) in m.items())
              for lr, seed, at, m in misses if m] or ["- none"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "watch-bf16-forecast"))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    state, config, tokens, source = pretrain()
    runs = [finetune(state, config, tokens, lr, seed, args.steps) for lr in LRS for seed in range(args.seeds)]
    try:
        from machine import machine_record, cpu_label
        record = machine_record("cpu")
        cpu = f"{record['device_name']}, {cpu_label(record['cpu'] or {})}"
    except Exception as error:     # the benchmark helpers unusable here: /proc/cpuinfo's model name
        record = {"error": repr(error)}
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), "unknown CPU")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu, "machine": record,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "source": source,
            "commit": record.get("git_commit") or "unknown", "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "sizes"} | {"agreement": {str(at): agreement(r, at) for at in AT}}
               for r in runs]
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "shape": SHAPE, "runs": summary}, indent=1))
    out.with_suffix(".md").write_text(markdown(meta, runs))
    print(markdown(meta, runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
