"""The preflight measured on held-out bf16 fine-tunes: ``python benchmarks/preflight_heldout.py --phase PHASE``.

Each run is the book's practitioner's fine-tune (:func:`lowprec_demo.book.finetune.finetune`, quick mode: a small GPT
pretrained in float32, cast to bf16, AdamW with 5 % warmup and a cosine to 0) at a peak learning rate, length, batch
seed and pretraining seed. Before its first step, :func:`lowprec_demo.preflight` gets the run's own model, optimizer and
scheduler (the finetune's ``before_run`` hook) and the loss of the run's batches; then plain bf16 and float32 runs
measure bf16's share of float32's loss improvement (held-out loss, ``(start - bf16) / (start - fp32)``). A run *needs*
a remedy when bf16 loses at least 10 % of float32's improvement, needs *none* when it loses at most 2 %; between, no
target. Runs where float32 does not improve the held-out loss (``start - fp32 <= 0``, a rate too high) are reported
and left out of the verdicts: there is no improvement to lose.

Per element, "moves at step t": over the probe's steps, the preflight's float32 copy's update against half a bf16 gap
(``not lp.would_freeze(q(w), d, "bf16")``, the copy made as the preflight makes it) against whether the real bf16 run's
stored weight changed at that step; counted only over elements whose gradient in the real run is nonzero at that step.
Precision and recall of "moves" are reported beside TRL #5417's about 30 % recall.

Targets, stated before measuring: a remedy recommended (``needs_remedy``) on every held-out run that needs one, none
on every held-out run that needs none; recall of "moves" above TRL's 30 %.

Phases: ``calibrate`` runs :data:`CALIBRATION` and proposes a cutoff of the predicted frozen share
(:func:`propose_cutoff`); the cutoff is then written into
``lowprec_demo/monitor/preflight.py`` (``CUTOFF``) and committed; ``heldout`` runs :data:`HELDOUT` with the committed
cutoff and writes ``--out PREFIX`` ``.json`` and ``.md`` (the calibration read back from ``--calibration``).

Example:
    ``python benchmarks/preflight_heldout.py --phase calibrate --json /tmp/calibration.json``
    ``python benchmarks/preflight_heldout.py --phase heldout --calibration /tmp/calibration.json
    --out benchmarks/cpu-2026-12-06-preflight``
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time

import torch

import lowprec_demo as lp
from lowprec_demo.book import finetune as ft
from lowprec_demo.book.results import atomic_write_json
from lowprec_demo.monitor import preflight as pre
from machine import cpu_label, load_average, machine_record, save_run

NEEDS, NONE, TRL_RECALL = 0.10, 0.02, 0.30

# (pretrain_seed, seed, peak lr, steps)
CALIBRATION = [(0, 0, lr, 300) for lr in (1e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2)] + \
              [(0, 0, 3e-3, 1000), (0, 0, 1e-2, 1000), (0, 0, 1e-4, 100)]
HELDOUT = [(1, 1, lr, 300) for lr in (2e-5, 6e-5, 2e-4, 6e-4, 2e-3, 6e-3)] + \
          [(1, 2, 2e-3, 600), (1, 2, 6e-3, 600), (1, 2, 6e-5, 150), (2, 3, 1e-4, 300), (2, 3, 5e-3, 300),
           (2, 3, 1e-2, 1000)]


def _moves_predicted(model, opt, sched, batches, probe: int) -> list:
    """Per probe step, the float32 copy's "moves" mask (all parameters of ``opt``, flattened, in its order): the copy
    made as the preflight makes it (one deepcopy, widened to float32), its update against half a bf16 gap."""
    with torch.random.fork_rng(devices=[]):
        m, o, s = copy.deepcopy((model, opt, sched))
        pre._own_step(o)
        pre._widen(m, o)
        params = [p for g in o.param_groups for p in g["params"]]
        out = []
        for t in range(probe):
            o.zero_grad(set_to_none=True)
            m(*batches.get_batch(t))[1].backward()
            old = [p.detach().clone() for p in params]
            o.step()
            s.step()
            out.append(torch.cat([~lp.would_freeze(lp.quantize(a, "bf16"), p.detach() - a, "bf16").reshape(-1)
                                  for a, p in zip(old, params)]))
    return out


class _Observed:
    """The real bf16 run's first ``probe`` steps: per step, which stored weights changed and which had a gradient."""

    def __init__(self, opt, probe: int) -> None:
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.probe, self.changed, self.grad = probe, [], []
        self.handles = [opt.register_step_pre_hook(self.before), opt.register_step_post_hook(self.after)]

    def before(self, *_):
        if len(self.changed) < self.probe:
            self.old = [p.detach().clone() for p in self.params]
            self.grad.append(torch.cat([(p.grad != 0).reshape(-1) if p.grad is not None else
                                        torch.zeros(p.numel(), dtype=torch.bool) for p in self.params]))

    def after(self, *_):
        if len(self.changed) < self.probe:
            self.changed.append(torch.cat([(p.detach().view(torch.int16) != a.view(torch.int16)).reshape(-1)
                                           for a, p in zip(self.old, self.params)]))
            if len(self.changed) == self.probe:
                for h in self.handles:
                    h.remove()


