"""A seeded fuzz of the request surface against a MAGICDEC server (`snap`, SnapKV in debug mode,
shared with test_snapkv_server.py): no request takes it down.

Valid and invalid sampling parameters, stop strings and token ids, logprobs, n > 1, regex and
JSON-schema constraints, long (summarised) and short prompts, batches, the OpenAI endpoints,
malformed bodies, streams and streams dropped mid-way, a few concurrently. Each request with an
invalid parameter, prompt or body must be refused (a 4xx with a message, or a stream's error
event) and each valid one answered 200; after every refusal the server answers a plain request;
at the end the KV pool is idle and no SnapKV summary is held. The out-of-vocabulary prompt that
used to kill the scheduler is among them, and also checked on its own, with and without MAGICDEC.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from test.helpers import flush_when_idle, pg19_texts

pytestmark = pytest.mark.server  # starts real SGLang servers

SEED = 12
REQUESTS = 240
CONCURRENCY = 6
TIMEOUT = 120
VOCAB = 49152  # SmolLM2's


@pytest.fixture(scope="module")
def long_texts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"][:1200] for text in pg19_texts("4K", count=3)]


@pytest.mark.parametrize("server_name", ["plain", "snap"])
@pytest.mark.parametrize("endpoint", ["/generate", "/generate batch", "/v1/completions"])
def test_out_of_vocabulary_token_ids_answer_400(plain, snap, server_name, endpoint):
    """Without MAGICDEC (`plain`) and with it (`snap`)."""
    server = {"plain": plain, "snap": snap}[server_name]
    bad = [5, 6, 1_000_000_000]
    if endpoint == "/v1/completions":
        response = requests.post(
            f"{server.url}/v1/completions",
            json={"model": "default", "prompt": bad, "max_tokens": 2},
            timeout=TIMEOUT,
        )
    else:
        ids = [[5, 6, 7], bad] if endpoint.endswith("batch") else bad
        response = requests.post(
            f"{server.url}/generate",
            json={"input_ids": ids, "sampling_params": {"max_new_tokens": 2}},
            timeout=TIMEOUT,
        )
    assert response.status_code == 400, response.text
    assert "outside the vocabulary" in response.text
    assert _serves(server)


def test_zero_parallel_samples_in_a_batch_answer_400(plain):
    """A batch with n = 0 expanded to no requests and failed inside SGLang (500)."""
    response = requests.post(
        f"{plain.url}/generate",
        json={"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 2, "n": 0}},
        timeout=TIMEOUT,
    )
    assert response.status_code == 400, response.text
    assert "n must be an integer >= 1" in response.text
    assert _serves(plain)


def test_fuzzed_requests_never_take_the_server_down(snap, long_texts):
    rng = random.Random(SEED)
    cases = [_case(rng, long_texts) for _ in range(REQUESTS)]

    def send_then_check(case: dict) -> tuple[int, str, bool]:
        status, body = _send(snap.url, case)
        return status, body, status == 200 or _serves(snap)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = list(pool.map(send_then_check, cases))
    refused, unexpected = 0, []
    for case, (status, body, serves_after) in zip(cases, outcomes, strict=True):
        label = f"{case['label']}: {status} {body[:300]}"
        assert status == 200 or 400 <= status < 500, label
        was_refused = status != 200 or _refused_in_stream(body)
        if was_refused != case["refuse"]:
            unexpected.append(f"expected refusal {case['refuse']}: {label}")
        if was_refused:
            refused += 1
            assert body.strip(), label  # a message, not an empty refusal
            assert "Traceback" not in body, label
            assert serves_after, f"no plain answer after {label}"
    assert not unexpected, "\n".join(unexpected)
    assert 0 < refused < REQUESTS, refused  # the mix has both kinds
    print(f"{REQUESTS} requests, {refused} refused with a 4xx")
    _assert_idle(snap)


def _serves(server) -> bool:
    response = requests.post(
        f"{server.url}/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 2}},
        timeout=TIMEOUT,
    )
    return response.status_code == 200


def _assert_idle(server) -> None:
    load = flush_when_idle(server)
    assert load["num_used_tokens"] == 0, load
    state = requests.get(f"{server.url}/server_info", timeout=30).json()
    assert state["internal_states"][0]["magicdec"]["summaries_held"] == 0


# -- the request mix ------------------------------------------------------------------------------


def _refused_in_stream(body: str) -> bool:
    """A stream answers 200 before SGLang has checked the request: a refusal then comes as an
    error event, or as an aborted finish (a grammar that does not compile)."""
    for line in body.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        try:
            event = json.loads(line.removeprefix("data: "))
        except json.JSONDecodeError:
            continue
        if not isinstance(event, dict):
            continue
        finish = (event.get("meta_info") or {}).get("finish_reason") or {}
        if "error" in event or finish.get("type") == "abort":
            return True
    return False


def _sampling(rng: random.Random) -> tuple[dict, set[str]]:
    """Sampling parameters, and the names of those given an invalid value."""
    params: dict = {"max_new_tokens": rng.randint(1, 8)}
    invalid: set[str] = set()
    choices = {
        "temperature": ([0, 0.7, 1.3], [-1, "hot"]),
        "top_p": ([0.5, 1.0], [0, 2]),
        "top_k": ([1, 20, -1], [-5]),
        "min_p": ([0.0, 0.1], [1.5]),
        "max_new_tokens": ([1, 4, 8], [-1]),
        "n": ([1, 2], [0]),
        "frequency_penalty": ([0.5], [5.0]),
        "repetition_penalty": ([1.1], [-1.0]),
        # SGLang accepts an empty stop string (it matches at once) and a stop id outside the
        # vocabulary (it never matches): odd, but valid requests.
        "stop": ([["the"], ["\n", "."], [""]], []),
        "stop_token_ids": ([[13, 30], [VOCAB * 100]], []),
        "regex": (["[0-9]{1,3}"], ["(unclosed"]),
        "json_schema": ([json.dumps({"type": "object"})], ["{not json"]),
        "ignore_eos": ([True, None], []),  # null: the default
        "logit_bias": ([{"13": 1.0}], [{str(VOCAB * 10): 1.0}]),
    }
    for name in rng.sample(sorted(choices), rng.randint(0, 4)):
        good, bad = choices[name]
        if bad and rng.random() < 0.3:
            params[name] = rng.choice(bad)
            invalid.add(name)
        else:
            params[name] = rng.choice(good)
    if "regex" in params and "json_schema" in params:
        del params["json_schema"]  # one constraint at a time, or it is refused for that
        invalid.discard("json_schema")
    return params, invalid


def _prompt(rng: random.Random, long_texts) -> tuple[dict, str]:
    kind = rng.choice(["text", "short ids", "long ids", "long ids", "bad ids", "empty"])
    if kind == "text":
        return {"text": rng.choice(["Hello", "Once upon a time", "1, 2, 3,"])}, kind
    if kind == "short ids":
        return {"input_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]}, kind
    if kind == "long ids":
        text = rng.choice(long_texts)
        return {"input_ids": text[: rng.randint(600, len(text))]}, kind
    if kind == "bad ids":
        bad = rng.choice([VOCAB, 1_000_000_000, -1, 2**40])
        return {"input_ids": [5, bad, 6]}, kind
    return {"input_ids": []}, kind


def _case(rng: random.Random, long_texts) -> dict:
    shape = rng.choices(
        ["generate", "stream", "dropped stream", "batch", "completions", "chat", "malformed"],
        weights=[6, 2, 2, 1, 2, 1, 1],
    )[0]
    sampling, invalid = _sampling(rng)
    prompt, kind = _prompt(rng, long_texts)
    bad_prompt = kind in ("bad ids", "empty")
    # The OpenAI shapes carry only these two of the sampling parameters.
    openai_invalid = bool(invalid & {"max_new_tokens", "temperature"})
    label = f"{shape}/{kind}/{sorted(sampling)} invalid {sorted(invalid)}"
    if shape == "malformed":
        raw = rng.choice(["{", "[]", '{"text": 5}'])
        return {"label": label, "path": "/generate", "raw": raw, "refuse": True}
    if shape == "completions":
        body = {
            "model": "default",
            "prompt": prompt.get("input_ids", prompt.get("text")),
            "max_tokens": sampling.get("max_new_tokens", 4),
            "temperature": sampling.get("temperature", 0),
            "logprobs": rng.choice([None, 2]),
        }
        refuse = bad_prompt or openai_invalid
        return {"label": label, "path": "/v1/completions", "json": body, "refuse": refuse}
    if shape == "chat":
        role = rng.choice(["user", "user", "wizard"])
        body = {
            "model": "default",
            "messages": [{"role": role, "content": "Name a colour."}],
            "max_tokens": sampling.get("max_new_tokens", 4),
            "temperature": sampling.get("temperature", 0),
        }
        refuse = role == "wizard" or openai_invalid
        return {"label": label, "path": "/v1/chat/completions", "json": body, "refuse": refuse}
    body = {**prompt, "sampling_params": sampling}
    if rng.random() < 0.3:
        body.update(return_logprob=True, top_logprobs_num=rng.choice([0, 2]))
    refuse = bad_prompt or bool(invalid)
    if shape == "batch":
        body = {
            "input_ids": [prompt.get("input_ids") or [5, 6, 7], [11, 12, 13]],
            "sampling_params": sampling,
        }
        refuse = kind == "bad ids" or bool(invalid)  # an empty or text prompt became ids
    if shape in ("stream", "dropped stream"):
        body["stream"] = True
    drop = shape == "dropped stream"
    return {"label": label, "path": "/generate", "json": body, "drop": drop, "refuse": refuse}


def _send(url: str, case: dict) -> tuple[int, str]:
    target = f"{url}{case['path']}"
    if "raw" in case:
        response = requests.post(
            target, data=case["raw"], headers={"Content-Type": "application/json"}, timeout=TIMEOUT
        )
        return response.status_code, response.text
    stream = case["json"].get("stream", False)
    with requests.post(target, json=case["json"], stream=stream, timeout=TIMEOUT) as response:
        if case.get("drop") and response.status_code == 200:
            first = next(response.iter_lines(), b"")  # the first chunk, then hang up
            return 200, first.decode(errors="replace")
        return response.status_code, response.text
