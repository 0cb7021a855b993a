"""How fast is it: ``python benchmarks/bench.py``.

Measures in one run, side by side, and prints tables with ratios:

* ``quantize`` (round to nearest and stochastic rounding) of a float32 tensor for bf16, fp16,
  e4m3, e5m2 and a format torch has no dtype for (e5m3), against torch's native round trip
  ``x.to(dtype).float()`` (for e5m3: the bf16 round trip), with the bytes per second achieved
  (counting one read and one write of float32, the least any rounding has to move) and the
  memory ``quantize`` allocates beyond its input (the output is one input-sized tensor);
* QPyTorch's ``float_quantize`` and pychop's ``Chop``, where they are installed (they are not
  requirements), with the number of elements whose result differs from the exact one;
* one training step of the quick nanoGPT and of GPT-2 124M (the experiments' quick settings:
  AdamW, random tokens) with the plain optimizer, with ``LowPrecisionOptimizer`` (nearest,
  stochastic), with freeze observation on, the plain step with freeze prediction on, and the plain
  step with the freeze watch on (``lowprec_demo.watch``, every step, bf16): the ratios to the
  plain step and the peak memory of each;
* how the costs grow: ``quantize`` against tensor size, and the tracked step against model size;
* the one-time cost of compiling the fused kernels;
* where the warm stochastic rounding's time goes (:func:`bench_split`): a plain copy, the bf16
  round trip, round to nearest, the hash alone and stochastic rounding, compiled, with the vector
  width the compiler picked;
* the cold path, as a reader who calls ``quantize`` once meets it: the same rounding with
  compiling off against the native round trip, and the first call of a fresh process (a new
  Python process, compiling included where its mode compiles).

Timings are medians over rounds in which every variant runs once (a training step shorter than a
quarter of a second several times in a row; :func:`timing.median_times`), so a
machine whose load changes during the run slows all of them alike; a training step's ratio to the
plain step is the median over the rounds of the ratio within each round (the tables show the
quartiles of those ratios too: how far they move from round to round on the machine). The tables
(:func:`bench_report.report`) end with a summary of every ratio against the
performance targets (:func:`bench_report.summary`,
:data:`bench_report.TARGETS`); the result names the machine
(:func:`machine.machine_record`). ``--device cuda`` runs the same on a GPU;
``--quick`` is a small version at sizes that are not the targets' (its summary says so): 3 min
20 s and 4 min 30 s in two runs on a shared, loaded 2-core CPU (compiling the fused kernels took
70 s of the first and 14 s of the second, torch's compile cache then warm); about a minute on a
GPU, compilation included. ``--out`` writes everything as JSON (atomically), and
``--summary-of FILE`` prints the tables of such a file again without measuring.

Example:
    ``python benchmarks/bench.py --threads 1 --out bench.json``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import warnings
from typing import Dict, List, Optional

import torch

from lowprec_demo.rounding import freeze_rule, round_to_grid
from lowprec_demo.rounding.round_to_grid import RoundParams, hash32, nearest_bits, round_params, stochastic_bits
from bench_report import report, summary
from lowprec_demo.book.experiments import get_experiment, make_config
from lowprec_demo.formats import get_format
from machine import compiler_vector_width, cpu_vector_extensions, load_average, machine_record
from lowprec_demo.optim.optimizer import LowPrecisionOptimizer
from lowprec_demo.freeze import FreezeObserver, FreezePredictor
from lowprec_demo.monitor.freeze_watch import watch
from lowprec_demo.rounding import quantize, quantize_
from lowprec_demo.book.results import atomic_write_json
from timing import median_times, peak_extra_bytes
from lowprec_demo.optim.plan import FreezePlan, load_plan
from lowprec_demo.book.training import lowprec_named_params, make_optimizer, variant_wrapper

__all__ = ["run", "main", "build_model", "bench_first_call", "bench_split", "QUANTIZE_FORMATS", "MODELS"]

# (format, torch dtype of its native round trip or None)
QUANTIZE_FORMATS = [("bf16", torch.bfloat16), ("fp16", torch.float16), ("e4m3", torch.float8_e4m3fn),
                    ("e5m2", torch.float8_e5m2), ("e5m3", None)]

#: the models of the training-step benchmark: each an experiment at a scale (its model, optimizer,
#: format and low-precision parameters, built by the experiment itself), stepped on random
#: tokens in batches of ``batch`` x ``context`` (the quick nanoGPT's own batch; the same batch
#: for nanoGPT's full model, whose steps the benchmark sets beside it, and a short context for
#: GPT-2 on a CPU)
MODELS = {
    "nanogpt-quick": dict(experiment="nanogpt", scale="quick", batch=8, context=64),
    "shakespeare-char": dict(experiment="nanogpt", scale="full", batch=8, context=64),
    "gpt2": dict(experiment="gpt2", scale="quick", batch=4, context=64),
}
VARIANTS = ("plain", "nearest", "stochastic", "nearest+observer", "plain+predictor", "plain+watch")
# the remedies of the training loop's variants (lowprec_demo.training.variant_wrapper): timed on
# request (--variants), whole steps only
REMEDY_VARIANTS = ("kahan", "kahan_lp", "master", "nearest_state", "stochastic_state", "plan")
# ("plan": a freeze plan's step, each tensor with its remedy; the plan comes from --plan PATH)
STEP_SECONDS = 0.25   # a training step shorter than this is timed over several steps in a row


# ------------------------------------------------------------------------------------------------
# compiling
# ------------------------------------------------------------------------------------------------
def warm_up(device: str) -> dict:
    """Compile every kernel the package uses (the three versions of the step kernel among them) and time each first
    call."""
    x = torch.randn(4096, device=device)
    fmt, zero = get_format("e5m3"), torch.zeros((), device=device)
    ids, grad = torch.arange(4096, dtype=torch.int32, device=device) % 2, torch.randn_like(x)
    calls = {
        "nearest": lambda: quantize(x, fmt), "nearest_": lambda: quantize_(x.clone(), fmt),
        "stochastic": lambda: quantize(x, fmt, "stochastic", generator=1),
        "stochastic_": lambda: quantize_(x.clone(), fmt, "stochastic", generator=1),
        "step (the predictor's)": lambda: freeze_rule.step_codes(x, x + 1e-3, None, ids, None, fmt),
        "step (one learning rate)": lambda: freeze_rule.step_codes(x, x + 1e-3, grad, ids, zero, fmt),
        "step (one per tensor)": lambda: freeze_rule.step_codes(x, x + 1e-3, grad, ids, torch.zeros(2, device=device),
                                                               fmt)}
    seconds, failed = {}, {}
    previous = round_to_grid.set_mode("on")
    start = time.perf_counter()
    try:
        for name, call in calls.items():
            begin = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", RuntimeWarning)
                call()
            if x.device.type == "cuda":
                torch.cuda.synchronize()
            seconds[name] = time.perf_counter() - begin
            failed.update({name: str(w.message) for w in caught if "compiling the" in str(w.message)})
    finally:
        round_to_grid.set_mode(previous)
    return {"total_seconds": sum(seconds.values()), "seconds": seconds, "wall_seconds_now": time.perf_counter() - start,
            "failed": failed}


# ------------------------------------------------------------------------------------------------
# quantize
# ------------------------------------------------------------------------------------------------
def bench_quantize(n: int, device: str, repeats: int, eager: bool = True) -> List[dict]:
    """One row per (format, rounding): native round trip, quantize (fused), quantize eager."""
    torch.manual_seed(0)
    x = torch.randn(n, device=device)
    rows = []
    natives = {}
    for name, dtype in QUANTIZE_FORMATS:
        ref_dtype = dtype or torch.bfloat16
        if ref_dtype not in natives:
            natives[ref_dtype] = lambda d=ref_dtype: x.to(d).float()
        for rounding in ("nearest", "stochastic"):
            cases = {"native": natives[ref_dtype],
                     "quantize": lambda f=name, r=rounding: quantize(x, f, r, generator=1)}
            previous = round_to_grid.set_mode("on")
            try:
                t = median_times(cases, device, repeats)
                extra = peak_extra_bytes(cases["quantize"], device)
            finally:
                round_to_grid.set_mode(previous)
            row = {"format": name, "rounding": rounding, "n": n,
                   "native_dtype": str(ref_dtype).replace("torch.", ""), "native_is_own_dtype": dtype is not None,
                   "native_ms": t["native"] * 1e3, "quantize_ms": t["quantize"] * 1e3,
                   "ratio": t["quantize"] / t["native"],
                   "quantize_GBps": 8 * n / t["quantize"] / 1e9, "native_GBps": 8 * n / t["native"] / 1e9,
                   "extra_memory_inputs": None if extra is None else extra / (4 * n)}
            if eager:
                previous = round_to_grid.set_mode("off")
                try:
                    # the cold path: the same functions uncompiled, timed in the same rounds as
                    # the native round trip
                    t = median_times(cases, device, max(1, repeats // 2), 1)
                    row.update(eager_ms=t["quantize"] * 1e3, eager_native_ms=t["native"] * 1e3,
                               eager_ratio=t["quantize"] / t["native"])
                finally:
                    round_to_grid.set_mode(previous)
            rows.append(row)
    return rows


def _hash_only(bits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The stochastic-rounding kernel's random bits alone, one int32 per element of ``bits``
    (for the split)."""
    q = RoundParams.read(p)
    r = torch.arange(bits.numel(), dtype=torch.int32, device=bits.device) + q.index_offset
    return hash32(r, q.seed_lo, q.seed_hi)


