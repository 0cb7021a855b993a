"""The chapters' stored outputs: store them, check them, and say which chapters a change may affect.

The site is built from the outputs stored in the notebooks (``tools/build_book.sh``). They are a
cache of one execution, not a second truth: ``./tools/run_tests.sh book/CHAPTER.ipynb`` executes a
chapter with nbval and compares every output a reader sees with the stored one
(``book/conftest.py``, ``tools/output_compare.py``). This script makes them and keeps them tidy:

    python tools/stored_outputs.py execute [NOTEBOOK ...]  # execute; re-store only what changed
    python tools/stored_outputs.py changed [--paths]       # which chapters the code changes may affect
    python tools/stored_outputs.py check [NOTEBOOK ...]    # fast: no kernel is started

``execute`` runs each notebook top to bottom in a fresh kernel, in its own folder (as nbval and
Jupyter Book run it), at the quick scale, on one thread, offline, with the data copies of
``LOWPREC_DATA_DIR`` (default ``../shared/data`` beside the repository) so that the stored pages
show the real data sets. It compares the new outputs with the stored ones (figures byte for byte):
a notebook whose outputs are the same keeps them and gets only a new fingerprint; one whose outputs
changed is stored again (atomically, and only when every cell ran), and the differences are
printed. A notebook with an error is left as it was.

The outputs of a chapter that trains in floating point depend on the CPU (the kernels MKL, oneDNN
and torch choose for it): the same on one machine from run to run, other digits on another kind of
machine. So each notebook records the machines (:func:`machine_signature`) on which its outputs
were computed bit for bit; the comparison runs where this machine is one of them, or where they are
two or more, which shows outputs that do not depend on the machine.

The fingerprint says what a chapter's outputs were computed from: its code cells and the modules of
``lowprec_demo`` its kernel had loaded, each as its syntax tree without docstrings and comments, and
the stored results under ``book/results/``. ``changed`` lists the chapters whose fingerprint differs
from the code as it is now, that is the chapters to verify; a docstring, a comment, a test, a tool or
prose changes no fingerprint. It also records whether the chapter read Tiny Shakespeare, so that a
run on the offline fallback text compares only the chapters that do not.

``check`` fails, naming each notebook, when a code cell was not executed once each and in order,
when an output is an error, when an output names an absolute path of the machine that made it, or
when a notebook was never stored by this script. It does not fail on a changed fingerprint: the
comparison decides that.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from output_compare import compare_outputs, is_progress_bar  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"
RESULTS = BOOK / "results"
PACKAGE_NAME = "lowprec_demo"
METADATA_KEY = "lowprec_demo"

# The settings every stored output is made with; ``execute`` sets them for the kernel.
EXECUTION_ENV = {"LOWPREC_SCALE": "quick", "LOWPREC_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

# Absolute paths that must not appear in a stored output: the folders a machine's paths start with.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:home|root|tmp|work|Users|usr|opt|var|private|mnt)/[\w.+-]")

# Run in the kernel before the first cell (its execution count taken off again): note whether the
# chapter opens Tiny Shakespeare, wherever it comes from (the data folder, the cache).
SETUP = """import sys as _sys
_sys.lowprec_demo_reads_text = False
def _lowprec_demo_audit(event, args):
    if event == "open" and str(args[0]).endswith("tinyshakespeare.txt"):
        _sys.lowprec_demo_reads_text = True
_sys.addaudithook(_lowprec_demo_audit)
del _lowprec_demo_audit"""
# Run after the last cell: which of the package's modules the chapter loaded, and whether it read the text.
PROBE = """import json as _json, sys as _sys
print(_json.dumps({"modules": sorted(n for n in _sys.modules if n == "lowprec_demo" or n.startswith("lowprec_demo.")),
                   "reads_text": _sys.lowprec_demo_reads_text}))"""


def machine_signature() -> str:
    """What a chapter's floating-point results depend on besides its code: the CPU (vendor, family,
    model, its vector instruction sets and level-2 cache, which decide the kernels MKL, oneDNN and
    torch pick) and torch's version. Two machines with the same signature compute the same bits."""
    import platform

    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model", "flags") and key.strip() not in info:
                info[key.strip()] = value.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile") if f in flags]
    try:
        l2 = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
    except OSError:
        l2 = "?"
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = "?"
    return (f"{info.get('vendor_id', platform.machine())} family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}, {'+'.join(isa) or 'no AVX2'}, L2 {l2}; torch {torch_version}")


