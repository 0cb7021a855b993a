"""Execute the chapters and store their outputs, or check that the stored outputs are current.

The site is built from the outputs stored in the notebooks (``tools/build_book.sh``), so those
outputs must come from the code as it is. This script is the one way to make them:

    python tools/stored_outputs.py execute                 # every chapter (about 8 minutes here)
    python tools/stored_outputs.py execute book/06_nanogpt.ipynb
    python tools/stored_outputs.py check                   # fast: no kernel is started

``execute`` runs each notebook top to bottom in a fresh kernel, in its own folder (as nbval and
Jupyter Book run it), at the quick scale, on one thread, offline, with the data copies of
``LOWPREC_DATA_DIR`` (default ``../shared/data`` beside the repository) so that the stored pages
show the real data sets; it stores the outputs and a fingerprint: the sha256 of the package's
sources and of the notebook's code cells. A notebook is written (atomically) only when every cell
ran without an error.

``check`` fails, naming each notebook and what to run, when a notebook's fingerprint does not match
the package and code as they are now (code changed since its outputs were stored), when a code
cell was not executed or in order, when an output is an error, or when an output names an absolute
path of the machine that made it. CI runs it (``tools/run_tests.sh``), and nbval then executes every
chapter again and compares the cells marked ``# NBVAL_CHECK_OUTPUT`` with their stored outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"
PACKAGE = REPO / "lowprec_demo"
METADATA_KEY = "lowprec_demo"

# The settings every stored output is made with; ``execute`` sets them for the kernel.
EXECUTION_ENV = {"LOWPREC_SCALE": "quick", "LOWPREC_OFFLINE": "1", "OMP_NUM_THREADS": "1"}

# Absolute paths that must not appear in a stored output: the folders a machine's paths start with.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])/(?:home|root|tmp|work|Users|usr|opt|var|private|mnt)/[\w.+-]")


def chapters() -> list[Path]:
    """Every notebook of the book, in the order tools/run_tests.sh runs them."""
    return sorted(p for p in BOOK.rglob("*.ipynb")
                  if ".ipynb_checkpoints" not in p.parts and "results" not in p.relative_to(BOOK).parts)


def package_digest() -> str:
    """sha256 over the package's Python sources (relative path and bytes of each, sorted)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def code_digest(nb: dict) -> str:
    """sha256 over the sources of the notebook's code cells, in order."""
    digest = hashlib.sha256()
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            digest.update(source.encode() + b"\0")
    return digest.hexdigest()


def fingerprint(nb: dict, package: str) -> dict:
    return {"package_sha256": package, "code_sha256": code_digest(nb)}


def _output_texts(output: dict):
    """Every text an output carries (streams, plain text, HTML, error messages)."""
    if "text" in output:
        yield output["text"] if isinstance(output["text"], str) else "".join(output["text"])
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/") or mime == "application/json":
            yield value if isinstance(value, str) else "".join(value) if isinstance(value, list) else json.dumps(value)
    if output.get("output_type") == "error":
        yield f"{output.get('ename')}: {output.get('evalue')}"


def problems(path: Path, package: str) -> list[str]:
    """What is wrong with a notebook's stored outputs; an empty list when they are current."""
    nb = json.loads(path.read_text(encoding="utf-8"))
    found = []
    stored = nb.get("metadata", {}).get(METADATA_KEY, {}).get("fingerprint")
    current = fingerprint(nb, package)
    if stored is None:
        found.append("no fingerprint: its outputs were not stored by this script")
    else:
        if stored.get("code_sha256") != current["code_sha256"]:
            found.append("its code cells changed since its outputs were stored")
        if stored.get("package_sha256") != current["package_sha256"]:
            found.append("the package (lowprec_demo/) changed since its outputs were stored")
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
    package = package_digest()
    stale = []
    for path in paths:
        issues = problems(path, package)
        rel = path.relative_to(REPO)
        if issues:
            stale.append(str(rel))
            print(f"{rel}: stored outputs are not current:")
            for issue in issues:
                print(f"  - {issue}")
        else:
            print(f"{rel}: stored outputs current")
    if stale:
        print(f"\n{len(stale)} notebook(s) need their outputs stored again: "
              f"python tools/stored_outputs.py execute {' '.join(stale)}")
        return 1
    return 0


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


def execute(paths: list[Path], data_dir: Path, timeout: int) -> int:
    import nbformat
    from nbclient import NotebookClient

    if not (data_dir / "tinyshakespeare.txt").is_file():
        print(f"{data_dir} has no tinyshakespeare.txt: the stored outputs show the real data sets, so "
              f"point --data-dir (or LOWPREC_DATA_DIR) at a folder with the copies (see the README)", file=sys.stderr)
        return 2
    os.environ.update(EXECUTION_ENV)
    os.environ["LOWPREC_DATA_DIR"] = str(data_dir.resolve())
    package = package_digest()
    failed = 0
    for path in paths:
        rel = path.relative_to(REPO)
        start = time.time()
        print(f"executing {rel} ...", flush=True)
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent)}})
        try:
            client.execute()
        except Exception as exc:  # a cell raised: report it and leave the notebook as it was
            failed += 1
            print(f"  FAILED after {time.time() - start:.0f} s, {rel} left unchanged:\n{exc}", file=sys.stderr)
            continue
        for cell in nb.cells:  # timestamps would change every file on every run
            cell.get("metadata", {}).pop("execution", None)
        nb.metadata[METADATA_KEY] = {"fingerprint": fingerprint(nb, package),
                                     "executed_with": {**EXECUTION_ENV, "LOWPREC_DATA_DIR": "shared data copies"}}
        _write_atomically(path, nbformat.writes(nb) + "\n")
        print(f"  stored in {time.time() - start:.0f} s", flush=True)
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("execute", "check"), help="store fresh outputs, or check the stored ones")
    parser.add_argument("notebooks", nargs="*", type=Path, help="notebooks (default: every chapter under book/)")
    parser.add_argument("--data-dir", type=Path,
                        default=Path(os.environ.get("LOWPREC_DATA_DIR") or REPO.parent / "shared" / "data"),
                        help="folder with the data copies (default: $LOWPREC_DATA_DIR, else ../shared/data)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may take (default 600)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or chapters()
    for p in paths:
        if not p.is_file() or p.suffix != ".ipynb":
            parser.error(f"{p} is not a notebook")
    if args.mode == "check":
        return check(paths)
    return execute(paths, args.data_dir.expanduser().resolve(), args.timeout)


if __name__ == "__main__":
    sys.exit(main())
