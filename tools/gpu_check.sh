#!/usr/bin/env bash
# Full-scale checks of chapters 6 and 7 on one GPU, inside a fixed time budget.
#
#   OUT=/path/to/out LOWPREC_DATA_DIR=.data bash tools/gpu_check.sh
#
# Run from the repository root. Two experiments run side by side on the GPU, each in its own
# process with its own budget of BUDGET_S seconds (calibration included):
#
#   nanogpt  nanoGPT's shakespeare-char model (6 layers, 384 wide, context 256, batches of 64):
#            one fp32 run predicting bf16, e8m6, e8m5 and e8m4; a round-to-nearest run in each;
#            stochastic rounding in bf16; then the bf16 pair again with seed 1, if time is left.
#   gpt2     GPT-2 124M at context 1024, batches of 16: the fp32 reference, and the matrices on
#            the E4M3 grid with round to nearest and with stochastic rounding. TF32 matrix products
#            (stored weights are unchanged: fp32 in the reference, on the grid otherwise).
#
# Each experiment first times a few steps of every run it will make (the median over the steps of
# the time one step of all runs takes),
# then picks the number of steps that fits what is left of its budget (at most the full size's
# 5000 and 2000 steps). So the size of the runs depends on the machine; the JSON records it.
#
# Environment:
#   OUT        output folder (default ./gpu_check_out). At most 8 files are written there:
#              nanogpt_{bf16,e8m6,e8m5,e8m4}_full.json, nanogpt_bf16_full_seed1.json,
#              gpt2_e4m3_full.json (the command line's JSON layout, with provenance),
#              gpu_check_summary.json (chosen sizes, step times, the headline numbers),
#              gpu_check.log (everything printed).
#   DEVICE     cuda (default) or cpu.
#   BUDGET_S   seconds per experiment (default 270), calibration included; the steps are chosen to
#              use 85 % of what is left after calibration, so the script usually ends within
#              BUDGET_S + 30 s. Each experiment is killed at BUDGET_S + 120 s (what it wrote before
#              stays), so the script always ends within about BUDGET_S + 150 s (7 minutes by default).
#   DRY=1      rehearsal on a CPU: quick-size models and a budget of BUDGET_S (say 60), same code.
#   LOWPREC_GIT_COMMIT  commit recorded in the provenance when the copy has no .git folder.
#
# Data: Tiny Shakespeare from $LOWPREC_DATA_DIR (verified against its sha256); without it, the
# standard-library fallback corpus, said so in the results. GPT-2's BPE needs tiktoken's files,
# which an offline machine lacks: the GPT-2 run then uses byte tokens, said so in the results.

set -uo pipefail   # (no -e: every stage runs; the last step sets the exit status)
OUT=${OUT:-gpu_check_out}
DEVICE=${DEVICE:-cuda}
BUDGET_S=${BUDGET_S:-270}
DRY=${DRY:-0}
export LOWPREC_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: >"$LOG"

say() { echo "[gpu_check] $*" | tee -a "$LOG"; }
say "start $(date -u +%FT%TZ), device $DEVICE, budget ${BUDGET_S}s per experiment, dry run $DRY"
say "python $(python3 --version 2>&1), data dir ${LOWPREC_DATA_DIR:-unset}, commit ${LOWPREC_GIT_COMMIT:-from git}"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"

read -r -d '' DRIVER <<'PY'
import json, os, sys, time, traceback
import torch

stage, out, work = sys.argv[1], sys.argv[2], sys.argv[3]
device, budget, dry = os.environ["DEVICE"], float(os.environ["BUDGET_S"]), os.environ["DRY"] == "1"
t0 = time.time()
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "8")))

import lowprec_demo as lp
from lowprec_demo.book.experiments import get_experiment, make_config
from lowprec_demo.book.training import train_formats, train_variants

summary = {"stage": stage, "device": device, "budget_s": budget, "dry_run": dry, "torch": torch.__version__,
           "cuda_device": torch.cuda.get_device_name(0) if device == "cuda" else None}


def say(*args):
    print(f"{time.time() - t0:7.1f}s", *args, flush=True)


