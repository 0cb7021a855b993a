"""The GPU tools, rehearsed on the CPU at small sizes: ``tools/gpu_bench.py`` (the bit check and
the benchmark) and ``tools/gpu_check.sh`` (its dry run). A change of the package that breaks
them fails here, not on the day a GPU is lent."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from repo_tools import load_tool

ROOT = Path(__file__).resolve().parents[1]


def _gpu_bench():
    return load_tool("gpu_bench")


def test_gpu_bench_runs_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_bench.json"
    rc = _gpu_bench().main(["--device", "cpu", "--mode", "off", "--random", "2000", "--stride", "65537",
                            "--size", "4096", "--models", "nanogpt-quick", "--scale-sizes", "", "--no-eager",
                            "--out", str(out)])
    result = json.loads(out.read_text())
    check = result["stages"]["check"]
    assert "error" not in check, check.get("error")
    assert "error" not in result["stages"]["bench"], result["stages"]["bench"].get("error")
    assert rc == 0 and result["ok"]
    assert check["total_differences"] == 0 and check["point_sets"] == "bit patterns, stride 65537"
    assert {"bf16", "fp16", "e4m3", "e5m2", "e5m3", "e2m1"} <= set(check)
    assert all(check[k]["step_code"] == 0 for k in ("bf16", "e4m3"))
    assert result["stages"]["bench"]["training"]


def test_gpu_bench_reports_a_broken_stage(tmp_path, monkeypatch):
    """A stage that raises is recorded and makes the exit status 1 (it once raised TypeError
    after a signature change, was recorded, and the run still 'passed')."""
    module = _gpu_bench()
    monkeypatch.setattr(module, "check_bits", lambda *a, **k: (_ for _ in ()).throw(TypeError("changed signature")))
    out = tmp_path / "gpu_bench.json"
    rc = module.main(["--device", "cpu", "--mode", "off", "--budget", "0", "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 1 and not result["ok"] and "TypeError" in result["stages"]["check"]["error"]


def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """``tools/gpu_check.sh`` with ``DRY=1 DEVICE=cpu``: the same Python as on the GPU, at the
    quick sizes, in a budget of 10 s per experiment; both stages end "ok" and write their files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOWPREC_")}
    env.update(DRY="1", DEVICE="cpu", BUDGET_S="10", OMP_NUM_THREADS="1", OUT=str(tmp_path),
               PATH=os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", ""))
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu_check_summary.json").read_text())
    assert summary["nanogpt"]["status"] == "ok" and summary["gpt2"]["status"] == "ok", summary
    assert summary["nanogpt"]["dry_run"] and summary["nanogpt"]["device"] == "cpu"
    for name in ("nanogpt_bf16_full", "nanogpt_e8m4_full", "gpt2_e4m3_full"):
        assert (tmp_path / f"{name}.json").is_file(), name
