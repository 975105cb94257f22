"""Shared fixtures: real SGLang servers on free loopback ports, and the tokenizer. Plain helper
functions and constants are in `test/helpers.py`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from benchmark.server_process import LAUNCH, ServerProcess, start_server
from sglang_magicdec.model import SMOLLM2
from test.helpers import GAMMA, POOL_ARGS, SNAPKV, pg19_acceptance_prompts, run_concurrently

# No model hub at run time: a test that reaches for the network must fail, not hang.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# What SGLang no longer has raises instead of falling back with a warning (servers inherit it).
os.environ.setdefault("SGLANG_MAGICDEC_STRICT", "1")


def _server_factory(tmp_path_factory) -> Iterator:
    started: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def factory(
        *args: str,
        env: dict[str, str] | None = None,
        launch: list[str] = LAUNCH,
        model: str | None = SMOLLM2.name,
    ) -> ServerProcess:
        server = start_server(list(args), log_dir, env=env, launch=launch, model=model)
        started.append(server)
        return server

    yield factory
    for server in started:  # all drain at once
        server.stop(wait=False)
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


# A session server holds ~5 GB (three processes and a 60K-token float32 pool) of the machine's
# 24: each is stopped right after the last collected test that needs it, not at the session's
# end, so that later modules' servers find the memory free (SGLang sizes its pool from it).
SESSION_SERVERS: dict[str, ServerProcess] = {}
_LAST_USER: dict[str, str] = {}


# Runs after every other module: its two servers of the 0.5B model need the memory the session
# servers hold until their last test.
LAST_MODULE = "test_long_context_server.py"


def pytest_collection_modifyitems(items) -> None:
    items.sort(key=lambda item: item.path.name == LAST_MODULE)  # stable: order kept otherwise
    for item in items:
        for name in ("plain", "streaming", "snap"):
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


def pytest_runtest_teardown(item) -> None:
    for name, last in _LAST_USER.items():
        if last == item.nodeid and name in SESSION_SERVERS:
            # The next test goes on while it drains; the session factory waits for it at the end.
            SESSION_SERVERS.pop(name).stop(wait=False)


@pytest.fixture(scope="session")
def plain(session_server_factory) -> ServerProcess:
    """The same model without speculation: the reference outputs."""
    SESSION_SERVERS["plain"] = session_server_factory(*POOL_ARGS)
    return SESSION_SERVERS["plain"]


@pytest.fixture(scope="session")
def streaming(session_server_factory) -> ServerProcess:
    """MAGICDEC with the StreamingLLM draft, checking every draft selection (debug)."""
    SESSION_SERVERS["streaming"] = session_server_factory(
        *POOL_ARGS,
        "--speculative-algorithm",
        "MAGICDEC",
        "--speculative-num-steps",
        str(GAMMA),
        "--magicdec-draft",
        "streaming",
        "--magicdec-debug",
    )
    return SESSION_SERVERS["streaming"]


@pytest.fixture(scope="session")
def snap(session_server_factory) -> ServerProcess:
    """MAGICDEC with the SnapKV draft, checking every draft selection (debug), with Prometheus
    metrics refreshed after every decode batch and custom logit processors allowed: the SnapKV
    modules and the fuzz share it."""
    metrics = ("--enable-metrics", "--decode-log-interval", "1")
    args = (*POOL_ARGS, *SNAPKV, "--magicdec-debug", *metrics, "--enable-custom-logit-processor")
    SESSION_SERVERS["snap"] = session_server_factory(*args)
    return SESSION_SERVERS["snap"]


@pytest.fixture(scope="session")
def streaming_pg19_run(streaming, tokenizer) -> list[dict]:
    """64 greedy tokens of each acceptance prompt on the streaming server, all at once."""
    return run_concurrently(streaming, pg19_acceptance_prompts(tokenizer), 64, ignore_eos=True)


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from sglang_magicdec.model import embedded_model_path

    return AutoTokenizer.from_pretrained(embedded_model_path(SMOLLM2))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """The 2-layer, 4-query / 2-KV-head model cut from the embedded one: it splits over 2
    tensor-parallel ranks and runs under Triton's CPU interpreter."""
    from sglang_magicdec.model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    """Writes (once per head dim) a 2-layer Qwen2 model with the 0.5B's group of 7 (14 query /
    2 KV heads, biases on q, k and v) at head dim 64 (Qwen2.5-0.5B's) or 128 (the 1.5B's), random
    weights: what it is for is comparing two forwards' logits bit for bit, which random weights
    show as well."""
    folders = {}

    def write(head_dim: int):
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        if head_dim in folders:
            return folders[head_dim]
        config = Qwen2Config(
            vocab_size=16384,
            hidden_size=14 * head_dim,
            intermediate_size=1024,
            num_hidden_layers=2,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1e6,
            tie_word_embeddings=False,
        )
        torch.manual_seed(head_dim)
        model = Qwen2ForCausalLM(config)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):  # initialised to zero: a bias dropped would not show
                    parameter.normal_(std=0.5)
        folder = folders[head_dim] = tmp_path_factory.mktemp(f"tiny-qwen2-{head_dim}")
        model.save_pretrained(folder)
        return folder

    return write