def one_run(pretrain_seed: int, seed: int, lr: float, steps: int) -> dict:
    got = {}

    def before_run(model, opt, sched, loss):
        start = time.perf_counter()
        pf = lp.preflight(model, opt, sched, steps, loss=loss)
        got["preflight_s"] = time.perf_counter() - start
        got["preflight"] = pf
        data = ft.pretrained(pretrain_seed)[2]
        got["predicted"] = _moves_predicted(model, opt, sched, data.batches(seed), pf.probe_steps)
        got["observed"] = _Observed(opt, pf.probe_steps)

    t0 = time.perf_counter()
    bf16 = ft.finetune("bf16", seed, lr=lr, steps=steps, pretrain_seed=pretrain_seed, before_run=before_run)
    fp32 = ft.finetune("fp32", seed, lr=lr, steps=steps, pretrain_seed=pretrain_seed)
    start = bf16["start_loss"]
    improvement = start - fp32["final_loss"]
    share = (start - bf16["final_loss"]) / improvement if improvement > 0 else None
    truth = None if share is None else "needs" if 1 - share >= NEEDS else "none" if 1 - share <= NONE else "between"
    pf, obs = got["preflight"], got["observed"]
    tp = fp = fn = counted = 0
    for pred, changed, grad in zip(got["predicted"], obs.changed, obs.grad):
        p, c = pred[grad], changed[grad]
        tp, fp, fn = tp + int((p & c).sum()), fp + int((p & ~c).sum()), fn + int((~p & c).sum())
        counted += int(grad.sum())
    return dict(pretrain_seed=pretrain_seed, seed=seed, lr=lr, steps=steps, start_loss=start,
                fp32_loss=fp32["final_loss"], bf16_loss=bf16["final_loss"], share=share, truth=truth,
                predicted_share=pf.frozen_share, probe_steps=pf.probe_steps, preflight_s=got["preflight_s"],
                bf16_step_ms=bf16["step_ms"], wall_s=time.perf_counter() - t0,
                remedies={r: list(pf.plan.remedies.values()).count(r) for r in set(pf.plan.remedies.values())},
                moves=dict(tp=tp, fp=fp, fn=fn, counted=counted, elements=sum(p.numel() for p in obs.params)))


def run_all(runs) -> list:
    out = []
    for args in runs:
        r = one_run(*args)
        out.append(r)
        share = "n/a" if r["share"] is None else f"{r['share']:.3f}"
        print(f"pretrain {args[0]} seed {args[1]} lr {args[2]:g} steps {args[3]}: bf16 share {share} "
              f"({r['truth']}), predicted frozen {r['predicted_share']:.3f} ({r['wall_s']:.0f} s)", flush=True)
    return out


