"""Shared fixtures: real SGLang servers on free loopback ports, and the PG-19 data."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from sglang_magicdec.cost_model import alpha_from_accept_length
from sglang_magicdec.server_process import ServerProcess, start_server

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MAGICDEC_DATA", REPO.parent / "shared" / "data"))

# No model hub at run time: a test that reaches for the network must fail, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _server_factory(tmp_path_factory) -> Iterator:
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def factory(*args: str) -> ServerProcess:
        server = start_server(list(args), log_dir)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory) -> Iterator:
    """Start servers for one module; all are stopped when the module ends."""
    yield from _server_factory(tmp_path_factory)


@pytest.fixture(scope="session")
def session_server_factory(tmp_path_factory) -> Iterator:
    """Servers several modules compare against; stopped when the session ends."""
    yield from _server_factory(tmp_path_factory)


GAMMA = 3
# float32 and a fixed pool, so MAGICDEC and plain servers compute the same thing.
POOL_ARGS = ("--dtype", "float32", "--max-total-tokens", "60000")


@pytest.fixture(scope="session")
def plain(session_server_factory) -> ServerProcess:
    """The same model without speculation: the reference outputs."""
    return session_server_factory(*POOL_ARGS)


@pytest.fixture(scope="session")
def streaming(session_server_factory) -> ServerProcess:
    """MAGICDEC with the StreamingLLM draft, checking every draft selection (debug)."""
    return session_server_factory(
        *POOL_ARGS,
        "--speculative-algorithm",
        "MAGICDEC",
        "--speculative-num-steps",
        str(GAMMA),
        "--magicdec-draft",
        "streaming",
        "--magicdec-debug",
    )


def pg19_acceptance_prompts(tokenizer) -> list[list[int]]:
    """DESIGN.md §4's acceptance setting: the first 6 PG-19 4K documents cut to 16,000
    characters (~3.7K tokens)."""
    return [tokenizer(text[:16000])["input_ids"] for text in pg19_texts("4K", count=6)]


@pytest.fixture(scope="session")
def streaming_pg19_run(streaming, tokenizer) -> list[dict]:
    """64 greedy tokens of each acceptance prompt on the streaming server, all at once."""
    return run_concurrently(streaming, pg19_acceptance_prompts(tokenizer), 64, ignore_eos=True)


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


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_magicdec.model import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path())
