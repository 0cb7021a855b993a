"""The freeze watch's cost per step in one process (a plain model) and under FSDP2 (``fully_shard``).

Run it in one process and under torchrun, one thread per process::

    OMP_NUM_THREADS=1 python benchmarks/fsdp_watch.py
    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 benchmarks/fsdp_watch.py

A 1.3M-parameter MLP (256 -> 1024, LayerNorm, 1024 -> 1024, 1024 -> 256), AdamW, a batch of 64 split
over the processes; ``LowPrecisionOptimizer`` (bf16, nearest or stochastic: the watch observes) or
plain AdamW (the watch predicts bf16). Per setting, the median over ``ROUNDS`` fresh runs of
``STEPS`` timed steps of: the whole step (wall), the watch's two hooks (wall and the main thread's
CPU time) and, within them, the all_reduce (wall and CPU), and the whole step's main-thread CPU
time: on a machine whose cores are shared the CPU times are the steadier measure. The rounding
kernels run eagerly (``round_to_grid.set_mode("off")``), so that no setting compiles them halfway
through. ``SAMPLE=all`` follows every element instead of at most 16,384 per tensor. Rank 0 prints
one JSON line.
"""

import json
import os
import time

import torch
import torch.distributed as dist

import lowprec_demo as lp

torch.set_num_threads(1)
lp.rounding.round_to_grid.set_mode("off")
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
if WORLD > 1:
    dist.init_process_group("gloo")
RANK = dist.get_rank() if WORLD > 1 else 0
STEPS, WARM, ROUNDS = int(os.environ.get("STEPS", 20)), 3, int(os.environ.get("ROUNDS", 5))
SAMPLE = None if os.environ.get("SAMPLE") == "all" else 1 << 14
CLOCK = [0.0] * 4      # the hooks' wall and CPU seconds, the all_reduce's wall and CPU seconds

_all_reduce = dist.all_reduce


def _timed_all_reduce(*args, **kwargs):
    wall, cpu = time.perf_counter(), time.thread_time()
    out = _all_reduce(*args, **kwargs)
    CLOCK[2] += time.perf_counter() - wall
    CLOCK[3] += time.thread_time() - cpu
    return out


dist.all_reduce = _timed_all_reduce     # the watch's one collective, timed where it is called


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    if WORLD > 1:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model)
    return model


X = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))


def _run(kind: str, watched: bool):
    model = _model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = inner if kind == "predict" else lp.LowPrecisionOptimizer(inner, "bf16", rounding=kind, generator=1)
    watch = lp.watch(model, opt, formats=("bf16",), total_steps=STEPS + WARM, sample=SAMPLE) if watched else None
    if watch is not None:
        watch.detach()      # its hooks are called by hand below, to time them
    for i in range(WARM + STEPS):
        if i == WARM:
            if WORLD > 1:
                dist.barrier()
            start, start_cpu, CLOCK[:] = time.perf_counter(), time.thread_time(), [0.0] * 4
        opt.zero_grad()
        model(X[RANK::WORLD]).pow(2).mean().backward()
        if watch is not None:
            wall, cpu = time.perf_counter(), time.thread_time()
            watch.before_step()
            CLOCK[0] += time.perf_counter() - wall
            CLOCK[1] += time.thread_time() - cpu
        opt.step()
        if watch is not None:
            wall, cpu = time.perf_counter(), time.thread_time()
            watch.after_step()
            CLOCK[0] += time.perf_counter() - wall
            CLOCK[1] += time.thread_time() - cpu
    total, total_cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    if WORLD > 1:
        dist.barrier()
    return [total / STEPS] + [c / STEPS for c in CLOCK] + [total_cpu / STEPS]


out = {"world": WORLD, "sample": SAMPLE, "steps": STEPS, "rounds": ROUNDS}
for kind in os.environ.get("KINDS", "nearest,stochastic,predict").split(","):
    for watched in (False, True):
        runs = [_run(kind, watched) for _ in range(ROUNDS)]
        median = [sorted(r[i] for r in runs)[len(runs) // 2] for i in range(6)]
        names = ("step_ms", "hooks_wall_ms", "hooks_cpu_ms", "allreduce_wall_ms", "allreduce_cpu_ms", "step_cpu_ms")
        out[kind + ("+watch" if watched else "")] = {k: round(1e3 * v, 3) for k, v in zip(names, median)}
if RANK == 0:
    print(json.dumps(out))
if WORLD > 1:
    dist.destroy_process_group()
