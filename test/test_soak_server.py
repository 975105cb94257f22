"""A small version of `benchmark.soak`'s long-context soak: prompts of 512-2,500 tokens, 4 at a
time, on a pool of 6,000 tokens (less than they need together), greedy and sampled, with aborts,
streams the client drops and cache flushes: every request is answered, and at the end no KV slot
or SnapKV summary is held (about 80 s here)."""

from __future__ import annotations

import random
from argparse import Namespace

import pytest

from benchmark import soak
from benchmark.common import DEFAULT_DATA
from benchmark.server_process import start_server

pytestmark = pytest.mark.server  # starts a real SGLang server

POOL = 6000
REQUESTS = 20


def test_a_long_context_soak_loses_and_leaks_nothing(tmp_path, tokenizer):
    shared, unshared = soak.build_prompts(DEFAULT_DATA, tokenizer, random.Random(0), (512, 2500))
    server_args = ["--dtype", "float32", "--max-total-tokens", str(POOL), *soak.SPECULATIVE]
    server = start_server(server_args, tmp_path, env=soak.RETRACT_ENV)
    args = Namespace(
        requests=REQUESTS, minutes=None, concurrency=4, seed=3, sample_every_s=1.0,
        aborts=0.2, drops=0.2,
    )  # fmt: skip
    try:
        result = soak.soak(server, shared, unshared, args)
    finally:
        server.stop()
    outcomes = result["outcomes"]
    print(
        f"{outcomes.finished} finished, {outcomes.aborted} aborted, {outcomes.dropped} dropped, "
        f"{outcomes.retracted} retractions, KV in use at most "
        f"{max(s['kv_used'] for s in result['samples'])} of {POOL}"
    )
    assert soak.leaks(result) == dict.fromkeys(soak.leaks(result), 0), outcomes.errors
    assert outcomes.finished + outcomes.aborted + outcomes.dropped == REQUESTS
    assert max(s["kv_used"] for s in result["samples"]) > POOL // 2, "the pool was never pressed"
