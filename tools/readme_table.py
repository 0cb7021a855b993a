"""The README's numbers, made from the book's stored outputs: what each chapter shows, the remedies on the
nanoGPT, what to do for a bf16 fine-tune, and what the preflight and the plan did.

    python tools/readme_table.py            # print the generated blocks
    python tools/readme_table.py --write    # put them into README.md between their markers
    python tools/readme_table.py --check    # exit 1 when README.md differs (tests/test_book_shape.py)

Every block sits in README.md between ``<!-- NAME: begin -->`` and ``<!-- NAME: end -->`` on lines of their
own, and everything between is replaced. The numbers are the values the notebooks glue, read from the
notebooks as stored (:func:`book_values`), so the README quotes what the chapters computed:

* ``chapters``: the table of chapters, one line each with the chapter's own numbers (:data:`CHAPTERS`);
  chapter 6's claim is the one the evidence supports, the wall's step within the spread over seeds,
  with the seed it shows (seed 0) and the appendix's other seeds (``app_nanogpt_*``);
* ``remedy-table``: chapter 9 glues, for every remedy of its nanoGPT comparison, ``ch9_gap_<remedy>`` (final
  loss minus fp32's), ``ch9_bytes_<remedy>`` (bytes per parameter) and, where a stored benchmark gives it,
  ``ch9_time_<remedy>`` (step time over the fp32 step);
* ``finetune-table``: :func:`lowprec_demo.book.remedies.advice_table` of the glued ``ch9_ft_closed_<variant>``,
  ``ch9_ft_bytes_<variant>`` and ``ch9_ft_time_<variant>``, the table chapter 9 shows;
* ``preflight`` and ``finetune-advice``: the preflight's record on the held-out fine-tunes of its stored
  benchmark (:data:`PREFLIGHT`), and chapter 8's plan against stochastic rounding.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"
CHAPTER = BOOK / "09_remedies.ipynb"
README = REPO / "README.md"
PREFLIGHT = REPO / "benchmarks" / "cpu-2026-12-06-preflight.json"
BEGIN, END = "<!-- remedy-table: begin -->", "<!-- remedy-table: end -->"
FT_BEGIN, FT_END = "<!-- finetune-table: begin -->", "<!-- finetune-table: end -->"
GLUE_MIME = "application/papermill.record/text/plain"
LABELS = {"fp32": "fp32", "nearest": "round to nearest", "stochastic": "stochastic rounding",
          "kahan": "Kahan, fp32 buffer", "kahan_lp": "Kahan, bf16 buffer", "master": "fp32 master weights",
          "nearest_state": "nearest, AdamW state in bf16", "stochastic_state": "SR, AdamW state in bf16",
          "floor": "nearest, learning-rate floor", "plan": "freeze plan (`watch.plan`)"}

# One line per chapter: the chapter's title and what it shows, its numbers named by the keys its cells glue
# (str.format fields; chapter 6's claim comes from nanogpt_claim).
CHAPTERS = [
    ("1. Float formats", "the grids of fp32, bf16, fp16, fp8 and fp4, and the ULP"),
    ("2. The freeze rule", "round to nearest drops an update under half a gap, stochastic rounding keeps it on "
     "average; on a quadratic one fp32 run predicts the bf16 freeze at step {ch2_predicted_step}, observed at "
     "{ch2_observed_step}"),
    ("3. Frozen-feature regression", "the freeze step in closed form ({ch3_closed_step}) and from an fp32 run "
     "({ch3_predicted}); observed at {ch3_observed}"),
    ("4. A small MLP", "SGD and AdamW: freeze predicted at step {ch4_sgd_predicted} and {ch4_adamw_predicted}, "
     "observed at {ch4_sgd_observed} and {ch4_adamw_observed}"),
    ("5. A CNN on MNIST", "test accuracy: bf16 {ch5_bf16_acc_nearest:.1f} % (fp32 {ch5_bf16_acc_reference:.1f} %); "
     "E4M3, frozen from step {ch5_e4m3_observed}, {ch5_e4m3_acc_nearest:.1f} %, with stochastic rounding "
     "{ch5_e4m3_acc_stochastic:.1f} %"),
    ("6. nanoGPT in bf16", "{nanogpt_claim}"),
    ("7. GPT-2 124M on fp8", "E4M3 weights locked from the first step, as predicted: after {ch7_steps} steps loss "
     "{ch7_loss_last_nearest:.2f}, fp32 {ch7_loss_last_reference:.2f}, stochastic rounding "
     "{ch7_loss_last_stochastic:.2f}; a per-tensor scale frees only the small weights"),
    ("8. Check your own training", "the freeze watch on an ordinary loop: freeze predicted at step "
     "{ch8_predicted_step}, observed {ch8_observed_step}; its plan ends {ch8_gap_plan:+.4f} nats from fp32 "
     "(round to nearest {ch8_gap_nearest:+.3f})"),
    ("9. Remedies", "the remedies side by side (below)"),
]


def glued(path: Path = CHAPTER) -> dict:
    """Every value the notebook's stored outputs glue, by key (as Python values)."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    values = {}
    for cell in nb["cells"]:
        for out in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
            name = out.get("metadata", {}).get("scrapbook", {}).get("name")
            text = out.get("data", {}).get(GLUE_MIME)
            if name and text is not None:
                text = "".join(text) if isinstance(text, list) else text
                try:
                    values[name] = json.loads(text)
                except ValueError:
                    values[name] = text
    return values