def chapters() -> list[Path]:
    """Every notebook of the book, in the order tools/run_tests.sh runs them."""
    return sorted(p for p in BOOK.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts and "results" not in p.relative_to(BOOK).parts)


# ---------------------------------------------------------------------------------------------
# The fingerprint: code as its syntax tree, so that docstrings, comments and layout change nothing.

def _without_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:]
    return tree


def code_form(source: str, cell: bool = False) -> str:
    """What of ``source`` can change what it computes: its syntax tree without docstrings (comments
    and layout are not in it). A cell's IPython syntax (``%magic``, ``!cmd``) is translated first; a
    source that still does not parse is taken as it is."""
    if cell:
        try:
            from IPython.core.inputtransformer2 import TransformerManager
            source = TransformerManager().transform_cell(source)
        except ImportError:
            pass
    try:
        return ast.dump(_without_docstrings(ast.parse(source)), annotate_fields=False)
    except SyntaxError:
        return source


def _source(cell: dict) -> str:
    return cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])


def code_digest(nb: dict) -> str:
    """sha256 over the code cells' syntax trees, in order (markdown and outputs are not in it)."""
    digest = hashlib.sha256()
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            digest.update(code_form(_source(cell), cell=True).encode() + b"\0")
    return digest.hexdigest()


def module_path(name: str) -> Path | None:
    """The source file of a module of the package, or None when it has none (gone, or a namespace)."""
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.lru_cache(maxsize=None)   # every notebook lists most modules: parse each once per process
def module_digest(name: str) -> str:
    """sha256 (16 hex digits) of a module's syntax tree; "gone" when it has no source any more."""
    path = module_path(name)
    return hashlib.sha256(code_form(path.read_text(encoding="utf-8")).encode()).hexdigest()[:16] if path else "gone"


