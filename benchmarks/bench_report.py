"""The benchmark's tables and its judgement: :func:`report` prints a result of
:func:`bench.run` as Markdown tables, :func:`summary` sets every ratio against the
performance targets (:data:`TARGETS`).

Both read only the result (a dict, or the JSON ``--out`` wrote), so a stored run is printed again
without measuring: ``python benchmarks/bench.py --summary-of FILE``.

Example:
    ``print(summary(json.load(open("benchmarks/cpu-2026-12-02-zen1-after.json"))))``
"""

from __future__ import annotations

import statistics
from typing import List, Optional

from machine import cpu_label

__all__ = ["report", "summary", "step_target", "TARGETS", "TARGET_SIZES", "QUICK_MARK"]


# ------------------------------------------------------------------------------------------------
# the tables
# ------------------------------------------------------------------------------------------------
def _table(headers: List[str], rows: List[list]) -> str:
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows])


def _spread(t: dict, variant: str) -> str:
    """The lower and upper quartiles of a variant's per-round ratios (how far the ratio moves
    from round to round on this machine), "-" where the result has no rounds (older runs, or
    fewer than two)."""
    ratios = (t.get("ratio_rounds") or {}).get(variant) or []
    if len(ratios) < 2:
        return "-"
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"{low:.3f}-{high:.3f}"


