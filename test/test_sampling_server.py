"""Rejection sampling inside the real SGLang server on CPU."""

from __future__ import annotations

from collections import Counter

import pytest
from scipy.stats import chi2

from benchmark.server_process import SGLANG_LAUNCH
from sglang_magicdec.model import SMOLLM2, embedded_model_path
from test.helpers import POOL_ARGS, pg19_texts

pytestmark = pytest.mark.server  # starts real SGLang servers

SAMPLES = 2000
CHUNK = 250  # requests per /generate call (a list of prompts)
MIN_P_VALUE = 1e-3
# One draft token a round: only output tokens 0 and 1 are tested, and token 1's law is the same
# at any γ (it is the first draft token, kept or replaced); more would cost drafts and verify rows
# no assertion reads (each of the 32 batches of 250 requests ran ~2x longer at γ = 3).
SAMPLER_GAMMA = 1


@pytest.fixture(scope="module")
def sampler(server_factory):
    """A draft far from the target (32 of ~150 tokens), so drafts are really rejected. Started
    by SGLang's own launcher, to which our plugin adds the MagicDec flags."""
    return server_factory(
        "--model-path",
        embedded_model_path(SMOLLM2),
        *POOL_ARGS,
        "--speculative-algorithm",
        "MAGICDEC",
        "--speculative-num-steps",
        str(SAMPLER_GAMMA),
        "--magicdec-draft",
        "streaming",
        "--magicdec-budget",
        "32",
        "--magicdec-sinks",
        "4",
        "--magicdec-min-context",
        "0",
        launch=SGLANG_LAUNCH,
    )


def test_sglang_launcher_carries_magicdec_flags(sampler):
    """`python -m sglang.launch_server` parses our flags and hands them to the worker with the
    server arguments: the worker reports the values given, not the defaults (512, 16 and 3)."""
    info = sampler.server_info()["internal_states"][0]["magicdec"]
    given = ("streaming", 32, 4, SAMPLER_GAMMA)
    assert (info["draft"], info["budget"], info["sinks"], info["gamma"]) == given


@pytest.fixture(scope="module")
def prompt(tokenizer):
    return tokenizer(pg19_texts("4K", count=1)[0])["input_ids"][:150]


def sample_tokens(server, prompt, count, seeded: bool = False, **params) -> list[dict]:
    """`count` samples of 2 tokens; `seeded`: request i carries `sampling_seed` i."""
    sampling = {"max_new_tokens": 2, "ignore_eos": True, **params}
    results = []
    for start in range(0, count, CHUNK):
        per_request = [
            {**sampling, "sampling_seed": start + i} if seeded else sampling for i in range(CHUNK)
        ]
        payload = {"input_ids": [prompt] * CHUNK, "sampling_params": per_request}
        results += server.generate(payload)
    return results


def homogeneity_p_value(first: Counter, second: Counter, min_expected: float = 5.0) -> float:
    """Chi-square test that two samples come from one distribution (rare tokens pooled)."""
    total_first, total_second = sum(first.values()), sum(second.values())
    combined = first + second
    scale = (total_first + total_second) / min(total_first, total_second)
    common = [t for t, n in combined.items() if n >= min_expected * scale]
    cells = [(first[t], second[t]) for t in common]
    cells.append((total_first - sum(a for a, _ in cells), total_second - sum(b for _, b in cells)))
    statistic = 0.0
    for a, b in cells:
        row = a + b
        for observed, total in ((a, total_first), (b, total_second)):
            expected = row * total / (total_first + total_second)
            statistic += (observed - expected) ** 2 / expected if expected else 0.0
    return float(chi2.sf(statistic, df=len(cells) - 1))


@pytest.fixture(scope="module")
def reference_samples(plain, prompt):
    """The server without speculation's samples, drawn once per sampling parameters: the
    seeded and the unseeded case at T 0.7 compare with the same ones."""
    drawn: dict[tuple, list[dict]] = {}

    def samples(**params) -> list[dict]:
        key = tuple(sorted(params.items()))
        if key not in drawn:
            drawn[key] = sample_tokens(plain, prompt, SAMPLES, **params)
        return drawn[key]

    return samples


# Qwen's published filters, with penalties strong enough to move the law of token 1 (token 0
# is counted against it).
PENALISED = {"top_k": 20, "top_p": 0.8, "repetition_penalty": 1.3, "frequency_penalty": 0.5}


@pytest.mark.parametrize(
    "temperature,params,seeded",
    [
        (0.7, {}, False),
        (1.0, {"top_p": 0.9}, False),
        (0.7, {}, True),
        (0.5, PENALISED, False),
    ],
)
def test_first_speculated_token_follows_the_target(
    sampler, reference_samples, prompt, temperature, params, seeded
):
    """Output token 0 comes from prefill; token 1 is the first speculation verified. Their
    distributions over 2,000 samples must match the server without speculation: by rejection
    sampling (penalised as the plain sampler penalises, where penalties are set), or (`seeded`,
    one seed per request) by the seeded race, which also picks token 0."""
    params = {"temperature": temperature, **params}
    spec = sample_tokens(sampler, prompt, SAMPLES, seeded=seeded, **params)
    reference = reference_samples(**params)
    assert sum(r["meta_info"]["spec_verify_ct"] for r in spec) >= SAMPLES
    drafted = SAMPLER_GAMMA * sum(r["meta_info"]["spec_verify_ct"] for r in spec)
    correct = sum(r["meta_info"]["spec_num_correct_drafts"] for r in spec)
    assert 0 < correct < drafted, "drafts should be both kept and rejected"
    for position in (0, 1):
        got = Counter(r["output_ids"][position] for r in spec)
        expected = Counter(r["output_ids"][position] for r in reference)
        p_value = homogeneity_p_value(got, expected)
        print(f"{params} token {position}: p = {p_value:.3g}")
        assert p_value > MIN_P_VALUE, (position, got.most_common(5), expected.most_common(5))


def test_sampling_seed_fixes_the_output(sampler, prompt):
    """A `sampling_seed` fixes the whole output, the prefill's first token included: the request
    alone and in a batch beside unseeded requests (other rounds, other batch sizes) give the
    same tokens; another seed gives others."""
    params = {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True}
    seeded = {**params, "sampling_seed": 1234}
    alone = sampler.generate({"input_ids": prompt, "sampling_params": seeded})["output_ids"]
    batch = sampler.generate(
        {
            "input_ids": [prompt] * 4,
            "sampling_params": [params, seeded, params, {**params, "sampling_seed": 4321}],
        }
    )
    assert batch[1]["output_ids"] == alone
    assert batch[3]["output_ids"] != alone