@functools.lru_cache(maxsize=1)
def results_digest() -> str:
    """sha256 over the stored full-scale results that chapters load (book/results/*.json)."""
    digest = hashlib.sha256()
    for path in sorted(RESULTS.glob("*.json")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def fingerprint(nb: dict, modules: list[str]) -> dict:
    """What a notebook's outputs were computed from: its code cells, the package's modules its kernel
    loaded (each module's digest) and the stored results."""
    return {"code_sha256": code_digest(nb), "modules": {name: module_digest(name) for name in sorted(modules)},
            "results_sha256": results_digest()}


def what_changed(nb: dict) -> list[str]:
    """Why the notebook's outputs may differ from the stored ones now; [] when nothing it ran changed."""
    stored = nb.get("metadata", {}).get(METADATA_KEY, {}).get("fingerprint")
    if not stored or not isinstance(stored.get("modules"), dict):
        return ["it has no fingerprint of the code it ran (store it with `execute`)"]
    reasons = []
    if stored.get("code_sha256") != code_digest(nb):
        reasons.append("its code cells")
    modules = [name for name, digest in stored["modules"].items() if module_digest(name) != digest]
    if modules:
        reasons.append(f"the package's code it runs ({', '.join(modules)})")
    if stored.get("results_sha256") != results_digest():
        reasons.append("the stored results in book/results/")
    return reasons


# ---------------------------------------------------------------------------------------------
# check: what is wrong with a notebook's stored outputs, whatever the code.

def _output_texts(output: dict):
    """Every text an output carries (streams, plain text, HTML, error messages)."""
    if "text" in output:
        yield output["text"] if isinstance(output["text"], str) else "".join(output["text"])
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/") or mime == "application/json":
            yield value if isinstance(value, str) else "".join(value) if isinstance(value, list) else json.dumps(value)
    if output.get("output_type") == "error":
        yield f"{output.get('ename')}: {output.get('evalue')}"


def problems(path: Path) -> list[str]:
    """What is wrong with a notebook's stored outputs; an empty list when nothing is."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    found = []
    if "fingerprint" not in nb.get("metadata", {}).get(METADATA_KEY, {}):
        found.append("no fingerprint: its outputs were not stored by this script")
    counts = [cell.get("execution_count") for cell in nb["cells"] if cell["cell_type"] == "code"]
    if counts != list(range(1, len(counts) + 1)):
        found.append(f"its code cells were not executed once each, in order (execution counts {counts})")
    for index, cell in enumerate(nb["cells"]):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append(f"cell {index} stored an error ({output.get('ename')})")
            for text in _output_texts(output):
                match = ABSOLUTE_PATH.search(text)
                if match:
                    start = max(0, match.start() - 30)
                    found.append(f"cell {index} shows an absolute path: ...{text[start:match.end() + 40]!r}...")
                    break
    return found


def check(paths: list[Path]) -> int:
    bad = []
    for path in paths:
        rel = path.relative_to(REPO)
        found = problems(path)
        if found:
            bad.append(str(rel))
            print(f"{rel}: stored outputs are not usable:")
            for issue in found:
                print(f"  - {issue}")
            continue
        reasons = what_changed(json.loads(path.read_text(encoding="utf-8")))
        print(f"{rel}: stored outputs well formed" + (f"; changed since stored: {'; '.join(reasons)}" if reasons else ""))
    if bad:
        print(f"\n{len(bad)} notebook(s) need their outputs stored again: "
              f"python tools/stored_outputs.py execute {' '.join(bad)}")
        return 1
    return 0


def changed(paths: list[Path], paths_only: bool) -> int:
    found = []
    for path in paths:
        reasons = what_changed(json.loads(path.read_text(encoding="utf-8")))
        if reasons:
            found.append(str(path.relative_to(REPO)))
            if not paths_only:
                print(f"{found[-1]}: changed since its outputs were stored: {'; '.join(reasons)}")
    if paths_only:
        print(" ".join(found))
    elif found:
        print(f"\nverify them: ./tools/run_tests.sh {' '.join(found)}")
    else:
        print("no chapter runs code that changed since its outputs were stored")
    return 0


# ---------------------------------------------------------------------------------------------
# execute: run, compare, re-store only what changed.

def _write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def notebook_differences(stored: dict, computed: dict, images: str = "bytes") -> list[str]:
    """What differs between two executions of a notebook, cell by cell ([] when nothing does)."""
    old = [c for c in stored["cells"] if c["cell_type"] == "code"]
    new = [c for c in computed["cells"] if c["cell_type"] == "code"]
    if len(old) != len(new):
        return [f"{len(old)} code cells stored, {len(new)} executed"]
    found = []
    for number, (a, b) in enumerate(zip(old, new)):
        if a.get("execution_count") != b.get("execution_count"):
            found.append(f"code cell {number}: execution count {a.get('execution_count')} -> {b.get('execution_count')}")
        found += [f"code cell {number}: {d}" for d in compare_outputs(a.get("outputs", []), b.get("outputs", []),
                                                                         images=images)]
    return found


def _execute_one(path: Path, timeout: int) -> tuple[str, str, float]:
    """Execute one notebook; store it where its outputs changed. Returns (path, verdict, seconds)."""
    import nbformat
    from nbclient import NotebookClient

    rel = path.relative_to(REPO)
    start = time.time()
    stored = nbformat.read(path, as_version=4)
    nb = nbformat.read(path, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(SETUP))
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except Exception as exc:  # a cell raised: report it and leave the notebook as it was
        return str(rel), f"FAILED after {time.time() - start:.0f} s, left unchanged:\n{exc}", time.time() - start
    probe = json.loads("".join(o.get("text", "") for o in nb.cells.pop().outputs if o.get("name") == "stdout"))
    nb.cells.pop(0)
    seconds = time.time() - start
    for cell in nb.cells:
        cell.get("metadata", {}).pop("execution", None)   # timestamps would change every file on every run
        if cell.cell_type == "code":   # the setup cell's count taken off
            cell.execution_count -= 1
            for output in cell.outputs:
                if output.get("execution_count") is not None:
                    output.execution_count -= 1
    differences = notebook_differences(stored, nb)
    target = stored if not differences else nb
    for cell in target.cells:   # progress bars show when the page was stored (0 % or 100 %), not the chapter
        if cell.cell_type == "code":
            cell.outputs = [output for output in cell.outputs if not is_progress_bar(output)]
    machines = [] if differences else stored.metadata.get(METADATA_KEY, {}).get("machines", [])
    target.metadata[METADATA_KEY] = {
        "fingerprint": fingerprint(nb, probe["modules"]),
        "reads_text": probe["reads_text"],
        "seconds": round(seconds),
        "executed_with": {**EXECUTION_ENV, "LOWPREC_DATA_DIR": "shared data copies"},
        # the machines on which these outputs were computed, bit for bit
        "machines": machines + [machine_signature()] * (machine_signature() not in machines),
    }
    _write_atomically(path, nbformat.writes(target) + "\n")
    if not differences:
        return str(rel), "outputs unchanged: only its fingerprint stored", seconds
    shown = "\n".join(f"    {d}" for d in differences[:12])
    more = f"\n    ... and {len(differences) - 12} more" if len(differences) > 12 else ""
    return str(rel), f"outputs changed, stored again:\n{shown}{more}", seconds


def longest_first(paths: list[Path]) -> list[Path]:
    """The notebooks by the time their last execution took, longest first (so that the last to
    finish on several processes is a short one); the same time keeps the book's order."""
    return sorted(paths, key=lambda p: -_stored_metadata(p).get("seconds", 0))


def _stored_metadata(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")).get("metadata", {}).get(METADATA_KEY, {})


def execute(paths: list[Path], data_dir: Path, timeout: int, jobs: int) -> int:
    if not (data_dir / "tinyshakespeare.txt").is_file():
        print(f"{data_dir} has no tinyshakespeare.txt: the stored outputs show the real data sets, so "
              f"point --data-dir (or LOWPREC_DATA_DIR) at a folder with the copies (see the README)", file=sys.stderr)
        return 2
    os.environ.update(EXECUTION_ENV)
    os.environ["LOWPREC_DATA_DIR"] = str(data_dir.resolve())
    failed = 0
    paths = longest_first(paths)
    # a fresh process for each notebook (its own kernel client and event loop)
    with ProcessPoolExecutor(max_workers=max(1, jobs), max_tasks_per_child=1) as pool:
        for rel, verdict, seconds in pool.map(_execute_one, paths, [timeout] * len(paths)):
            failed += verdict.startswith("FAILED")
            print(f"{rel} ({seconds:.0f} s): {verdict}", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("execute", "changed", "check", "list"),
                        help="execute and re-store what changed; name the chapters to verify; check the stored "
                             "ones; list the chapters, longest first")
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks (default: every chapter under book/)")
    parser.add_argument("--data-dir", type=Path,
                        default=Path(os.environ.get("LOWPREC_DATA_DIR") or REPO.parent / "shared" / "data"),
                        help="folder with the data copies (default: $LOWPREC_DATA_DIR, else ../shared/data)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may take (default 600)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                        help="notebooks executed at once (default: 2, or 1 on one CPU)")
    parser.add_argument("--paths", action="store_true", help="with `changed`: print only the paths, on one line")
    parser.add_argument("--reads-text", action="store_true",
                        help="with `list`: only the chapters that read Tiny Shakespeare (or have not said whether)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or chapters()
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            parser.error(f"{p} is not a notebook")
    if args.mode == "list":
        if args.reads_text:
            paths = [p for p in paths if _stored_metadata(p).get("reads_text", True)]
        print("\n".join(str(p.relative_to(REPO)) for p in longest_first(paths)))
        return 0
    if args.mode == "check":
        return check(paths)
    if args.mode == "changed":
        return changed(paths, args.paths)
    return execute(paths, args.data_dir.expanduser().resolve(), args.timeout, args.jobs)


if __name__ == "__main__":
    sys.exit(main())
