"""LowPrecisionOptimizer and the freeze watch on FSDP2 (``fully_shard``) parameters, under torchrun
on the CPU (gloo): 2 and 4 processes, against the same training in one process.

The model is one the book does not build: an embedding (some rows never used), two linear
layers with a LayerNorm and GELUs, and a linear head. Its shapes give uneven blocks of rows
(on 4 processes the head's weight has an empty one) and, with the watch's ``sample=64``,
strided sampling whose stride does not divide the shards' offsets. ``packing.SMALL_NUMEL`` is
lowered so that one weight is rounded alone and the rest as a pack of small tensors, in both runs.
Six optimizer settings run on float32 parameters, one on float64 (stochastic rounding outside the
fused kernels), and on 4 processes one on a 2 x 2 mesh (HSDP: replicated, then sharded).

For the gradients to be the single process's bit for bit, the batch goes to the processes so that
the gradient reduction is exact: on 2 processes each takes half of the batch, and the single
process accumulates the two halves' gradients (a + b is the same in any order; halving is exact);
on 4 processes the sum of four terms depends on the order the collective adds them in, so
process 0 takes the whole batch (its loss times 4, exact) and the others contribute zeros.
Every process checks, in its own run of the single-process training, that every parameter,
the optimizer state, and the watch's report are the same, and writes what it found to a JSON
file that the tests read.

Run by hand: ``torchrun --nproc_per_node=2 tests/test_fsdp.py OUT.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
STEPS = 6
CONFIGS = {   # name: LowPrecisionOptimizer settings (None: plain AdamW, the watch predicts)
    "nearest": {"rounding": "nearest"},
    "stochastic": {"rounding": "stochastic"},
    "stochastic_3bits_state": {"rounding": "stochastic", "rand_bits": 3, "state_format": "bf16",
                               "state_rounding": "stochastic"},
    "kahan": {"compensation": "kahan", "compensation_format": "bf16"},
    "master": {"master_weights": True},
    "predict": None,
    "stochastic_fp64": {"rounding": "stochastic"},      # float64 parameters: SR outside the fused kernels
    "hsdp": {"rounding": "stochastic"},                 # 4 processes: replicated over 2, sharded over 2
}


# ------------------------------------------------------------------------------------------------
# the worker: one process of the torchrun job
# ------------------------------------------------------------------------------------------------
class _Net(torch.nn.Module):
    """An embedding of 4 tokens (summed), two linear layers with a LayerNorm and GELUs, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 7)
        self.body = torch.nn.Sequential(torch.nn.Linear(7, 30), torch.nn.LayerNorm(30), torch.nn.GELU(),
                                        torch.nn.Linear(30, 45), torch.nn.GELU())
        self.head = torch.nn.Linear(45, 3)

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens).sum(1)))


def _model(name: str = "") -> torch.nn.Module:
    torch.manual_seed(0)
    return _Net().to(torch.float64 if name.endswith("fp64") else torch.float32)


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 15, (8, 4), generator=g), torch.randn(8, 3, generator=g)   # rows 15..19 unused


def _loss(model, tokens, target):
    out = model(tokens)
    return (out - target.to(out.dtype)).pow(2).mean()


def _make(model, settings, lp):
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    opt = inner if settings is None else lp.LowPrecisionOptimizer(inner, "bf16", generator=11, **settings)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 - s / (2 * STEPS))
    return opt, sched


def _train(model, opt, sched, steps, world: int, rank: int, sharded: bool):
    """``steps`` steps; sharded: this process's share of the batch (see the module docstring),
    else the single process's gradients for the same split."""
    for step in steps:
        tokens, target = _batch(step)
        opt.zero_grad(set_to_none=True)
        if not sharded:
            if world == 2:
                for r in range(2):
                    (_loss(model, tokens[4 * r:4 * r + 4], target[4 * r:4 * r + 4]) / 2).backward()
            else:
                _loss(model, tokens, target).backward()
        elif world == 2:
            _loss(model, tokens[4 * rank:4 * rank + 4], target[4 * rank:4 * rank + 4]).backward()
        else:
            (_loss(model, tokens, target) * (float(world) if rank == 0 else 0.0)).backward()
        opt.step()
        sched.step()


def _full(t):
    from lowprec_demo.common.sharding import is_sharded
    return t.full_tensor() if is_sharded(t) else t


