"""Helpers the tests share: requests to real servers, greedy-exactness checks, α, PG-19 data.

Fixtures live in `conftest.py`; plain functions and constants live here, imported by name.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
import torch

from sglang_magicdec.cost_model import alpha_from_accept_length

REPO = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("MAGICDEC_DATA", REPO.parent / "shared" / "data"))

GAMMA = 3

# Tests of our CPU platform's defaults only hold on a machine without a GPU (there SGLang's CUDA
# platform is active and our plugin stays out of the way).
ON_CPU_MACHINE = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="checks our CPU platform's defaults; a CUDA machine runs SGLang's CUDA platform",
)
# float32 and a fixed pool, so MAGICDEC and plain servers compute the same thing.
POOL_ARGS = ("--dtype", "float32", "--max-total-tokens", "60000")


def pg19_acceptance_prompts(tokenizer) -> list[list[int]]:
    """The README's acceptance setting: the first 6 PG-19 4K documents cut to 16,000
    characters (~3.7K tokens)."""
    return [tokenizer(text[:16000])["input_ids"] for text in pg19_texts("4K", count=6)]


def greedy(server, input_ids, max_new_tokens, **params) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, **params}
    return server.generate({"input_ids": input_ids, "sampling_params": sampling})


def run_concurrently(server, prompts, max_new_tokens, **params) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: greedy(server, ids, max_new_tokens, **params), prompts))


def flush_when_idle(server, timeout_s: float = 60) -> dict:
    """Flush the radix cache once no request runs (SGLang refuses a flush while requests run)
    and return the server's load then; `num_used_tokens` 0 means no KV is left allocated."""
    deadline = time.monotonic() + timeout_s
    while True:
        flushed = requests.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
        load = requests.get(f"{server.url}/v1/loads", timeout=30).json()["loads"][0]
        if (flushed and load["num_running_reqs"] == 0) or time.monotonic() > deadline:
            return load
        time.sleep(1)


def top2_gap(server, context: list[int]) -> float:
    """Logit gap between the two most likely next tokens (logprob gap: same normaliser)."""
    result = server.generate(
        {
            "input_ids": context,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "top_logprobs_num": 2,
            "logprob_start_len": len(context) - 1,
        }
    )
    (first, _, _), (second, _, _) = result["meta_info"]["output_top_logprobs"][0][:2]
    return first - second


TIE_GAP = 1e-4


def assert_same_or_tie(plain, prompt, got, expected, label):
    """Outputs must match; a divergence is allowed only at a numerical tie of the target."""
    diverge = next((i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None)
    if diverge is None:
        assert len(got) == len(expected), f"{label}: lengths {len(got)} != {len(expected)}"
        return
    gap = top2_gap(plain, prompt + expected[:diverge])
    assert gap < TIE_GAP, (
        f"{label}: diverged at token {diverge} where the target's top-2 gap is {gap:.3g} "
        f"(not a tie): got {got[diverge]}, expected {expected[diverge]}"
    )


def measured_alpha(results: list[dict], gamma: int = GAMMA) -> float:
    """Per-token acceptance α from the verify rounds and accepted drafts SGLang reports."""
    rounds = sum(r["meta_info"]["spec_verify_ct"] for r in results)
    correct = sum(r["meta_info"]["spec_num_correct_drafts"] for r in results)
    return alpha_from_accept_length(1 + correct / rounds, gamma)


def pg19_texts(length: str = "4K", count: int = 20) -> list[str]:
    path = DATA_DIR / "pg19" / f"pg19_{length}.jsonl"
    if not path.is_file():
        pytest.skip(f"PG-19 data not found at {path} (set MAGICDEC_DATA to the shared/data folder)")
    with path.open() as handle:
        return [json.loads(line)["text"] for line in handle][:count]


# A 2-layer Llama with even head counts (4 query / 2 KV heads, head dim 64) cut out of the
# embedded model's real weights: small enough for Triton's CPU interpreter, and its logits are
# peaked like a trained model's (random dummy weights would make greedy decoding a chain of ties).
TINY_LAYERS, TINY_Q_HEADS, TINY_KV_HEADS = 2, (0, 1, 3, 4), (0, 1)


def tiny_llama(folder: Path) -> Path:
    """Write the tiny model into `folder` (config, safetensors, the embedded tokenizer)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from sglang_magicdec.model import embedded_model_path

    source = Path(embedded_model_path())
    config = json.loads((source / "config.json").read_text())
    head_dim = config["head_dim"]

    def rows(heads):
        return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])

    q_rows, kv_rows = rows(TINY_Q_HEADS), rows(TINY_KV_HEADS)
    tensors = {}
    with safe_open(str(source / "model.safetensors"), "pt") as weights:
        for name in weights.keys():
            if ".layers." in name and int(name.split(".layers.")[1].split(".")[0]) >= TINY_LAYERS:
                continue
            tensor = weights.get_tensor(name)
            if name.endswith("q_proj.weight"):
                tensor = tensor[q_rows]
            elif name.endswith(("k_proj.weight", "v_proj.weight")):
                tensor = tensor[kv_rows]
            elif name.endswith("o_proj.weight"):
                tensor = tensor[:, q_rows]
            tensors[name] = tensor.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.update(
        num_hidden_layers=TINY_LAYERS,
        num_attention_heads=len(TINY_Q_HEADS),
        num_key_value_heads=len(TINY_KV_HEADS),
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, folder / name)
    return folder
