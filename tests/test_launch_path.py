"""The ways in: every chapter must run on Colab and on Binder as the launch buttons open it.

(a) Colab: the first code cell of each chapter, run as Colab runs it (IPython's own transform of
    `!` lines, then executed with `google.colab` present and with it absent), installs exactly the
    package `lowprec_demo[book]` from the repository URL and branch configured in `_config.yml`,
    and nothing else; outside Colab it installs nothing.
(b) Binder: the environment files (binder/requirements.txt, binder/postBuild) name every
    third-party module the chapters import; the top-level requirements.txt (a local setup) too.

A chapter is a notebook under book/ with at least one code cell. While none exists these tests
are skipped, with the reason, rather than passing on nothing.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
import types
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "book"
BINDER = REPO / "binder"

# Import name -> the pip distribution that provides it, where the two differ (or to be explicit).
IMPORT_TO_PIP = {
    "torch": "torch",
    "numpy": "numpy",
    "matplotlib": "matplotlib",
    "mpl_toolkits": "matplotlib",
    "tqdm": "tqdm",
    "ml_dtypes": "ml-dtypes",
    "ipywidgets": "ipywidgets",
    "mlxtend": "mlxtend",
    "tiktoken": "tiktoken",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "yaml": "pyyaml",
    "scipy": "scipy",
    "pandas": "pandas",
}
# Provided by the package itself, which binder/postBuild installs.
OUR_PACKAGE = "lowprec_demo"
# Present wherever a Jupyter kernel runs (Binder's and Colab's images, and any local Jupyter).
KERNEL_PROVIDED = {"IPython", "ipykernel", "jupyter_client", "traitlets"}
# Only importable on Colab, and only imported behind the `google.colab` guard.
COLAB_ONLY = {"google"}

PIP_QUIET_FLAGS = {"-q", "-qq", "-qqq", "--quiet"}


def chapter_notebooks() -> list[Path]:
    found = []
    for path in sorted(BOOK.rglob("*.ipynb")):
        rel = path.relative_to(BOOK)
        if rel.parts[0] == "results" or ".ipynb_checkpoints" in rel.parts:
            continue
        if code_cells(path):
            found.append(path)
    return found


def code_cells(path: Path) -> list[str]:
    notebook = json.loads(path.read_text(encoding="utf-8"))
    cells = []
    for cell in notebook.get("cells", []):
        if cell.get("cell_type") == "code":
            source = cell.get("source", "")
            cells.append("".join(source) if isinstance(source, list) else source)
    return cells


CHAPTERS = chapter_notebooks()
NO_CHAPTER = "no chapter notebook with code under book/ yet: nothing to check until the chapters land"


def per_chapter(test):
    """Parametrize over the chapters, or skip with a reason while there are none."""
    if CHAPTERS:
        params = [pytest.param(p, id=p.relative_to(BOOK).as_posix()) for p in CHAPTERS]
    else:
        params = [pytest.param(None, id="no-chapters", marks=pytest.mark.skip(reason=NO_CHAPTER))]
    return pytest.mark.parametrize("notebook", params)(test)


def repository() -> tuple[str, str]:
    config = yaml.safe_load((REPO / "_config.yml").read_text())
    repo = config["repository"]
    return str(repo["url"]).rstrip("/"), str(repo.get("branch", "main"))


def as_ipython_runs_it(source: str) -> str:
    """The Python that IPython executes for a cell: `!cmd` becomes get_ipython().system('cmd'),
    magics become run_line_magic / run_cell_magic calls."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


# --------------------------------------------------------------------------------------------
# (a) The Colab launch path.


class FakeShell:
    """Stands in for get_ipython(): records shell escapes and magics instead of running them."""

    def __init__(self) -> None:
        self.commands: list[str] = []

    def system(self, cmd: str) -> None:
        self.commands.append(cmd)

    getoutput = system

    def run_line_magic(self, name: str, line: str, *args) -> None:
        self.commands.append(f"%{name} {line}")

    def run_cell_magic(self, name: str, line: str, cell: str) -> None:
        self.commands.append(f"%%{name} {line}\n{cell}")


def fake_package() -> types.ModuleType:
    """A stand-in for lowprec_demo (and its ``book``) that records what the setup cell asks of it."""
    module = types.ModuleType(OUR_PACKAGE)
    module.calls = []
    module.book = types.ModuleType(f"{OUR_PACKAGE}.book")

    def record(name, result):
        def function(*args, **kwargs):
            module.calls.append(name)
            return result

        return function

    module.book.scale = record("scale", "quick")
    module.book.pick_device = record("pick_device", "cpu")
    module.book.seed_everything = record("seed_everything", None)
    return module