def _same_state(a, b) -> bool:
    """The optimizer states (and a LowPrecisionOptimizer's buffers) equal bit for bit."""
    sa, sb = a.state_dict(), b.state_dict()
    ok = sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        for k, v in sa["state"][i].items():
            ok &= torch.equal(_full(v), _full(sb["state"][i][k]))
    if "lowprec" in sa:
        for key in ("compensation_buffers", "master_weights"):
            ok &= sa["lowprec"][key].keys() == sb["lowprec"][key].keys()
            ok &= all(torch.equal(_full(v), _full(sb["lowprec"][key][i])) for i, v in sa["lowprec"][key].items())
        ok &= torch.equal(sa["lowprec"]["generator_state"], sb["lowprec"]["generator_state"])
    return bool(ok)


def _report_difference(a, b, path="") -> list:
    """Where two watch reports differ: exactly, except the share stochastic rounding would move
    (a sum of probabilities) and the kept share (a ratio of sums of real updates), both added in
    another order over shards, to 1e-12."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for k in a for d in _report_difference(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _report_difference(x, y, f"{path}[{i}]")]
    if ("move_fraction" in path or path.startswith("/kept/")) and isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) <= 1e-12 else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} != {b!r}"]


def _shard(model, name: str = ""):
    """FSDP2 on each layer with parameters and the whole model; ``"hsdp"``: on a 2 x 2 mesh,
    replicated over its first dimension and sharded over its second."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import torch.distributed as dist
    mesh = (init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("replicate", "shard"))
            if name == "hsdp" else None)
    for part in model.body:
        if any(True for _ in part.parameters()):
            fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(out_path: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import lowprec_demo as lp
    from lowprec_demo.common import packing, sharding

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    packing.SMALL_NUMEL = 1000          # one weight alone, the rest packed (in both runs)
    found: dict = {"world": world, "rank": rank}
    for name, settings in CONFIGS.items():
        if name == "hsdp" and world != 4:
            continue
        ref, model = _model(name), _shard(_model(name), name)
        ref_opt, ref_sched = _make(ref, settings, lp)
        opt, sched = _make(model, settings, lp)
        kwargs = dict(formats=("bf16", "e4m3"), total_steps=2 * STEPS, sample=64, patience=2)
        ref_watch = lp.watch(ref, ref_opt, scheduler=ref_sched, **kwargs)
        watch = lp.watch(model, opt, scheduler=sched, **kwargs)
        _train(ref, ref_opt, ref_sched, range(STEPS), world, rank, sharded=False)
        _train(model, opt, sched, range(STEPS), world, rank, sharded=True)
        params = dict(model.named_parameters())
        found[name] = {
            "sharded": all(sharding.is_sharded(p) for p in params.values()),
            "placements": [type(pl).__name__ for pl in next(iter(params.values())).placements],
            "pieces_smaller": sum(sharding.local_part(p).numel() < p.numel() for p in params.values()),
            "empty_pieces": sum(sharding.local_part(p).numel() == 0 for p in params.values()),
            "bits_equal": {n: torch.equal(_full(p), dict(ref.named_parameters())[n]) for n, p in params.items()},
            "state_equal": _same_state(ref_opt, opt),
            "report_differences": _report_difference(ref_watch.report().data, watch.report().data)[:5],
            "summary_equal": ref_watch.summary(show=False) == watch.summary(show=False),
            "forecast_equal": watch.mode == "observe" or ref_watch.forecast() == watch.forecast(),
            "forecast": watch.forecast() if watch.mode == "predict" else None,
            "diagnoses": [d.kind for d in watch.diagnoses()],
            "mode": watch.mode,
            "frozen": watch.record().overall,
            "weights": {n: _full(p).tolist() for n, p in params.items() if n == "body.3.weight"},
        }
        if name in ("stochastic", "kahan"):   # a dcp checkpoint in the middle, resumed in new objects
            folder = os.path.join(os.path.dirname(out_path), f"ckpt-{name}")
            model2 = _shard(_model())
            opt2, sched2 = _make(model2, settings, lp)
            _train(model2, opt2, sched2, range(3), world, rank, sharded=True)
            dcp.save({"model": model2.state_dict(), "optimizer": opt2.state_dict()}, checkpoint_id=folder)
            model3 = _shard(_model())
            opt3, sched3 = _make(model3, settings, lp)
            opt3.prepare_state()
            state = {"model": model3.state_dict(), "optimizer": opt3.state_dict()}
            dcp.load(state, checkpoint_id=folder)
            model3.load_state_dict(state["model"])
            opt3.load_state_dict(state["optimizer"])
            for _ in range(3):
                sched3.step()
            _train(model3, opt3, sched3, range(3, STEPS), world, rank, sharded=True)
            found[name]["resumed_bits_equal"] = all(torch.equal(_full(p), _full(q)) for p, q in
                                                     zip(model.parameters(), model3.parameters()))
            found[name]["resumed_state_equal"] = _same_state(opt, opt3)
        if name == "stochastic":
            report = os.path.join(os.path.dirname(out_path), "watch.json")
            watch.save(report)
            dist.barrier()
            found["saved_by"] = [rank] if os.path.exists(report) and rank == 0 else []
            found["saved_report_equal"] = json.loads(Path(report).read_text())["records"] == \
                json.loads(json.dumps(ref_watch.report().data))["records"]
        watch.detach(), ref_watch.detach()
    # a placement the optimizer does not support is refused by name
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", list(range(world)))
    wrong = torch.nn.Parameter(distribute_tensor(torch.ones(4, 4 * world), mesh, [Shard(1)]))
    try:
        lp.LowPrecisionOptimizer(torch.optim.SGD([wrong], lr=0.1), "bf16", rounding="stochastic")
        found["shard1_error"] = ""
    except ValueError as error:
        found["shard1_error"] = str(error)
    Path(f"{out_path}.{rank}").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# in one process: a piece rounded with its offset draws the whole tensor's bits
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rand_bits", [None, 3])
def test_a_piece_with_its_offset_draws_the_whole_tensors_bits(dtype, rand_bits):
    from lowprec_demo.rounding import quantize, quantize_, random_bits
    x = (1 + torch.randn(300, 5, generator=torch.Generator().manual_seed(0)) * 1e-3).to(dtype)
    whole = quantize(x, "bf16", "stochastic", generator=9, rand_bits=rand_bits)
    assert not torch.equal(whole, quantize(x, "bf16"))        # SR moved some elements nearest keeps
    rows = x[120:].clone()                                     # rows 120.. start at element 600
    quantize_(rows, "bf16", "stochastic", generator=9, rand_bits=rand_bits, index_offset=600)
    assert torch.equal(rows, whole[120:])
    strided = x[120:].t().contiguous().t()                     # the same rows, not contiguous
    assert torch.equal(quantize(strided, "bf16", "stochastic", generator=9, rand_bits=rand_bits,
                                index_offset=600), whole[120:])
    unshifted = x[120:].clone()
    quantize_(unshifted, "bf16", "stochastic", generator=9, rand_bits=rand_bits)
    assert not torch.equal(unshifted, whole[120:])             # without the offset: other bits
    assert torch.equal(random_bits((5,), 3, index_offset=7), random_bits((12,), 3)[7:])


def test_a_bad_index_offset_is_refused():
    from lowprec_demo.rounding import quantize
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="index_offset must be a non-negative integer"):
            quantize(torch.ones(3), "bf16", "stochastic", generator=1, index_offset=bad)


