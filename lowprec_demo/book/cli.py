"""The command line: ``python -m lowprec_demo run EXPERIMENT [--format NAME] [--steps N] [--lr LR] [--seed S]
[--device cpu|cuda|auto] [--scale quick|full] [--out results.json] [--set key=value ...]`` writes the result's JSON
(:meth:`~lowprec_demo.book.results.TrainResult.to_dict`, atomically); ``list`` names the experiments; ``report
WATCH.json [--format NAME] [--plot out.png]`` prints a saved freeze watch (``--plot``'s path checked first), ``report
PLAN.json`` a saved freeze plan (``plan.save``, ``freeze_plan.json``); ``--version`` the package's version.
``--set`` sets a TrainConfig field or an experiment option, read as its declared type (``--set betas=0.9,0.95``,
``--set bias=false``). Everything that can be checked is checked before training: a refused setting or ``--out`` ends
the command with exit status 2."""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
import typing
from pathlib import Path
from typing import List, Optional

if __name__ == "__main__" and not __package__:   # run as a file: ``torchrun lowprec_demo/book/cli.py run ...``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    import lowprec_demo.book  # noqa: F401
    __package__ = "lowprec_demo.book"

from lowprec_demo.formats import FORMAT_NAMES, get_format
from lowprec_demo.book.runtime import DEVICES, SCALES, pick_device

# TrainConfig fields that have a flag of their own: --set may give them too, but not both ways
_FLAGS = {"format": "--format", "steps": "--steps", "lr": "--lr", "seed": "--seed", "device": "--device",
          "threshold": "--threshold", "rand_bits": "--rand-bits", "predict_formats": "--predict",
          "variants": "--variants"}


class SettingError(ValueError):
    """A ``--set`` or ``--out`` the command line refuses before any training."""


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _as_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
        raise ValueError
    return lowered in ("true", "1", "yes", "on")


def _as_int(text: str) -> int:
    value = _literal(text)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError
    return value


def _as_float(text: str) -> float:
    value = _literal(text)
    if isinstance(value, bool):
        raise ValueError
    return float(value) if isinstance(value, (int, float)) else float(text)   # "inf", "nan"


def _as_tuple(text: str) -> tuple:
    """``a,b`` or ``(a, b)``: each item a Python literal, else a string."""
    inner = text.strip()
    if inner[:1] in "([" and inner[-1:] in ")]":
        inner = inner[1:-1]
    return tuple(_literal(item.strip()) for item in inner.split(",") if item.strip())


_READERS = {bool: (_as_bool, "true or false"), int: (_as_int, "an integer"),
            float: (_as_float, "a number such as 0.001"), tuple: (_as_tuple, "a comma-separated list"),
            str: (str, "text")}


def _field_types() -> dict:
    from lowprec_demo.book.config import TrainConfig
    types = {}
    for name, hint in typing.get_type_hints(TrainConfig).items():
        args = typing.get_args(hint)
        optional = typing.get_origin(hint) is typing.Union and type(None) in args
        base = next(a for a in args if a is not type(None)) if optional else (typing.get_origin(hint) or hint)
        types[name] = (base, optional)
    return types


def parse_setting(key: str, text: str, kind: Optional[type] = None, optional: bool = False):
    """The value of ``--set key=text`` as a ``kind`` (bool, int, float, tuple or str; None: a
    Python literal, else the text; ``None`` allowed when ``optional``), or a SettingError.

    Example:
        >>> parse_setting("lr", "3e-4", float), parse_setting("betas", "0.9,0.95", tuple)
        (0.0003, (0.9, 0.95))
    """
    text = text.strip()
    if optional and text.lower() in ("none", ""):
        return None
    if kind is None or kind not in _READERS:
        return _literal(text)
    reader, expected = _READERS[kind]
    try:
        value = reader(text)
    except (ValueError, TypeError, SyntaxError):
        raise SettingError(f"--set {key}={text}: {key} takes {expected}" + (" or None" if optional else "")
                           + f", not {text!r}") from None
    if key == "betas" and (len(value) != 2 or not all(isinstance(b, (int, float)) for b in value)):
        raise SettingError(f"--set betas={text}: betas takes two numbers, e.g. 0.9,0.95")
    return value