def _fmt(value, digits=2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def report(result: dict) -> str:
    """The tables of a :func:`bench.run` result, as Markdown."""
    m = result["machine"]
    cpu = f", {cpu_label(m['cpu'])}" if m.get("cpu") else ""
    out = [f"# lowprec_demo benchmark, {m['date']}",
           f"{m['device_name']}{cpu} ({m['device']}, {m['threads']} threads of {m['cpu_count']} cores), torch {m['torch']}, "
           f"load average at start {m['load_average_start']}, fused kernels: {result['fused']['mode']}, "
           f"lowprec_demo {m.get('package_version')} at commit {m.get('git_commit') or 'unknown'}"]
    comp = result.get("compile")
    if comp and "skipped" in comp:
        out.append(f"\nCompiling the fused kernels: skipped ({comp['skipped']})")
    elif comp:
        out.append(f"\nCompiling the fused kernels (first call of each, once per process): "
                   f"{comp['total_seconds']:.1f} s in all"
                   + (f"; FAILED, using the eager path: {comp['failed']}" if comp["failed"] else ""))
    q = result.get("quantize")
    if q:
        out.append(f"\n## quantize, {q[0]['n'] / 2**20:g}M float32 elements (ms, median; ratio = quantize / native round trip)")
        rows = [[r["format"], r["rounding"], f"x.to({r['native_dtype']}).float()" + ("" if r["native_is_own_dtype"] else " *"),
                 _fmt(r["native_ms"], 1), _fmt(r["quantize_ms"], 1), _fmt(r["ratio"]), _fmt(r["quantize_GBps"]),
                 _fmt(r.get("eager_ms"), 0), _fmt(r["extra_memory_inputs"])] for r in q]
        out.append(_table(["format", "rounding", "native round trip", "native", "quantize", "ratio", "GB/s",
                           "eager", "memory / input"], rows))
        out.append("(* no torch dtype: compared with the bf16 round trip. GB/s counts one float32 read and one "
                   "write. eager: with the fused kernels off. memory / input: peak extra memory of one call over the "
                   "input's size; the result itself is 1.)")
    split = result.get("split")
    if split and "ms" in split:
        out.append(f"\n## Where the warm stochastic rounding's time goes, {split['n'] / 2**20:g}M float32 to bf16 "
                   f"(compiled; inductor's vector width: {split.get('compiler_vector_width')}; CPU: "
                   f"{', '.join((split.get('cpu_vector_extensions') or {}).get('flags', [])) or '-'})")
        labels = {"copy": "x.clone() (one read, one write)", "native": "x.to(bfloat16).float()",
                  "nearest": "round to nearest (no hash)", "hash": "the hash alone", "stochastic": "stochastic rounding"}
        out.append(_table(["work", "ms", "/ native round trip"],
                          [[labels[k], _fmt(v, 2), _fmt(split["to_native"][k])] for k, v in split["ms"].items()]))
    elif split:
        out.append(f"\n(where the warm stochastic rounding's time goes: not measured, {split['error']})")
    libs = result.get("libraries")
    if libs:
        out.append("\n## Other libraries (same input; differ = elements of 100k random + edge cases whose "
                   "nearest result is not the exact one)")
        rows = []
        for r in libs:
            if "error" in r and "format" not in r:
                rows.append([r["library"], "-", "-", "-", "-", "-", r["error"][:80]])
            else:
                note = r.get("error", "")
                if "differ" in r:
                    note = f"differ: {r['differ']}" + (f", e.g. (x, theirs, exact) {r['differ_examples'][:2]}"
                                                      if r["differ"] else "")
                elif "sr_mean_minus_x_in_gaps" in r:
                    note = f"mean - x: {r['sr_mean_minus_x_in_gaps']:+.4f} eps"
                rows.append([r["library"], r["format"], r["rounding"], _fmt(r.get("lib_ms"), 1),
                             _fmt(r.get("quantize_ms"), 1), _fmt(r.get("ratio_lib_to_quantize")), note[:120]])
        out.append(_table(["library", "format", "rounding", "library ms", "quantize ms", "library / quantize", "note"],
                          rows))
    for t in result.get("training", []):
        out.append(f"\n## Training step: {t['model']} ({t['params'] / 1e6:.2f}M parameters, {t['format']} on "
                   f"{t['lowprec_params'] / 1e6:.2f}M of them, batch {t['batch']} x {t['context']} tokens)")
        rows = [[v, _fmt(t["step_ms"][v], 1), _fmt(t["ratio"][v], 3), _spread(t, v), _fmt(t["added_alone_ms"][v], 1),
                 _fmt(t["ratio_from_parts"][v], 3), _fmt(t["peak_extra_MB"][v], 0), _fmt(t["held_MB"][v], 0)]
                for v in t["step_ms"]]
        out.append(_table(["variant", "step ms", "ratio to plain", "middle half of rounds", "added work alone, ms",
                           "1 + alone / plain", "peak MB in the step", "MB held between steps"], rows))
        out.append(f"(parameters {t['memory_MB']['parameters']:.0f} MB, AdamW state "
                   f"{t['memory_MB']['optimizer_state']:.0f} MB; peak: the most the step allocates beyond them, "
                   f"gradients and activations included; held: snapshot copies of the tracked tensors and packs)")
        if "eager_ratio" in t:
            out.append("with the fused kernels off: " + ", ".join(f"{v} {r:.3f}" for v, r in t["eager_ratio"].items()))
    s = result.get("scale")
    if s:
        out.append("\n## Scale: quantize against tensor size (ns per element)")
        keys = [k[:-len(" ns/element")] for k in s[0] if k.endswith("ns/element")]
        out.append(_table(["elements"] + keys,
                          [[f"{r['n'] / 2**20:g}M"] + [_fmt(r[f"{k} ns/element"]) for k in keys] for r in s]))
    ms = result.get("model_scale")
    if ms:
        out.append("\n## Scale: the tracked step against model size (ms per step; ms per million parameters of "
                   "overhead over the plain step)")
        rows = []
        for t in ms:
            plain = t["step_ms"]["plain"]
            rows.append([t["model"], f"{t['params'] / 1e6:.2f}M", _fmt(plain, 1)]
                        + [f"{_fmt(t['step_ms'][v], 1)} ({_fmt((t['step_ms'][v] - plain) / (t['lowprec_params'] / 1e6), 2)})"
                           for v in t["step_ms"] if v != "plain"])
        out.append(_table(["model", "parameters", "plain"] + [v for v in ms[0]["step_ms"] if v != "plain"], rows))
    return "\n".join(out)

#: the performance targets: the most each ratio may be. quantize, compiled (warm), against the
#: native round trip, and the extra memory of one call over its input's size; round to nearest
#: with compiling off (the cold path) against the native round trip; the first call of a fresh
#: process in seconds (16M-element stochastic rounding to bf16, compiling included where its mode
#: compiles); a training step against the plain step (the freeze watch looking at every step),
#: the same on every model unless a key "VARIANT on MODEL" sets it for one (:func:`step_target`). Stochastic rounding with compiling
#: off has no target: its eager operations cost a fixed time each, 4 to 14 times the round trip
#: on a first-generation EPYC.
TARGETS = {"nearest bf16/fp16": 1.5, "nearest, other formats": 2.5, "stochastic": 3.0, "memory / input": 2.0,
           "cold nearest": 3.0, "first call seconds": 2.0,
           "nearest": 1.10, "stochastic step": 1.10, "nearest+observer": 1.15, "plain+predictor": 1.15,
           "plain+watch on nanogpt-quick": 1.10, "plain+watch on gpt2": 1.05}


def step_target(model: str, variant: str) -> Optional[float]:
    """The most a training step of ``variant`` on ``model`` may take over the plain step:
    ``TARGETS["VARIANT on MODEL"]`` where it is set, else ``TARGETS[VARIANT]`` (stochastic
    rounding's is ``"stochastic step"``), else None (the remedies have none, nor the watch on a
    model it is not set for).

    Example: ``step_target("gpt2", "plain+watch")`` -> ``1.05``."""
    key = "stochastic step" if variant == "stochastic" else variant
    return TARGETS.get(f"{variant} on {model}", TARGETS.get(key))


#: the sizes the targets are set for: those of the full run on a CPU (``--threads 1``)
TARGET_SIZES = {"quantize elements": 1 << 24, "models": ("nanogpt-quick", "gpt2")}

#: what follows a missed target in a ``--quick`` run, whose sizes are not the targets'
QUICK_MARK = "(quick: not comparable)"


def _met(value: Optional[float], limit: float) -> str:
    return "-" if value is None else ("yes" if value <= limit else "no")


def _is_quick(result: dict) -> bool:
    """Whether a result comes from ``--quick`` (older files: read from the command line kept
    in them)."""
    if "quick" in result:
        return bool(result["quick"])
    return "--quick" in str(result.get("command", "")).split()


def _quick_note(result: dict) -> str:
    """The note above a quick run's judgement: how its sizes differ from the targets'."""
    q = result.get("quantize") or []
    models = [t["model"] for t in result.get("training") or []]
    parts = []
    if q and q[0]["n"] != TARGET_SIZES["quantize elements"]:
        parts.append(f"quantize on {q[0]['n'] / 2**20:g}M elements, not "
                     f"{TARGET_SIZES['quantize elements'] / 2**20:g}M")
    left_out = [m for m in TARGET_SIZES["models"] if m not in models]
    if left_out:
        parts.append(f"no training step of {', '.join(left_out)}")
    parts.append("fewer timed rounds")
    return (f"Quick run (--quick): {'; '.join(parts)}. These are not the sizes the targets are set for, so a "
            f"verdict below is not comparable with the stored full run, and a missed target is marked "
            f"\"{QUICK_MARK}\". `python benchmarks/bench.py --threads 1` measures at the targets' sizes.")


def summary(result: dict) -> str:
    """The ratios of a :func:`bench.run` result against :data:`TARGETS`, as Markdown
    tables (the short form the README and the book's introduction show). Training steps are judged
    both ways the benchmark measures them: the whole step against the plain step, and the added
    work timed alone over the plain step.

    A ``--quick`` result is judged the same way, under a note that says how its sizes differ from
    the targets', and each missed target is marked :data:`QUICK_MARK` rather than a bare "no"."""
    m = result["machine"]
    quick = _is_quick(result)

    def verdict(text: str) -> str:
        return f"{text} {QUICK_MARK}" if quick and "no" in text.split() else text
    out = [_quick_note(result), ""] if quick else []
    cpu = f", {cpu_label(m['cpu'])}" if m.get("cpu") else ""
    out += [f"Measured {m['date'][:10]} on {m['device_name']}{cpu} ({m['device']}, {m['threads']} of {m['cpu_count']} "
           f"cores), torch {m['torch']}, lowprec_demo {m.get('package_version')} at commit "
           f"{(m.get('git_commit') or 'unknown')[:12]}."]
    q = result.get("quantize") or []
    if q:
        out.append("")
        rows = []
        for r in q:
            nearest = r["rounding"] == "nearest"
            limit = (TARGETS["nearest bf16/fp16"] if r["format"] in ("bf16", "fp16") else
                     TARGETS["nearest, other formats"]) if nearest else TARGETS["stochastic"]
            native = f"x.to({r['native_dtype']}).float()" + ("" if r["native_is_own_dtype"] else " (no own dtype)")
            rows.append([r["format"], r["rounding"], native, _fmt(r["native_ms"], 1), _fmt(r["quantize_ms"], 1),
                         _fmt(r["ratio"]), f"<= {limit:g}", verdict(_met(r["ratio"], limit)),
                         _fmt(r["extra_memory_inputs"]),
                         verdict(_met(r["extra_memory_inputs"], TARGETS["memory / input"]))])
        out.append(_table([f"quantize, {q[0]['n'] / 2**20:g}M fp32", "rounding", "native round trip", "native ms",
                           "quantize ms", "ratio", "target", "met", "memory / input (<= 2)", "met"], rows))
    cold = [r for r in q if "eager_ratio" in r]
    if cold:
        out.append("")
        rows = []
        for r in cold:
            limit = TARGETS["cold nearest"] if r["rounding"] == "nearest" else None   # stochastic: none
            rows.append([r["format"], r["rounding"], _fmt(r["eager_native_ms"], 1), _fmt(r["eager_ms"], 1),
                         _fmt(r["eager_ratio"]), "-" if limit is None else f"<= {limit:g}",
                         "-" if limit is None else verdict(_met(r["eager_ratio"], limit))])
        out.append(_table([f"cold path: compiling off, {q[0]['n'] / 2**20:g}M fp32", "rounding", "native ms",
                           "quantize ms", "ratio", "target", "met"], rows))
    first = result.get("first_call")
    if first and "error" not in first:
        out.append("")
        rows = []
        for key in ("bf16 stochastic", "e5m3 nearest"):
            f = first[key]
            way = "compiled" if f["calls"].get("compiled") else "eager"
            limit = TARGETS["first call seconds"] if key == "bf16 stochastic" else None
            compile_s = f.get("compile_seconds")
            rows.append([key, _fmt(f["seconds"]), way + (f" (compiling {compile_s:.1f} s)" if compile_s else ""),
                         "-" if limit is None else f"<= {limit:g}",
                         "-" if limit is None else verdict(_met(f["seconds"], limit))])
        out.append(_table([f"first call of a fresh process, {first['n'] / 2**20:g}M fp32 (mode {first['mode']})",
                           "seconds", "ran", "target", "met"], rows))
    elif first:
        out.append(f"\nfirst call of a fresh process: {first['error']}")
    training = result.get("training") or []
    if training:
        out.append("")
        rows = []
        for t in training:
            for v in t["step_ms"]:
                if v == "plain":
                    continue
                limit = step_target(t["model"], v)
                step, parts = t["ratio"][v], t["ratio_from_parts"][v]
                rows.append([t["model"], v, _fmt(t["step_ms"]["plain"], 1), _fmt(t["step_ms"][v], 1), _fmt(step, 3),
                             _spread(t, v), _fmt(parts, 3), "-" if limit is None else f"<= {limit:g}",
                             "-" if limit is None else verdict(f"{_met(step, limit)} / {_met(parts, limit)}")])
        out.append(_table(["training step", "variant", "plain ms", "variant ms", "ratio", "middle half of rounds",
                           "1 + added alone / plain", "target", "met (ratio / alone)"], rows))
    return "\n".join(out)