def bench_split(n: int, device: str, repeats: int) -> dict:
    """Where the warm compiled stochastic rounding's time goes, on ``n`` float32 elements to
    bf16, each compiled once and timed in the same rounds: a plain copy (one read and one
    write, the floor of any rounding), torch's bf16 round trip, round to nearest (the same
    passes over memory, no hash), the hash alone (its bits written as an int32 tensor) and
    stochastic rounding, the kernels as the package runs them (on the bit patterns); with the
    vector width inductor picked and the CPU's vector extensions.
    On a CPU whose round trip is one instruction each way (``avx512_bf16``) the ratio to the
    round trip is larger for the same kernel."""
    torch.manual_seed(0)
    x = torch.randn(n, device=device)
    bits = x.view(torch.int32)
    fmt = get_format("bf16")
    pn = round_params(fmt).tensor(device)
    ps = round_params(fmt, seed=1).tensor(device)
    compiled = {name: torch.compile(fn, dynamic=True, fullgraph=True)
                for name, fn in (("nearest", nearest_bits), ("hash", _hash_only), ("stochastic", stochastic_bits))}
    cases = {"copy": lambda: x.clone(), "native": lambda: x.to(torch.bfloat16).float(),
             "nearest": lambda: compiled["nearest"](bits, pn), "hash": lambda: compiled["hash"](bits, ps),
             "stochastic": lambda: compiled["stochastic"](bits, ps)}
    try:
        with torch.no_grad():
            t = median_times(cases, device, repeats)
    except Exception as error:  # no compiler here: nothing to split
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"}
    return {"n": n, "ms": {k: v * 1e3 for k, v in t.items()}, "to_native": {k: v / t["native"] for k, v in t.items()},
            "compiler_vector_width": compiler_vector_width() if device == "cpu" else None,
            "cpu_vector_extensions": cpu_vector_extensions() if device == "cpu" else None}


