"""Autoregressive decoding vs MAGICDEC on the CPU server, side by side in one run.

    .venv/bin/python benchmark/bench_magicdec.py [--contexts 2048 4096 8000] [--batches 1 4 8]

For each server (AR first, then MAGICDEC, never both at once: two cores) and each context length,
the prompts (PG-19 documents cut to that many tokens) are prefilled once, then each batch size
decodes `--new-tokens` tokens from the radix cache. Prints decode tokens/s of both, their ratio,
mean tokens per verify round and the per-token acceptance α that round length implies.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sglang_magicdec.cost_model import alpha_from_accept_length
from sglang_magicdec.model import embedded_model_path
from sglang_magicdec.server_process import ServerProcess, start_server

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
# PG-19 files long enough for each context (SmolLM2 tokens run a little longer than Llama-3's).
SOURCE_FILE = {2048: "pg19_4K", 4096: "pg19_8K", 8000: "pg19_16K"}


def load_prompts(data: Path, context: int, count: int, tokenizer) -> list[list[int]]:
    name = next(name for length, name in sorted(SOURCE_FILE.items()) if length >= context)
    with (data / "pg19" / f"{name}.jsonl").open() as handle:
        texts = [json.loads(line)["text"] for line in handle][:count]
    prompts = [tokenizer(text)["input_ids"][:context] for text in texts]
    assert all(len(p) == context for p in prompts), f"{name} has documents shorter than {context}"
    return prompts


def run_batch(server: ServerProcess, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(
            pool.map(
                lambda ids: server.generate({"input_ids": ids, "sampling_params": params}), prompts
            )
        )


def measure(server: ServerProcess, prompts_by_context, batches, new_tokens) -> dict:
    points = {}
    for context, prompts in prompts_by_context.items():
        run_batch(server, prompts, 1)  # prefill once; every batch below hits the radix cache
        for batch in batches:
            start = time.perf_counter()
            results = run_batch(server, prompts[:batch], new_tokens + 1)
            elapsed = time.perf_counter() - start
            rounds = sum(r["meta_info"].get("spec_verify_ct", 0) for r in results)
            correct = sum(r["meta_info"].get("spec_num_correct_drafts", 0) for r in results)
            points[(context, batch)] = {
                "tokens_per_s": batch * new_tokens / elapsed,
                "tokens_per_round": 1 + correct / rounds if rounds else None,
            }
            print(f"  ctx {context} batch {batch}: {points[(context, batch)]}", flush=True)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/magicdec.json"))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    count = max(args.batches)
    prompts_by_context = {c: load_prompts(args.data, c, count, tokenizer) for c in args.contexts}
    modes = {
        "ar": [],
        "magicdec": [
            "--speculative-algorithm",
            "MAGICDEC",
            "--speculative-num-steps",
            str(args.gamma),
            "--magicdec-budget",
            str(args.budget),
        ],
    }
    log_dir = Path(tempfile.mkdtemp(prefix="bench-magicdec-"))
    results = {}
    for mode, mode_args in modes.items():
        print(f"{mode}:", flush=True)
        server = start_server([*args.server_args, *mode_args], log_dir)
        try:
            results[mode] = measure(server, prompts_by_context, args.batches, args.new_tokens)
        finally:
            server.stop()

    rows = []
    for context in args.contexts:
        for batch in args.batches:
            ar, spec = results["ar"][(context, batch)], results["magicdec"][(context, batch)]
            per_round = spec["tokens_per_round"]
            alpha = alpha_from_accept_length(per_round, args.gamma) if per_round else None
            rows.append(
                {
                    "context": context,
                    "batch": batch,
                    "ar_tokens_per_s": ar["tokens_per_s"],
                    "magicdec_tokens_per_s": spec["tokens_per_s"],
                    "speedup": spec["tokens_per_s"] / ar["tokens_per_s"],
                    "tokens_per_round": per_round,
                    "alpha": alpha,
                }
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
    )
    print(
        f"\nstreaming draft, budget {args.budget}, γ={args.gamma}, "
        f"{args.new_tokens} new tokens, greedy"
    )
    print("| context | batch | AR tok/s | MagicDec tok/s | MagicDec / AR | tokens/round | α |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['context']} | {row['batch']} | {row['ar_tokens_per_s']:.1f} | "
            f"{row['magicdec_tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
            f"{row['tokens_per_round']:.2f} | {row['alpha']:.3f} |"
        )


if __name__ == "__main__":
    main()
