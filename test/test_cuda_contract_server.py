"""The CUDA contract on real servers, seen from inside the scheduler process by test probes
(`test/probes`, loaded as an SGLang plugin): a round's host synchronisations do not grow with
the batch or the model's depth, and a SnapKV window whose queries a layer's hook never saw (as
under a replayed graph) costs that prompt its summary, never the server or its output.

The tiny models cut from SmolLM2 (2 and 4 layers), float32, our CPU backend.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from test.helpers import REPO, assert_same_or_tie, pg19_prompts, run_concurrently, start_together

pytestmark = pytest.mark.server  # starts real SGLang servers

PROMPT_LENS = (180, 200, 220, 240, 260, 280, 300, 320)  # ragged, all past the budget
NEW_TOKENS = 24
MAGICDEC = ("--speculative-algorithm", "MAGICDEC", "--speculative-num-steps", "3")
# Per round, on the worker's path: the host copy of the committed lengths made into a list
# (a host tensor on a GPU too). Everything else a round needs from the host goes to the device
# without waiting, and nothing comes back until the scheduler reads the round's tokens.
MAX_SYNCS_PER_ROUND = 1


def probe_env(probe: dict) -> dict[str, str]:
    paths = [str(REPO / "test" / "probes"), os.environ.get("PYTHONPATH", "")]
    return {
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "MAGICDEC_PROBE": json.dumps(probe),
    }


def tiny_args(model) -> tuple[str, ...]:
    return ("--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "16384")


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return pg19_prompts(tokenizer, PROMPT_LENS)


@pytest.fixture(scope="module")
def deeper_tiny_llama(tmp_path_factory):
    from sglang_magicdec.model import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama-4"), layers=4)


def sampled(server, input_ids, seed: int | None) -> dict:
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.8, "ignore_eos": True}
    if seed is not None:
        params["sampling_seed"] = seed
    return server.generate({"input_ids": input_ids, "sampling_params": params})


def start_recording(server_factory, model, tmp_path, draft: str) -> tuple:
    """A MAGICDEC server whose probe writes each round's host syncs, and the file it writes."""
    path = tmp_path / f"syncs-{draft}-{model.name}.jsonl"
    server = server_factory(
        *tiny_args(model),
        *MAGICDEC,
        "--magicdec-draft",
        draft,
        "--magicdec-budget",
        "64",
        env=probe_env({"host_syncs": str(path)}),
    )
    return server, path


def round_syncs(recording: tuple, prompts) -> dict:
    """{(sampled, batch size): {sync counts per round}} over one request alone, then 8 greedy
    ones together, then 8 sampled ones (4 of them seeded) together."""
    server, path = recording
    try:
        run_concurrently(server, prompts[:1], NEW_TOKENS, ignore_eos=True)
        run_concurrently(server, prompts, NEW_TOKENS, ignore_eos=True)
        with ThreadPoolExecutor(len(prompts)) as pool:
            seeds = [seed if seed % 2 else None for seed in range(len(prompts))]
            list(pool.map(lambda args: sampled(server, *args), zip(prompts, seeds, strict=True)))
    finally:
        server.stop(wait=False)
    rounds = defaultdict(set)
    for line in path.read_text().splitlines():
        record = json.loads(line)
        counts = {k: v for k, v in record.items() if k not in ("batch", "gamma", "sampled")}
        rounds[(record["sampled"], record["batch"])].add(json.dumps(counts, sort_keys=True))
    return {key: [json.loads(c) for c in counts] for key, counts in rounds.items()}


def assert_syncs_do_not_grow_with_batch(rounds: dict) -> None:
    assert (False, 1) in rounds and (False, 8) in rounds and (True, 8) in rounds, rounds
    for key, counts in rounds.items():
        for count in counts:
            assert sum(count.values()) <= MAX_SYNCS_PER_ROUND, (key, count)
    # The same calls at every batch size, greedy or sampled.
    assert len({json.dumps(c, sort_keys=True) for cs in rounds.values() for c in cs}) == 1


def test_snapkv_round_host_syncs_do_not_grow_with_batch_or_depth(
    server_factory, tiny_llama, deeper_tiny_llama, prompts, tmp_path
):
    """Depth is checked with SnapKV, whose draft runs the most per layer: the observer hooks on
    top of the sparse attention path both drafts share."""
    recordings = start_together(
        lambda: start_recording(server_factory, tiny_llama, tmp_path, "snapkv"),
        lambda: start_recording(server_factory, deeper_tiny_llama, tmp_path, "snapkv"),
    )  # one at a time decoding: the other waits idle
    shallow, deep = (round_syncs(recording, prompts) for recording in recordings)
    for rounds in (shallow, deep):
        assert_syncs_do_not_grow_with_batch(rounds)
    assert shallow[(False, 8)] == deep[(False, 8)]


def test_streaming_round_host_syncs_do_not_grow_with_batch(
    server_factory, tiny_llama, prompts, tmp_path
):
    recording = start_recording(server_factory, tiny_llama, tmp_path, "streaming")
    assert_syncs_do_not_grow_with_batch(round_syncs(recording, prompts))


def test_a_layer_whose_hook_never_fires_leaves_serving_exact(server_factory, tiny_llama, prompts):
    """Layer 1's observer hook is silenced: every prompt drafts with the streaming fallback
    (counted, logged), the server keeps serving, and greedy output is the plain server's."""
    snap_args = (*tiny_args(tiny_llama), *MAGICDEC, "--magicdec-draft", "snapkv",
                 "--magicdec-budget", "64")  # fmt: skip
    plain, snap = start_together(
        lambda: server_factory(*tiny_args(tiny_llama)),
        lambda: server_factory(*snap_args, env=probe_env({"silence_layer": 1})),
    )
    try:
        expected = [r["output_ids"] for r in run_concurrently(plain, prompts, NEW_TOKENS)]
        try:
            results = run_concurrently(snap, prompts, NEW_TOKENS)
            for prompt, result, tokens in zip(prompts, results, expected, strict=True):
                assert result["meta_info"]["magicdec_summary"][0]["status"] == "none"
                assert_same_or_tie(plain, prompt, result["output_ids"], tokens, "silenced layer")
            state = requests.get(f"{snap.url}/server_info", timeout=30).json()
            info = state["internal_states"][0]["magicdec"]
            assert info["summaries_computed"] == 0
            assert info["drafts_without_summary"] == len(prompts)
            assert info["verify_rounds"] > 0
            assert "were not captured in layers [1]" in snap.log_path.read_text()
        finally:
            snap.stop(wait=False)
    finally:
        plain.stop(wait=False)