_FIRST_CALL = """
import json, sys, time, torch
torch.set_num_threads({threads})
from lowprec_demo.rounding import round_to_grid
from lowprec_demo import quantize
x = torch.randn({n}, device={device!r})
out = {{}}
for fmt, rounding in (("bf16", "stochastic"), ("e5m3", "nearest")):
    start = time.perf_counter()
    quantize(x, fmt, rounding, generator=1)
    if {device!r}.startswith("cuda"):
        torch.cuda.synchronize()
    kernel = round_to_grid.stochastic_bits if rounding == "stochastic" else round_to_grid.nearest_bits
    compiled = round_to_grid._compiled.get((kernel, torch.device({device!r}).type)) is not None
    out[fmt + " " + rounding] = {{"seconds": time.perf_counter() - start,
                                  "calls": {{"compiled": int(compiled), "eager": int(not compiled)}}}}
out["mode"] = round_to_grid.get_mode()
print(json.dumps(out))
"""


def bench_first_call(n: int, device: str) -> dict:
    """The first call of a fresh process, as a reader meets it: a new Python process (the
    fused kernels' mode as the environment leaves it, by default ``"auto"``) times its first
    ``quantize(x, "bf16", "stochastic")`` and then its first nearest e5m3 on ``n`` float32
    elements, compiling included if the mode compiles, and says which way each ran (the
    kernel's compiled and eager calls)."""
    import subprocess
    code = _FIRST_CALL.format(threads=torch.get_num_threads(), n=n, device=device)
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return {"n": n, "error": "timed out after 600 s"}
    if done.returncode != 0:
        return {"n": n, "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return {"n": n, **json.loads(done.stdout.strip().splitlines()[-1])}


def bench_libraries(n: int, device: str, repeats: int) -> List[dict]:
    """QPyTorch's float_quantize and pychop's Chop, where installed, against quantize: time and
    the number of elements that differ from the exact result (nearest: bit for bit)."""
    torch.manual_seed(0)
    x = torch.randn(n, device=device)
    edge = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3e-8, 1e30, -1e30, math.inf, -math.inf, 500.0, 464.0,
                         61440.0, 65520.0, 2.0**-17, 1.0 + 2.0**-4], device=device)
    rows = []
    libraries = {}
    try:
        from qtorch.quant import float_quantize
        libraries["qtorch"] = lambda t, fmt, r: float_quantize(t, fmt.exp_bits, fmt.man_bits, rounding=r)
    except Exception as error:  # not installed, or its C++ extension does not build
        rows.append({"library": "qtorch", "error": f"{type(error).__name__}: {str(error)[:200]}"})
    try:
        from pychop import Chop

        def chop(t, fmt, r):
            return Chop(exp_bits=fmt.exp_bits, sig_bits=fmt.man_bits, rmode=1 if r == "nearest" else 5)(t)
        libraries["pychop"] = chop
    except Exception as error:
        rows.append({"library": "pychop", "error": f"{type(error).__name__}: {str(error)[:200]}"})
    for lib, fn in libraries.items():
        for name, _ in QUANTIZE_FORMATS:
            fmt = get_format(name)
            for rounding in ("nearest", "stochastic"):
                row = {"library": lib, "format": name, "rounding": rounding, "n": n}
                try:
                    t = median_times({"lib": lambda f=fn, q=fmt, r=rounding: f(x, q, r),
                                      "quantize": lambda q=fmt, r=rounding: quantize(x, q, r, generator=1)},
                                     device, repeats)
                    row.update(lib_ms=t["lib"] * 1e3, quantize_ms=t["quantize"] * 1e3,
                               ratio_lib_to_quantize=t["lib"] / t["quantize"])
                    if rounding == "nearest":
                        probe = torch.cat([x[:100_000], edge])
                        theirs, ours = fn(probe, fmt, "nearest").float(), quantize(probe, fmt)
                        differ = ~((theirs == ours) | (theirs.isnan() & ours.isnan()))
                        row["differ"] = int(differ.sum())
                        row["differ_examples"] = [(probe[i].item(), theirs[i].item(), ours[i].item())
                                                  for i in differ.nonzero().flatten()[:4].tolist()]
                    else:  # unbiased? mean error over many draws of one value
                        v = torch.full((200_000,), 1.0 + fmt.eps / 3, device=device)
                        row["sr_mean_minus_x_in_gaps"] = ((fn(v, fmt, rounding).double().mean() - v[0].double())
                                                          / (fmt.eps)).item()
                except Exception as error:
                    row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# training steps