def book_values() -> dict:
    """The glued values of the numbered chapters and of the nanoGPT appendix (their keys carry the page's prefix)."""
    values = {}
    for path in sorted(BOOK.glob("0[1-9]_*.ipynb")) + [BOOK / "appendix_nanogpt.ipynb"]:
        values.update(glued(path))
    return values


def _strip(text) -> str:
    return text.strip("'\"") if isinstance(text, str) else text


def nanogpt_claim(v: dict) -> str:
    """Chapter 6's claim as the evidence supports it: one fp32 run predicts the frozen share, and the wall's step
    within the spread over seeds, with how far the chapter's seed 0 misses said. Chapter 6 glues it over its
    seeds (``ch6_claim_gap_spread``, the words chapters 5 and 6 use); a chapter stored before it did is read with
    the nanoGPT appendix."""
    if "ch6_claim_gap_spread" in v:
        return (f"trains like fp32, then stalls; one fp32 run predicts the frozen share (curve error "
                f"{v['ch6_curve_error']:.3f}) and the wall's step within the spread over seeds: bf16 stalls "
                f"{_strip(v['ch6_claim_gap_spread'])}; seed 0, the chapter's, misses by {v['ch6_step_gap']} steps "
                f"(tolerance {v['ch6_tolerance']}), {_strip(v['ch6_seed0_rank'])}; validation loss "
                f"{v['ch6_val_gap_nearest']:+.3f} above fp32 (stochastic rounding {v['ch6_val_gap_sr']:+.4f})")
    verdict, misses = _strip(v["ch6_step_verdict"]), _strip(v["app_nanogpt_bf16_misses"])
    if verdict == "outside" and misses != f"seed 0, {v['ch6_step_gap']} steps apart":
        raise SystemExit(f"chapter 6 (seed 0, {v['ch6_step_gap']} steps apart) and appendix_nanogpt ({misses!r}) "
                         "disagree: execute both again")
    seeds = (f"seed 0, the chapter's, {v['ch6_step_gap']} steps off (tolerance {v['ch6_tolerance']}), the other "
             f"{v['app_nanogpt_bf16_within']} seeds within" if verdict == "outside" else
             f"seed 0, the chapter's, {v['ch6_step_gap']} steps off (tolerance {v['ch6_tolerance']})")
    return (f"trains like fp32, then stalls; one fp32 run predicts the frozen share (curve error "
            f"{v['ch6_curve_error']:.3f}) and the wall's step within the spread over seeds (the seed moves it by "
            f"{v['app_nanogpt_bf16_predicted_spread']} steps): {seeds}; validation loss "
            f"{v['ch6_val_gap_nearest']:+.3f} above fp32 (stochastic rounding {v['ch6_val_gap_sr']:+.4f})")


def chapters_table(v: dict) -> str:
    fields = dict(v, nanogpt_claim=nanogpt_claim(v))
    lines = ["| chapter | what it shows |", "| --- | --- |"]
    for title, template in CHAPTERS:
        try:
            lines.append(f"| {title} | {template.format_map(fields)} |")
        except KeyError as e:
            raise SystemExit(f"no stored output glues {e.args[0]}: execute its chapter first") from None
    return "\n".join(lines)


def remedy_order(keys) -> list:
    """fp32, then the remedies in LABELS' order, few-bit SR (sr<k>) after exact SR by k."""
    names = {k[len("ch9_gap_"):] for k in keys if k.startswith("ch9_gap_")}
    fewbit = sorted((n for n in names if re.fullmatch(r"sr\d+", n)), key=lambda n: int(n[2:]))
    order = [n for n in LABELS if n in names and n not in ("kahan", "kahan_lp")]
    i = order.index("stochastic") + 1 if "stochastic" in order else len(order)
    order[i:i] = fewbit
    j = order.index("master") if "master" in order else len(order)
    order[j:j] = [n for n in ("kahan", "kahan_lp") if n in names]
    return order + sorted(names - set(order))


def table(values: dict) -> str:
    order = remedy_order(values)
    if not order:
        raise SystemExit(f"{CHAPTER.relative_to(REPO)} glues no ch9_gap_<remedy> value: execute it first")
    lines = ["| remedy | loss - fp32 | bytes | step time |", "| --- | --- | --- | --- |"]
    for name in order:
        gap = values[f"ch9_gap_{name}"]
        label = LABELS.get(name) or (f"SR with {name[2:]} random bits" if name.startswith("sr") else name)
        gap_text = "0" if name == "fp32" else f"{gap:+.4f}"
        nbytes = values.get(f"ch9_bytes_{name}")
        time = values.get(f"ch9_time_{name}")
        lines.append(f"| {label} | {gap_text} | {'' if nbytes is None else f'{nbytes:.3g}'} | "
                     f"{'' if time is None else f'{time:.2f}'} |")
    return "\n".join(lines)


