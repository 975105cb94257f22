"""MagicDec on SGLang's own distributed engine: tensor parallelism (one node, and two "nodes" over
loopback), the data-parallel controller, and sglang-router's cache-aware routing in front of two
servers. All on the tiny model cut from the embedded one (2 KV heads: one per rank at --tp 2),
in float32, greedy outputs compared with plain decoding; TP ranks talk over gloo.

A tiny server takes ~3 GB of this 24 GB machine (4.5 GB at TP 2) while the session's shared
servers stay up, so servers here live only for the `with` block that uses them: reference outputs
are computed once and the servers stopped, and a plain server for tie checks starts only if two
outputs diverge."""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests
import torch

from benchmark.server_process import LAUNCH, ServerProcess, free_port, start_server
from sglang_magicdec.sampling import counter_uniforms
from test.helpers import TIE_GAP, assert_same_or_tie, pg19_prompts, pg19_texts, start_together

pytestmark = pytest.mark.server  # starts real SGLang servers

NEW_TOKENS = 32
PROMPT_TOKENS = (1700, 2300, 1900, 2100, 1800, 2200)  # a ragged batch of ~2K-token prompts
QUESTIONS = (
    "Who is the main character?",
    "Where does this take place?",
    "What happens first?",
    "Summarise it in one line.",
)
SNAPKV = ("--speculative-algorithm", "MAGICDEC", "--magicdec-budget", "256", "--magicdec-debug")
# Documents of ~1,500 tokens are shared above 1,024 tokens (--magicdec-share-min-len's default).
DOC_CHARS = 6000
SEEDED = [{"temperature": 0.8, "sampling_seed": 1000 + i} for i in range(4)]
UNSEEDED = [{"temperature": 0.8, "top_p": 0.9}] * 2
VOCAB = 49152  # the tiny model's (SmolLM2's)


# Servers stopped by `serving` drain while the next test starts; the module waits for them.
DRAINING: list[ServerProcess] = []


@contextmanager
def serving(log_dir, *args: str) -> Iterator[ServerProcess]:
    server = start_server(list(args), log_dir)
    try:
        yield server
    finally:
        server.stop(wait=False)
        DRAINING.append(server)


class StartedOnUse:
    """A plain server for tie checks, started the first time one asks it something."""

    def __init__(self, log_dir, args: tuple[str, ...]):
        self.log_dir, self.args, self.server = log_dir, args, None

    def generate(self, payload: dict, timeout: float = 900) -> dict:
        if self.server is None:
            self.server = start_server(list(self.args), self.log_dir)
        return self.server.generate(payload, timeout)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory) -> Iterator:
    yield tmp_path_factory.mktemp("scale-out-logs")
    while DRAINING:
        DRAINING.pop().stop()


@pytest.fixture(scope="module")
def tiny_args(tiny_llama) -> tuple[str, ...]:
    return ("--model-path", str(tiny_llama), "--dtype", "float32", "--max-total-tokens", "30000")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return pg19_prompts(tokenizer, PROMPT_TOKENS)


@pytest.fixture(scope="module")
def documents() -> list[list[str]]:
    """2 documents × 4 questions, as text (the router matches prefixes on text)."""
    texts = pg19_texts("4K", count=8)[6:]
    return [[f"{text[:DOC_CHARS]}\n\nQuestion: {question}\nAnswer:" for question in QUESTIONS]
            for text in texts]  # fmt: skip


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """What the server's tokenizer makes of text prompts (for the tie check's prompts)."""
    return [tokenizer(text)["input_ids"] for text in texts]


def generate_all(server, prompts: list, timeout: float = 600, fields=None, **sampling) -> list:
    """Completions of all prompts, sent at once: greedy unless `sampling` says otherwise, with
    `fields` added to each request (return_logprob, say)."""
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, **sampling}

    def one(prompt):
        key = "text" if isinstance(prompt, str) else "input_ids"
        payload = {key: prompt, "sampling_params": sampling, **(fields or {})}
        return server.generate(payload, timeout=timeout)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def output_ids(results: list[dict]) -> list[list[int]]:
    return [result["output_ids"] for result in results]


