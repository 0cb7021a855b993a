"""Data-parallel training under torchrun: 2 CPU processes with the gloo backend.

Each process trains a replica on half of every batch and gradients are averaged, so the run is the
single-process run up to floating-point reassociation; stochastic rounding draws the same bits on
both processes (one seed), so the replicas stay bit-identical (checked by the training loop and
recorded in ``provenance["distributed"]``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec_demo.book.cli import main

REPO = Path(__file__).resolve().parents[1]
_candidates = [os.environ.get("LOWPREC_DATA_DIR", ""), REPO.parent / "shared" / "data"]
SHARED_DATA = next((str(c) for c in _candidates if c and (Path(c) / "tinyshakespeare.txt").is_file()), "")

ARGS = ["run", "nanogpt", "--format", "bf16", "--scale", "quick", "--steps", "20", "--device", "cpu",
        "--no-progress", "--set", "n_layer=1", "--set", "n_head=2", "--set", "n_embd=32", "--set", "block_size=32",
        "--set", "batch_size=4", "--set", "eval_batches=1"]


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", LOWPREC_OFFLINE="1", PYTHONPATH=str(REPO))
    if SHARED_DATA:
        env["LOWPREC_DATA_DIR"] = SHARED_DATA
    return env


def _torchrun(entry: list, out: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *entry, *ARGS,
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # only rank 0 prints the summary and writes the file
    assert proc.stdout.count("wrote ") == 1, proc.stdout
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("single") / "single.json"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LOWPREC_OFFLINE", "1")
        if SHARED_DATA:
            env.setenv("LOWPREC_DATA_DIR", SHARED_DATA)
        assert main([*ARGS, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _assert_matches(dist: dict, single: dict) -> None:
    info = dist["provenance"]["distributed"]
    assert info["world_size"] == 2 and info["backend"] == "gloo"
    assert info["replicas_identical"] == {"reference": True, "nearest": True, "stochastic": True}
    assert "distributed" not in single["provenance"]
    for variant in ("reference", "nearest", "stochastic"):
        a, b = single["runs"][variant]["loss"], dist["runs"][variant]["loss"]
        assert len(a) == len(b) == 20
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4, variant
    for variant in ("nearest", "stochastic"):
        a, b = single["runs"][variant]["frozen_observed"], dist["runs"][variant]["frozen_observed"]
        assert max(abs(x - y) for x, y in zip(a, b)) < 0.01, variant
    a, b = single["prediction"]["frozen_predicted"], dist["prediction"]["frozen_predicted"]
    assert max(abs(x - y) for x, y in zip(a, b)) < 0.01


def test_torchrun_module_matches_single_process(tmp_path, single):
    _assert_matches(_torchrun(["-m", "lowprec_demo"], tmp_path / "ddp.json"), single)


def test_torchrun_cli_file_matches_single_process(tmp_path, single):
    _assert_matches(_torchrun([str(REPO / "lowprec_demo" / "book" / "cli.py")], tmp_path / "ddp.json"), single)