# ------------------------------------------------------------------------------------------------
def build_model(model_name: str, device: str):
    """One of :data:`MODELS` as its experiment builds it: ``(config, task, model, optimizer,
    lowprec)``, the model initialised from seed 0 and on ``device``, the plain optimizer the
    training loop makes, and the parameters the experiment keeps in low precision, by name."""
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; valid models: {', '.join(MODELS)}")
    spec = MODELS[model_name]
    config = make_config(spec["experiment"], spec["scale"], device=device)
    task = get_experiment(spec["experiment"]).build(config)
    model = task.make_model(torch.Generator().manual_seed(0)).to(device)
    return config, task, model, make_optimizer(model, task, config), lowprec_named_params(model, config)


def bench_training(model_name: str, device: str, repeats: int, variants=VARIANTS, plan=None) -> dict:
    """Step times of every variant of one model, their ratios to the plain step and the peak
    memory of a step. One model and one optimizer (the training loop's, ``foreach=False``) are
    shared by the variants, which differ only in what wraps and watches the step. The ``"plan"``
    variant stores each tensor with its remedy in ``plan`` (a FreezePlan for this model)."""
    spec = MODELS[model_name]
    train_config, task, model, inner, lowprec = build_model(model_name, device)
    config = model.config
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, config.vocab_size, (spec["batch"], spec["context"]), generator=gen).to(device)
    y = torch.randint(0, config.vocab_size, (spec["batch"], spec["context"]), generator=gen).to(device)
    fmt = train_config.format

    def lpo(rounding="nearest", **wrapper):
        return LowPrecisionOptimizer(inner, fmt, rounding=rounding, generator=torch.Generator().manual_seed(2),
                                     params=list(lowprec.values()), **wrapper)
    setups = {"plain": (inner, None), "nearest": (lpo("nearest"), None), "stochastic": (lpo("stochastic"), None),
              "nearest+observer": (lpo("nearest"), FreezeObserver(lowprec, fmt)),
              "plain+predictor": (inner, FreezePredictor(lowprec, [fmt]))}
    for v in variants:
        if v == "plan":
            if plan is None:
                raise ValueError("the plan variant times a freeze plan's step: give the plan (--plan PATH)")
            # the plan's remedies by tensor name, on this model's shapes (its vocabulary may differ)
            by_name = FreezePlan(plan.format, plan.remedies, kahan_format=plan.kahan_format)
            setups[v] = (LowPrecisionOptimizer(inner, fmt, generator=torch.Generator().manual_seed(2), plan=by_name,
                                               model=model), None)
        elif v in REMEDY_VARIANTS:
            setups[v] = (lpo(**variant_wrapper(v, fmt)), None)
    if "plain+watch" in variants:   # an AdamW of its own: the watch's hooks are on it alone
        watched = make_optimizer(model, task, train_config)
        setups["plain+watch"] = (watched, watch(model, watched, formats=("bf16",)))

    def step_of(opt, tracker, hooked=False):
        def step():
            loss = model(x, y)[1]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tracker is not None and not hooked:
                tracker.before_step()
            opt.step()
            if tracker is not None and not hooked:
                tracker.after_step()
        return step
    cases = {v: step_of(*setups[v], hooked=v == "plain+watch") for v in variants}
    rounds: Dict[str, List[float]] = {}
    times = median_times(cases, device, repeats, min_seconds=STEP_SECONDS, per_round=rounds)
    # the added work alone (no forward, backward or AdamW around it): less noisy than a
    # difference of whole steps, though a little cheaper than inside a step (warmer caches).
    # The trackers see a real update: the weights before and after one plain AdamW step are
    # kept and written back around before_step/after_step (a zero update would put every
    # element in the same histogram bin, the slowest case for the predictor's bincount); the
    # time of those two copies is measured alone and taken off.
    lp_n, lp_s = setups["nearest"][0], setups["stochastic"][0]
    observer, predictor = setups["nearest+observer"][1], setups["plain+predictor"][1]
    watcher = setups["plain+watch"][1] if "plain+watch" in variants else None
    tracked = list(lowprec.values())
    with torch.no_grad():
        weights_before = [p.detach().clone() for p in tracked]
    cases["plain"]()
    with torch.no_grad():
        weights_after = [p.detach().clone() for p in tracked]

    @torch.no_grad()
    def store(opt, rounding):
        opt.round_params(rounding)

    @torch.no_grad()
    def across_update(tracker=None):
        for p, w in zip(tracked, weights_before):
            p.copy_(w)
        if tracker is not None:
            tracker.before_step()
        for p, w in zip(tracked, weights_after):
            p.copy_(w)
        if tracker is not None:
            tracker.after_step()
    jobs = {"nearest": lambda: store(lp_n, "nearest"), "stochastic": lambda: store(lp_s, "stochastic"),
            "copies": across_update, "observer": lambda: across_update(observer),
            "predictor": lambda: across_update(predictor), "watch": lambda: across_update(watcher)}
    needed = {"copies"} | {{"nearest+observer": "observer", "plain+predictor": "predictor", "plain+watch": "watch"}.get(v, v)
                           for v in variants if v != "plain"} | ({"nearest"} if "nearest+observer" in variants else set())
    parts = median_times({k: f for k, f in jobs.items() if k in needed}, device, repeats,
                         min_seconds=STEP_SECONDS)
    observe = max(0.0, parts.get("observer", 0.0) - parts["copies"])
    alone = {"plain": 0.0, "nearest": parts.get("nearest", 0.0), "stochastic": parts.get("stochastic", 0.0),
             "nearest+observer": parts.get("nearest", 0.0) + observe,
             "plain+predictor": max(0.0, parts.get("predictor", 0.0) - parts["copies"]),
             "plain+watch": max(0.0, parts.get("watch", 0.0) - parts["copies"])}
    for v in REMEDY_VARIANTS:   # not timed alone: what their whole step adds
        if v in variants:
            alone[v] = max(0.0, times[v] - times["plain"])
    peaks, held = {}, {}
    for v in variants:   # each from the same state: gradients released, optimizer state made
        inner.zero_grad(set_to_none=True)
        peaks[v] = peak_extra_bytes(cases[v], device)
        # what it keeps, right after its own step (the variants share the parameters, which live
        # in the packs of the variant that stepped last)
        held[v] = _held_bytes(*setups[v])
    # the ratio within each round (the variant and the plain step timed minutes apart at most,
    # under the same load); the reported ratio is their median
    ratios = {v: [a / b for a, b in zip(rounds[v], rounds["plain"])] for v in variants}
    n_params = sum(p.numel() for p in model.parameters())
    state = sum(t.numel() * t.element_size() for s in inner.state.values() for t in s.values() if torch.is_tensor(t))
    return {"model": model_name, "params": n_params, "lowprec_params": sum(p.numel() for p in lowprec.values()),
            "format": fmt, "batch": spec["batch"], "context": spec["context"],
            "experiment": f"{spec['experiment']} ({spec['scale']}): {task.description}",
            "step_ms": {v: t * 1e3 for v, t in times.items()},
            "ratio": {v: statistics.median(r) for v, r in ratios.items()},
            "ratio_rounds": ratios,
            "added_alone_ms": {v: alone[v] * 1e3 for v in variants},
            "ratio_from_parts": {v: 1 + alone[v] / times["plain"] for v in variants},
            "memory_MB": {"parameters": n_params * 4 / 2**20, "optimizer_state": state / 2**20},
            "held_MB": {v: b / 2**20 for v, b in held.items()},
            "peak_extra_MB": {v: None if p is None else p / 2**20 for v, p in peaks.items()}}


