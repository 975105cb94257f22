"""The SnapKV draft inside the real SGLang server on CPU: exactness, acceptance against the
streaming draft, chunked prefill, radix-shared summaries through frontend programs, and KV
pressure (eviction, retraction, aborts) with every selection checked in debug mode."""

from __future__ import annotations

import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from benchmark.common import stream_chunks
from test.helpers import (
    POOL_ARGS,
    REPO,
    SNAPKV,
    assert_same_or_tie,
    flush_when_idle,
    greedy,
    measured_alpha,
    pg19_acceptance_prompts,
    pg19_texts,
    run_concurrently,
)

sys.path.insert(0, str(REPO / "python"))
import agent_loop  # noqa: E402  (the frontend programs live in python/, not a package)
import shared_doc_qa  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

MIN_ALPHA_GAIN = 0.02  # the SnapKV paper's claim over StreamingLLM at equal budget
OBS_WINDOW = 32  # --magicdec-obs-window's default
COUNTERS = ("summaries_computed", "summaries_reused", "drafts_without_summary")


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    return [tokenizer(text)["input_ids"][:2048] for text in pg19_texts("4K", count=4)]


def magicdec_info(server) -> dict:
    state = requests.get(f"{server.url}/server_info", timeout=30).json()
    return state["internal_states"][0]["magicdec"]


def summary_of(result: dict) -> dict:
    return result["meta_info"]["magicdec_summary"][0]


def test_greedy_identical_to_autoregressive(snap, plain, long_prompts):
    got = run_concurrently(snap, long_prompts[:3], 48, ignore_eos=True)
    expected = run_concurrently(plain, long_prompts[:3], 48, ignore_eos=True)
    for index, (prompt, a, b) in enumerate(zip(long_prompts[:3], got, expected, strict=True)):
        assert summary_of(a)["status"] == "computed"
        assert_same_or_tie(plain, prompt, a["output_ids"], b["output_ids"], f"prompt {index}")


