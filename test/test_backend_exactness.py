"""Our CPU attention backends (the native kernel's and the torch one) give the same greedy
tokens as SGLang's stock torch_native one."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from test.helpers import GAMMA, pg19_texts, start_together

pytestmark = pytest.mark.server  # starts real SGLang servers

PROMPT_TOKENS = 2048
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer(text)["input_ids"][:PROMPT_TOKENS] for text in pg19_texts("4K", count=3)]


def _greedy_batch(server, prompts):
    def one(input_ids):
        payload = {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
        }
        return server.generate(payload)["output_ids"]

    with ThreadPoolExecutor(len(prompts)) as pool:  # one concurrent batch
        return list(pool.map(one, prompts))


FP32 = ("--dtype", "float32", "--max-total-tokens", "12000")  # 3 prompts of 2,080 tokens


@pytest.fixture(scope="module")
def servers(server_factory, plain) -> dict:
    """Each backend's float32 server, started together with SGLang's stock one; magicdec_cpu
    is the CPU default, which the session's `plain` server (float32) runs."""
    stock, torch_ops = start_together(
        lambda: server_factory(*FP32, "--attention-backend", "torch_native"),
        lambda: server_factory(*FP32, "--attention-backend", "magicdec_cpu_torch"),
    )
    assert plain.server_info()["attention_backend"] == "magicdec_cpu"
    return {"torch_native": stock, "magicdec_cpu": plain, "magicdec_cpu_torch": torch_ops}


@pytest.fixture(scope="module")
def stock_outputs(servers, prompts):
    try:
        return _greedy_batch(servers["torch_native"], prompts)
    finally:
        servers["torch_native"].stop(wait=False)


@pytest.mark.parametrize("backend", ["magicdec_cpu", "magicdec_cpu_torch"])
def test_greedy_tokens_identical_to_torch_native_fp32(servers, prompts, stock_outputs, backend):
    ours = servers[backend]  # one server decoding at a time: the others wait idle
    our_outputs = _greedy_batch(ours, prompts)
    if ours is not servers["magicdec_cpu"]:
        ours.stop(wait=False)
    assert "native CPU kernels unavailable" not in ours.log_path.read_text()
    for index, (got, expected) in enumerate(zip(our_outputs, stock_outputs, strict=True)):
        assert len(got) == NEW_TOKENS
        first_diff = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=True)) if a != b), None
        )
        assert first_diff is None, f"prompt {index}: first different token at {first_diff}"


def test_magicdec_bf16_greedy_is_the_plain_bf16_servers(server_factory, tokenizer):
    """bfloat16 weights and KV: MAGICDEC's greedy tokens are the plain bf16 server's, token for
    token, on 8 PG-19 prompts: every op a verify row runs computes what a decode step of its token
    computes, bit for bit (the few-row product, the layer ops and the slot attention do not depend
    on the rows beside them), so not even a bf16 tie of the target can tell them apart.

    Each prompt is sent alone: a prefill's bits still depend on which prompts SGLang groups into
    one prefill batch (oneDNN's product for many rows, the extend attention's plan), which varies
    from run to run of the same server; decode and verify rows do not depend on their batch
    (`test_cpu_native.py`, `test_few_rows_linear.py`)."""
    prompts = [tokenizer(text)["input_ids"][:1024] for text in pg19_texts("4K", count=8)]
    common = ("--dtype", "bfloat16", "--max-total-tokens", "12000")
    speculative = ("--speculative-algorithm", "MAGICDEC", "--speculative-num-steps", str(GAMMA))
    plain, magicdec = start_together(
        lambda: server_factory(*common), lambda: server_factory(*common, *speculative)
    )

    def one_by_one(server) -> list[list[int]]:
        return [_greedy_batch(server, [prompt])[0] for prompt in prompts]

    expected = one_by_one(plain)
    try:
        got = one_by_one(magicdec)
        rounds = magicdec.server_info()["internal_states"][0]["magicdec"]["verify_rounds"]
    finally:
        magicdec.stop(wait=False)
    assert rounds > 0
    different = {
        index: next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        for index, (ours, theirs) in enumerate(zip(got, expected, strict=True))
        if ours != theirs
    }
    assert different == {}, f"prompt: first different token {different}"
