"""The README's two tables, made from chapter 9's stored outputs: the remedies on the nanoGPT, and what to do for a
bf16 fine-tune.

    python tools/readme_table.py            # print the table
    python tools/readme_table.py --write    # put it into README.md between its remedy-table markers
    python tools/readme_table.py --check    # exit 1 when README.md's table differs (tests/test_book_shape.py)

Chapter 9 glues, for every remedy of its nanoGPT comparison, ``ch9_gap_<remedy>`` (final loss minus
fp32's), ``ch9_bytes_<remedy>`` (bytes per parameter) and, where a stored benchmark gives it,
``ch9_time_<remedy>`` (step time over the fp32 step). This reads those outputs from the notebook as
stored, so the README quotes what the chapter computed. The fine-tune table is
:func:`lowprec_demo.book.remedies.advice_table` of the glued ``ch9_ft_closed_<variant>``, ``ch9_ft_bytes_<variant>``
and ``ch9_ft_time_<variant>``, the table chapter 9 shows.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHAPTER = REPO / "book" / "09_remedies.ipynb"
README = REPO / "README.md"
BEGIN, END = "<!-- remedy-table: begin -->", "<!-- remedy-table: end -->"
FT_BEGIN, FT_END = "<!-- finetune-table: begin -->", "<!-- finetune-table: end -->"
GLUE_MIME = "application/papermill.record/text/plain"
LABELS = {"fp32": "fp32", "nearest": "round to nearest", "stochastic": "stochastic rounding",
          "kahan": "Kahan, fp32 buffer", "kahan_lp": "Kahan, bf16 buffer", "master": "fp32 master weights",
          "nearest_state": "nearest, AdamW state in bf16", "stochastic_state": "SR, AdamW state in bf16",
          "floor": "nearest, learning-rate floor", "plan": "freeze plan (`watch.plan`)"}


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


def spliced(readme: str, body: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in readme or end not in readme:
        raise SystemExit(f"README.md has no {begin} ... {end} markers")
    head, rest = readme.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def both(readme: str, values: dict) -> str:
    """README.md with both tables put in."""
    return spliced(spliced(readme, table(values)), finetune_table(values), FT_BEGIN, FT_END)


def main(argv) -> int:
    values = glued()
    readme = README.read_text(encoding="utf-8")
    if "--write" in argv:
        README.write_text(both(readme, values), encoding="utf-8")
        print(f"wrote the remedy and fine-tune tables into {README.name}")
    elif "--check" in argv:
        if both(readme, values) != readme:
            print("README.md's tables are not chapter 9's stored output: run python tools/readme_table.py --write")
            return 1
        print("README.md's tables are chapter 9's stored output")
    else:
        print(table(values) + "\n\n" + finetune_table(values))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