def propose_cutoff(rows) -> dict:
    """The rule, fixed before calibrating: the largest multiple of 0.05 at or below the lowest predicted frozen share
    of a calibration run that needs a remedy (missing a run that needs one costs a loss gap; recommending stochastic
    rounding where none is needed costs its step time only); the runs that need none it misjudges are counted."""
    needs = sorted(r["predicted_share"] for r in rows if r["truth"] == "needs")
    none = sorted(r["predicted_share"] for r in rows if r["truth"] == "none")
    if not needs:
        return dict(cutoff=None, rule="no calibration run needs a remedy", needs=needs, none=none)
    cutoff = int(min(needs) * 20 + 1e-9) / 20
    return dict(cutoff=cutoff, rule=f"the largest multiple of 0.05 at or below the lowest needing run's predicted "
                f"share ({min(needs):.3f}); runs needing none at or above it: {sum(x >= cutoff for x in none)} of "
                f"{len(none)}", needs=needs, none=none)


def verdicts(rows, cutoff: float) -> dict:
    judged = [r for r in rows if r["truth"] in ("needs", "none")]
    for r in rows:
        r["verdict"] = "remedy" if r["predicted_share"] >= cutoff else "none"
        judged_run = r["truth"] in ("needs", "none")
        r["right"] = (r["verdict"] == "remedy") == (r["truth"] == "needs") if judged_run else None
    m = {k: sum(r["moves"][k] for r in rows) for k in ("tp", "fp", "fn", "counted")}
    return dict(judged=len(judged), right=sum(bool(r["right"]) for r in judged),
                needs=sum(r["truth"] == "needs" for r in rows), none=sum(r["truth"] == "none" for r in rows),
                between=sum(r["truth"] == "between" for r in rows),
                no_improvement=sum(r["truth"] is None for r in rows),
                precision=m["tp"] / max(1, m["tp"] + m["fp"]), recall=m["tp"] / max(1, m["tp"] + m["fn"]),
                moved=(m["tp"] + m["fn"]) / max(1, m["counted"]),
                **{f"moves_{k}": v for k, v in m.items()})


def table(rows) -> list:
    lines = ["| pretrain seed | seed | peak lr | steps | fp32 gain | bf16's share of it | predicted frozen | verdict "
             "| needs (truth) | right | moves precision | moves recall | moved (base rate) |", "|" + "---|" * 13]
    for r in rows:
        m = r["moves"]
        share = "n/a" if r["share"] is None else f"{r['share']:.1%}"
        right = "-" if r["right"] is None else "yes" if r["right"] else "NO"
        lines.append(f"| {r['pretrain_seed']} | {r['seed']} | {r['lr']:g} | {r['steps']} | "
                     f"{r['start_loss'] - r['fp32_loss']:+.4f} | {share} | {r['predicted_share']:.1%} | "
                     f"{r['verdict']} | {r['truth'] or 'fp32 no gain'} | {right} | "
                     f"{m['tp'] / max(1, m['tp'] + m['fp']):.1%} | {m['tp'] / max(1, m['tp'] + m['fn']):.1%} | "
                     f"{(m['tp'] + m['fn']) / max(1, m['counted']):.1%} |")
    return lines


