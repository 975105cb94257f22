"""The GPU code path, whole server, on this CPU: SGLang's `triton` attention backend wrapped by
MagicDec's draft backend (`sglang_magicdec/gpu_attention.py`), its kernels and ours run by
Triton's CPU interpreter (TRITON_INTERPRET=1, set for the servers only).

What this leaves out of a GPU run: CUDA streams and graphs (MAGICDEC turns graphs off on CUDA),
FlashInfer and fa3 (CUDA-only libraries), and the GPU's own numerics.
"""

from __future__ import annotations

import pytest
import requests

from test.helpers import assert_same_or_tie, pg19_prompts, run_concurrently

pytestmark = pytest.mark.server  # starts real SGLang servers

INTERPRETER = {"TRITON_INTERPRET": "1"}
BUDGET = 64  # the draft reads 64 prompt tokens; prompts are 2-5x longer
PROMPT_LENS = (130, 210, 320)  # ragged
NEW_TOKENS = 20
GAMMA = 3


@pytest.fixture(scope="module")
def tiny_args(tiny_llama) -> tuple[str, ...]:
    return (
        "--model-path",
        str(tiny_llama),
        "--attention-backend",
        "triton",
        "--dtype",
        "float32",
        "--max-total-tokens",
        "4096",
    )


def magicdec_args(*extra: str) -> tuple[str, ...]:
    return (
        "--speculative-algorithm",
        "MAGICDEC",
        "--speculative-num-steps",
        str(GAMMA),
        "--magicdec-budget",
        str(BUDGET),
        *extra,
    )


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return pg19_prompts(tokenizer, PROMPT_LENS)


@pytest.fixture(scope="module")
def reference(server_factory, tiny_args, prompts):
    """The same tiny model on the plain triton backend, without speculation."""
    plain = server_factory(*tiny_args, env=INTERPRETER)
    return plain, [r["output_ids"] for r in run_concurrently(plain, prompts, NEW_TOKENS)]


def magicdec_info(server) -> dict:
    state = requests.get(f"{server.url}/server_info", timeout=30).json()
    return state["internal_states"][0]["magicdec"]


@pytest.mark.parametrize(
    "label,extra",
    [
        ("streaming", ("--magicdec-draft", "streaming", "--magicdec-debug")),
        (
            "snapkv, γ = auto",
            ("--magicdec-draft", "snapkv", "--magicdec-gamma", "auto", "--magicdec-debug"),
        ),
    ],
)
def test_greedy_identical_to_plain_triton(
    server_factory, tiny_args, prompts, reference, label, extra
):
    plain, expected = reference
    server = server_factory(*tiny_args, *magicdec_args(*extra), env=INTERPRETER)
    try:
        log = server.log_path.read_text()
        assert "MagicDec draft steps wrap the triton attention backend" in log
        results = run_concurrently(server, prompts, NEW_TOKENS)
        for prompt, result, want in zip(prompts, results, expected, strict=True):
            assert_same_or_tie(plain, prompt, result["output_ids"], want, f"{label}, {len(prompt)}")
        info = magicdec_info(server)
        assert info["verify_rounds"] > 0, info  # the drafts ran (through the wrapper's sparse path)
        if "snapkv" in label:
            summaries = [r["meta_info"]["magicdec_summary"][0]["status"] for r in results]
            assert "none" not in summaries, summaries  # each request drafted from its own summary
    finally:
        server.stop(wait=False)  # each server is ~2.5 GB under the interpreter: one at a time