def finetune_table(values: dict) -> str:
    """Chapter 9's fine-tune advice table, from its glued values."""
    from lowprec_demo.book.remedies import FINETUNE_ADVICE, advice_table
    rows = {v: {"closed": values[f"ch9_ft_closed_{v}"], "bytes": values[f"ch9_ft_bytes_{v}"],
                "time": values.get(f"ch9_ft_time_{v}")} for v, _, _ in FINETUNE_ADVICE if f"ch9_ft_closed_{v}" in values}
    if not rows:
        raise SystemExit(f"{CHAPTER.relative_to(REPO)} glues no ch9_ft_closed_<variant> value: execute it first")
    return advice_table(rows)


def remedy_block(v: dict) -> str:
    """The remedy table, then what the plan's row shows and what it does not."""
    return (table(v) + "\n\n"
            + f"`watch.plan(\"bf16\")` gives each tensor a remedy within a byte budget ({v['ch9_gap_plan']:+.4f}; "
              f"stochastic rounding alone {v['ch9_gap_stochastic']:+.4f}); the same bytes in the reverse order of "
              f"need end {v['app_remedies_reversed_ch9']:+.4f} here, and on the appendices' other runs three seeds "
              f"cannot tell the orders apart.")


def finetune_block(v: dict) -> str:
    """The fine-tune table with its caption."""
    return (f"For a bf16 fine-tune (`model.to(torch.bfloat16)`, {v['ch9_ft_steps']} steps of AdamW at a peak rate "
            f"of 5e-5; the share of plain bf16's gap to fp32 closed, bytes per parameter, step time over plain "
            f"bf16's):\n\n" + finetune_table(v))


def advice(v: dict) -> str:
    return (f"So: fix from step 0. Stochastic rounding is enough here and costs no byte; the preflight "
            f"(`plan_after=0`) says whether a run needs a remedy, and its plan spends up to a byte per parameter "
            f"where stochastic rounding alone leaves a little (chapter 8's run from scratch: "
            f"{v['ch8_sr_gap']:+.4f} nats for stochastic rounding, {v['ch8_pf_gap']:+.4f} for the plan).")


def preflight(v: dict, path: Path = PREFLIGHT) -> str:
    """The preflight's record on the held-out fine-tunes of its stored benchmark."""
    rows = json.loads(path.read_text(encoding="utf-8"))["rows"]
    needs = [r for r in rows if r["truth"] == "needs"]
    none = [r for r in rows if r["truth"] == "none"]
    called = sum(r["verdict"] == "remedy" for r in needs)
    spared = sum(r["verdict"] == "none" for r in none)
    on_needs = f"all {len(needs)}" if called == len(needs) else f"{called} of the {len(needs)}"
    return (f"The preflight takes {v['ch8_pf_probe']} probe steps on a float32 copy (yours stay as they were; "
            f"`next_loss(m)` is the loss of the next batch on `m`). On {len(rows)} held-out bf16 fine-tunes "
            f"it called for a remedy on {on_needs} where plain bf16 lost at least 10 % of fp32's improvement, and "
            f"for none on {spared} of the {len(none)} where it lost at most 2 % "
            f"(`{path.relative_to(REPO).with_suffix('.md')}`).")


BLOCKS = {"chapters": chapters_table, "preflight": preflight, "remedy-table": remedy_block,
          "finetune-table": finetune_block, "finetune-advice": advice}


def values() -> dict:
    """The glued values of chapters 1-9, the nanoGPT appendix and the remedies appendix."""
    return {**book_values(), **glued(BOOK / "appendix_remedies.ipynb")}


def spliced(readme: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in readme or end not in readme:
        raise SystemExit(f"README.md has no {begin} ... {end} markers")
    head, rest = readme.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def filled(readme: str, v: dict) -> str:
    """README.md with every generated block put in between its markers."""
    for name, make in BLOCKS.items():
        readme = spliced(readme, make(v), f"<!-- {name}: begin -->", f"<!-- {name}: end -->")
    return readme


def main(argv) -> int:
    v = values()
    readme = README.read_text(encoding="utf-8")
    if "--write" in argv:
        README.write_text(filled(readme, v), encoding="utf-8")
        print(f"wrote {', '.join(BLOCKS)} into {README.name}")
    elif "--check" in argv:
        if filled(readme, v) != readme:
            print("README.md's numbers are not the book's stored outputs: run python tools/readme_table.py --write")
            return 1
        print("README.md's numbers are the book's stored outputs")
    else:
        print("\n\n".join(f"<!-- {name} -->\n{make(v)}" for name, make in BLOCKS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
