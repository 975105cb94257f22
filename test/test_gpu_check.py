"""The prepared GPU check, in its CPU smoke mode: it must run end to end before it meets a GPU.

`benchmark/gpu_check.py --device cpu --tiny` takes the same path as the real run (model, pool,
the three step kinds, ratios, report) with toy shapes and the torch references.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmark" / "gpu_check.py"
TINY_SHAPES = ("llama8b-tiny", "smollm2-tiny")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out_dir = tmp_path_factory.mktemp("gpu-check")
    # A run that must not depend on the caller's OUT, nor see a GPU it would try to use.
    env = {**os.environ, "OUT": str(out_dir), "CUDA_VISIBLE_DEVICES": ""}
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--tiny"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return completed, out_dir


def test_tiny_run_exits_cleanly(tiny_run):
    completed, _ = tiny_run
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]


def test_json_times_all_step_kinds_for_each_tiny_shape(tiny_run):
    _, out_dir = tiny_run
    results = json.loads((out_dir / "gpu_check.json").read_text())
    assert set(results["shapes"]) == set(TINY_SHAPES)
    for name, shape in results["shapes"].items():
        timings = shape["timings"]
        for kind in ("decode", "draft"):
            assert timings[kind]["ms"] > 0, (name, kind)
        assert set(timings["verify"]) == {str(g) for g in range(1, 7)}, name
        assert all(t["ms"] > 0 for t in timings["verify"].values()), name


def test_predicted_speedups_follow_the_cost_model_from_the_timings(tiny_run):
    """Each prediction is Ω(γ, α)·T_decode / (γ·T_draft + T_verify(γ)) of the timings the run
    recorded, and the reported best γ is the best of those."""
    _, out_dir = tiny_run
    results = json.loads((out_dir / "gpu_check.json").read_text())
    for name, shape in results["shapes"].items():
        timings = shape["timings"]
        t_decode, t_draft = timings["decode"]["ms"], timings["draft"]["ms"]
        assert set(shape["predicted_speedup"]) == {"0.8", "0.84", "0.9"}, name
        for alpha, prediction in shape["predicted_speedup"].items():
            expected = {
                gamma: (1 - float(alpha) ** (int(gamma) + 1))
                / (1 - float(alpha))
                * t_decode
                / (int(gamma) * t_draft + timings["verify"][gamma]["ms"])
                for gamma in timings["verify"]
            }
            assert prediction["per_gamma"] == pytest.approx(expected), (name, alpha)
            assert all(math.isfinite(x) and x > 0 for x in expected.values())
            best = max(expected, key=expected.__getitem__)
            assert prediction["best_gamma"] == int(best), (name, alpha)


def test_kernel_checks_are_skipped_with_a_reason_on_cpu(tiny_run):
    completed, out_dir = tiny_run
    results = json.loads((out_dir / "gpu_check.json").read_text())
    assert results["correctness"]
    assert all(c["status"] == "SKIP" and "CUDA" in c["detail"] for c in results["correctness"])
    assert "[SKIP] snapkv" in completed.stdout


def test_summary_table_is_printed_last(tiny_run):
    completed, out_dir = tiny_run
    report = (out_dir / "gpu_check.md").read_text()
    assert completed.stdout.endswith(report)
    last_lines = completed.stdout.strip().splitlines()[-4:]
    assert last_lines[0].startswith("| shape | batch×context")
    assert last_lines[1].startswith("|---")
    assert [line.split("|")[1].strip() for line in last_lines[2:]] == list(TINY_SHAPES)