def assert_outputs_match(reference, prompts, got, expected, label: str) -> None:
    """Token for token, a divergence allowed only where the reference's top two tie."""
    for index, (prompt, got_ids, expected_ids) in enumerate(
        zip(prompts, got, expected, strict=True)
    ):
        assert_same_or_tie(reference, prompt, got_ids, expected_ids, f"{label} prompt {index}")


def magicdec_states(server) -> list[dict]:
    """Each scheduler's (each DP worker's) MagicDec state, from `/server_info`."""
    states = server.server_info()["internal_states"]
    return [state["magicdec"] for state in states]


@pytest.fixture(scope="module")
def tie_tp1(log_dir, tiny_args) -> Iterator[StartedOnUse]:
    reference = StartedOnUse(log_dir, tiny_args)
    yield reference
    reference.stop()


@pytest.fixture(scope="module")
def tie_tp2(log_dir, tiny_args) -> Iterator[StartedOnUse]:
    reference = StartedOnUse(log_dir, (*tiny_args, "--tp", "2"))
    yield reference
    reference.stop()


@pytest.fixture(scope="module")
def tp1_outputs(log_dir, tiny_args, prompts, documents) -> dict:
    """The plain TP 1 server's greedy outputs: the prompts (with logprobs) and each document's
    questions."""
    with serving(log_dir, *tiny_args) as server:
        return {
            "prompts": generate_all(server, prompts, fields={"return_logprob": True}),
            "documents": [output_ids(generate_all(server, questions)) for questions in documents],
        }


@pytest.fixture(scope="module")
def tp2_outputs(log_dir, tiny_args, prompts) -> list[dict]:
    """The plain TP 2 server's greedy outputs of the prompts, with logprobs."""
    with serving(log_dir, *tiny_args, "--tp", "2") as server:
        return generate_all(server, prompts, fields={"return_logprob": True})


def test_tp2_matches_tp1_without_speculation(tp1_outputs, tp2_outputs, tie_tp1, prompts):
    """TP 2 splits each row-parallel matmul's sum over two ranks and adds the halves (gloo),
    a different float32 order than TP 1's: the tokens must still agree (ties excepted), and the
    size of the difference is printed for the record."""
    tp1, tp2 = tp1_outputs["prompts"], tp2_outputs
    assert_outputs_match(tie_tp1, prompts, output_ids(tp2), output_ids(tp1), "TP 2 vs TP 1")
    differences = [
        abs(logprob_1 - logprob_2)
        for one, two in zip(tp1, tp2, strict=True)
        for (logprob_1, token_1, _), (logprob_2, token_2, _) in zip(
            one["meta_info"]["output_token_logprobs"],
            two["meta_info"]["output_token_logprobs"],
            strict=True,
        )
        if token_1 == token_2
    ]
    print(f"\nTP 2 vs TP 1: max |Δ logprob| of the output tokens {max(differences):.3g}")


