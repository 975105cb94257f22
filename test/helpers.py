"""Helpers the tests share: requests to real servers, greedy-exactness checks, α, PG-19 data.

Fixtures live in `conftest.py`; plain functions and constants live here, imported by name.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import pytest
import requests
import torch

from sglang_magicdec.cost_model import alpha_from_accept_length

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MAGICDEC_DATA", REPO.parent / "shared" / "data"))

GAMMA = 3
T = TypeVar("T")

# Tests of our CPU platform's defaults only hold on a machine without a GPU (there SGLang's CUDA
# platform is active and our plugin stays out of the way).
ON_CPU_MACHINE = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="checks our CPU platform's defaults; a CUDA machine runs SGLang's CUDA platform",
)
# float32 and a fixed pool, so MAGICDEC and plain servers compute the same thing.
POOL_ARGS = ("--dtype", "float32", "--max-total-tokens", "60000")
SNAPKV = ("--speculative-algorithm", "MAGICDEC", "--magicdec-draft", "snapkv")


def pg19_acceptance_prompts(tokenizer) -> list[list[int]]:
    """The README's acceptance setting: the first 6 PG-19 4K documents cut to 16,000
    characters (~3.7K tokens)."""
    return [tokenizer(text[:16000])["input_ids"] for text in pg19_texts("4K", count=6)]


def pg19_prompts(tokenizer, lengths: tuple[int, ...]) -> list[list[int]]:
    """The first PG-19 4K documents, one per length, tokenized and cut to it (ragged batches)."""
    texts = pg19_texts("4K", count=len(lengths))
    return [
        tokenizer(text)["input_ids"][:length] for text, length in zip(texts, lengths, strict=True)
    ]


def greedy(server, input_ids, max_new_tokens, **params) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, **params}
    return server.generate({"input_ids": input_ids, "sampling_params": sampling})


def run_concurrently(server, prompts, max_new_tokens, **params) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy(server, ids, max_new_tokens, **params), prompts))


def start_together(*starts: Callable[[], T]) -> list[T]:
    """Run server starts (zero-argument calls of a factory) at once. A start is mostly Python
    importing SGLang on one core, so two on this machine's two cores take ~1.5x one, not 2x."""
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    failed = [future.exception() for future in futures if future.exception() is not None]
    if failed:  # stop what did start (a server, or what holds one), then fail as the first did
        for future in futures:
            if future.exception() is None:
                result = future.result()
                (result[0] if isinstance(result, tuple) else result).stop()
        raise failed[0]
    return [future.result() for future in futures]


def flush_when_idle(server, timeout_s: float = 60) -> dict:
    """Flush the radix cache once no request runs (SGLang refuses a flush while requests run)
    and return the server's load then; `num_used_tokens` 0 means no KV is left allocated."""
    deadline = time.monotonic() + timeout_s
    while True:
        flushed = requests.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
        load = requests.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
        if (flushed and load["num_running_reqs"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(1)


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


def assert_same_or_tie(plain, prompt, got, expected, label, tie_gap: float = TIE_GAP):
    """Outputs must match; a divergence is allowed only at a numerical tie of the target."""
    diverge = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if diverge is None:
        assert len(got) == len(expected), f"{label}: lengths {len(got)} != {len(expected)}"
        return
    gap = top2_gap(plain, prompt + expected[:diverge])
    assert gap < tie_gap, (
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