def run_setup_cell(source: str, in_colab: bool, monkeypatch) -> tuple[list[str], types.ModuleType]:
    shell = FakeShell()
    package = fake_package()
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, OUR_PACKAGE, package)
        patch.setitem(sys.modules, f"{OUR_PACKAGE}.book", package.book)
        if in_colab:
            patch.setitem(sys.modules, "google", types.ModuleType("google"))
            patch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
        else:
            patch.delitem(sys.modules, "google.colab", raising=False)
        namespace = {"get_ipython": lambda: shell, "__name__": "__main__"}
        exec(compile(as_ipython_runs_it(source), "<first code cell>", "exec"), namespace)
    return shell.commands, package


def install_requirements(command: str) -> list[str] | None:
    """The requirements a shell command installs with pip, or None when it is not a pip install.
    Options other than quiet flags are refused: they could install more (-r, -e, --index-url ...)."""
    if command.startswith("%"):
        name, _, line = command.lstrip("%").partition(" ")
        if name not in ("pip", "conda", "mamba", "uv"):
            return None
        words = [name] + shlex.split(line)
    else:
        words = shlex.split(command)
    if words[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        words = ["pip"] + words[3:]
    if words[:2] == ["uv", "pip"]:
        words = words[1:]
    if words and words[0] in ("conda", "mamba", "apt", "apt-get") and "install" in words:
        return ["<" + " ".join(words) + ">"]
    if words[:2] != ["pip", "install"]:
        return None
    requirements = []
    for word in words[2:]:
        if word.startswith("-"):
            if word not in PIP_QUIET_FLAGS:
                requirements.append(f"<option {word}>")
        else:
            requirements.append(word)
    return requirements


@per_chapter
def test_first_code_cell_installs_only_the_book_package_on_colab(notebook, monkeypatch):
    url, branch = repository()
    expected = f"{OUR_PACKAGE}[book] @ git+{url}@{branch}"
    first = code_cells(notebook)[0]

    commands, package = run_setup_cell(first, in_colab=True, monkeypatch=monkeypatch)
    installs = [(c, r) for c in commands if (r := install_requirements(c)) is not None]
    assert installs, (
        f"{notebook.name}: run as on Colab, the first code cell installs nothing; it must run\n"
        f'    !pip install -q "{expected}"\n'
        'inside `if "google.colab" in sys.modules:`'
    )
    requirements = [r for _, rs in installs for r in rs]
    assert requirements == [expected], (
        f"{notebook.name}: on Colab the first code cell installs {requirements} "
        f"(from {[c for c, _ in installs]}); it must install exactly [{expected!r}], "
        "the repository URL and branch of _config.yml, and nothing else"
    )
    for name in ("scale", "pick_device", "seed_everything"):
        assert name in package.calls, f"{notebook.name}: the first code cell never calls book.{name}()"


@per_chapter
def test_first_code_cell_installs_nothing_outside_colab(notebook, monkeypatch):
    first = code_cells(notebook)[0]
    commands, _ = run_setup_cell(first, in_colab=False, monkeypatch=monkeypatch)
    installs = [c for c in commands if install_requirements(c) is not None]
    assert not installs, (
        f"{notebook.name}: outside Colab the first code cell still runs {installs}; "
        'the install must sit inside `if "google.colab" in sys.modules:`'
    )


@per_chapter
def test_no_other_cell_installs_anything(notebook):
    for index, source in enumerate(code_cells(notebook)[1:], start=2):
        code = as_ipython_runs_it(source)
        assert not re.search(r"\b(pip|conda|mamba|apt-get|apt)\b[^\n]*\binstall\b", code), (
            f"{notebook.name}: code cell {index} installs something; only the first cell may, and only on Colab"
        )


# --------------------------------------------------------------------------------------------
# (b) The Binder environment names every third-party import.


def imported_modules(source: str) -> set[str]:
    """Top-level names of the modules a cell imports (absolute imports only)."""
    tree = ast.parse(as_ipython_runs_it(source))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports(notebook: Path) -> set[str]:
    names = set()
    for source in code_cells(notebook):
        names |= imported_modules(source)
    return {
        n
        for n in names
        if n not in sys.stdlib_module_names and n != "__future__" and n not in KERNEL_PROVIDED | COLAB_ONLY
    }


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path: Path, seen: set | None = None) -> set[str]:
    """Distribution names a requirements file asks for (following -r includes)."""
    from packaging.requirements import Requirement

    seen = seen if seen is not None else set()
    if path in seen:
        return set()
    seen.add(path)
    names = set()
    for raw in path.read_text().splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith(("-r ", "--requirement ")):
            names |= requirement_names(path.parent / line.split(None, 1)[1], seen)
            continue
        if line.startswith("-"):
            continue  # index options and the like
        names.add(canonical(Requirement(line).name))
    return names


