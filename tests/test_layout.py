"""The package's layout: one job per module, imports that run one way, and the public methods
the benchmark measures through (instead of private attributes)."""

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.freeze import FreezeObserver, FreezePredictor
from lowprec_demo.book.results import provenance


PACKAGE = Path(lp.__file__).resolve().parent
sys.path.insert(0, str(PACKAGE.parent / "benchmarks"))   # the benchmark's modules


def _module_path(module: str):
    """The file of a dotted module name relative to the package ("book.training"), or None."""
    base = PACKAGE / module.replace(".", "/")
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _imports(module: str) -> set:
    """The package modules that ``module`` imports anywhere in its source (module level and
    inside functions), as dotted names relative to the package: ``from lowprec_demo.rounding
    import freeze_rule`` is ``rounding.freeze_rule``, ``from lowprec_demo.rounding import quantize`` is
    ``rounding``. Relative imports are resolved the same way."""
    path = _module_path(module)
    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name[len("lowprec_demo."):] for a in node.names if a.name.startswith("lowprec_demo.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                target = ".".join(base[:len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            elif node.module == "lowprec_demo" or (node.module or "").startswith("lowprec_demo."):
                target = node.module[len("lowprec_demo."):] if node.module != "lowprec_demo" else ""
            else:
                continue
            for a in node.names:
                sub = f"{target}.{a.name}".strip(".")
                found.add(sub if _module_path(sub) else target)
    found.discard("")
    return found


def _modules() -> list:
    names = [p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".") for p in PACKAGE.rglob("*.py")]
    return sorted(n[:-len(".__init__")] if n.endswith(".__init__") else n for n in names if n != "__init__")


# The layers, lowest first: a module imports only from its own layer and those before it.
LAYERS = ("version", "common", "formats", "rounding", "optim", "freeze", "monitor", "book", "__main__")


def test_lower_layers_never_import_higher_ones():
    """The package's layering: formats -> rounding -> optim -> freeze -> monitor, with ``common``
    underneath and the book's machinery (``book``) and the command line on top. No module of a
    layer imports one of a later layer (the book and the command line are never imported by the
    library)."""
    bad = []
    for module in _modules():
        rank = LAYERS.index(module.split(".")[0])
        for target in _imports(module):
            if LAYERS.index(target.split(".")[0]) > rank:
                bad.append(f"{module} imports {target}")
    assert not bad, bad


def test_import_lowprec_demo_is_light():
    """``import lowprec_demo`` loads the version and nothing else of the package; the user's API
    (at most 25 names) and the book's names come on first use."""
    code = ("import sys, lowprec_demo as lp; print(sorted(m for m in sys.modules if m.startswith('lowprec_demo'))); "
            "print(len(lp.__all__)); print(hasattr(lp, 'torch')); lp.watch; lp.LowPrecisionOptimizer; "
            "print(sorted(m for m in sys.modules if m.startswith('lowprec_demo')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    first, count, has_torch, after = out.stdout.splitlines()
    assert eval(first) == ["lowprec_demo", "lowprec_demo.version"]
    assert int(count) <= 25 and has_torch == "False"
    loaded = eval(after)
    assert len(loaded) <= 34 and not any(m.startswith("lowprec_demo.book") for m in loaded), loaded


def test_every_name_the_package_offers_resolves_and_no_attribute_shadows_a_submodule():
    for name in dir(lp):
        assert getattr(lp, name) is not None, name
    for package in ("rounding", "optim", "freeze", "monitor", "book", "common"):
        module = importlib.import_module(f"lowprec_demo.{package}")
        for sub in (PACKAGE / package).iterdir():
            name = sub.stem
            if name.startswith("__") or not (sub.suffix == ".py" or (sub / "__init__.py").is_file()):
                continue
            value = getattr(module, name, None)
            assert value is None or inspect.ismodule(value), f"lowprec_demo.{package}.{name} is not the submodule"
        assert len(getattr(module, "__all__", [])) <= 25, package


@pytest.mark.parametrize("name", ["run_experiment", "scale", "plots", "experiments", "steps_agree", "FreezePredictor"])
def test_the_top_level_offers_the_library_and_nothing_of_the_book(name):
    """``lowprec_demo`` is the library: the book's names (and analysis helpers) are reached through their subpackage,
    ``lowprec_demo.book.run_experiment``, ``lowprec_demo.freeze.steps_agree``."""
    with pytest.raises(AttributeError, match=name):
        getattr(lp, name)
    for top in dir(lp):
        value = getattr(lp, top)
        home = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", "") or ""
        assert top == "book" or not home.startswith("lowprec_demo.book"), top


def test_the_training_loop_does_not_reach_up_to_the_experiments():
    assert not any(m.startswith("book.experiments") for m in _imports("book.training"))
    assert {"book.config", "book.results", "book.distributed"} <= _imports("book.training")


def test_config_and_results_do_not_need_the_loop():
    assert "book.training" not in _imports("book.config") and "book.results" not in _imports("book.config")
    assert "book.training" not in _imports("book.results")
    assert "book.training" not in _imports("book.distributed") and "book.results" not in _imports("book.distributed")


def test_no_package_module_imports_from_itself_in_a_cycle():
    """Apart from the experiments (checked by
    test_the_experiment_modules_import_the_registry_not_the_package), the package's imports form
    no cycle."""
    modules = [p.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".") for p in PACKAGE.rglob("*.py")]
    modules = [m[:-len(".__init__")] if m.endswith(".__init__") else m for m in modules]
    modules = [m for m in modules if m != "__init__" and not m.startswith("experiments")]
    graph = {m: {d for d in _imports(m) if d in modules and d != m} for m in modules}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in graph[m]:
            assert state.get(d) != "open", f"import cycle: {' -> '.join(path + [d])}"
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in modules:
        if m not in state:
            visit(m, [m])


