"""MAGICDEC inside the real SGLang server on CPU, against the same server without speculation.

Both servers run float32 on the embedded model. The MAGICDEC one runs in debug mode, which checks
every draft selection against the request's live KV slots.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from benchmark.common import stream_chunks
from sglang_magicdec.model import SMOLLM2, embedded_model_path
from test.helpers import (
    GAMMA,
    assert_same_or_tie,
    flush_when_idle,
    greedy,
    measured_alpha,
    pg19_texts,
    run_concurrently,
)

pytestmark = pytest.mark.server  # starts real SGLang servers

# The reference per-token acceptance of StreamingLLM at budget 512 (README, Tests).
REFERENCE_ALPHA_STREAMING_512 = 0.84


@pytest.fixture(scope="module")
def spec(streaming):
    return streaming


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    return [tokenizer(text)["input_ids"][:2048] for text in pg19_texts("4K", count=10)]


def test_greedy_identical_to_autoregressive_in_one_ragged_batch(spec, plain, long_prompts):
    spec_results = run_concurrently(spec, long_prompts, 64, ignore_eos=True)
    plain_results = run_concurrently(plain, long_prompts, 64, ignore_eos=True)
    for index, (prompt, got, expected) in enumerate(
        zip(long_prompts, spec_results, plain_results, strict=True)
    ):
        assert_same_or_tie(
            plain, prompt, got["output_ids"], expected["output_ids"], f"prompt {index}"
        )
    accept_lengths = {round(r["meta_info"]["spec_accept_length"], 3) for r in spec_results}
    assert len(accept_lengths) > 1, "acceptance lengths should differ inside the batch"
    assert all(r["meta_info"]["spec_verify_ct"] > 0 for r in spec_results)


# SmolLM2's " the" is token 260, "," token 28.
LOGIT_BIAS = {"260": -100.0, "28": 2.0}
PENALTIES = [
    {},
    {"repetition_penalty": 1.1},
    {"frequency_penalty": 0.3},
    {"presence_penalty": 0.5},
    {"repetition_penalty": 1.3, "frequency_penalty": 0.2, "presence_penalty": 0.2},
    {"logit_bias": LOGIT_BIAS},
    {"repetition_penalty": 1.3, "logit_bias": {"28": -3.0}},  # the bias after the penalty
]


def test_penalties_speculate_and_commit_the_plain_servers_tokens(spec, plain, long_prompts):
    """Greedy requests with penalties and logit bias, in one batch beside one without: every
    output is the plain server's token for token (each chain position penalised for the output
    and the drafts before it, then biased), the penalties and the bias change the output, and
    the requests still speculate."""
    prompts = long_prompts[: len(PENALTIES)]

    def run(server) -> list[dict]:
        with ThreadPoolExecutor(len(prompts)) as pool:
            calls = [
                pool.submit(greedy, server, prompt, 48, ignore_eos=True, **penalty)
                for prompt, penalty in zip(prompts, PENALTIES, strict=True)
            ]
        return [call.result() for call in calls]

    spec_results, plain_results = run(spec), run(plain)
    unpenalised = greedy(plain, prompts[1], 48, ignore_eos=True)["output_ids"]
    unbiased = greedy(plain, prompts[5], 48, ignore_eos=True)["output_ids"]
    for penalty, got, expected in zip(PENALTIES, spec_results, plain_results, strict=True):
        assert got["output_ids"] == expected["output_ids"], f"{penalty}"
        assert got["meta_info"]["spec_verify_ct"] > 0, f"{penalty}: no speculative round"
        assert got["meta_info"]["spec_accept_length"] > 1.0, f"{penalty}"
    assert plain_results[1]["output_ids"] != unpenalised, "repetition_penalty changed nothing"
    assert plain_results[5]["output_ids"] != unbiased, "logit_bias changed nothing"
    assert 260 not in plain_results[5]["output_ids"]


def test_streaming_acceptance_matches_reference(streaming_pg19_run):
    """PG-19 4K, first 6 documents cut to 16,000 characters, 64 tokens, budget 512."""
    alpha = measured_alpha(streaming_pg19_run)
    print(f"streaming, budget 512: α = {alpha:.3f}")
    assert abs(alpha - REFERENCE_ALPHA_STREAMING_512) <= 0.03, f"α = {alpha:.3f}"


@pytest.mark.parametrize("max_new_tokens", [5, 6, 7, 33])
def test_max_new_tokens_inside_an_accepted_run(spec, plain, long_prompts, max_new_tokens):
    prompt = long_prompts[0]
    got = greedy(spec, prompt, max_new_tokens, ignore_eos=True)
    expected = greedy(plain, prompt, max_new_tokens, ignore_eos=True)
    assert got["meta_info"]["completion_tokens"] == max_new_tokens
    assert got["output_ids"] == expected["output_ids"]


def test_eos_inside_an_accepted_run_with_prompt_shorter_than_budget(spec, plain, tokenizer):
    prompt = tokenizer("The capital of France is")["input_ids"]
    got = greedy(spec, prompt, 64)
    expected = greedy(plain, prompt, 64)
    assert expected["meta_info"]["finish_reason"]["type"] == "stop", "needs an EOS within 64 tokens"
    assert got["output_ids"] == expected["output_ids"]
    assert got["meta_info"]["finish_reason"] == expected["meta_info"]["finish_reason"]
    # The EOS must fall inside a round, not only at its end, for this test to mean anything.
    assert (len(expected["output_ids"]) - 1) % (GAMMA + 1) != 0


def test_stop_string_inside_an_accepted_run(spec, plain, long_prompts, tokenizer):
    prompt = long_prompts[1]
    reference = greedy(plain, prompt, 48, ignore_eos=True)
    words = tokenizer.decode(reference["output_ids"]).split()
    stop = next(word for word in words[3:] if len(word) > 3)
    got = greedy(spec, prompt, 48, ignore_eos=True, stop=[stop])
    expected = greedy(plain, prompt, 48, ignore_eos=True, stop=[stop])
    assert got["text"] == expected["text"]
    assert got["meta_info"]["finish_reason"]["type"] == "stop"
    # The stop must cut a round's accepted run, not end one, for this test to mean anything:
    # the rounds produced (first token from prefill, then each round's accepted drafts and its
    # bonus token) more than the request kept.
    meta = got["meta_info"]
    produced = 1 + meta["spec_verify_ct"] + meta["spec_num_correct_drafts"]
    assert produced > meta["completion_tokens"], meta


def test_batch_mixing_short_and_long_prompts(spec, plain, long_prompts, tokenizer):
    short = [tokenizer(text)["input_ids"] for text in ["Hello, my name is", "Water boils at"]]
    prompts = [short[0], long_prompts[2], short[1], long_prompts[3][:700]]
    got = run_concurrently(spec, prompts, 40, ignore_eos=True)
    expected = run_concurrently(plain, prompts, 40, ignore_eos=True)
    for index, (prompt, a, b) in enumerate(zip(prompts, got, expected, strict=True)):
        assert_same_or_tie(plain, prompt, a["output_ids"], b["output_ids"], f"prompt {index}")


def test_long_generation_rolls_the_window(spec, plain, long_prompts):
    prompt = long_prompts[4][:1024]
    got = greedy(spec, prompt, 512, ignore_eos=True)
    expected = greedy(plain, prompt, 512, ignore_eos=True)
    assert got["meta_info"]["completion_tokens"] == 512
    assert_same_or_tie(plain, prompt, got["output_ids"], expected["output_ids"], "512 tokens")


def test_abort_mid_round_frees_everything(spec, long_prompts):
    """Aborted once it has streamed 8 tokens (so mid-decode, speculating): it ends as aborted,
    the server keeps serving, and once the cache is flushed no KV slot is left allocated."""
    params = {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": long_prompts[5], "sampling_params": params, "rid": "to-abort",
               "stream": True}  # fmt: skip
    last, aborted = None, False
    with requests.post(f"{spec.url}/generate", json=payload, stream=True, timeout=300) as stream:
        for _, last in stream_chunks(stream):
            if not aborted and last["meta_info"]["completion_tokens"] >= 8:
                requests.post(f"{spec.url}/abort_request", json={"rid": "to-abort"}, timeout=30)
                aborted = True
    meta = last["meta_info"]
    assert aborted and meta["finish_reason"]["type"] == "abort", meta
    assert 8 <= meta["completion_tokens"] < 4000
    assert meta["spec_verify_ct"] > 0  # it was speculating when aborted
    assert (
        greedy(spec, long_prompts[0][:100], 8, ignore_eos=True)["meta_info"]["completion_tokens"]
        == 8
    )
    load = flush_when_idle(spec)
    assert load["num_used_tokens"] == 0, load


def test_kv_pool_back_to_idle(spec, long_prompts):
    run_concurrently(spec, [long_prompts[6], long_prompts[7][:300]], 50, ignore_eos=True)
    load = flush_when_idle(spec)
    assert load["num_used_tokens"] == 0, load


def test_server_info_reports_acceptance(spec, long_prompts):
    greedy(spec, long_prompts[8], 16, ignore_eos=True)
    state = requests.get(f"{spec.url}/server_info", timeout=30).json()["internal_states"][0]
    info = state["magicdec"]
    assert info["draft"] == "streaming" and info["gamma"] == GAMMA and info["budget"] == 512
    assert info["verify_rounds"] > 0
    assert 1.0 <= info["avg_accept_length"] <= GAMMA + 1
    assert state["avg_spec_accept_length"] == pytest.approx(info["avg_accept_length"])


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_match_autoregressive(spec, plain, long_prompts, temperature):
    """Greedy and sampled requests with logprobs speculate and report, from the verify, the
    target's logprobs of the committed tokens: each the plain server's logprob of the same token
    after the same context (under the temperature where the request samples)."""
    prompt = long_prompts[9][:600]
    params = {"max_new_tokens": 12, "temperature": temperature, "ignore_eos": True}
    payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True}
    got = spec.generate(payload)
    logprobs = got["meta_info"]["output_token_logprobs"]
    assert len(logprobs) == 12
    meta = got["meta_info"]
    assert meta["spec_num_correct_drafts"] > 0, meta
    assert [token for _, token, _ in logprobs] == got["output_ids"]
    if temperature == 0.0:
        assert got["output_ids"] == plain.generate(payload)["output_ids"]
    # Teacher-forced on the plain server: the whole next-token distribution after every prefix
    # (the first entry of SGLang's input logprobs is the last prompt token's, without a value).
    config = Path(embedded_model_path(SMOLLM2)) / "config.json"
    vocab = json.loads(config.read_text())["vocab_size"]
    forced = plain.generate(
        {
            "input_ids": prompt + got["output_ids"],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": len(prompt) - 1,
            "top_logprobs_num": vocab,
        }
    )["meta_info"]["input_top_logprobs"][1:]
    for (ours, token, _), distribution in zip(logprobs, forced, strict=True):
        # SGLang reports a sampled token's logprob under its temperature: log_softmax(logits / T).
        raw = torch.tensor([value for value, _, _ in distribution], dtype=torch.float64)
        ids = [token_id for _, token_id, _ in distribution]
        scaled = torch.log_softmax(raw / (temperature or 1.0), dim=0)  # greedy: T = 1
        assert ours == pytest.approx(float(scaled[ids.index(token)]), abs=1e-3)
