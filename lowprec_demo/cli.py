"""Command line: run an experiment and write its JSON result.

Usage::

    python -m lowprec_demo run EXPERIMENT [--format NAME] [--steps N] [--lr LR] [--seed S]
        [--device cpu|cuda|auto] [--scale quick|full] [--out results.json] [--set key=value ...]
    python -m lowprec_demo list

The JSON holds ``experiment``, ``config``, ``provenance`` (package and torch versions, device,
git commit, date), ``runs`` (``reference``, ``nearest``, ``stochastic``, each with a per-step
``loss`` list; the low-precision ones also ``frozen_observed``) and ``prediction``
(``frozen_predicted`` per step, ``threshold``, ``freeze_step``). It is written atomically.

Example:
    ``python -m lowprec_demo run quadratic --format bf16 --out r.json``
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
from typing import List, Optional

if __name__ == "__main__" and not __package__:
    # run as a file (``torchrun lowprec_demo/cli.py run ...``): import the package it belongs to
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import lowprec_demo  # noqa: F401
    __package__ = "lowprec_demo"

from .formats import FORMAT_NAMES, get_format
from .runtime import DEVICES, SCALES


def _parse_value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _parse_sets(items: List[str]) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = _parse_value(value.strip())
    return out


def build_parser() -> argparse.ArgumentParser:
    from .experiments import experiment_names
    parser = argparse.ArgumentParser(prog="python -m lowprec_demo",
                                     description="Low-precision training experiments: the freeze, predicted and observed.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment: reference, round-to-nearest and stochastic rounding")
    run.add_argument("experiment", help=f"one of: {', '.join(experiment_names())}")
    run.add_argument("--format", dest="fmt", default=None,
                     help=f"storage format: {', '.join(FORMAT_NAMES)} or e<E>m<m> (default: the experiment's)")
    run.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the experiment's)")
    run.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the experiment's)")
    run.add_argument("--seed", type=int, default=0, help="seed for initialisation, data and SR (default 0)")
    run.add_argument("--device", default="auto", help=f"one of {', '.join(DEVICES)} (default auto)")
    run.add_argument("--scale", default=None, help=f"one of {', '.join(SCALES)} (default: LOWPREC_SCALE or quick)")
    run.add_argument("--threshold", type=float, default=None, help="frozen fraction that defines the freeze step")
    run.add_argument("--rand-bits", type=int, default=None, help="few-bit stochastic rounding with this many bits")
    run.add_argument("--predict", default="", help="extra formats to predict from the same reference, comma separated")
    run.add_argument("--variants", default=None,
                     help="comma-separated runs (default reference,nearest,stochastic; kahan is available)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="an experiment option or config field, e.g. --set dim=1 (repeatable)")
    run.add_argument("--out", default="results.json", help="output JSON path (default results.json)")
    run.add_argument("--max-points", type=int, default=1000,
                     help="keep per-tensor curves at most this long in the JSON (0: all)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    sub.add_parser("list", help="list experiments and formats")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit status. Under ``torchrun`` every process trains its share
    and only rank 0 prints and writes the JSON."""
    from .experiments import experiment_names, get_experiment, run_experiment
    from .training import finish_distributed, init_distributed
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in experiment_names():
            print(f"{name:12s} {get_experiment(name).description}")
        print("formats:", ", ".join(FORMAT_NAMES), "or e<E>m<m>")
        return 0
    try:
        if args.experiment not in experiment_names():
            raise ValueError(f"unknown experiment {args.experiment!r}; valid experiments: {', '.join(experiment_names())}")
        if args.fmt is not None:
            get_format(args.fmt)
        overrides = _parse_sets(args.set)
        if args.threshold is not None:
            overrides["threshold"] = args.threshold
        if args.rand_bits is not None:
            overrides["rand_bits"] = args.rand_bits
        if args.predict:
            overrides["predict_formats"] = tuple(f.strip() for f in args.predict.split(",") if f.strip())
        if args.variants:
            overrides["variants"] = tuple(v.strip() for v in args.variants.split(",") if v.strip())
        main_process = init_distributed(args.device).is_main
        result = run_experiment(args.experiment, fmt=args.fmt, steps=args.steps, lr=args.lr, seed=args.seed,
                                device=args.device, scale=args.scale,
                                progress=main_process and not args.no_progress, **overrides)
        finish_distributed()
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not main_process:
        return 0
    path = result.save(args.out, max_points=args.max_points)
    s = result.summary()
    print(f"{s['experiment']} {s['format']}: predicted freeze step {s['predicted_freeze_step']}, "
          f"observed {s['observed_freeze_step']} (threshold {s['threshold']}, {s['steps']} steps)")
    for v in result.runs:
        print(f"  final loss {v:>10}: {result.runs[v].loss[-1]:.4g}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