def timed_task(name, config):
    """The experiment's task, with the time of every step recorded (a step starts when its batch
    is drawn; the loop reads the loss each step, which waits for the GPU)."""
    task = get_experiment(name).build(config)
    stamps, inner = [], task.batch

    def batch(step):
        stamps.append((step, time.perf_counter()))
        return inner(step)
    task.batch = batch
    return task, stamps


def step_seconds(stamps):
    """Seconds that one step of every run takes, all runs together: each batch stamp's time until
    the next stamp of the same step (the reference and round-to-nearest runs go in lockstep, one
    step of each in turn) or of the next step (a run on its own), summed per step, and the median
    over the steps after the first (compilation) and before the last (a run's end)."""
    per_step = {}
    for (step, t), (step2, t2) in zip(stamps, stamps[1:]):
        if step >= 1 and step2 in (step, step + 1):
            per_step.setdefault(step, []).append(t2 - t)
    totals = sorted(sum(v) for s, v in per_step.items() if s <= max(per_step) - 1) or [0.0]
    return totals[len(totals) // 2]


def steps_for(seconds_per_step, lo, hi):
    left = budget - (time.time() - t0)
    n = int(0.85 * left / seconds_per_step)
    say(f"{left:.0f} s left, {seconds_per_step:.3f} s per step of all runs together: {n} steps (kept in {lo}..{hi})")
    return max(lo, min(hi, n))


def save(result, name):
    path = result.save(os.path.join(out, f"{name}.json"), max_points=300)
    say(f"wrote {path} ({os.path.getsize(path) / 1e6:.1f} MB)")


def run_nanogpt():
    scale = "quick" if dry else "full"
    formats = ["bf16", "e8m6", "e8m5", "e8m4"]
    variants = {"bf16": ("nearest", "stochastic")}
    cal = 4 if dry else 12
    config = make_config("nanogpt", scale, device=device, steps=cal, eval_every=0)
    task, stamps = timed_task("nanogpt", config)
    say("nanogpt:", task.description)
    train_formats("nanogpt", task, config, formats, variants=variants, progress=False)
    main = step_seconds(stamps)              # reference and 4 nearest runs in lockstep, then stochastic
    seed_config = make_config("nanogpt", scale, device=device, steps=cal, eval_every=0, seed=1,
                              variants=("reference", "nearest"))
    seed_task, seed_stamps = timed_task("nanogpt", seed_config)
    train_variants("nanogpt", seed_task, seed_config, progress=False)
    seed = step_seconds(seed_stamps)
    summary["calibration_step_s"] = {"sweep": main, "seed1": seed}
    say(f"seconds per step of all runs: sweep {main:.4f}, seed 1 {seed:.4f}")
    steps = steps_for(main + seed, 20 if dry else 100, 5000)
    warmup = min(100, steps // 10)
    summary["steps"] = steps
    config = make_config("nanogpt", scale, device=device, steps=steps, warmup_steps=warmup)
    start = time.time()
    results = train_formats("nanogpt", get_experiment("nanogpt").build(config), config, formats, variants=variants,
                            progress=False)
    summary["sweep_seconds"] = round(time.time() - start, 1)
    summary["freeze_steps"] = {}
    for fmt, result in results.items():
        save(result, f"nanogpt_{fmt}_full")
        row = {"predicted": result.predicted_freeze_step(), "observed": result.observed_freeze_step(),
               "agree": result.freeze_steps_agree(),
               "final_val_loss": {v: r.final_eval.get("val_loss") for v, r in result.runs.items()}}
        summary["freeze_steps"][fmt] = row
        say(f"nanogpt {fmt}: {row}")
    expected = (time.time() - start) * seed / main
    left = budget - (time.time() - t0)
    if expected < 0.9 * left:
        config = make_config("nanogpt", scale, device=device, steps=steps, warmup_steps=warmup, seed=1,
                             variants=("reference", "nearest"))
        result = train_variants("nanogpt", get_experiment("nanogpt").build(config), config, progress=False)
        save(result, "nanogpt_bf16_full_seed1")
        summary["seed1"] = {"predicted": result.predicted_freeze_step(), "observed": result.observed_freeze_step(),
                            "agree": result.freeze_steps_agree()}
        say("nanogpt bf16 seed 1:", summary["seed1"])
    else:
        say(f"nanogpt: no time for seed 1 (needs about {expected:.0f} s, {left:.0f} s left)")


def run_gpt2():
    if dry:
        scale, shape = "quick", {"n_layer": 2, "n_head": 2, "n_embd": 64, "context": 32, "batch_size": 2}
    else:
        scale, shape = "full", {"tf32": True}
    cal = 3 if dry else 6
    config = make_config("gpt2", scale, device=device, steps=cal, eval_every=0, **shape)
    task, stamps = timed_task("gpt2", config)
    say("gpt2:", task.description)
    train_variants("gpt2", task, config, progress=False)
    per_step = step_seconds(stamps)
    summary["calibration_step_s"] = per_step
    say(f"seconds per step of all runs (reference and nearest in lockstep, then stochastic): {per_step:.4f}")
    steps = steps_for(per_step, 3 if dry else 10, 2000)
    summary["steps"] = steps
    config = make_config("gpt2", scale, device=device, steps=steps, warmup_steps=min(20, steps // 10),
                         eval_every=max(1, steps // 6), **shape)
    start = time.time()
    result = train_variants("gpt2", get_experiment("gpt2").build(config), config, progress=False)
    summary["run_seconds"] = round(time.time() - start, 1)
    if device == "cuda":
        summary["max_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    save(result, "gpt2_e4m3_full")
    pred, obs = result.prediction.overall, result.runs["nearest"].frozen.overall
    summary.update({
        "frozen_predicted_min": min(pred), "frozen_observed_min": min(obs),
        "frozen_predicted_first": pred[0], "frozen_observed_first": obs[0],
        "loss_first": {v: r.loss[0] for v, r in result.runs.items()},
        "loss_last": {v: r.loss[-1] for v, r in result.runs.items()},
        "final_val_loss": {v: r.final_eval.get("val_loss") for v, r in result.runs.items()},
    })
    say("gpt2:", {k: summary[k] for k in ("frozen_predicted_min", "frozen_observed_min", "loss_last", "final_val_loss")})


try:
    {"nanogpt": run_nanogpt, "gpt2": run_gpt2}[stage]()
    summary["status"] = "ok"
except BaseException as exc:   # keep what was written, say what failed
    summary["status"] = f"failed: {type(exc).__name__}: {exc}"
    traceback.print_exc()
summary["seconds"] = round(time.time() - t0, 1)
say(stage, summary["status"], f"after {summary['seconds']} s")
with open(os.path.join(work, f"{stage}.json"), "w") as f:
    json.dump(summary, f, indent=1)
PY

export DEVICE BUDGET_S DRY
run_stage() {
    timeout --signal=TERM --kill-after=20 $((BUDGET_S + 120)) \
        python3 -c "$DRIVER" "$1" "$OUT" "$WORK" 2>&1 | sed -u "s/^/[$1] /" | tee -a "$LOG"
}
run_stage nanogpt &
run_stage gpt2 &
wait

python3 - "$OUT" "$WORK" <<'PY' 2>&1 | tee -a "$LOG"
import json, os, sys
out, work = sys.argv[1:]
summary = {}
for stage in ("nanogpt", "gpt2"):
    path = os.path.join(work, f"{stage}.json")
    summary[stage] = json.load(open(path)) if os.path.exists(path) else {"status": "killed at the time limit"}
with open(os.path.join(out, "gpu_check_summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print(json.dumps(summary, indent=1))
PY
say "end $(date -u +%FT%TZ); files in $OUT:"
ls -la "$OUT" | tee -a "$LOG"
# the exit status says whether both experiments ended "ok"
python3 - "$OUT/gpu_check_summary.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
summary = json.load(open(sys.argv[1]))
failed = [stage for stage, s in summary.items() if s.get("status") != "ok"]
print("[gpu_check] " + (f"FAILED: {', '.join(failed)}" if failed else "both experiments ok"))
sys.exit(1 if failed else 0)
PY
