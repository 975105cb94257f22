"""The prepared GPU check, run on CPU under Triton's interpreter: it must run end to end, and
check and time the kernels the server runs, before it meets a GPU.

`python -m benchmark.gpu_check --device cpu --tiny` takes the real run's path (kernel checks,
decoder steps with SGLang's Triton decode/verify and every draft kernel, cost-model predictions,
report) at toy sizes. A second run hides SGLang, as on the GPU machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmark.gpu_check.attention import FLASHINFER_PER_LAYER
from test.helpers import REPO

TINY_SHAPES = ("llama8b-tiny", "smollm2-tiny")
HIDE_SGLANG = (
    "import runpy, sys; sys.modules['sglang'] = None; "
    "runpy.run_module('benchmark.gpu_check', run_name='__main__')"
)


def _run(tmp_path_factory, name: str, argv: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    out_dir = tmp_path_factory.mktemp(name)
    env = {**os.environ, "OUT": str(out_dir), "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}
    completed = subprocess.run(
        [sys.executable, *argv, "--device", "cpu", "--tiny"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads((out_dir / "gpu_check.json").read_text())
    results["report"] = (out_dir / "gpu_check.md").read_text()
    return completed, results


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    return _run(tmp_path_factory, "gpu-check", ["-m", "benchmark.gpu_check"])


@pytest.fixture(scope="module")
def run_without_sglang(tmp_path_factory):
    argv = ["-c", HIDE_SGLANG, "--shapes", "smollm2", "--max-gamma", "1"]
    return _run(tmp_path_factory, "gpu-check-no-sglang", argv)


def test_every_kernel_runs_and_matches_the_oracle_flashinfer_skipped_with_reason(tiny_run):
    _, results = tiny_run
    by_status = {}
    for check in results["checks"]:
        by_status.setdefault(check["status"], []).append(check)
    assert set(by_status) == {"PASS", "SKIP"}
    passed = " ".join(check["name"] for check in by_status["PASS"])
    for kernel in (
        "decode [SGLang Triton decode_attention_fwd]",
        "verify(γ=3) [SGLang Triton extend_attention_fwd]",
        "draft [magicdec sparse_decode_triton]",
        "draft [SGLang decode_attention_fwd, flat rows]",
    ):
        assert kernel in passed
    assert all("FlashInfer" in c["name"] and c["detail"] for c in by_status["SKIP"])


def test_steps_are_timed_with_sglangs_kernels_and_each_draft_kernel(tiny_run):
    _, results = tiny_run
    assert [point["shape"] for point in results["points"]] == list(TINY_SHAPES)
    for point in results["points"]:
        assert point["decode_kernel"] == "SGLang Triton decode_attention_fwd"
        assert point["verify_kernel"] == "SGLang Triton extend_attention_fwd"
        assert point["decode"]["ms"] > 0
        assert set(point["verify"]) == {str(gamma) for gamma in range(1, 7)}
        assert all(timing["ms"] > 0 for timing in point["verify"].values())
        drafts = point["draft"]
        assert drafts["magicdec sparse_decode_triton"]["ms"] > 0
        assert drafts["SGLang decode_attention_fwd, flat rows"]["ms"] > 0
        assert drafts[FLASHINFER_PER_LAYER]["skipped"]


def test_predictions_follow_the_cost_model_from_the_recorded_times(tiny_run):
    """Ω(γ, α)·T_decode / (γ·T_draft + T_verify(γ)), with the fastest draft kernel's T_draft."""
    _, results = tiny_run
    for point in results["points"]:
        drafts = {name: t["ms"] for name, t in point["draft"].items() if "ms" in t}
        predicted = point["predicted"]
        assert predicted["draft_kernel"] == min(drafts, key=drafts.get)
        t_decode, t_draft = point["decode"]["ms"], min(drafts.values())
        for alpha, prediction in predicted["per_alpha"].items():
            a = float(alpha)
            expected = {
                gamma: (1 - a ** (int(gamma) + 1))
                / (1 - a)
                * t_decode
                / (int(gamma) * t_draft + verify["ms"])
                for gamma, verify in point["verify"].items()
            }
            assert prediction["per_gamma"] == pytest.approx(expected)
            assert prediction["best_gamma"] == int(max(expected, key=expected.get))


def test_summary_table_is_printed_last(tiny_run):
    completed, results = tiny_run
    assert completed.stdout.endswith(results["report"])
    last_lines = completed.stdout.strip().splitlines()[-4:]
    assert last_lines[0].startswith("| shape | batch×context | T_decode ms")
    assert [line.split("|")[1].strip() for line in last_lines[2:]] == list(TINY_SHAPES)


def test_without_sglang_dense_steps_use_the_sdpa_stand_in_and_say_why(run_without_sglang):
    """The GPU machine has no SGLang: the check still runs, checks its stand-in against the
    oracle, and names what it could not run."""
    _, results = run_without_sglang
    statuses = {check["name"].split(" [")[0]: check["status"] for check in results["checks"]}
    assert statuses["decode"] == statuses["verify(γ=3)"] == "PASS"
    skipped = [c for c in results["checks"] if c["status"] == "SKIP"]
    assert any("SGLang not importable" in c["detail"] for c in skipped)
    (point,) = results["points"]
    assert point["decode_kernel"].startswith("torch SDPA stand-in: SGLang not importable")
    assert point["verify_kernel"].startswith("torch SDPA stand-in")
    assert (
        "SGLang not importable"
        in point["draft"]["SGLang decode_attention_fwd, flat rows"]["skipped"]
    )
    assert point["draft"]["magicdec sparse_decode_triton"]["ms"] > 0