def scrape_metrics(server) -> dict[str, float]:
    """`/metrics` samples by name (the label sets of one server's single scheduler)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{server.url}/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_metrics_describe_magicdec(snap, long_prompts):
    """With --enable-metrics, SGLang's speculative gauges describe the MAGICDEC rounds just run
    and MagicDec's own counters equal `/server_info`'s (one request at a time: the last
    decode batch was this request's, and nothing runs between the scrape and the info)."""
    result = greedy(snap, long_prompts[3], 32, ignore_eos=True)
    assert result["meta_info"]["spec_verify_ct"] > 0
    scraped, info = scrape_metrics(snap), magicdec_info(snap)
    gamma = info["gamma"]
    assert scraped["sglang:spec_num_steps"] == gamma
    assert scraped["sglang:spec_num_draft_tokens"] == gamma + 1
    assert scraped["sglang:magicdec_gamma"] == gamma
    assert 1.0 <= scraped["sglang:spec_accept_length"] <= gamma + 1
    assert scraped["sglang:magicdec_request_rounds_total"] == info["verify_rounds"] > 0
    for counter in COUNTERS:
        assert scraped[f"sglang:magicdec_{counter}_total"] == info[counter], counter
    assert info["summaries_computed"] > 0


def test_batches_that_cannot_speculate_are_counted(snap, long_prompts):
    """A custom logit processor (SGLang's, disallowing " the") makes a batch take plain decode
    steps: each is counted under its reason in `/server_info` and in `/metrics`."""
    from prometheus_client.parser import text_string_to_metric_families
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    before = magicdec_info(snap)["plain_batches"]["custom_logit_processor"]
    sampling = {"max_new_tokens": 6, "temperature": 0, "custom_params": {"token_ids": [260]}}
    result = snap.generate(
        {
            "input_ids": long_prompts[2],
            "sampling_params": {**sampling, "ignore_eos": True},
            "custom_logit_processor": DisallowedTokensLogitsProcessor.to_str(),
        }
    )
    assert result["meta_info"]["completion_tokens"] == 6 and 260 not in result["output_ids"]
    plain = magicdec_info(snap)["plain_batches"]
    assert plain["custom_logit_processor"] - before == 5  # the 6 tokens but the prefill's first
    text = requests.get(f"{snap.url}/metrics", timeout=30).text
    by_reason = {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "sglang:magicdec_plain_batches_total"
    }
    assert by_reason == {reason: float(count) for reason, count in plain.items()}


def test_snapkv_accepts_more_than_streaming(snap, streaming_pg19_run, tokenizer):
    """PG-19 4K (6 documents, ~3.7K tokens), budget 512, 64 tokens: α of both drafts."""
    snap_run = run_concurrently(snap, pg19_acceptance_prompts(tokenizer), 64, ignore_eos=True)
    alpha_snap, alpha_streaming = measured_alpha(snap_run), measured_alpha(streaming_pg19_run)
    print(f"budget 512: α snapkv = {alpha_snap:.3f}, α streaming = {alpha_streaming:.3f}")
    assert alpha_snap >= alpha_streaming + MIN_ALPHA_GAIN, (
        f"α snapkv {alpha_snap:.3f} vs streaming {alpha_streaming:.3f}"
    )


@pytest.fixture(scope="module")
def chunked(server_factory):
    """Prefill in chunks of 256 tokens, one decode batch run between two chunks (SGLang runs
    every chunk first by default), every draft selection checked."""
    interleaved = ("--chunked-prefill-size", "256", "--prefill-decode-interval", "1")
    return server_factory(*POOL_ARGS, *SNAPKV, *interleaved, "--magicdec-debug")


def test_chunked_prefill_selects_the_same_positions(snap, chunked, tokenizer):
    """Chunks of 256 tokens, the last one shorter than the observation window: the window's
    queries straddle two chunks. The selection must equal the one-shot prefill's."""
    # A document no other test sends to `snap`, so nothing of it is cached there.
    prompt = tokenizer(pg19_texts("4K", count=20)[15])["input_ids"][: 256 * 6 + 10]
    one_shot = greedy(snap, prompt, 4)
    in_chunks = greedy(chunked, prompt, 4)
    assert summary_of(one_shot)["status"] == summary_of(in_chunks)["status"] == "computed"
    assert summary_of(in_chunks)["digest"] == summary_of(one_shot)["digest"]


def stream_arrivals(server, prompt: list[int], max_new_tokens: int, arrivals: list) -> None:
    """Stream a greedy request, appending (arrival time, output ids by then) per chunk."""
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    payload = {"input_ids": prompt, "sampling_params": sampling, "stream": True}
    with requests.post(f"{server.url}/generate", json=payload, stream=True, timeout=600) as r:
        r.raise_for_status()
        for arrived, chunk in stream_chunks(r):
            arrivals.append((arrived, chunk["output_ids"]))


def test_requests_keep_speculating_between_a_long_prompts_chunks(chunked, plain, tokenizer):
    """A 2,100-token prompt arrives while a request decodes: between its 9 prefill chunks the
    decoding request runs MagicDec rounds (not plain steps, not a stall), its output is the plain
    server's, and the new prompt's SnapKV summary is computed once, when its last chunk ends."""
    texts = pg19_texts("4K", count=20)
    decoding = tokenizer(texts[16])["input_ids"][:1500]
    arriving = tokenizer(texts[17])["input_ids"][: 256 * 8 + 52]
    arrivals: list[tuple[float, list[int]]] = []
    decoder = threading.Thread(target=stream_arrivals, args=(chunked, decoding, 96, arrivals))
    decoder.start()
    while not arrivals and decoder.is_alive():  # until the decoding request's prefill ends
        time.sleep(0.01)
    assert arrivals, "the decoding request failed"
    before = magicdec_info(chunked)
    sent = time.perf_counter()
    result = greedy(chunked, arriving, 1)
    first_token = time.perf_counter()
    after = magicdec_info(chunked)
    decoder.join()
    chunks = -(-len(arriving) // 256)
    in_window = [at for at, _ in arrivals if sent < at < first_token]
    rounds = after["verify_rounds"] - before["verify_rounds"]
    accepted = (
        after["avg_accept_length"] * after["verify_rounds"]
        - before["avg_accept_length"] * before["verify_rounds"]
    )
    print(f"{chunks} chunks: {rounds} rounds, {accepted:.0f} tokens committed meanwhile")
    # One decode batch after each chunk but the last (then the prompt's own first token).
    assert rounds >= chunks - 1 and len(in_window) >= chunks - 1
    assert accepted > rounds, "the rounds between the chunks accepted no draft"
    assert after["summaries_computed"] - before["summaries_computed"] == 1
    assert summary_of(result)["status"] == "computed"
    expected = greedy(plain, decoding, 96, ignore_eos=True)["output_ids"]
    assert_same_or_tie(plain, decoding, arrivals[-1][1], expected, "decoding beside the chunks")
    chunked.stop(wait=False)  # its pool's memory, for the servers of this module's later tests


def test_shared_document_computes_one_summary(snap, plain, tokenizer):
    """8 questions over one ~3K-token document, forked by a frontend program: the document is
    summarised once and every question reuses it; answers equal plain decoding's."""
    document = tokenizer.decode(tokenizer(pg19_texts("4K", count=8)[7])["input_ids"][:3000])
    before = magicdec_info(snap)
    answers = shared_doc_qa.run(snap.url, document, num_questions=8, max_tokens=12)
    after = magicdec_info(snap)
    assert after["summaries_computed"] - before["summaries_computed"] == 1
    assert after["summaries_reused"] - before["summaries_reused"] == 8
    assert answers == shared_doc_qa.run(plain.url, document, num_questions=8, max_tokens=12)


@pytest.mark.parametrize("questions,text_index", [(4, 8), (8, 9)])
def test_concurrent_raw_requests_share_one_summary_per_document(
    snap, plain, tokenizer, questions, text_index
):
    """No fork, no document sent alone: N questions about one ~3K-token document sent at once
    to /generate as document + question. One summary is computed, every other request reuses
    it (none falls back to StreamingLLM), and the answers equal plain decoding's."""
    document = tokenizer(pg19_texts("4K", count=20)[text_index])["input_ids"][:3000]
    prompts = [
        document + tokenizer(f"\n\nQuestion {i}: {question}\nAnswer:")["input_ids"]
        for i, question in enumerate(shared_doc_qa.QUESTIONS[:questions])
    ]
    before = magicdec_info(snap)
    got = run_concurrently(snap, prompts, 12, ignore_eos=True)
    after = magicdec_info(snap)
    statuses = sorted(summary_of(result)["status"] for result in got)
    assert statuses == ["computed"] + ["reused"] * (questions - 1)
    assert after["summaries_computed"] - before["summaries_computed"] == 1
    assert after["drafts_without_summary"] == before["drafts_without_summary"]
    expected = run_concurrently(plain, prompts, 12, ignore_eos=True)
    for index, (prompt, a, b) in enumerate(zip(prompts, got, expected, strict=True)):
        assert_same_or_tie(plain, prompt, a["output_ids"], b["output_ids"], f"question {index}")


def test_multi_turn_chat_reuses_summaries_turn_after_turn(snap, plain, tokenizer):
    """Two conversations through the OpenAI client, interleaved, 4 turns each, the whole
    history re-sent every turn, the first turn carrying a ~1.5K-token document: each
    conversation computes one summary on its first turn and every later turn reuses it."""
    documents = [
        tokenizer.decode(tokenizer(text)["input_ids"][:1500])
        for text in pg19_texts("4K", count=20)[18:20]
    ]
    follow_ups = ["Who is in it?", "Where are they?", "What happens next?"]

    def chat(server) -> list[list[str]]:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
        histories = [
            [{"role": "user", "content": f"Read this:\n{document}\n\nWhat is it about?"}]
            for document in documents
        ]
        for turn in range(4):
            for history in histories:  # interleaved: A1 B1 A2 B2 ...
                reply = client.chat.completions.create(
                    model="default", messages=history, temperature=0, max_tokens=12
                )
                history.append({"role": "assistant", "content": reply.choices[0].message.content})
                if turn < 3:
                    history.append({"role": "user", "content": follow_ups[turn]})
        return [
            [m["content"] for m in history if m["role"] == "assistant"] for history in histories
        ]

    before = magicdec_info(snap)
    answers = chat(snap)
    after = magicdec_info(snap)
    counts = {key: after[key] - before[key] for key in COUNTERS}
    assert counts == {"summaries_computed": 2, "summaries_reused": 6, "drafts_without_summary": 0}
    assert answers == chat(plain)


def test_radix_hit_with_a_short_suffix_computes_its_own_summary(snap, plain, tokenizer):
    """A ~900-token document (long enough to draft with a summary, too short to store one
    under --magicdec-share-min-len 1024) asked twice: the second prompt's only new tokens are a
    short question, fewer than the observation window, and no summary exists to reuse. Its
    prefill recomputes the window instead (the radix match stops `obs_window` tokens early) and
    selects what a prefill with nothing cached selects: the same positions in each (layer, KV
    head) but where a rounding tie falls otherwise (the hit's window is a ~40-row extend, the
    cold one's a ~930-row prefill: their linear layers round differently), where a window that
    differs in its last few tokens (the first question's) moves most heads."""
    document = tokenizer(pg19_texts("4K", count=20)[17])["input_ids"][:900]
    first = document + tokenizer(" Question: who speaks?")["input_ids"]
    second = document + tokenizer(" Question: where?")["input_ids"]
    other_window = greedy(snap, first, 1)
    hit = greedy(snap, second, 12)
    assert summary_of(hit)["status"] == "computed"
    assert hit["meta_info"]["cached_tokens"] <= len(second) - OBS_WINDOW
    assert hit["meta_info"]["cached_tokens"] >= len(document) - OBS_WINDOW - 1
    assert requests.post(f"{snap.url}/flush_cache", timeout=30).status_code == 200
    cold = greedy(snap, second, 12)
    assert cold["meta_info"]["cached_tokens"] == 0
    heads = summary_of(cold)["head_digests"]

    def heads_apart(result: dict) -> int:
        return sum(a != b for a, b in zip(summary_of(result)["head_digests"], heads, strict=True))

    assert heads_apart(hit) <= len(heads) // 20, f"{heads_apart(hit)} of {len(heads)} heads"
    assert heads_apart(other_window) >= len(heads) // 2, f"{heads_apart(other_window)} heads"
    expected = greedy(plain, second, 12)["output_ids"]
    assert_same_or_tie(plain, second, hit["output_ids"], expected, "radix hit")


def test_agent_loop_reuses_the_manual_summary(snap, plain):
    """Two agents, three turns each, over a ~1.9K-token tool manual: one summary (the manual),
    reused by every turn, whose prompt extends the manual and the earlier turns."""
    before = magicdec_info(snap)
    transcripts = agent_loop.run(snap.url, num_agents=2, turns=3, max_tokens=12, num_tools=24)
    after = magicdec_info(snap)
    assert after["summaries_computed"] - before["summaries_computed"] == 1
    assert after["summaries_reused"] - before["summaries_reused"] == 2 * 3
    assert transcripts == agent_loop.run(plain.url, 2, 3, max_tokens=12, num_tools=24)


def test_eviction_retraction_and_aborts_under_kv_pressure(
    server_factory, plain, tokenizer, monkeypatch
):
    """200 mixed requests (questions over a shared document, sharing summaries by prefix;
    unshared prompts; aborts) on a pool far too small for them: the radix cache evicts, decode
    retracts, and every request that was not aborted returns exactly its plain-decoding output.
    Debug mode asserts inside the worker that no draft selection or summary refers to a freed
    slot.

    SGLang admits decode requests with enough KV reserved for MAGICDEC's rounds that this pool
    evicts but never runs out mid-decode, so retraction is also forced through SGLang's own
    test switch (its real `retract_decode`, every 10th step)."""
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")
    monkeypatch.setenv("SGLANG_TEST_RETRACT_INTERVAL", "10")
    pressed = server_factory(
        "--dtype",
        "float32",
        "--max-total-tokens",
        "6000",
        *SNAPKV,
        "--magicdec-budget",
        "256",
        "--magicdec-share-min-len",
        "512",
        "--magicdec-debug",
    )
    texts = pg19_texts("4K", count=20)
    document = tokenizer(texts[10])["input_ids"][:1200]
    questions = [tokenizer(f" Question {i}: what happens next?")["input_ids"] for i in range(6)]
    shared = [document + question for question in questions]
    unshared = [tokenizer(text)["input_ids"][:700] for text in texts[11:17]]
    distinct = shared + unshared
    max_new_tokens = 24
    expected = run_concurrently(plain, distinct, max_new_tokens, ignore_eos=True)
    # The document is never sent alone: questions share its summary by prefix.

    rng = random.Random(0)
    jobs = [(i, rng.randrange(len(distinct)), rng.random() < 0.1) for i in range(200)]

    def send(job):
        index, prompt, abort = job
        rid = f"pressure-{index:03d}-"  # SGLang aborts every rid that starts with the one given
        if abort:
            threading.Timer(rng.uniform(0.5, 5), _abort, (pressed.url, rid)).start()
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        payload = {"input_ids": distinct[prompt], "sampling_params": sampling, "rid": rid}
        return prompt, abort, pressed.generate(payload)

    with ThreadPoolExecutor(32) as pool:
        outcomes = list(pool.map(send, jobs))

    finished = 0
    for prompt, abort, result in outcomes:
        if result["meta_info"]["finish_reason"]["type"] == "abort":
            assert abort, "only the requests we aborted may end aborted"
            continue
        finished += 1
        assert result["output_ids"] == expected[prompt]["output_ids"], f"prompt {prompt}"
    assert finished >= 150
    info = magicdec_info(pressed)
    assert info["summaries_reused"] > 0 and info["summaries_dropped"] > 0, info
    retractions = sum(result["meta_info"].get("num_retractions", 0) for _, _, result in outcomes)
    assert retractions > 0, "the pool should have been small enough to retract requests"
    # Back to idle: nothing held, nothing leaked.
    load = flush_when_idle(pressed)
    assert load["num_used_tokens"] == 0, load
    assert magicdec_info(pressed)["summaries_held"] == 0


def _abort(url: str, rid: str) -> None:
    requests.post(f"{url}/abort_request", json={"rid": rid}, timeout=30)
