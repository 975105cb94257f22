"""Helpers the tests share: requests to real servers, greedy-exactness checks, α, PG-19 data.

Fixtures live in `conftest.py`; plain functions and constants live here, imported by name.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_magicdec.cost_model import alpha_from_accept_length

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MAGICDEC_DATA", REPO.parent / "shared" / "data"))

GAMMA = 3
# float32 and a fixed pool, so MAGICDEC and plain servers compute the same thing.
POOL_ARGS = ("--dtype", "float32", "--max-total-tokens", "60000")


def pg19_acceptance_prompts(tokenizer) -> list[list[int]]:
    """The README's acceptance setting: the first 6 PG-19 4K documents cut to 16,000
    characters (~3.7K tokens)."""
    return [tokenizer(text[:16000])["input_ids"] for text in pg19_texts("4K", count=6)]


def greedy(server, input_ids, max_new_tokens, **params) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, **params}
    return server.generate({"input_ids": input_ids, "sampling_params": sampling})


def run_concurrently(server, prompts, max_new_tokens, **params) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy(server, ids, max_new_tokens, **params), prompts))


def top2_gap(server, context: list[int]) -> float:
    """Logit gap between the two most likely next tokens (logprob gap: same normaliser)."""
    result = server.generate(
        {
            "input_ids": context,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": len(context) - 1,
        }
    )
    (first, _, _), (second, _, _) = result["meta_info"]["output_top_logprobs"][0][:2]
    return first - second


TIE_GAP = 1e-4


def assert_same_or_tie(plain, prompt, got, expected, label):
    """Outputs must match; a divergence is allowed only at a numerical tie of the target."""
    diverge = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if diverge is None:
        assert len(got) == len(expected), f"{label}: lengths {len(got)} != {len(expected)}"
        return
    gap = top2_gap(plain, prompt + expected[:diverge])
    assert gap < TIE_GAP, (
        f"{label}: diverged at token {diverge} where the target's top-2 gap is {gap:.3g} "
        f"(not a tie): got {got[diverge]}, expected {expected[diverge]}"
    )


def measured_alpha(results: list[dict], gamma: int = GAMMA) -> float:
    """Per-token acceptance α from the verify rounds and accepted drafts SGLang reports."""
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    correct = sum(r["meta_info"]["spec_num_correct_drafts"] for r in results)
    return alpha_from_accept_length(1 + correct / rounds, gamma)


def pg19_texts(length: str = "4K", count: int = 20) -> list[str]:
    path = DATA_DIR / "pg19" / f"pg19_{length}.jsonl"
    if not path.is_file():
        pytest.skip(f"PG-19 data not found at {path} (set MAGICDEC_DATA to the shared/data folder)")
    with path.open() as handle:
        return [json.loads(line)["text"] for line in handle][:count]
