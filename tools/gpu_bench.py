"""The GPU benchmark, in about a minute: checks, then times, then writes one JSON.

    python tools/gpu_bench.py --out gpu_bench.json          # from the repository root

1. Bits: the compiled (Triton) kernels on the GPU against the package's eager code on the CPU,
   bit for bit: round to nearest on the exhaustive point sets of bf16, fp16, e4m3, e5m2, e5m3 and
   e2m1 (every policy), stochastic rounding (full resolution and 3 bits) on random inputs, and the
   freeze statistics. A mismatch is reported in the JSON, and the exit status is 1.
2. Speed: ``python benchmarks/bench.py --device cuda --quick`` (quantize of 16M elements against
   the native casts, the nanoGPT and GPT-2 training steps, quantize against size), with the
   compile time of the fused kernels.

If compiling fails (no Triton, an unsupported torch), the package falls back to its eager code:
the benchmark then measures that, and the output says so (``fused_failed``). Each stage is
guarded: whatever fails is recorded in the JSON, the file is written in every case, and the exit
status is 1 when a stage failed or a bit differs. Stages are skipped once ``--budget`` seconds
(default 85) are spent. ``tests/test_gpu_tools.py`` runs the whole script on the CPU (eager
kernels, small sizes), so that it cannot fall behind the package.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))   # the benchmark's modules


def _say(t0, *args):
    print(f"[gpu_bench {time.time() - t0:6.1f}s]", *args, flush=True)


def check_bits(device: str, mode: str = "on", n_random: int = 50_000, stride: int = 0) -> dict:
    """Compiled GPU kernels against the CPU: round to nearest against ``quantize`` of the same
    values as float64 on the CPU (the exact route), stochastic rounding and the freeze code
    against the same kernel functions run eagerly on the CPU; counts of differing elements.

    ``mode``: the kernels' compile mode while checking (``"on"``: compiled; ``"off"`` runs the
    same code eagerly, which is how the test suite runs this on the CPU in seconds).
    ``n_random``: random inputs per format. ``stride``: 0 for the test suite's exhaustive point
    sets, else every stride-th float32 bit pattern."""
    import numpy as np
    import torch

    from lowprec_demo.formats import get_format
    from lowprec_demo.rounding import freeze_rule, quantize, round_to_grid
    from lowprec_demo.rounding.round_to_grid import nearest_bits, round_params, run, stochastic_bits

    def on_device(kernel, x, p):   # a rounding kernel on float32 numbers, compiled or not as the mode says
        return run(kernel, x.reshape(-1).view(torch.int32), p.to(x.device)).view(torch.float32)

    def exact_nearest(x, fmt, policy):   # float64 on the CPU: the package's exact route
        return quantize(x.cpu().double(), fmt, overflow=policy).float()

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    try:  # the exhaustive point sets of the test suite (needs pytest and ml_dtypes)
        if stride:
            raise ImportError("a stride was asked for")
        import test_rounding as TR
        points, policies = (lambda key: TR.exhaustive_points(key)), TR.policies
    except Exception:  # else float32 bit patterns at a stride, and the policies each format allows
        TR = None

        def points(key):
            return np.arange(0, 2**32, stride or 4093, dtype=np.uint64).astype(np.uint32).view(np.float32)

        def policies(fmt):
            return [p for p in ("inf", "saturate", "nan")
                    if (p != "inf" or fmt.has_inf) and (p != "nan" or fmt.has_nan)]

    def random_inputs(fmt, n):
        rng = np.random.default_rng(1)
        bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
        near = (rng.standard_normal(n) * 2.0 ** rng.uniform(-20, min(math.log2(fmt.max) + 2, 126), n)).astype(np.float32)
        return torch.from_numpy(np.concatenate([bits, near, np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)]))

    def differ(a, b):
        a, b = a.reshape(-1).cpu(), b.reshape(-1).cpu()
        nan = a.isnan() | b.isnan()
        return int((a.isnan() != b.isnan()).sum()) + int((a[~nan].view(torch.int32) != b[~nan].view(torch.int32)).sum())

    out = {"mode": mode}
    previous = round_to_grid.set_mode(mode)
    try:
        out["point_sets"] = ("exhaustive (tests/test_rounding.py)" if TR is not None
                             else f"bit patterns, stride {stride or 4093}")
        for key in ("bf16", "fp16", "e4m3", "e5m2", "e5m3", "e2m1"):
            fmt = get_format(key)
            pts = torch.from_numpy(points(key).astype(np.float32))
            rnd = random_inputs(fmt, n_random)
            row = {"points": len(pts), "random": len(rnd)}
            for policy in policies(fmt):
                row[f"nearest_{policy}"] = differ(on_device(nearest_bits, pts.to(device), round_params(fmt, policy).tensor()),
                                                  exact_nearest(pts, fmt, policy))
                for k in (None, 3):
                    p = round_params(fmt, policy, k, 2024).tensor()
                    row[f"stochastic_{policy}_k{k}"] = differ(on_device(stochastic_bits, rnd.to(device), p),
                                                              on_device(stochastic_bits, rnd, p))
            old = rnd.nan_to_num(0.0, 0.0, 0.0)
            new = (old * (1 + 2.0**-9) + 1e-7).nan_to_num(0.0, 0.0, 0.0)
            zero = torch.zeros((), dtype=torch.int32, device=device)
            # the predictor's call: no gradient, no learning-rate shift
            code, moves = freeze_rule.step_codes(old.to(device), new.to(device), None, zero, None, fmt, 3)
            eager = round_to_grid.set_mode("off")
            want_code, want_moves = freeze_rule.step_codes(old, new, None, zero.cpu(), None, fmt, 3)
            round_to_grid.set_mode(eager)
            # every code exactly: the frozen bit and the bin
            row["step_code"] = int((code.cpu() != want_code).sum())
            moved, want_moved = moves.double().sum(), want_moves.double().sum()
            row["moved_relative_error"] = abs(moved.item() - want_moved.item()) / max(1e-300, abs(want_moved.item()))
            out[key] = row
        # quantize end to end, as users call it (nearest float8 takes the fused kernel on the GPU)
        x = random_inputs(get_format("e4m3"), 100_000)
        out["quantize_e4m3_vs_cpu"] = differ(quantize(x.to(device), get_format("e4m3"), overflow="saturate"),
                                             exact_nearest(x, get_format("e4m3"), "saturate"))
    finally:
        round_to_grid.set_mode(previous)
    out["total_differences"] = sum(v for row in out.values() if isinstance(row, dict)
                                   for k, v in row.items() if k not in ("points", "random", "moved_relative_error")) + \
        out["quantize_e4m3_vs_cpu"]
    out["moved_relative_error_max"] = max(row["moved_relative_error"] for row in out.values()
                                          if isinstance(row, dict) and "moved_relative_error" in row)
    out["fused_status"] = {"mode": round_to_grid.get_mode()}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_bench.json", help="JSON file to write")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--budget", type=float, default=85.0, help="seconds after which stages are skipped")
    parser.add_argument("--no-check", action="store_true", help="skip the bit-for-bit check")
    parser.add_argument("--mode", default="on", choices=("on", "off", "auto"),
                        help="the kernels' compile mode for the check (off: eager, the CPU rehearsal)")
    parser.add_argument("--random", type=int, default=50_000, help="random inputs per format in the check")
    parser.add_argument("--stride", type=int, default=0,
                        help="check float32 bit patterns at this stride instead of the exhaustive point sets")
    parser.add_argument("--size", type=int, default=None, help="elements of the benchmark's quantize (default: its own)")
    parser.add_argument("--models", default="auto", help="comma-separated benchmark models, '' for none "
                        "(auto: nanogpt-quick and gpt2 when the budget allows)")
    parser.add_argument("--scale-sizes", default="20,22,24,26", help="log2 sizes of the quantize-against-size table")
    parser.add_argument("--no-eager", action="store_true",
                        help="leave out the eager comparisons and the first call of a fresh process")
    args = parser.parse_args(argv)
    t0 = time.time()
    result = {"argv": sys.argv, "stages": {}}

    def save():
        result["seconds"] = round(time.time() - t0, 1)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)

    try:
        import torch
        result["torch"] = torch.__version__
        result["cuda_available"] = torch.cuda.is_available()
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            result["error"] = "no CUDA device"
            _say(t0, "no CUDA device: nothing to measure")
            save()
            return 1
        if args.device.startswith("cuda"):
            result["gpu"] = torch.cuda.get_device_name()
        try:
            import triton
            result["triton"] = triton.__version__
        except Exception as error:
            result["triton"] = f"not importable: {error}"
        import bench
        from lowprec_demo.rounding import round_to_grid
    except Exception:
        result["error"] = traceback.format_exc()
        save()
        print(result["error"])
        return 1
    previous_mode = round_to_grid.set_mode(args.mode)
    try:
        return _stages(args, result, t0, save)
    finally:
        round_to_grid.set_mode(previous_mode)


def _stages(args, result: dict, t0: float, save) -> int:
    import bench
    from lowprec_demo.rounding import round_to_grid

    if not args.no_check:
        _say(t0, "bits: compiled GPU kernels against the CPU's eager code ...")
        try:
            check = check_bits(args.device, args.mode, args.random, args.stride)
            result["stages"]["check"] = check
            _say(t0, f"bits: {check['total_differences']} elements differ"
                 + ("" if check["total_differences"] == 0 else " -- SEE THE JSON"))
        except Exception:
            result["stages"]["check"] = {"error": traceback.format_exc()}
            _say(t0, "bits: the check failed:\n" + result["stages"]["check"]["error"])
        save()

    if time.time() - t0 < args.budget:
        _say(t0, "speed: python benchmarks/bench.py --device cuda --quick ...")
        try:
            left = args.budget - (time.time() - t0)
            if args.models == "auto":
                models = ["nanogpt-quick", "gpt2"] if left > 40 else ["nanogpt-quick"]
            else:
                models = [m for m in args.models.split(",") if m]
            sizes = [1 << int(k) for k in args.scale_sizes.split(",") if k]
            run = bench.run(args.device, quick=True, size=args.size, models=models, libraries=False,
                            eager=not args.no_eager, compile_kernels=args.mode != "off",
                            scale_sizes=sizes, progress=False)
            result["stages"]["bench"] = run
            failed = run.get("compile", {}).get("failed")
            if failed:
                result["fused_failed"] = failed
                _say(t0, f"NOTE: the fused kernels did not compile ({failed}); the plain path was measured")
            print(bench.report(run), flush=True)
        except Exception:
            result["stages"]["bench"] = {"error": traceback.format_exc()}
            _say(t0, "speed: failed:\n" + result["stages"]["bench"]["error"])
    else:
        result["stages"]["bench"] = {"skipped": f"budget of {args.budget} s spent"}
    result["fused_status"] = {"mode": round_to_grid.get_mode()}
    failed = [name for name, stage in result["stages"].items() if isinstance(stage, dict) and "error" in stage]
    differ = result["stages"].get("check", {}).get("total_differences", 0)
    result["ok"] = not failed and not differ
    save()
    _say(t0, f"wrote {args.out}" + (f"; FAILED: {', '.join(failed)}" if failed else "")
         + (f"; {differ} elements differ" if differ else ""))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
