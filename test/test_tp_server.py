"""SGLang's tensor parallelism on our CPU platform (gloo between the ranks)."""

from __future__ import annotations

import pytest

from test.helpers import greedy, tiny_llama

pytestmark = pytest.mark.server  # starts real SGLang servers


def test_tp_2_needs_no_extra_environment(server_factory, tmp_path_factory, monkeypatch):
    """SGLang's CPU ranks refuse to start unless SGLANG_CPU_OMP_THREADS_BIND names their cores
    (one rank per NUMA node otherwise); the platform sets it. A tiny Llama whose 2 KV heads
    split over 2 ranks, MAGICDEC on."""
    monkeypatch.delenv("SGLANG_CPU_OMP_THREADS_BIND", raising=False)
    model = tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    server = server_factory(
        "--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "4096",
        "--tp", "2", "--speculative-algorithm", "MAGICDEC", "--magicdec-budget", "64",
    )  # fmt: skip
    result = greedy(server, list(range(100, 400)), 8, ignore_eos=True)
    assert result["meta_info"]["completion_tokens"] == 8