def _held_bytes(opt, tracker) -> int:
    """Memory a variant keeps between steps beyond the model and its optimizer: the tracker's buffers (a watch's:
    ``watch.tracker``) and LowPrecisionOptimizer's (their ``held_bytes()``)."""
    tracker = getattr(tracker, "tracker", tracker)
    return sum(x.held_bytes() for x in (opt, tracker) if x is not None and hasattr(x, "held_bytes"))


# ------------------------------------------------------------------------------------------------
# scale
# ------------------------------------------------------------------------------------------------
def bench_scale(sizes: List[int], device: str, repeats: int) -> List[dict]:
    """quantize time per element against tensor size: native bf16 round trip, nearest e5m3,
    stochastic bf16."""
    rows = []
    previous = round_to_grid.set_mode("on")
    try:
        for n in sizes:
            x = torch.randn(n, device=device)
            t = median_times({"native bf16": lambda x=x: x.to(torch.bfloat16).float(),
                              "nearest e5m3": lambda x=x: quantize(x, "e5m3"),
                              "stochastic bf16": lambda x=x: quantize(x, "bf16", "stochastic", generator=1)},
                             device, repeats)
            rows.append({"n": n, **{f"{k} ms": v * 1e3 for k, v in t.items()},
                         **{f"{k} ns/element": v * 1e9 / n for k, v in t.items()}})
    finally:
        round_to_grid.set_mode(previous)
    return rows


