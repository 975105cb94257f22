"""γ = auto inside the real SGLang server on CPU."""

from __future__ import annotations

import pytest

from sglang_magicdec.cost_model import CostModel, bucket_key
from test.helpers import POOL_ARGS, pg19_texts, run_concurrently

pytestmark = pytest.mark.server  # starts real SGLang servers

BATCH = 8
PROMPT_LEN = 4000
OUTPUT_LEN = 96


def test_auto_gamma_speculates_at_long_context_and_batch_8(server_factory, tokenizer):
    auto = server_factory(
        *POOL_ARGS, "--speculative-algorithm", "MAGICDEC", "--magicdec-gamma", "auto"
    )
    state = auto.server_info()
    needed = BATCH * (PROMPT_LEN + OUTPUT_LEN)
    # A smaller pool admits fewer requests at once and the batch-8 point is never reached.
    assert state["max_total_num_tokens"] >= needed, (
        f"KV pool of {state['max_total_num_tokens']} tokens cannot hold {BATCH} x "
        f"{PROMPT_LEN + OUTPUT_LEN}: too little free memory at server start"
    )
    prompts = [tokenizer(text)["input_ids"][:PROMPT_LEN] for text in pg19_texts("8K", count=BATCH)]
    results = run_concurrently(auto, prompts, OUTPUT_LEN, ignore_eos=True)
    info = auto.server_info()["internal_states"][0]["magicdec"]
    print(f"auto at batch {BATCH}, 4K context: {info}")
    assert info["gamma_mode"] == "auto"
    assert all(r["meta_info"]["completion_tokens"] == OUTPUT_LEN for r in results)
    # Requests finish at different rounds, so the batch shrinks at the end: read the decision
    # for the full batch, not the last one.
    full_batch = info["gamma_by_bucket"][bucket_key(CostModel.bucket(BATCH, PROMPT_LEN))]
    # The cost model's own choice: calibration and exploration rounds also run γ >= 1.
    assert full_batch["model_gamma"] is not None and full_batch["model_gamma"] >= 1, info