def test_plain_tensors_are_their_own_whole():
    from lowprec_demo.common import sharding
    t = torch.ones(4, 3)
    assert not sharding.any_sharded([t]) and sharding.local_part(t) is t
    assert sharding.flat_offset(t) == 0 and sharding.row_range(t) == (0, 4)
    sharding.check_placements(t)      # nothing to refuse


# ------------------------------------------------------------------------------------------------
# the tests: one torchrun job per process count
# ------------------------------------------------------------------------------------------------
def _run(nproc: int, tmp_path: Path) -> list:
    out = tmp_path / "found.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), LOWPREC_FUSED="off")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(Path(__file__).resolve()), str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module", params=[2, 4])
def found(request):
    with tempfile.TemporaryDirectory() as folder:
        yield _run(request.param, Path(folder))


def test_every_process_holds_a_piece(found):
    world = found[0]["world"]
    for f in found:
        for name in _names(f):
            assert f[name]["sharded"]
            assert f[name]["pieces_smaller"] >= 5, (name, f["rank"])   # every parameter but 1-row ones split
    # on 4 processes the head (3 rows) leaves the last process without a piece of its weight and bias
    assert any(f["nearest"]["empty_pieces"] for f in found) == (world == 4)


def _names(f: dict) -> list:
    return [n for n in CONFIGS if n in f]


def _skip_unless_run(found, name):
    if name not in found[0]:
        pytest.skip(f"{name} runs on 4 processes only")


def test_hsdp_is_replicated_then_sharded(found):
    _skip_unless_run(found, "hsdp")
    assert all(f["hsdp"]["placements"] == ["Replicate", "Shard"] for f in found)
    assert all(f["nearest"]["placements"] == ["Shard"] for f in found)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_weights_and_state_are_the_single_process_bits(found, name):
    _skip_unless_run(found, name)
    for f in found:
        assert all(f[name]["bits_equal"].values()), (f["rank"], f[name]["bits_equal"])
        assert f[name]["state_equal"], f["rank"]