def test_public_names_where_the_package_exports_them():
    assert lp.book.run_formats.__module__ == "lowprec_demo.book.experiments"
    assert lp.book.TrainResult.__module__ == "lowprec_demo.book.results"
    assert lp.book.TrainConfig.__module__ == lp.book.lr_factor.__module__ == "lowprec_demo.book.config"
    assert lp.book.train_variants.__module__ == "lowprec_demo.book.training"


EXPERIMENT_MODULES = ("quadratic", "regression", "mlp", "mnist", "nanogpt", "gpt2")


def test_the_experiment_modules_import_the_registry_not_the_package():
    """The package imports every experiment module; they import the registry (and the GPT ones
    the shared language module), never the package or each other, so there is no cycle."""
    for name in EXPERIMENT_MODULES + ("language", "registry"):
        imported = {d for d in _imports(f"book.experiments.{name}") if d.startswith("book.experiments")}
        assert imported <= {"book.experiments.registry", "book.experiments.language"}, (name, imported)
    assert "book.experiments.language" not in _imports("book.experiments.registry")


def test_the_version_lives_in_a_module_of_its_own():
    from lowprec_demo import version
    assert "version" in _imports("book.results") and "__version__" not in _imports("book.results")
    assert lp.__version__ == version.__version__ == provenance("cpu")["package_version"]


def test_names_moved_out_of_a_module_are_still_importable_from_it():
    from lowprec_demo.book import experiments
    from lowprec_demo.book.experiments import language, nanogpt, registry
    for name in ("Experiment", "register", "experiment_names", "get_experiment", "ExperimentOptions"):
        assert getattr(experiments, name) is getattr(registry, name)
    for name in ("gpt_task", "decay_groups", "shard_rows"):
        assert getattr(nanogpt, name) is getattr(language, name)
    assert nanogpt.char_tokens.__module__ == "lowprec_demo.book.experiments.nanogpt"


def test_the_data_sets_import_the_environment_and_the_package_names_them_all():
    """``data.environment`` (where files come from) imports none of the data sets; each data set
    imports at most the environment; ``lowprec_demo.book.data`` re-exports their public names."""
    from lowprec_demo.book import data
    from lowprec_demo.book.data import batches, environment, mnist, text
    assert not any(d.startswith("book.data") for d in _imports("book.data.environment"))
    for name in ("text", "batches", "mnist"):
        assert {d for d in _imports(f"book.data.{name}") if d.startswith("book.data")} <= {"book.data.environment"}, name
    homes = (environment, text, batches, mnist)
    assert sorted(data.__all__) == sorted(n for m in homes for n in m.__all__)
    for module in homes:
        for name in module.__all__:
            assert getattr(data, name) is getattr(module, name), name


def test_round_params_nearest_and_stochastic():
    w = torch.nn.Parameter(torch.full((10_000,), 1.0 + 2.0**-9))     # a quarter of a gap above 1 in bf16
    opt = lp.LowPrecisionOptimizer(torch.optim.SGD([w], lr=0.1), "bf16", generator=3, round_initial=False)
    opt.round_params("stochastic")
    moved_up = (w.data > 1.0).float().mean().item()
    assert set(w.data.unique().tolist()) <= {1.0, 1.0 + 2.0**-7}
    assert 0.2 < moved_up < 0.3          # SR goes up with probability 1/4
    w.data.fill_(1.0 + 2.0**-9)
    opt.round_params()                   # nearest by default
    assert (w.data == 1.0).all()
    with pytest.raises(ValueError, match="nearest, stochastic"):
        opt.round_params("up")