# ------------------------------------------------------------------------------------------------
# the whole run
# ------------------------------------------------------------------------------------------------
def run(device: str = "cpu", quick: bool = False, size: Optional[int] = None, repeats: Optional[int] = None,
        models: Optional[List[str]] = None, libraries: bool = True, eager: bool = True,
        scale_sizes: Optional[List[int]] = None, progress: bool = True, variants=VARIANTS,
        compile_kernels: bool = True, plan=None) -> dict:
    """Run the benchmark and return its results (see the module docstring); ``variants``: the
    training-step variants to time (``plain`` always among them; ``"plan"`` with ``plan``, a
    FreezePlan of the model timed); ``compile_kernels=False``
    leaves the kernels as the current mode has them (a rehearsal in mode "off" compiles nothing).

    Example:
        >>> result = run(quick=True, size=1 << 12, models=[], libraries=False, scale_sizes=[])
    """
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    on_gpu = device.startswith("cuda")
    size = size or (1 << 24 if (on_gpu or not quick) else 1 << 20)
    repeats = repeats or (5 if quick else 7)
    if models is None:
        models = ["nanogpt-quick", "gpt2"] if (on_gpu or not quick) else ["nanogpt-quick"]
    if scale_sizes is None:
        scale_sizes = [1 << 20, 1 << 22, 1 << 24, 1 << 26] if not quick else [1 << 18, 1 << 20, 1 << 22]
    result = {"machine": machine_record(device), "command": " ".join(sys.argv), "quick": quick}
    if compile_kernels:
        say("compiling the fused kernels ...")
        result["compile"] = warm_up(device)
    else:
        result["compile"] = {"skipped": f"compile_kernels=False (kernel mode {round_to_grid.get_mode()!r})"}
    say(f"quantize, {size} elements ...")
    result["quantize"] = bench_quantize(size, device, repeats, eager=eager)
    say("where the warm stochastic rounding's time goes ...")
    result["split"] = bench_split(size, device, repeats)
    if eager:
        say("the first call of a fresh process ...")
        result["first_call"] = bench_first_call(size, device)
    if libraries:
        say("other libraries ...")
        result["libraries"] = bench_libraries(size, device, max(3, repeats // 2))
    result["training"] = []
    for name in models:
        say(f"training steps: {name} ...")
        # small models: many short rounds (their steps are milliseconds); GPT-2 on a CPU: a few
        train_repeats = (3 if quick else 15) if (name == "gpt2" and not on_gpu) else (15 if quick else 40)
        previous = round_to_grid.set_mode("on")
        try:
            t = bench_training(name, device, train_repeats, variants, plan)
        finally:
            round_to_grid.set_mode(previous)
        if eager and name == "nanogpt-quick":
            previous = round_to_grid.set_mode("off")
            try:
                t["eager_ratio"] = bench_training(name, device, train_repeats, variants, plan)["ratio"]
            finally:
                round_to_grid.set_mode(previous)
        result["training"].append(t)
    if scale_sizes:
        say("scale ...")
        result["scale"] = bench_scale(scale_sizes, device, max(3, repeats // 2))
        sized = [t for t in result["training"]]
        if not quick and "shakespeare-char" not in models:
            previous = round_to_grid.set_mode("on")
            try:
                sized.append(bench_training("shakespeare-char", device, 10))
            finally:
                round_to_grid.set_mode(previous)
        result["model_scale"] = sorted(sized, key=lambda t: t["params"])
    result["fused"] = {"mode": round_to_grid.get_mode(), "torch": torch.__version__}
    result["machine"]["load_average_end"] = load_average()
    return result


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--quick", action="store_true", help="a small version: 1M elements, the quick nanoGPT only "
                        "(on a GPU: 16M elements and both models)")
    parser.add_argument("--size", type=int, default=None, help="elements of the quantize benchmark (default 16M)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, --quick 5)")
    parser.add_argument("--models", default=None, help="comma-separated: nanogpt-quick, shakespeare-char, gpt2")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--no-libraries", action="store_true", help="skip QPyTorch and pychop")
    parser.add_argument("--no-eager", action="store_true", help="skip the measurements with the fused kernels off")
    parser.add_argument("--no-scale", action="store_true", help="skip the scale tables")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated training-step variants (default: {', '.join(VARIANTS)}; "
                             f"also the remedies {', '.join(REMEDY_VARIANTS)})")
    parser.add_argument("--plan", default=None, metavar="JSON",
                        help="the freeze plan the plan variant stores with (FreezePlan.save's file)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--summary-of", default=None, metavar="JSON",
                        help="measure nothing: print the tables and the summary against the targets of a "
                             "result written before with --out")
    args = parser.parse_args(argv)
    if args.summary_of:
        try:
            with open(args.summary_of) as f:
                saved = json.load(f)
        except (OSError, ValueError) as error:
            parser.error(f"--summary-of: cannot read {args.summary_of}: {error}")
        print(report(saved) + "\n\n## Against the targets\n" + summary(saved))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU")
    models = None if args.models is None else [m for m in args.models.split(",") if m]
    variants = VARIANTS
    if args.variants:
        variants = tuple(dict.fromkeys(["plain"] + [v.strip() for v in args.variants.split(",") if v.strip()]))
        unknown = [v for v in variants if v not in VARIANTS + REMEDY_VARIANTS]
        if unknown:
            parser.error(f"--variants: unknown {', '.join(unknown)}; valid: {', '.join(VARIANTS + REMEDY_VARIANTS)}")
    plan = None
    if "plan" in variants:
        if not args.plan:
            parser.error("--variants plan: give the plan to time with --plan PATH (a FreezePlan saved as JSON)")
        try:
            plan = load_plan(args.plan)
        except (OSError, ValueError, KeyError) as error:
            parser.error(f"--plan: cannot read a freeze plan from {args.plan}: {error}")
        if models is None or len(models) != 1:
            parser.error("--variants plan: a plan is made for one model; give --models with one of them")
    result = run(args.device, args.quick, args.size, args.repeats, models, not args.no_libraries, not args.no_eager,
                 scale_sizes=[] if args.no_scale else None, variants=variants, plan=plan)
    if plan is not None:
        result["plan"] = plan.to_dict()
    print(report(result) + "\n\n## Against the targets\n" + summary(result))
    if args.out:
        atomic_write_json(args.out, json.loads(json.dumps(result, default=str)))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
