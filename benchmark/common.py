"""What the benchmark scripts share: data paths, the tokenizer, concurrent requests, α, plots."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmark.server_process import ServerProcess
from sglang_magicdec.cost_model import alpha_from_accept_length
from sglang_magicdec.model import QWEN_CODER, SMOLLM2, embedded_model_path

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
RESULTS = Path(__file__).resolve().parent / "results"
# The embedded models (`sglang_magicdec.model.EMBEDDED_MODELS`) by the short names the benchmark
# commands' `--model` takes.
MODELS = {"smollm2": SMOLLM2, "qwen": QWEN_CODER}
# The servers a serving benchmark compares: plain decoding and MagicDec at a fixed γ = 3.
AR_AND_MAGICDEC = {
    "ar": [],
    "magicdec": ["--speculative-algorithm", "MAGICDEC", "--magicdec-gamma", "3"],
}


def best_seconds(fn: Callable[[], object], tries: int = 5) -> float:
    """The fastest of `tries` timed calls of `fn`, after one untimed (noise only adds time)."""
    fn()
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def load_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_model_path(SMOLLM2))


def run_batch(
    server: ServerProcess,
    prompts: list[list[int]],
    new_tokens: int,
    sampling: dict | None = None,
) -> list[dict]:
    """All prompts at once (one ragged batch on the server): greedy, or with `sampling`'s
    sampling parameters."""
    params = {"temperature": 0, **(sampling or {})}
    params.update(max_new_tokens=new_tokens, ignore_eos=True)
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(
                lambda ids: server.generate({"input_ids": ids, "sampling_params": params}), prompts
            )
        )


def stream_chunks(response: requests.Response) -> Iterator[tuple[float, dict]]:
    """(arrival time, chunk) per chunk of a streamed SGLang or OpenAI-API response, as each
    arrives (`time.perf_counter()`): its `data: {...}` lines, without the closing `[DONE]`."""
    for line in response.iter_lines():
        if line.startswith(b"data: {"):
            yield time.perf_counter(), json.loads(line[len(b"data: ") :])


def magicdec_info(url: str, timeout: float = 30) -> dict:
    """The `magicdec` section of a server's `/server_info` ({} without MAGICDEC)."""
    state = requests.get(f"{url}/server_info", timeout=timeout).json()
    return state.get("internal_states", [{}])[0].get("magicdec") or {}


def accept_length_between(before: dict, after: dict) -> float | None:
    """Tokens per request round of the speculative rounds a server ran between two of its
    `magicdec_info`s (None: none ran). Not SGLang's per-request `spec_verify_ct`, which counts
    every decode batch of a speculative server, plain steps (γ = 0) included."""
    rounds = after["verify_rounds"] - before.get("verify_rounds", 0)
    if not rounds:
        return None
    accepted = after["avg_accept_length"] * after["verify_rounds"]
    return (accepted - before.get("avg_accept_length", 0) * before.get("verify_rounds", 0)) / rounds


def alpha_of(results: list[dict], gamma: int) -> float:
    """Per-token acceptance implied by the mean tokens per verify round of these requests."""
    rounds = sum(r["meta_info"].get("spec_verify_ct", 0) for r in results)
    correct = sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in results)
    return alpha_from_accept_length(1 + correct / rounds, gamma) if rounds else float("nan")


def save_plot(
    path: Path, series: dict[str, tuple[list, list]], x_label: str, y_label: str, log_x=False
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, (xs, ys) in series.items():
        axes.plot(xs, ys, marker="o", label=label)
    if log_x:
        axes.set_xscale("log", base=2)
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