def test_held_bytes_count_what_is_kept_between_steps():
    small = [torch.nn.Parameter(torch.randn(10)) for _ in range(5)]
    homes = {p.untyped_storage().data_ptr() for p in small}
    opt = lp.LowPrecisionOptimizer(torch.optim.SGD(small, lr=0.1), "bf16")
    assert opt.held_bytes() == 0 and {p.untyped_storage().data_ptr() for p in small} == homes   # each its own
    packed = lp.LowPrecisionOptimizer(torch.optim.SGD(small, lr=0.1), "bf16", pack=True)   # one buffer of 50
    assert packed.held_bytes() == 0 and len({p.untyped_storage().data_ptr() for p in small}) == 1   # they live in it
    shared = torch.randn(50)     # views of one tensor stay there: the pack's buffer is memory of its own
    views = [torch.nn.Parameter(shared[10 * i:10 * i + 10]) for i in range(5)]
    assert lp.LowPrecisionOptimizer(torch.optim.SGD(views, lr=0.1), "bf16", pack=True).held_bytes() == 50 * 4
    kahan = lp.LowPrecisionOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.randn(1000))], lr=0.1), "bf16",
                                     compensation="kahan")
    before = kahan.held_bytes()
    kahan.param_groups[0]["params"][0].grad = torch.ones(1000)
    kahan.step()
    assert kahan.held_bytes() == before + 1000 * 4       # the compensation buffer
    w = torch.nn.Parameter(torch.randn(1000))
    plain = FreezePredictor({"w": w}, ["bf16"])
    masked = FreezePredictor({"w": w}, ["bf16"], keep_masks=True)
    for tracker in (plain, masked):
        tracker.before_step()
        w.data -= 1e-3
        tracker.after_step()
    # one float32 snapshot and the first-step ratios; the masks one byte per element more
    assert plain.held_bytes() >= 1000 * 4 + 1000 * 4
    assert masked.held_bytes() == plain.held_bytes() + 1000
    obs = FreezeObserver({"w": w}, "bf16")
    obs.before_step()
    obs.after_step()
    assert obs.held_bytes() >= 1000 * 4


def test_provenance_names_the_cpu_model():
    p = provenance("cpu")
    try:
        with open("/proc/cpuinfo") as f:
            models = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:
        models = []
    if not models:
        pytest.skip("no /proc/cpuinfo model name on this machine")
    assert p["device_name"] == models[0]
    assert {"package_version", "torch_version", "git_commit", "date"} <= set(p)


def test_benchmark_machine_is_the_provenance_plus_load():
    from machine import machine_record
    m = machine_record("cpu")
    p = provenance("cpu")
    assert m["device_name"] == p["device_name"] and m["git_commit"] == p["git_commit"]
    assert m["threads"] == torch.get_num_threads() and "load_average_start" in m


def test_the_benchmark_tables_machine_and_timing_do_not_import_the_benchmark():
    """The arrow runs one way: ``bench`` (what is measured) imports ``bench_report`` (the tables,
    the targets), ``machine`` (which machine) and ``timing`` (how it is timed), and none of them
    imports ``bench``."""
    folder = PACKAGE.parent / "benchmarks"

    def top_imports(name):
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level:
                found.add(node.module.split(".")[0])
        return found
    for module in ("bench_report", "machine", "timing"):
        assert "bench" not in top_imports(module), module
    assert {"bench_report", "machine", "timing"} <= top_imports("bench")
    assert not [p for p in PACKAGE.rglob("*.py") if p.stem in ("bench", "bench_report", "machine", "timing")]


def test_the_benchmark_builds_its_models_through_the_experiments():
    """bench's models are the experiments' own: the same config, the same initialisation, the
    training loop's optimizer and the same low-precision parameters (no settings copied)."""
    import bench
    from lowprec_demo.book.experiments import get_experiment, make_config
    for path in PACKAGE.rglob("*.py"):   # the arrow runs one way
        assert "import bench" not in path.read_text() and "from bench" not in path.read_text(), path
    for name, spec in bench.MODELS.items():
        if name == "gpt2":
            continue   # 124M parameters: the smaller two say the same
        config, task, model, opt, lowprec = bench.build_model(name, "cpu")
        assert config == make_config(spec["experiment"], spec["scale"], device="cpu")
        own = get_experiment(spec["experiment"]).build(config).make_model(torch.Generator().manual_seed(0))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), own.state_dict().values()))
        assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == config.lr
        assert tuple(opt.defaults["betas"]) == tuple(config.betas)
        assert [g["weight_decay"] for g in opt.param_groups] == [config.weight_decay, 0.0]
        assert set(lowprec) == {n for n, _ in model.named_parameters()}   # nanoGPT: every parameter
    with pytest.raises(ValueError, match="valid models: nanogpt-quick"):
        bench.build_model("gpt3", "cpu")
