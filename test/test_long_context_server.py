"""The embedded 32K model at long context: what `make serve` serves (no --model-path: the Qwen
model, MAGICDEC with its SnapKV draft) against a plain server of the same model, in bfloat16.

One document (PG-19 books joined, 16K tokens, a needle sentence at ~6K) is prefilled once per
server and shared by every question through the radix cache: first its first 8K tokens with a
question, then all of it with the needle question, then all of it with another question. Each
request is sent alone and in the same order to both servers, so their prefills group alike and
a bf16 greedy output must be the plain server's token for token. A 16K prefill of the 0.5B takes
~2.5 minutes here per server (a 30K one ~7), so 32K is measured by `benchmark.long_context`,
not here; the module runs last (`conftest.LAST_MODULE`).
"""

from __future__ import annotations

import openai
import pytest
import requests

from sglang_magicdec.model import QWEN_CODER
from test.helpers import greedy, pg19_texts, start_together

pytestmark = pytest.mark.server  # starts real SGLang servers

NEEDLE_AT = 6_000
DOCUMENT_TOKENS = 16_000
NEEDLE = " The secret password is violet-harbor-42. Remember it. "
NEEDLE_QUESTION = "What is the secret password mentioned in the text above? Answer with it only."
OTHER_QUESTION = "Name one character of the story above."
SHORT_QUESTION = "Who wrote the text above?"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def servers(server_factory):
    """(plain, magicdec): the Qwen model without speculation, and as `make serve` runs it."""
    # Both load the 0.5B at once, and SGLang's CPU profile charges whatever the machine's free
    # RAM lost meanwhile to each: at the CPU default of 0.25 two loads can exceed it (CI did).
    pool = ("--max-total-tokens", "70000", "--mem-fraction-static", "0.6")
    return start_together(
        lambda: server_factory(*pool, model=QWEN_CODER.name),
        lambda: server_factory(*pool, "--speculative-algorithm", "MAGICDEC", model=None),
    )


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_magicdec.model import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path(QWEN_CODER))


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    """Chat prompts over the document, as token ids: its first 8K tokens with a question, and
    all 16K with the needle question and with another."""
    texts = pg19_texts("32K", count=2)
    book = tokenizer(texts[0] + texts[1], add_special_tokens=False)["input_ids"]
    needle = tokenizer(NEEDLE, add_special_tokens=False)["input_ids"]
    document = book[:NEEDLE_AT] + needle + book[NEEDLE_AT : DOCUMENT_TOKENS - len(needle)]
    marker = "\x00DOCUMENT\x00"
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": marker + "QUESTION"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    before, after = template.split(marker)

    def prompt(tokens: int, question: str) -> list[int]:
        head = tokenizer(before, add_special_tokens=False)["input_ids"]
        tail = tokenizer("\n\n" + after.replace("QUESTION", question), add_special_tokens=False)
        return head + document[:tokens] + tail["input_ids"]

    return {
        "8K": prompt(8_000, SHORT_QUESTION),
        "16K needle": prompt(len(document), NEEDLE_QUESTION),
        "16K other": prompt(len(document), OTHER_QUESTION),
    }


@pytest.fixture(scope="module")
def answers(servers, prompts) -> dict[str, tuple[dict, dict]]:
    """Each prompt's greedy answer from (plain, magicdec), one request at a time."""
    plain, magicdec = servers
    return {
        name: tuple(greedy(server, ids, NEW_TOKENS) for server in (plain, magicdec))
        for name, ids in prompts.items()
    }


def test_the_default_model_is_the_32k_qwen_and_answers(servers):
    _, magicdec = servers
    client = openai.OpenAI(base_url=f"{magicdec.url}/v1", api_key="none")
    (model,) = client.models.list().data
    assert model.id == QWEN_CODER.served_name
    reply = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=24,
    )
    assert "Paris" in reply.choices[0].message.content
    info = requests.get(f"{magicdec.url}/server_info", timeout=30).json()
    assert info["speculative_algorithm"] == "MAGICDEC"


@pytest.mark.parametrize("name", ["8K", "16K needle", "16K other"])
def test_greedy_output_is_the_plain_servers_at_long_context(answers, prompts, name):
    plain, magicdec = answers[name]
    assert magicdec["output_ids"] == plain["output_ids"], (
        f"{name} ({len(prompts[name])} tokens): MagicDec {magicdec['text']!r}, "
        f"plain {plain['text']!r}"
    )
    # It speculated: rounds took more than one token each on average.
    meta = magicdec["meta_info"]
    assert meta["spec_verify_ct"] > 0
    assert meta["completion_tokens"] / meta["spec_verify_ct"] > 1.5


def test_the_needle_is_answered_alike(answers):
    plain, magicdec = answers["16K needle"]
    assert magicdec["text"] == plain["text"]


def test_questions_on_one_document_share_its_summary(answers):
    """The second question over the 16K document reuses the SnapKV summary the first computed
    (the radix cache holds one copy of the document)."""
    statuses = [
        answers[name][1]["meta_info"]["magicdec_summary"][0]["status"]
        for name in ("8K", "16K needle", "16K other")
    ]
    assert statuses == ["computed", "computed", "reused"]
    plain, _ = answers["16K other"]
    # the plain server prefilled only the question: the document was cached
    assert plain["meta_info"]["cached_tokens"] >= DOCUMENT_TOKENS - 500


def test_a_prompt_past_the_context_is_refused_in_one_line(servers, prompts):
    plain, _ = servers
    too_long = prompts["16K needle"] * 3
    response = requests.post(
        f"{plain.url}/generate",
        json={"input_ids": too_long, "sampling_params": {"max_new_tokens": 4}},
        timeout=120,
    )
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "32768" in message and "\n" not in message.strip()
    # and the server goes on serving
    assert greedy(plain, prompts["8K"][:64], 2)["meta_info"]["completion_tokens"] == 2