def postbuild_installs_the_package() -> bool:
    postbuild = BINDER / "postBuild"
    if not postbuild.is_file():
        return False
    return any(
        re.search(r"\bpip\s+install\b.*\s(-e\s+)?[\"']?\.(\[[\w,]+\])?[\"']?(\s|$)", line)
        for line in postbuild.read_text().splitlines()
        if not line.strip().startswith("#")
    )


def missing_from(requirements: Path, notebook: Path) -> list[str]:
    listed = requirement_names(requirements)
    missing = []
    for module in sorted(third_party_imports(notebook)):
        if module == OUR_PACKAGE:
            continue
        pip_name = canonical(IMPORT_TO_PIP.get(module, module))
        if pip_name not in listed:
            missing.append(f"{module} (pip: {pip_name})")
    return missing


@per_chapter
def test_binder_requirements_name_every_chapter_import(notebook):
    requirements = BINDER / "requirements.txt"
    assert requirements.is_file(), "binder/requirements.txt is missing"
    missing = missing_from(requirements, notebook)
    assert not missing, f"{notebook.name} imports {missing}, which binder/requirements.txt does not name"
    if OUR_PACKAGE in third_party_imports(notebook):
        assert postbuild_installs_the_package(), (
            f"{notebook.name} imports {OUR_PACKAGE}, but binder/postBuild does not `pip install -e .`"
        )


@per_chapter
def test_local_requirements_name_every_chapter_import(notebook):
    missing = missing_from(REPO / "requirements.txt", notebook)
    assert not missing, f"{notebook.name} imports {missing}, which requirements.txt does not name"


# --------------------------------------------------------------------------------------------
# Checks that hold with or without chapters.


def test_binder_takes_torch_from_the_cpu_index():
    text = (BINDER / "requirements.txt").read_text()
    assert re.search(r"^--extra-index-url\s+https://download\.pytorch\.org/whl/cpu/?\s*$", text, re.MULTILINE), (
        "binder/requirements.txt must take torch from the CPU index (a CUDA build does not fit Binder)"
    )
    assert "torch" in requirement_names(BINDER / "requirements.txt")


def test_binder_postbuild_installs_the_package():
    postbuild = BINDER / "postBuild"
    assert postbuild.is_file(), "binder/postBuild is missing"
    assert postbuild.stat().st_mode & 0o111, "binder/postBuild must be executable"
    assert postbuild_installs_the_package(), "binder/postBuild must `pip install -e .` the package"


def test_launch_buttons_use_the_configured_repository():
    config = yaml.safe_load((REPO / "_config.yml").read_text())
    url, branch = repository()
    assert re.fullmatch(r"https://github\.com/[\w.-]+/[\w.-]+", url), url
    assert branch
    launch = config["launch_buttons"]
    assert launch["binderhub_url"].rstrip("/") == "https://mybinder.org"
    assert launch["colab_url"].rstrip("/") == "https://colab.research.google.com"


def test_toc_names_existing_pages_only():
    """Every page in _toc.yml exists (a missing chapter is reported by name), and every page
    under book/ is in the toc (a page left out would silently not be built)."""
    toc = yaml.safe_load((REPO / "_toc.yml").read_text())
    entries = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                entries.append(node["file"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(toc.get("parts", []))
    walk(toc.get("chapters", []))

    def exists(entry):
        return any((REPO / f"{entry}{ext}").is_file() for ext in (".md", ".ipynb"))

    missing = [e for e in entries if not exists(e)]
    pages = {
        p.relative_to(REPO).with_suffix("").as_posix()
        for p in BOOK.rglob("*")
        if p.suffix in (".md", ".ipynb")
        and "results" not in p.relative_to(BOOK).parts
        and ".ipynb_checkpoints" not in p.parts
    }
    unlisted = sorted(pages - set(entries))
    assert not unlisted, f"pages under book/ that _toc.yml does not list: {unlisted}"
    if missing:
        pytest.skip(f"pages listed in _toc.yml that do not exist yet: {missing}")
