"""The package's layout: one job per module, imports that run one way, and the public methods
the benchmark measures through (instead of private attributes)."""

import ast
from pathlib import Path

import pytest
import torch

import lowprec_demo as lp
from lowprec_demo.prediction import FreezeObserver, FreezePredictor
from lowprec_demo.results import provenance


PACKAGE = Path(lp.__file__).resolve().parent


def _imports(module: str) -> set:
    """The package modules that ``module`` imports anywhere in its source (module level and
    inside functions), as dotted names relative to the package. A subpackage is its
    ``__init__.py``, whose relative imports start in the subpackage itself."""
    path = PACKAGE / (module.replace(".", "/") + ".py")
    base = module.split(".")[:-1]
    if not path.is_file():
        path = PACKAGE / module.replace(".", "/") / "__init__.py"
        base = module.split(".")
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            parent = base[:len(base) - (node.level - 1)]
            target = ".".join(parent + ([node.module] if node.module else []))
            found |= {f"{target}.{a.name}".strip(".") for a in node.names} if not node.module else {target}
    return found


def test_the_training_loop_does_not_reach_up_to_the_experiments():
    assert not any(m.startswith("experiments") for m in _imports("training"))
    assert {"config", "results", "distributed"} <= _imports("training")


def test_config_and_results_do_not_need_the_loop():
    assert "training" not in _imports("config") and "results" not in _imports("config")
    assert "training" not in _imports("results")
    assert "training" not in _imports("distributed") and "results" not in _imports("distributed")


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
    assert lp.run_formats.__module__ == "lowprec_demo.experiments"
    assert lp.TrainResult.__module__ == "lowprec_demo.results"
    assert lp.TrainConfig.__module__ == lp.lr_factor.__module__ == "lowprec_demo.config"
    assert lp.train_variants.__module__ == "lowprec_demo.training"


EXPERIMENT_MODULES = ("quadratic", "regression", "mlp", "mnist", "nanogpt", "gpt2")


def test_the_experiment_modules_import_the_registry_not_the_package():
    """The package imports every experiment module; they import the registry (and the GPT ones
    the shared language module), never the package or each other, so there is no cycle."""
    for name in EXPERIMENT_MODULES + ("language", "registry"):
        imported = {d for d in _imports(f"experiments.{name}") if d.startswith("experiments")}
        assert imported <= {"experiments.registry", "experiments.language"}, (name, imported)
    assert "experiments.language" not in _imports("experiments.registry")


def test_the_version_lives_in_a_module_of_its_own():
    from lowprec_demo import version
    assert "version" in _imports("results") and "__version__" not in _imports("results")
    assert lp.__version__ == version.__version__ == provenance("cpu")["package_version"]


def test_names_moved_out_of_a_module_are_still_importable_from_it():
    from lowprec_demo import experiments
    from lowprec_demo.experiments import language, nanogpt, registry
    for name in ("Experiment", "register", "experiment_names", "get_experiment", "ExperimentOptions"):
        assert getattr(experiments, name) is getattr(registry, name)
    for name in ("gpt_task", "decay_groups", "shard_rows"):
        assert getattr(nanogpt, name) is getattr(language, name)
    assert nanogpt.char_tokens.__module__ == "lowprec_demo.experiments.nanogpt"


def test_the_data_sets_import_the_environment_and_the_package_names_them_all():
    """``data.environment`` (where files come from) imports none of the data sets; each data set
    imports at most the environment; ``lowprec_demo.data`` re-exports their public names."""
    from lowprec_demo import data
    from lowprec_demo.data import batches, environment, mnist, text
    assert not any(d.startswith("data") for d in _imports("data.environment"))
    for name in ("text", "batches", "mnist"):
        assert {d for d in _imports(f"data.{name}") if d.startswith("data")} <= {"data.environment"}, name
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
    small = [torch.nn.Parameter(torch.randn(10)) for _ in range(5)]   # packed into one buffer of 50
    opt = lp.LowPrecisionOptimizer(torch.optim.SGD(small, lr=0.1), "bf16")
    assert opt.held_bytes() == 0 and len({p.untyped_storage().data_ptr() for p in small}) == 1   # they live in it
    shared = torch.randn(50)     # views of one tensor stay there: the pack's buffer is memory of its own
    views = [torch.nn.Parameter(shared[10 * i:10 * i + 10]) for i in range(5)]
    assert lp.LowPrecisionOptimizer(torch.optim.SGD(views, lr=0.1), "bf16").held_bytes() == 50 * 4
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
    from lowprec_demo.machine import machine_record
    m = machine_record("cpu")
    p = provenance("cpu")
    assert m["device_name"] == p["device_name"] and m["git_commit"] == p["git_commit"]
    assert m["threads"] == torch.get_num_threads() and "load_average_start" in m


def test_the_benchmark_tables_machine_and_timing_do_not_import_the_benchmark():
    """The arrow runs one way: ``bench`` (what is measured) imports ``bench_report`` (the tables,
    the targets), ``machine`` (which machine) and ``timing`` (how it is timed), and none of them
    imports ``bench``."""
    for module in ("bench_report", "machine", "timing"):
        assert not any(d == "bench" or d.startswith("bench.") for d in _imports(module)), module
    assert {"bench_report", "machine", "timing"} <= {d.split(".")[0] for d in _imports("bench")}


def test_the_benchmark_builds_its_models_through_the_experiments():
    """bench's models are the experiments' own: the same config, the same initialisation, the
    training loop's optimizer and the same low-precision parameters (no settings copied)."""
    from lowprec_demo import bench
    from lowprec_demo.experiments import get_experiment, make_config
    for path in (PACKAGE / "experiments").glob("*.py"):   # the arrow runs one way
        assert "bench" not in path.read_text(), path
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
