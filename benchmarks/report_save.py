"""What a saved freeze-watch report costs with the forecast's inputs in it: ``python benchmarks/report_save.py``.

A model of 24 Linear(256, 256) and LayerNorm(256) layers (48 tensors, 790k parameters) under AdamW and a cosine
(``LambdaLR``) is watched for 20 steps of a run of ``total_steps`` (300, a fine-tune; 10,000, a pretraining run), then
saved (``watch.save``) with the forecast's inputs (``"forecast_state"``, :mod:`lowprec_demo.monitor.saved`) and
without them (as before), in interleaved rounds, one thread; the smallest time of the rounds is kept. The saved report
is read back (``lp.load_watch``) and its ``forecast()`` compared with the live watch's, in prediction (float32
parameters) and in observation (the same model in bf16), at thresholds 0.5 and 0.9.

Targets, fixed after one exploratory run on the same machine (not tuned toward afterwards):

* the read-back forecast equal to the live watch's (the same dict), every case;
* a save with the state within 1.25 times a save without it, and the file within 1.5 times.

``--out PREFIX`` writes ``PREFIX.json`` and ``PREFIX.md``.

Example:
    ``python benchmarks/report_save.py --out benchmarks/cpu-2026-12-06-report-save``
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

import lowprec_demo as lp
from lowprec_demo.monitor import report as report_module
from machine import cpu_label, machine_record, save_run

TARGETS = {"time_ratio": 1.25, "size_ratio": 1.5}


def watched_run(total: int, dtype=torch.float32, steps: int = 20):
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256)]
    model = torch.nn.Sequential(*layers).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / total)))
    w = lp.watch(model, opt, scheduler=sched, total_steps=total)
    x = torch.randn(64, 256, dtype=dtype)
    for _ in range(steps):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
        sched.step()
    return w


def measure(total: int, rounds: int, folder: str) -> dict:
    w = watched_run(total)
    paths = {k: os.path.join(folder, f"{k}-{total}.json") for k in ("with", "without")}
    times = {"with": [], "without": []}
    state = report_module.forecast_state
    for _ in range(rounds):
        for kind in ("with", "without"):
            report_module.forecast_state = state if kind == "with" else (lambda watch: None)
            try:
                start = time.perf_counter()
                w.save(paths[kind])
                times[kind].append(time.perf_counter() - start)
            finally:
                report_module.forecast_state = state
    sizes = {k: os.path.getsize(p) for k, p in paths.items()}
    start = time.perf_counter()
    lp.load_watch(paths["with"]).forecast()
    read_s = time.perf_counter() - start
    equal = {}
    for mode, watch in (("predict", w), ("observe", watched_run(total, torch.bfloat16))):
        watch.save(paths["with"])
        saved = lp.load_watch(paths["with"])
        for tau in (0.5, 0.9):
            equal[f"{mode}, threshold {tau}"] = saved.forecast(threshold=tau) == watch.forecast(threshold=tau)
    out = {"total_steps": total, "tensors": len(w.tracked), "parameters": sum(w.sizes.values()),
           "save_s": {k: min(v) for k, v in times.items()}, "rounds": rounds, "size_bytes": sizes,
           "load_and_forecast_s": read_s, "forecast_equal": equal}
    out["time_ratio"] = out["save_s"]["with"] / out["save_s"]["without"]
    out["size_ratio"] = out["size_bytes"]["with"] / out["size_bytes"]["without"]
    out["met"] = {"equal": all(equal.values()), "time": out["time_ratio"] <= TARGETS["time_ratio"],
                  "size": out["size_ratio"] <= TARGETS["size_ratio"]}
    return out


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = ["# A saved freeze-watch report with the forecast's inputs: its cost", "",
             f"Machine: {cpu_label(m['cpu'] or {})} ({m['device_name']}), {m['threads']} thread, torch {m['torch']}, "
             f"lowprec_demo {m['package_version']} at {m['git_commit']}, {m['date']}; load average at the start "
             f"{m['load_average_start']} on {m['cpu_count']} cores (a shared machine: the times vary run to run).",
             f"Command: `{result['command']}`", "",
             f"Targets (fixed before this run): the read-back forecast equal to the live watch's in every case; a save "
             f"with the state within {TARGETS['time_ratio']}x of one without, the file within "
             f"{TARGETS['size_ratio']}x.", "",
             "| run length | tensors | save without (s) | save with (s) | ratio | file without (MB) | file with (MB) | "
             "ratio | load + forecast (s) | forecast equal | targets met |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        s, b = r["save_s"], r["size_bytes"]
        lines.append(f"| {r['total_steps']:,} | {r['tensors']} | {s['without']:.3f} | {s['with']:.3f} | "
                     f"{r['time_ratio']:.2f} | {b['without'] / 1e6:.2f} | {b['with'] / 1e6:.2f} | "
                     f"{r['size_ratio']:.2f} | "
                     f"{r['load_and_forecast_s']:.3f} | {sum(r['forecast_equal'].values())} of "
                     f"{len(r['forecast_equal'])} | {'yes' if all(r['met'].values()) else 'NO: ' + str(r['met'])} |")
    lines += ["", "Forecast equal: prediction and observation (bf16 parameters), thresholds 0.5 and 0.9. Most of a "
              "long run's file and save time is the forecast curves the report already kept (a value per tensor and "
              "step ahead), not the state."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--totals", default="300,10000", help="run lengths, comma separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="PREFIX for PREFIX.json and PREFIX.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = {"machine": machine_record("cpu"), "command": "python " + " ".join(sys.argv), "targets": TARGETS}
    with tempfile.TemporaryDirectory() as folder:
        result["runs"] = [measure(int(t), args.rounds, folder) for t in args.totals.split(",")]
    text = markdown(result)
    print(text)
    if args.out:
        save_run(args.out, result, text)


if __name__ == "__main__":
    main()
