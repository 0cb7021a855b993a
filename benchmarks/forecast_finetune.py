"""How well the freeze watch's relative forecast (``watch.forecast(relative=0.9)``) holds on a bf16 fine-tune.

The book's fine-tune (:func:`lowprec_demo.book.finetune.finetune`: a small GPT pretrained in float32 on Tiny
Shakespeare, cast to bf16, 300 steps of torch's AdamW, 5 % warmup then cosine to 0) starts over half frozen, so the
absolute forecast at the default threshold 0.5 reads "0 (0-0)" everywhere. The relative forecast gives per tensor the
step from which its measured frozen share stays at or above ``base + 0.9 (1 - base)`` (``base``: its least frozen
share), with a band. The band's constants (:data:`lowprec_demo.monitor.forecast.BAND_OCTAVES` = (0.5, 2.5)) were
chosen on the DESIGN runs (asked at steps 30, 60, 120) and fixed before the HELDOUT runs (other seeds, learning rates,
a second pretraining seed, asked at steps 15, 45, 90, 150) were scored.

Scored: each (tensor or the whole model, run, asked-at step) whose observed passage of the level it was given came after
the step it was asked at (*open*: still to come; never within the run counts, as "none"): is the observed step within
[low, high] (high None: the run's end)? Target, stated before the held-out runs: at least 80 % of the held-out open
pairs. Beside it, the absolute forecast at threshold 0.9 (the issue's trial) scored the same way on the same runs.

The watch's state at step k is the live one: a step post-hook, registered after the watch's own (through a wrapper of
``lowprec_demo.watch`` for the length of each run), asks the forecast after the k-th step.

    python benchmarks/forecast_finetune.py --sample 16384   # writes benchmarks/cpu-2026-12-06-forecast-finetune.*
    python benchmarks/forecast_finetune.py --sample 1024 --out benchmarks/cpu-2026-12-06-forecast-finetune-sample1024
    python benchmarks/forecast_finetune.py --quick --out /tmp/ff    # one design and one held-out run
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import lowprec_demo as lp                                          # noqa: E402
from lowprec_demo.book import finetune as ft                      # noqa: E402
from lowprec_demo.freeze.records import freeze_step                # noqa: E402
from lowprec_demo.monitor import forecast as F                     # noqa: E402

DESIGN = dict(runs=[(2e-5, 0, 0), (2e-5, 1, 0), (1e-4, 0, 0), (1e-4, 1, 0)], asked=(30, 60, 120))
HELDOUT = dict(runs=[(1e-5, 2, 0), (5e-5, 2, 0), (2e-4, 2, 0), (1e-5, 3, 0), (5e-5, 3, 0), (2e-4, 3, 0),
                     (5e-5, 4, 1), (1e-4, 4, 1)], asked=(15, 45, 90, 150))
TARGET = 0.80


def run(lr: float, seed: int, pretrain_seed: int, asked, sample=None) -> dict:
    """One fine-tune, its forecasts (relative 0.9 and absolute 0.9) after each asked-at step, its final records."""
    made, real = {}, lp.watch

    def watch_and_ask(model, optimizer, **options):
        w = real(model, optimizer, **options)

        def ask(*_):
            if len(w.steps) in asked:
                made[len(w.steps)] = {"relative": w.forecast(relative=0.9), "absolute": w.forecast(threshold=0.9)}
        w.optimizer.register_step_post_hook(ask)
        return w

    start = time.perf_counter()
    with mock.patch.object(lp, "watch", watch_and_ask):
        r = ft.finetune("bf16", seed=seed, lr=lr, pretrain_seed=pretrain_seed,
                        watch={} if sample is None else {"sample": sample})
    w = r["watch"]
    rec = w.record()
    return {"lr": lr, "seed": seed, "pretrain_seed": pretrain_seed, "steps": w.steps, "sizes": w.sizes,
            "overall": rec.overall, "by_tensor": rec.by_tensor, "made": made, "seconds": time.perf_counter() - start,
            "start_loss": r["start_loss"], "final_loss": r["final_loss"], "frozen_first": rec.overall[0]}


def score(r: dict, kind: str) -> list:
    """Per (asked-at, tensor): the forecast, its band, the level and the observed passage step, and whether open."""
    out, end = [], r["steps"][-1] + 1
    for k, both in sorted(r["made"].items()):
        fc = both[kind]
        rows = [("(all)", fc, r["overall"])] + [(n, b, r["by_tensor"][n]) for n, b in fc["by_tensor"].items()]
        for name, b, values in rows:
            band = (fc["overall"], fc["low"], fc["high"]) if name == "(all)" else (b["step"], b["low"], b["high"])
            level = (fc if name == "(all)" else b).get("level", 0.9)
            i = freeze_step(values, level)
            observed = None if i is None else r["steps"][i]
            step, low, high = band
            inside = (observed is None and high is None) or (observed is not None and low is not None
                                                             and low <= observed <= (end if high is None else high))
            out.append({"asked": k, "tensor": name, "step": step, "low": low, "high": high, "level": level,
                        "observed": observed, "open": observed is None or observed >= k, "in_band": inside,
                        "width": (end if high is None else high) - (0 if low is None else low),
                        "error": None if step is None or observed is None else step - observed})
    return out


def tally(rows: list) -> dict:
    opened = [x for x in rows if x["open"]]
    errors = [abs(x["error"]) for x in opened if x["error"] is not None]
    return {"pairs": len(rows), "in_band": sum(x["in_band"] for x in rows), "open": len(opened),
            "open_in_band": sum(x["in_band"] for x in opened),
            "coverage_open": sum(x["in_band"] for x in opened) / max(1, len(opened)),
            "median_width_open": statistics.median([x["width"] for x in opened]) if opened else None,
            "median_abs_error_open": statistics.median(errors) if errors else None}


def show(x) -> str:
    return "none" if x is None else str(x)


def markdown(meta: dict, sets: dict) -> str:
    lines = ["# The relative forecast on the book's bf16 fine-tune: band coverage on held-out runs", "",
             f"{meta['date']}; {meta['cpu']} ({meta['threads']} thread), torch {meta['torch']}, commit "
             f"{meta['commit']}; data: {meta['source']}; run time {meta['seconds']:.0f} s.", "",
             f"Command: `{meta['command']}`", "",
             f"Fine-tune: `lowprec_demo.book.finetune.finetune('bf16', seed, lr, pretrain_seed, watch=...)`, the "
             f"watch following up to {meta['sample']} elements per tensor (`sample`), 300 steps, "
             "AdamW, 5 % warmup then cosine to 0, bf16 weights and Adam state, the watch in observation mode. "
             "Forecast: `watch.forecast(relative=0.9)` after the k-th step: per tensor the step from which its "
             "frozen share stays at or above `base + 0.9 (1 - base)`; its band constants "
             f"`BAND_OCTAVES = {F.BAND_OCTAVES}` chosen on the design runs and fixed before the held-out runs were "
             f"scored. **Target (stated before): the band holds the observed step for at least {TARGET:.0%} of the "
             "held-out open pairs** (tensor or whole model, run, asked-at step, whose observed passage comes after "
             "the step asked at; none within the run counts and is held by a band that reaches the end).", ""]
    for name, (spec, runs) in sets.items():
        lines += [f"## {name} runs: (lr, seed, pretrain seed) {', '.join(str(x) for x in spec['runs'])}; asked at "
                  f"steps {', '.join(map(str, spec['asked']))}", "",
                  "| lr | seed | pretrain seed | frozen at step 0 | asked at | open pairs | in band | median width "
                  "| median abs error | absolute 0.9: open in band |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            rel, ab = score(r, "relative"), score(r, "absolute")
            for k in spec["asked"]:
                t = tally([x for x in rel if x["asked"] == k])
                a = tally([x for x in ab if x["asked"] == k])
                lines.append(f"| {r['lr']:g} | {r['seed']} | {r['pretrain_seed']} | {r['frozen_first']:.3f} | {k} | "
                             f"{t['open']} | {t['open_in_band']} | {show(t['median_width_open'])} | "
                             f"{show(t['median_abs_error_open'])} | {a['open_in_band']}/{a['open']} |")
        t = tally([x for r in runs for x in score(r, "relative")])
        a = tally([x for r in runs for x in score(r, "absolute")])
        lines += ["", f"**{name}: the relative band held {t['open_in_band']} of {t['open']} open pairs "
                  f"({t['coverage_open']:.1%}); median width {show(t['median_width_open'])} steps of 300, median "
                  f"|error| of the point forecast {show(t['median_abs_error_open'])} steps; all pairs (passed already "
                  f"included): {t['in_band']}/{t['pairs']}.** The absolute forecast at threshold 0.9 on the same runs: "
                  f"{a['open_in_band']} of {a['open']} open pairs ({a['coverage_open']:.1%}).", ""]
        scored = [(r, x) for r in runs for x in score(r, "relative") if x["open"]]
        for what, key in (("asked at step", lambda r, x: x["asked"]), ("peak lr", lambda r, x: r["lr"])):
            groups = {}
            for r, x in scored:
                groups.setdefault(key(r, x), []).append(x["in_band"])
            lines.append(f"By {what}: " + "; ".join(f"{k:g} {sum(v)}/{len(v)} ({sum(v) / len(v):.0%})"
                                                    for k, v in sorted(groups.items())) + ".")
        lines.append("")
        if name == "Held-out":
            misses = [(r["lr"], r["seed"], r["pretrain_seed"], x) for r in runs for x in score(r, "relative")
                      if x["open"] and not x["in_band"]]
            lines += ["Held-out misses (forecast (band) / observed):", ""]
            lines += [f"- lr {lr:g}, seed {s}, pretrain {p}, asked at {x['asked']}: {x['tensor']} {show(x['step'])} "
                      f"({show(x['low'])}-{'end' if x['high'] is None else x['high']}) / {show(x['observed'])}"
                      for lr, s, p, x in misses] or ["- none"]
            lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one design and one held-out run")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "cpu-2026-12-06-forecast-finetune"))
    parser.add_argument("--sample", type=int, default=None, help="the watch's elements followed per tensor "
                        "(default: the watch's default)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    sets = {"Design": DESIGN, "Held-out": HELDOUT}
    if args.quick:
        sets = {k: dict(v, runs=v["runs"][:1]) for k, v in sets.items()}
    done = {name: (spec, [run(*x, spec["asked"], args.sample) for x in spec["runs"]]) for name, spec in sets.items()}
    sample = args.sample or inspect.signature(lp.watch).parameters["sample"].default
    from machine import machine_record, cpu_label
    record = machine_record("cpu")
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": record,
            "cpu": f"{record['device_name']}, {cpu_label(record['cpu'] or {})}", "threads": torch.get_num_threads(),
            "torch": torch.__version__, "commit": record.get("git_commit") or "unknown",
            "source": ft.pretrained(0)[2].source, "seconds": time.perf_counter() - start,
            "command": " ".join(["python benchmarks/forecast_finetune.py", *(sys.argv[1:] if argv is None else argv)]),
            "sample": sample,
            "band_octaves": F.BAND_OCTAVES, "relative": 0.9, "target": TARGET}
    out = Path(args.out)
    summary = {name: {"spec": {"runs": spec["runs"], "asked": spec["asked"]},
                      "relative": tally([x for r in runs for x in score(r, "relative")]),
                      "absolute_0.9": tally([x for r in runs for x in score(r, "absolute")]),
                      "runs": [{k: r[k] for k in ("lr", "seed", "pretrain_seed", "frozen_first", "start_loss",
                                                  "final_loss", "seconds")}
                               | {"relative": score(r, "relative"), "absolute_0.9": score(r, "absolute")}
                               for r in runs]}
               for name, (spec, runs) in done.items()}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "sets": summary}, indent=1))
    text = markdown(meta, done)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
