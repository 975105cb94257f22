"""Acceptance under tensor parallelism, and what a `sampling_seed` costs in acceptance.

    .venv/bin/python -m benchmark.bench_scale_out [--parts tp seeded] [--new-tokens 64]

tp       the tiny model cut from SmolLM2 (2 KV heads, `python -m sglang_magicdec.model
         tiny-llama`), StreamingLLM and SnapKV at budget 256, γ = 3, at TP 1 and TP 2: α and
         whether the greedy tokens are the same. Each rank selects for its own KV heads, so α
         should not move with the TP degree.
seeded   SmolLM2, SnapKV at budget 512, γ = 3, sampled at two temperatures: α of the same
         requests by rejection sampling (no seed) and by the seeded race (`sampling_seed`).

6 PG-19 documents decoded at once; one server at a time (two cores). Writes
benchmark/results/scale_out.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmark.common import DEFAULT_DATA, RESULTS, alpha_of, load_tokenizer, run_batch
from benchmark.server_process import start_server
from sglang_magicdec.model import write_tiny_llama

GAMMA = 3
TINY_PROMPT_TOKENS = (1700, 2300, 1900, 2100, 1800, 2200)
TEMPERATURES = (0.6, 1.0)


def pg19(data: Path, count: int) -> list[str]:
    with (data / "pg19" / "pg19_4K.jsonl").open() as handle:
        return [json.loads(line)["text"] for line in handle][:count]


def tp_rows(data: Path, tokenizer, new_tokens: int, log_dir: Path) -> list[str]:
    model = write_tiny_llama(log_dir / "tiny-llama")
    texts = pg19(data, len(TINY_PROMPT_TOKENS))
    prompts = [
        tokenizer(text)["input_ids"][:length]
        for text, length in zip(texts, TINY_PROMPT_TOKENS, strict=True)
    ]
    rows = ["| draft | α TP 1 | α TP 2 | same greedy tokens |", "|---|---|---|---|"]
    for draft in ("streaming", "snapkv"):
        alphas, outputs = [], []
        for tp in ("1", "2"):
            server = start_server(
                ["--model-path", str(model), "--dtype", "float32", "--max-total-tokens", "30000",
                 "--tp", tp, "--speculative-algorithm", "MAGICDEC", "--magicdec-draft", draft,
                 "--magicdec-budget", "256", "--speculative-num-steps", str(GAMMA)],
                log_dir,
            )  # fmt: skip
            try:
                results = run_batch(server, prompts, new_tokens)
            finally:
                server.stop()
            alphas.append(alpha_of(results, GAMMA))
            outputs.append([result["output_ids"] for result in results])
        rows.append(f"| {draft} | {alphas[0]:.3f} | {alphas[1]:.3f} | {outputs[0] == outputs[1]} |")
        print(rows[-1], flush=True)
    return rows


def sampled(server, prompts, new_tokens: int, temperature: float, seeded: bool) -> list[dict]:
    def one(index: int) -> dict:
        params = {"max_new_tokens": new_tokens, "temperature": temperature, "ignore_eos": True}
        if seeded:
            params["sampling_seed"] = index
        return server.generate({"input_ids": prompts[index], "sampling_params": params})

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def seeded_rows(data: Path, tokenizer, new_tokens: int, log_dir: Path) -> list[str]:
    prompts = [tokenizer(text[:16000])["input_ids"] for text in pg19(data, 6)]
    server = start_server(
        ["--dtype", "float32", "--max-total-tokens", "60000", "--speculative-algorithm",
         "MAGICDEC", "--magicdec-budget", "512", "--speculative-num-steps", str(GAMMA)],
        log_dir,
    )  # fmt: skip
    rows = ["| temperature | α rejection sampling | α seeded race |", "|---|---|---|"]
    try:
        for temperature in TEMPERATURES:
            plain = alpha_of(sampled(server, prompts, new_tokens, temperature, False), GAMMA)
            seeded = alpha_of(sampled(server, prompts, new_tokens, temperature, True), GAMMA)
            rows.append(f"| {temperature} | {plain:.3f} | {seeded:.3f} |")
            print(rows[-1], flush=True)
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--parts", nargs="+", default=["tp", "seeded"], choices=["tp", "seeded"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS / "scale_out.md")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="bench-scale-out-"))
    tokenizer = load_tokenizer()  # the tiny model's too
    sections = []
    if "tp" in args.parts:
        rows = tp_rows(args.data, tokenizer, args.new_tokens, log_dir)
        sections.append(
            "## Acceptance at TP 1 and TP 2 (tiny model, 6 PG-19 prompts of 1.7K–2.3K tokens, "
            f"{args.new_tokens} greedy tokens, γ = {GAMMA}, budget 256)\n\n" + "\n".join(rows)
        )
    if "seeded" in args.parts:
        rows = seeded_rows(args.data, tokenizer, args.new_tokens, log_dir)
        sections.append(
            "## Rejection sampling vs the seeded race (SmolLM2, 6 PG-19 prompts of ~3.7K tokens, "
            f"{args.new_tokens} sampled tokens, SnapKV budget 512, γ = {GAMMA})\n\n"
            + "\n".join(rows)
        )
    command = "python -m benchmark.bench_scale_out --parts " + " ".join(args.parts)
    args.out.write_text(
        f"# Scale-out and seeded sampling\n\n`{command}`\n\n" + "\n\n".join(sections) + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