def report(cal: dict, held: dict) -> str:
    cut, v, vc = held["cutoff"], held["verdicts"], cal["verdicts_at_fixed_cutoff"]
    times = [r["preflight_s"] for r in held["rows"] + cal["rows"]]
    steps = [r["bf16_step_ms"] for r in held["rows"] + cal["rows"]]
    lines = [f"# The preflight on held-out bf16 fine-tunes ({held['date']})", "",
             f"Command: `{held['command']}`; machine: {held['machine']['device_name']}, {held['machine_label']}, "
             f"one thread; torch {held['machine']['torch']}, commit {held['machine']['git_commit']}. Calibration: "
             f"`{cal['command']}` before it, its rows kept in this run's JSON (`calibration`).", "",
             "Targets, stated before measuring: a remedy recommended on every held-out run where plain bf16 loses at "
             f"least {NEEDS:.0%} of float32's loss improvement, none where it loses at most {NONE:.0%}; recall of "
             f"per-element \"moves\" above TRL #5417's {TRL_RECALL:.0%}.", "",
             f"Cutoff: `needs_remedy` when the predicted frozen share over the run is at least **{cut:g}** "
             f"(`lowprec_demo.monitor.preflight.CUTOFF`), fixed {held['cutoff_fixed']} after the calibration runs "
             f"and before any held-out run. Calibration's proposal: {cal['proposal']['rule']}.", "",
             "## Held-out runs", "", *table(held["rows"]), "",
             f"Held-out: {v['right']} of {v['judged']} judged runs right ({v['needs']} need a remedy, {v['none']} "
             f"need none, {v['between']} between 2 % and 10 %, {v['no_improvement']} where float32 did not improve). "
             f"Moves over the probe steps (elements with a nonzero gradient in the bf16 run, "
             f"{v['moves_counted']:,} element-steps): precision {v['precision']:.1%}, recall {v['recall']:.1%} "
             f"(TRL #5417: about {TRL_RECALL:.0%} recall); {v['moved']:.1%} of them moved, the precision of a "
             f"predictor that says every element moves.", "",
             "## Calibration runs (the cutoff chosen on these)", "", *table(cal["rows"]), "",
             f"Calibration at the fixed cutoff: {vc['right']} of {vc['judged']} judged runs right; moves precision "
             f"{vc['precision']:.1%}, recall {vc['recall']:.1%} ({vc['moved']:.1%} moved).", "", "## Notes", "",
             f"* The preflight's cost: {statistics.median(times):.2f} s median per run (20 float32 probe steps with "
             f"the watch, on a copy), against a bf16 step of {statistics.median(steps):.1f} ms median inside the "
             f"runs; both on a machine shared with other work (load average {held['machine']['load_average_start']} "
             f"at start, {held['load_average_end']} at end).",
             "* bf16's share of float32's improvement is `(start - bf16) / (start - fp32)` of the held-out loss, both "
             "runs on the same batches; a run *needs* a remedy when bf16 loses at least 10 % of it, *none* when at "
             "most 2 %; between, no target; where float32 does not improve (`fp32 gain` <= 0), no verdict is judged.",
             "* Moves: over the first `probe_steps` steps of each run, the float32 copy's predicted \"moves\" "
             "(`not lp.would_freeze(q(w), d, 'bf16')`) against the real bf16 run's stored weight changing at the "
             "same step, over the element-steps whose gradient in the real run is nonzero. These are each run's first "
             "20 steps (its warmup is 5 % of the run); later the copy's weights drift from the bf16 run's, and no "
             "per-element claim is made for those steps.", ""]
    return "\n".join(lines + held.get("notes", []))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phase", choices=("calibrate", "heldout", "report"), required=True,
                    help="report: the .md again from --out's .json")
    ap.add_argument("--json", help="calibrate: where to write the calibration")
    ap.add_argument("--calibration", help="heldout: the calibration JSON")
    ap.add_argument("--out", help="heldout: PREFIX of .json and .md")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    command = "python " + " ".join(["benchmarks/preflight_heldout.py", *(argv or sys.argv[1:])])
    machine = machine_record("cpu")
    if args.phase == "calibrate":
        rows = run_all(CALIBRATION)
        out = dict(rows=rows, proposal=propose_cutoff(rows), command=command, machine=machine,
                   cutoff_then=pre.CUTOFF)
        print(json.dumps(out["proposal"]))
        atomic_write_json(args.json, out)
        return 0
    if args.phase == "report":
        held = json.loads(open(args.out + ".json").read())
        held["verdicts"] = verdicts(held["rows"], held["cutoff"])
        held["calibration"]["verdicts_at_fixed_cutoff"] = verdicts(held["calibration"]["rows"], held["cutoff"])
        save_run(args.out, held, report(held["calibration"], held) + "\n")
        return 0
    cal = json.loads(open(args.calibration).read())
    commit = subprocess.run(["git", "log", "-1", "--format=%h %cI", "--", "lowprec_demo/monitor/preflight.py"],
                            capture_output=True, text=True).stdout.strip()
    cal["verdicts_at_fixed_cutoff"] = verdicts(cal["rows"], pre.CUTOFF)
    rows = run_all(HELDOUT)
    held = dict(rows=rows, cutoff=pre.CUTOFF, cutoff_fixed=f"in commit {commit}", verdicts=verdicts(rows, pre.CUTOFF),
                command=command, machine=machine, machine_label=cpu_label(machine["cpu"]) if machine["cpu"] else "",
                date=machine["date"][:10], load_average_end=load_average(), calibration=cal)
    text = report(cal, held)
    save_run(args.out, held, text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