def parse_sets(experiment: str, items: List[str], scale: Optional[str] = None) -> dict:
    """The ``--set key=value`` items as typed settings for ``experiment`` (an option undeclared by its
    experiment is read as its default's type at ``scale``, or a literal), or a SettingError.

    Example:
        >>> parse_sets("quadratic", ["dim=8", "momentum=0.9"])
        {'dim': 8, 'momentum': 0.9}
    """
    from lowprec_demo.book.experiments import check_settings, get_experiment
    from lowprec_demo.book.runtime import scale as current_scale
    types = _field_types()
    exp = get_experiment(experiment)
    option_types = {} if exp.option_class is None else exp.option_class.types()
    defaults = dict(exp.defaults(current_scale(scale)).get("options", {}))
    out = {}
    for item in items:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SettingError(f"--set expects key=value, got {item!r}")
        if key == "options":
            raise SettingError("--set options=...: give each option as its own --set name=value")
        try:
            check_settings(experiment, {key: None})
        except ValueError as error:
            raise SettingError(f"--set {item}: {error}") from None
        default = defaults.get(key)
        kind, optional = types.get(key) or option_types.get(key) or (None if default is None else type(default), False)
        out[key] = parse_setting(key, text, kind, optional)
    return out


def check_out(path: str) -> Path:
    """Raise SettingError unless ``path`` is writable (checked before training, so a long run is not lost)."""
    out = Path(path)
    if out.is_dir():
        raise SettingError(f"--out {path}: is a folder; give a file name, e.g. --out {out / 'results.json'}")
    folder = existing = out.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise SettingError(f"--out {path}: {existing} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        reason = error.strerror or str(error)
        if existing == folder:
            raise SettingError(f"--out {path}: cannot write a file in the folder {folder} ({reason})") from None
        raise SettingError(f"--out {path}: the folder {folder} does not exist and cannot be made in "
                           f"{existing} ({reason})") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    from lowprec_demo.book.experiments import experiment_names
    from lowprec_demo.version import __version__
    parser = argparse.ArgumentParser(prog="python -m lowprec_demo", description="Low-precision training "
                                     "experiments: the freeze, predicted and observed.")
    parser.add_argument("--version", action="version", version=f"lowprec_demo {__version__}",
                        help="print the package's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment: reference, round-to-nearest and stochastic rounding")
    run.add_argument("experiment", help=f"one of: {', '.join(experiment_names())}")
    run.add_argument("--format", dest="fmt", default=None,
                     help=f"storage format: {', '.join(FORMAT_NAMES)} or e<E>m<m> (default: the experiment's)")
    run.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the experiment's)")
    run.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the experiment's)")
    run.add_argument("--seed", type=int, default=None, help="seed for initialisation, data and SR (default 0)")
    run.add_argument("--device", default=None, help=f"one of {', '.join(DEVICES)} (default auto)")
    run.add_argument("--scale", default=None, help=f"one of {', '.join(SCALES)} (default: LOWPREC_SCALE or quick)")
    run.add_argument("--threshold", type=float, default=None, help="frozen fraction that defines the freeze step")
    run.add_argument("--rand-bits", type=int, default=None, help="few-bit stochastic rounding with this many bits")
    run.add_argument("--predict", default="", help="extra formats to predict from the same reference, comma separated")
    run.add_argument("--variants", default=None, help="comma-separated runs (default reference,nearest,stochastic; "
                                                      "also kahan, kahan_lp, master, nearest_state, stochastic_state)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="a config field or an experiment option, e.g. --set dim=1 or --set momentum=0.9 "
                          "(repeatable; a field's value is read as the field's type; a field with a flag of "
                          "its own may be given either way, not both)")
    run.add_argument("--out", default="results.json",
                     help="output JSON path (default results.json; missing folders are made), checked before training")
    run.add_argument("--max-points", type=int, default=1000,
                     help="keep per-tensor curves at most this long in the JSON (0: all)")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.set_defaults(run_parser=run)
    sub.add_parser("list", help="list experiments and formats")
    report = sub.add_parser("report", help="print the table of a saved freeze watch (watch.save(PATH)), and draw it; "
                                           "or of a saved freeze plan (plan.save(PATH), freeze_plan.json)")
    report.add_argument("path", help="the JSON file the watch (or the plan) saved")
    report.add_argument("--format", dest="fmt", default=None, help="which of its formats (default: the first)")
    report.add_argument("--plot", default=None, metavar="OUT.png",
                        help="also draw a watch's figure into this image file (its folder must exist)")
    report.set_defaults(report_parser=report)
    return parser


def check_plot(path: str) -> None:
    """Raise SettingError unless ``--plot path`` can be written: an image suffix matplotlib writes, in a folder that
    exists and takes a new file (checked before anything is printed)."""
    from matplotlib.backend_bases import FigureCanvasBase
    out, kinds = Path(path), sorted(FigureCanvasBase.get_supported_filetypes())
    if out.suffix.lower().lstrip(".") not in kinds:
        what = (f"the suffix {out.suffix!r} is no image type matplotlib writes" if out.suffix
                else "no suffix names its type")
        raise SettingError(f"--plot {path}: {what}; give one of {', '.join('.' + k for k in kinds)}")
    folder = out.parent
    if out.is_dir() or not folder.is_dir():
        what = ("is a folder" if out.is_dir() else f"the folder {folder} does not exist" if not folder.exists()
                else f"{folder} is a file, not a folder")
        raise SettingError(f"--plot {path}: cannot write it: {what}; give an image file in an existing folder")
    try:
        if out.exists() and not os.access(out, os.W_OK):
            raise PermissionError(13, "Permission denied")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise SettingError(f"--plot {path}: cannot write it in the folder {folder} "
                           f"({error.strerror or error})") from None


def plan_table(plan) -> str:
    """A saved plan as ``report PLAN.json`` prints it: the bytes, then per tensor its remedy, the extra bytes it
    stores (elements x the remedy's bytes per element) and why."""
    b, made = plan.bytes_per_parameter(), "" if plan.step is None else f", made at step {plan.step}"
    width = max(len("tensor"), *(len(n) for n in plan.remedies))
    lines = [f"freeze plan for {plan.format}{made}" + (f" of {plan.total_steps}" if plan.total_steps else "")
             + f": {b['extra']:.3g} bytes per parameter above round to nearest"
             + (f" (budget {plan.budget:g})" if plan.budget is not None else "") + f", {b['total']:.3g} in all",
             f"{'tensor':<{width}}  {'elements':>11}  {'remedy':<10}  {'extra bytes':>11}  why"]
    for n, r in plan.remedies.items():
        size = plan.sizes.get(n)
        extra = "-" if size is None else f"{round(size * plan.extra_bytes(r)):,}"
        lines.append(f"{n:<{width}}  {'-' if size is None else format(size, ','):>11}  {r:<10}  {extra:>11}  "
                     f"{plan.reasons.get(n, '')}")
    return "\n".join(lines)


def _report(args: argparse.Namespace) -> int:
    """``report PATH``: a saved watch's table, and with ``--plot`` its figure; or a saved plan's table (exit status 2
    and why, before anything is printed)."""
    import json

    from lowprec_demo.monitor import WatchReport
    from lowprec_demo.optim.plan import FreezePlan
    fail = args.report_parser
    if os.path.isdir(args.path):
        return _fail(fail, f"{args.path}: is a directory, not a saved report (give the JSON file watch.save wrote)")
    try:
        if args.plot:
            check_plot(args.plot)
        with open(args.path) as f:
            data = json.load(f)
    except SettingError as exc:
        return _fail(fail, str(exc))
    except FileNotFoundError:
        return _fail(fail, f"{args.path}: no such file")
    except OSError as exc:
        return _fail(fail, f"{args.path}: cannot read it ({exc.strerror or exc})")
    except ValueError as exc:     # not JSON (or not text)
        return _fail(fail, f"{args.path}: not a JSON file ({exc})")
    try:
        if isinstance(data, dict) and data.get("kind") == "lowprec_demo.freeze_plan":
            try:
                plan = FreezePlan.from_dict(data)
            except (KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"a freeze plan (kind 'lowprec_demo.freeze_plan') that cannot be read: {exc!r} (a "
                                 f"plan as FreezePlan.save writes it holds format, remedies, reasons, sizes)") from None
            if args.plot:
                raise ValueError(f"--plot {args.plot}: a freeze plan has no figure; --plot draws a saved watch's")
            if args.fmt is not None and get_format(args.fmt).name != plan.format:
                raise ValueError(f"--format {args.fmt}: this plan is for {plan.format} only")
            print(plan_table(plan))
            return 0
        text = (report := WatchReport(data, args.path)).summary(args.fmt, show=False)
        if args.plot and not data["steps"]:
            raise ValueError(f"--plot {args.plot}: no step watched yet, nothing to draw")
    except (ValueError, KeyError, TypeError) as exc:   # not a watch report, or a format it does not hold
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        return _fail(fail, f"{args.path}: {message}")
    print(text)
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        ax = report.plot(args.fmt)
        try:
            ax.figure.savefig(args.plot, dpi=120, bbox_inches="tight")
        except (OSError, ValueError) as exc:      # ValueError: a file type matplotlib does not write
            reason = f"cannot write it ({exc.strerror or exc})" if isinstance(exc, OSError) else exc
            return _fail(fail, f"--plot {args.plot}: {reason}")
        finally:
            plt.close(ax.figure)
        print(f"wrote {args.plot}")
    return 0


def _fail(parser: argparse.ArgumentParser, message: str) -> int:
    """Report an error as argparse does (usage, then ``prog: error: message``); returns 2."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def _settings(args: argparse.Namespace) -> dict:
    """Every setting of the run, from the flags and ``--set`` (a key given both ways is refused)."""
    flags = {"format": args.fmt, "steps": args.steps, "lr": args.lr, "seed": args.seed, "device": args.device,
             "threshold": args.threshold, "rand_bits": args.rand_bits,
             "predict_formats": tuple(f.strip() for f in args.predict.split(",") if f.strip()) or None,
             "variants": tuple(v.strip() for v in args.variants.split(",") if v.strip()) if args.variants else None}
    flags = {k: v for k, v in flags.items() if v is not None}
    sets = parse_sets(args.experiment, args.set, args.scale)
    for key in sets:
        if key in flags:
            raise SettingError(f"{key} is given twice: {_FLAGS[key]} {flags[key]} and --set {key}=...; give it once")
    return {**flags, **sets}


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit status (under ``torchrun`` rank 0 prints and writes the JSON)."""
    from lowprec_demo.book.experiments import experiment_names, get_experiment, make_config, run_experiment
    from lowprec_demo.book.distributed import finish_distributed, init_distributed
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in experiment_names():
            print(f"{name:12s} {get_experiment(name).description}")
        print("formats:", ", ".join(FORMAT_NAMES), "or e<E>m<m>")
        return 0
    if args.command == "report":
        return _report(args)
    fail = args.run_parser
    try:   # everything that can be checked, before any training
        if args.experiment not in experiment_names():
            raise SettingError(f"unknown experiment {args.experiment!r}; valid experiments: "
                               f"{', '.join(experiment_names())}")
        settings = _settings(args)
        fmt, steps, lr = settings.pop("format", None), settings.pop("steps", None), settings.pop("lr", None)
        seed, device = settings.pop("seed", 0), settings.pop("device", "auto")
        pick_device(device)
        make_config(args.experiment, args.scale, format=fmt, steps=steps, lr=lr, seed=seed, device=device,
                    **settings)
        check_out(args.out)
    except (ValueError, TypeError, RuntimeError) as exc:
        return _fail(fail, str(exc))
    try:
        main_process = init_distributed(device).is_main
        result = run_experiment(args.experiment, fmt=fmt, steps=steps, lr=lr, seed=seed, device=device,
                                scale=args.scale, progress=main_process and not args.no_progress, **settings)
        finish_distributed()
    except (ValueError, TypeError, RuntimeError) as exc:
        print(f"{fail.prog}: error: {exc}", file=sys.stderr)
        return 2
    if not main_process:
        return 0
    path = result.save(args.out, max_points=args.max_points)
    s = result.summary()
    print(f"{s['experiment']} {s['format']}: predicted freeze step {s['predicted_freeze_step']}, "
          f"observed {s['observed_freeze_step']} (threshold {s['threshold']}, {s['steps']} steps)")
    if "nearest" in result.runs:
        for name, e in result.predictor_errors().items():
            print(f"  predictor {name:>15}: freeze step {e['freeze_step']}, mean |F - F_observed| "
                  f"{e['mean_abs_error']:.3f}")
        a = result.element_agreement()
        print(f"  element mismatch {a['element_mismatch']:.3f} (independent masks: {a['chance_mismatch']:.3f}; "
              f"within each tensor and binade: {a['stratified_chance_mismatch']:.3f})")
    for v in result.runs:
        print(f"  final loss {v:>10}: {result.runs[v].loss[-1]:.4g}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
