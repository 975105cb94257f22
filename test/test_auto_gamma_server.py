"""γ = auto (and budget = auto) inside the real SGLang server on CPU."""

from __future__ import annotations

import sys

import pytest

from sglang_magicdec.config import AUTO_BUDGETS
from sglang_magicdec.cost_model import CostModel, bucket_key
from test.helpers import (
    POOL_ARGS,
    REPO,
    SNAPKV,
    assert_same_or_tie,
    pg19_texts,
    run_concurrently,
)

sys.path.insert(0, str(REPO / "python"))
import shared_doc_qa  # noqa: E402  (the frontend programs live in python/, not a package)

pytestmark = pytest.mark.server  # starts real SGLang servers

BATCH = 8
PROMPT_LEN = 4000
OUTPUT_LEN = 96
AUTO_PLAN = ("--magicdec-gamma", "auto", "--magicdec-budget", "auto")


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


def test_auto_budget_drafts_at_every_budget_and_stays_exact(server_factory, plain, tokenizer):
    """γ and budget = auto, every draft selection checked against live KV (debug): 4 questions
    over one 3K-token document (one summary, selected at 4,096 positions, reused at every
    smaller budget) and 2 prompts of their own, decoded together. The calibration drafts at
    each budget below the context (256 to 2,048 here), /server_info prices each, and the greedy
    answers are the plain server's."""
    auto = server_factory(*POOL_ARGS, *SNAPKV, *AUTO_PLAN, "--magicdec-debug")
    texts = pg19_texts("4K", count=12)
    document = tokenizer(texts[10])["input_ids"][:3000]
    prompts = [
        document + tokenizer(f"\n\nQuestion {i}: {question}\nAnswer:")["input_ids"]
        for i, question in enumerate(shared_doc_qa.QUESTIONS[:4])
    ] + [tokenizer(text)["input_ids"][:2500] for text in texts[:2]]
    got = run_concurrently(auto, prompts, 32, ignore_eos=True)
    info = auto.server_info()["internal_states"][0]["magicdec"]
    print(f"budget = auto: {info}")
    assert info["budget"] == "auto" and info["current_budget"] in AUTO_BUDGETS
    priced = set()
    for bucket in info["gamma_by_bucket"].values():
        priced |= {int(budget) for budget in bucket.get("draft_ms_by_budget", {})}
    assert priced == {256, 512, 1024, 2048}, info["gamma_by_bucket"]
    assert info["summaries_computed"] == 3 and info["summaries_reused"] == 3
    expected = run_concurrently(plain, prompts, 32, ignore_eos=True)
    for index, (prompt, a, b) in enumerate(zip(prompts, got, expected, strict=True)):
        assert_same_or_tie(plain, prompt, a["output_ids"], b["output_ids"], f"prompt {index}")