def sampled_outputs(server, prompts) -> list[list[int]]:
    """4 seeded and 2 unseeded sampled requests in one batch; the seeded ones' tokens."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda job: generate_all(server, [job[0]], timeout=300, **job[1])[0],
            zip(prompts, SEEDED + UNSEEDED, strict=True),
        ))  # fmt: skip
    return output_ids(results)[: len(SEEDED)]


def assert_seeded_same_or_race_tie(reference, prompts, got, expected, label: str) -> None:
    """The seeded requests' outputs token for token. A seeded token is the argmax over the
    vocabulary of log p_v - log E_v (`sampling.seeded_sample`, E_v fixed by the seed and the
    position), p computed by a verify pass or a plain step, which round logits differently; so a
    divergence is allowed only where the two tokens' race scores tie by the reference's logits
    (the greedy tests' TIE_GAP, scaled by 1 / temperature)."""
    for index, (prompt, got_ids, expected_ids) in enumerate(
        zip(prompts[: len(got)], got, expected, strict=True)
    ):
        diverge = next(
            (i for i, (a, b) in enumerate(zip(got_ids, expected_ids, strict=False)) if a != b), None
        )
        if diverge is None:
            assert got_ids == expected_ids, f"{label}: seeded request {index} lengths differ"
            continue
        params = SEEDED[index]
        tokens = [got_ids[diverge], expected_ids[diverge]]
        context = prompt + expected_ids[:diverge]
        result = reference.generate({
            "input_ids": context, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "token_ids_logprob": tokens,
            "logprob_start_len": len(context) - 1,
        })  # fmt: skip
        logprobs = {
            token: lp for lp, token, _ in result["meta_info"]["output_token_ids_logprobs"][0]
        }
        # The token after `context` is drawn at position len(context) - 1 (the prefill's first
        # token at the prompt's last position, each later one where its predecessor sits).
        uniforms = counter_uniforms(
            torch.tensor([params["sampling_seed"]]), torch.tensor([len(context) - 1]), VOCAB
        )[0]
        scores = [
            logprobs[token] / params["temperature"] - math.log(-math.log(float(uniforms[token])))
            for token in tokens
        ]
        gap = abs(scores[0] - scores[1])
        assert gap < TIE_GAP / params["temperature"], (
            f"{label}: seeded request {index} diverges at token {diverge} ({tokens}) where the "
            f"seeded race does not tie (score gap {gap:.3g})"
        )
        print(f"\n{label}: seeded request {index}: a race tie at token {diverge} (gap {gap:.2g})")


def test_tp2_magicdec_lossless_and_seeded_sampling_fixed(log_dir, tiny_args, prompts, tp2_outputs,
                                                         tie_tp2):  # fmt: skip
    """MAGICDEC at TP 2 on one node (SnapKV at γ = auto) and on two (`--nnodes 2`: SGLang's
    multi-node path, two launchers joined through --dist-init-addr, one rank each, node 1
    serving no HTTP; StreamingLLM at γ = 3), debug mode checking every round that both ranks
    committed the same tokens:
    - greedy: the plain TP 2 server's tokens on the ragged batch;
    - sampled (temperature 0.8), 4 requests with a `sampling_seed` beside 2 without, each bounded
      by a timeout (a rank waiting on another would hang): a seed fixes the whole output, run
      after run, whatever γ = auto chose, whichever draft proposed and over however many nodes."""
    seeded = {}
    one_node = (*tiny_args, "--tp", "2", *SNAPKV, "--magicdec-gamma", "auto",
                "--speculative-num-steps", "4")  # fmt: skip
    with serving(log_dir, *one_node) as server:
        seeded["one node, snapkv γ=auto"] = greedy_then_seeded_twice(
            server, prompts, tp2_outputs, tie_tp2, "one node, snapkv γ=auto"
        )
    two_nodes = (*tiny_args, "--tp", "2", "--nnodes", "2", "--dist-init-addr",
                 f"127.0.0.1:{free_port()}", *SNAPKV, "--magicdec-draft", "streaming",
                 "--speculative-num-steps", "3")  # fmt: skip
    node1_log = log_dir / "node1.log"
    with node1_log.open("w") as log:
        node1 = subprocess.Popen(
            [*LAUNCH, *two_nodes, "--node-rank", "1"], stdout=log, stderr=subprocess.STDOUT
        )
    try:
        with serving(log_dir, *two_nodes, "--node-rank", "0") as node0:
            seeded["two nodes, streaming γ=3"] = greedy_then_seeded_twice(
                node0, prompts, tp2_outputs, tie_tp2, "two nodes, streaming γ=3"
            )
        assert node1.poll() is None or node1.returncode == 0, node1_log.read_text()[-3000:]
    finally:
        node1.terminate()
        try:
            node1.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node1.kill()
    assert_seeded_same_or_race_tie(tie_tp2, prompts, *seeded.values(), "across drafts and nodes")


def greedy_then_seeded_twice(server, prompts, tp2_outputs, tie_tp2, label: str) -> list[list[int]]:
    """Greedy outputs checked against plain TP 2's, then the seeded batch run twice and checked
    against itself; returns the seeded outputs."""
    got = output_ids(generate_all(server, prompts))
    assert_outputs_match(tie_tp2, prompts, got, output_ids(tp2_outputs), f"TP 2 {label}")
    greedy_state = magicdec_states(server)[0]
    assert greedy_state["verify_rounds"] > 0, greedy_state
    seeded, again = sampled_outputs(server, prompts), sampled_outputs(server, prompts)
    assert_seeded_same_or_race_tie(tie_tp2, prompts, again, seeded, label)
    state = magicdec_states(server)[0]
    assert state["verify_rounds"] > greedy_state["verify_rounds"], "sampling never drafted"
    gammas = {key: v["gamma"] for key, v in state.get("gamma_by_bucket", {}).items()}
    print(f"\nTP 2 {label}: greedy acceptance {greedy_state['draft_acceptance_rate']:.3f};"
          f" γ by bucket while sampling {gammas}")  # fmt: skip
    return seeded


def test_dp2_summarises_each_document_once_per_worker(log_dir, tiny_args, documents, tokenizer,
                                                      tp1_outputs, tie_tp1):  # fmt: skip
    """`--dp 2`: two schedulers behind SGLang's data-parallel controller, each with its own
    MagicDec worker and summaries, each reported in `/server_info`. Each document's 4
    questions at once: at most one summary of it per worker, outputs equal to one server's."""
    with serving(log_dir, *tiny_args, "--dp", "2", *SNAPKV) as server:
        states = magicdec_states(server)
        assert len(states) == 2 and all(s["draft"] == "snapkv" for s in states), states
        computed_before = [0, 0]
        for questions, expected in zip(documents, tp1_outputs["documents"], strict=True):
            got = output_ids(generate_all(server, questions))
            assert_outputs_match(tie_tp1, token_ids(tokenizer, questions), got, expected, "DP 2")
            computed = [s["summaries_computed"] for s in magicdec_states(server)]
            assert all(c - b <= 1 for c, b in zip(computed, computed_before, strict=True)), (
                f"a worker summarised one document twice: {computed_before} -> {computed}"
            )
            assert sum(computed) > sum(computed_before), "a new document was never summarised"
            computed_before = computed
        states = magicdec_states(server)
    assert sum(s["summaries_computed"] + s["summaries_reused"] for s in states) == 8, states
    assert all(s["drafts_without_summary"] == 0 for s in states), states
    print(f"\nDP 2 (computed, reused) per worker: "
          f"{[(s['summaries_computed'], s['summaries_reused']) for s in states]}")  # fmt: skip


@contextmanager
def routing(worker_urls: list[str], log_path, timeout_s: float = 120) -> Iterator[ServerProcess]:
    """sglang-router's own launcher, cache-aware, in front of `worker_urls`."""
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
             "--port", str(port), "--prometheus-port", str(free_port()),
             "--policy", "cache_aware", "--worker-urls", *worker_urls],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    router = ServerProcess(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        # The router answers /health before it has registered its workers (in the background:
        # its log says "Router ready | workers: []"), and answers 503 to traffic until then.
        while not _serves(router, worker_urls):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router did not start ({process.poll()}):\n{router.log_tail()}")
            time.sleep(1)
        yield router
    finally:
        router.stop()


def _serves(router: ServerProcess, worker_urls: list[str]) -> bool:
    """Every worker is registered with the router and healthy (its `/workers` listing)."""
    try:
        listing = requests.get(f"{router.url}/workers", timeout=10).json()["workers"]
    except (requests.RequestException, ValueError, KeyError):
        return False
    healthy = {worker["url"] for worker in listing if worker.get("is_healthy")}
    return healthy >= set(worker_urls)


def test_router_sends_a_document_to_one_worker(log_dir, tiny_args, documents, tokenizer,
                                               tp1_outputs, tie_tp1, tmp_path):  # fmt: skip
    """sglang-router (cache-aware) in front of two MAGICDEC servers: each document's questions
    go to one worker, so each document is summarised once, and outputs equal one server's."""
    workers = start_together(*[lambda: start_server([*tiny_args, *SNAPKV], log_dir)] * 2)
    try:
        first, second = workers
        with routing([first.url, second.url], tmp_path / "router.log") as router:
            for questions, expected in zip(documents, tp1_outputs["documents"], strict=True):
                got = output_ids(generate_all(router, questions))
                assert_outputs_match(
                    tie_tp1, token_ids(tokenizer, questions), got, expected, "router"
                )
        counts = [
            (state["summaries_computed"], state["summaries_reused"])
            for worker in (first, second)
            for state in magicdec_states(worker)
        ]
    finally:
        for worker in workers:
            worker.stop(wait=False)
            DRAINING.append(worker)
    print(f"\nrouter (computed, reused) per worker: {counts}")
    assert sum(computed for computed, _ in counts) == len(documents), counts
    assert sum(reused for _, reused in counts) == sum(len(q) for q in documents) - len(documents)