def test_the_runs_differ_where_they_should(found):
    """Not a vacuous comparison: nearest freezes, SR moves what nearest freezes, settings differ."""
    f = found[0]
    assert f["nearest"]["frozen"][-1] > 0.2 and f["nearest"]["mode"] == "observe"
    assert f["predict"]["mode"] == "predict"
    weights = [f[name]["weights"]["body.3.weight"] for name in ("nearest", "stochastic", "stochastic_3bits_state")]
    assert weights[0] != weights[1] and weights[1] != weights[2]
    assert f["stochastic"]["frozen"][-1] < f["nearest"]["frozen"][-1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_watch_report_is_the_single_process_report_on_every_process(found, name):
    _skip_unless_run(found, name)
    for f in found:
        assert f[name]["report_differences"] == [], (f["rank"], f[name]["report_differences"])
        assert f[name]["summary_equal"] and f[name]["forecast_equal"], f["rank"]
    # the unused embedding rows (15..19, a whole piece on 4 processes) are seen on every process
    assert all("idle" in f[name]["diagnoses"] for f in found)


def test_a_dcp_checkpoint_resumes_to_the_same_bits(found):
    for f in found:
        for name in ("stochastic", "kahan"):
            assert f[name]["resumed_bits_equal"] and f[name]["resumed_state_equal"], (f["rank"], name)


def test_the_report_is_written_once(found):
    assert [r for f in found for r in f["saved_by"]] == [0]
    assert all(f["saved_report_equal"] for f in found)


def test_an_unsupported_placement_is_refused_by_name(found):
    for f in found:
        assert "Shard(1)" in f["shard1_error"] and "Shard(0) or Replicate()" in f["shard1_error"]


# ------------------------------------------------------------------------------------------------
# the command line: python -m lowprec_demo run ... --set parallel=fsdp under torchrun
# ------------------------------------------------------------------------------------------------
CLI_ARGS = ["run", "nanogpt", "--format", "bf16", "--scale", "quick", "--steps", "12", "--device", "cpu",
            "--no-progress", "--set", "n_layer=1", "--set", "n_head=2", "--set", "n_embd=32", "--set", "block_size=32",
            "--set", "batch_size=4", "--set", "eval_batches=1"]


def test_the_command_line_trains_sharded_like_one_process(tmp_path):
    """Each process takes half of every batch, as under DDP, so the run is the single-process run
    up to floating-point reassociation of the batch's gradient (bits are the worker's business)."""
    from lowprec_demo.book.cli import main
    env = dict(os.environ, OMP_NUM_THREADS="1", LOWPREC_OFFLINE="1", PYTHONPATH=str(REPO))
    data = REPO.parent / "shared" / "data"
    if (data / "tinyshakespeare.txt").is_file() and not env.get("LOWPREC_DATA_DIR"):
        env["LOWPREC_DATA_DIR"] = str(data)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "lowprec_demo",
           *CLI_ARGS, "--set", "parallel=fsdp", "--out", str(tmp_path / "fsdp.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1, proc.stdout       # rank 0 alone writes
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LOWPREC_OFFLINE", "1")
        if "LOWPREC_DATA_DIR" in env:
            patch.setenv("LOWPREC_DATA_DIR", env["LOWPREC_DATA_DIR"])
        assert main([*CLI_ARGS, "--out", str(tmp_path / "single.json")]) == 0
    sharded, single = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("fsdp", "single"))
    assert sharded["provenance"]["distributed"] == {"world_size": 2, "backend": "gloo", "parallel": "fsdp"}
    assert sharded["config"]["parallel"] == "fsdp" and single["config"]["parallel"] == "ddp"
    for variant in ("reference", "nearest", "stochastic"):
        a, b = single["runs"][variant]["loss"], sharded["runs"][variant]["loss"]
        assert len(a) == len(b) == 12 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, variant
    for variant in ("nearest", "stochastic"):
        a, b = single["runs"][variant]["frozen_observed"], sharded["runs"][variant]["frozen_observed"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 0.01, variant
    assert single["runs"]["nearest"]["frozen_observed"][-1] > 0.1     # something froze to compare
    a, b = single["prediction"]["frozen_predicted"], sharded["prediction"]["frozen_predicted"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.01


def test_an_unknown_parallel_setting_is_refused_by_name():
    from lowprec_demo.book.config import TrainConfig
    with pytest.raises(ValueError, match="parallel must be one of ddp, fsdp"):
        TrainConfig(parallel="tp")


if __name__ == "__main__":
    _worker(sys.argv[1])
