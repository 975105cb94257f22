"""Online traffic as SGLang's users measure it: `python -m sglang.benchmark.serving` (the client
`sglang.bench_serving` now names) against an AR and a MAGICDEC server, at request rates, with
prompts of mixed length cut from BookSum chapters, at Qwen2.5's published sampling (SmolLM2
publishes none): TTFT, TPOT and ITL at P50 / P99, output throughput and goodput.

    python -m benchmark.online                                  # SmolLM2, 1K-7K prompts
    python -m benchmark.online --rates 0.02 0.04 --num-prompts 16

Both servers stay up; at each rate AR and MagicDec take turns (one runs at a time), from the
same dataset file and the same seed, so both see the same prompts at the same arrival times.
Each server's radix cache is flushed before a run. The SLO for goodput is TPOT <= 1.5x the
idle AR server's TPOT (one request of a middle-length prompt, measured first).
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from benchmark.common import (
    AR_AND_MAGICDEC,
    DEFAULT_DATA,
    MODELS,
    RESULTS,
    magicdec_info,
    stream_chunks,
)
from benchmark.server_process import ServerProcess, start_server
from sglang_magicdec.model import embedded_model_path

# Qwen2.5-Instruct's published generation settings (the converted Qwen folder carries them).
SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
TPOT_SLO_FACTOR = 1.5
METRICS = [
    "completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
    "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "request_goodput", "slo_attainment",
]  # fmt: skip


def build_dataset(model_path: str, data: Path, args, path: Path) -> list[tuple[int, int]]:
    """`--num-prompts` conversations in the client's custom format: a BookSum chapter (its
    summarising instruction first) cut to a random length, and a reference summary cut to a
    random length (the client asks for as many tokens as the reply has)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = []
    for name in ("booksum_4096.jsonl", "booksum_8192.jsonl"):
        rows += [json.loads(line) for line in (data / "booksum" / name).open()]
    rows = [row for row in rows if row.get("answer")]
    rng = random.Random(args.seed)
    rng.shuffle(rows)
    shapes, lines = [], []
    for index in range(args.num_prompts):
        row = rows[index % len(rows)]
        prompt_ids = tokenizer(row["text"], add_special_tokens=False)["input_ids"]
        prompt_len = min(rng.randint(args.min_prompt, args.max_prompt), len(prompt_ids))
        answer_ids = tokenizer(row["answer"] * 4, add_special_tokens=False)["input_ids"]
        output_len = rng.randint(args.min_output, args.max_output)
        user = tokenizer.decode(prompt_ids[:prompt_len])
        reply = tokenizer.decode(answer_ids[:output_len])
        shapes.append((prompt_len, len(tokenizer(reply, add_special_tokens=False)["input_ids"])))
        lines.append(json.dumps({"conversations": [
            {"role": "user", "content": user}, {"role": "assistant", "content": reply},
        ]}))  # fmt: skip
    path.write_text("\n".join(lines) + "\n")
    return shapes


def idle_tpot_ms(server: ServerProcess, prompt_tokens: int, output_tokens: int = 64) -> float:
    """TPOT of one request alone on the server (streamed; first token excluded)."""
    ids = list(range(1000, 1000 + prompt_tokens))  # distinct tokens: no radix hit on later runs
    payload = {
        "input_ids": ids,
        "sampling_params": {**SAMPLING, "max_new_tokens": output_tokens, "ignore_eos": True},
        "stream": True,
    }
    with requests.post(f"{server.url}/generate", json=payload, stream=True, timeout=900) as r:
        chunks = list(stream_chunks(r))
    (first, _), (last, chunk) = chunks[0], chunks[-1]
    return 1e3 * (last - first) / (chunk["meta_info"]["completion_tokens"] - 1)


def run_client(
    server: ServerProcess,
    model_path: str,
    dataset: Path,
    rate: float,
    args,
    slo_ms: float,
    out: Path,
) -> dict:
    requests.post(f"{server.url}/flush_cache", timeout=60)
    command = [
        sys.executable, "-m", "sglang.benchmark.serving", "--backend", "sglang-oai-chat",
        "--base-url", server.url, "--model", model_path, "--tokenizer", model_path,
        "--dataset-name", "custom", "--dataset-path", str(dataset),
        "--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
        "--seed", str(args.seed), "--extra-request-body", json.dumps(SAMPLING),
        "--goodput", f"tpot:{slo_ms:.1f}", "--output-file", str(out), "--disable-tqdm",
        "--warmup-requests", "0",
    ]  # fmt: skip
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.03, 0.06])
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--min-prompt", type=int, default=1024)
    parser.add_argument("--max-prompt", type=int, default=7000)
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=2048, help="--chunked-prefill-size")
    parser.add_argument("--prefill-decode-interval", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, default=RESULTS / "online")
    args = parser.parse_args()

    model_path = str(embedded_model_path(MODELS[args.model]))
    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="online-"))
    dataset = logs / f"{args.model}_dataset.jsonl"  # rebuilt from the seed each run
    shapes = build_dataset(model_path, args.data, args, dataset)
    print(f"{len(shapes)} prompts: {sorted(shapes)}", flush=True)
    pool = args.num_prompts * (args.max_prompt + args.max_output + 64)
    common = [
        "--model-path", model_path, "--dtype", args.dtype, "--max-total-tokens", str(pool),
        "--chunked-prefill-size", str(args.chunk),
        "--prefill-decode-interval", str(args.prefill_decode_interval),
    ]  # fmt: skip
    servers = {
        mode: start_server([*common, *extra], logs, 900) for mode, extra in AR_AND_MAGICDEC.items()
    }
    try:
        idle = idle_tpot_ms(servers["ar"], (args.min_prompt + args.max_prompt) // 2)
        slo_ms = TPOT_SLO_FACTOR * idle
        print(f"idle AR TPOT {idle:.1f} ms: SLO TPOT <= {slo_ms:.1f} ms", flush=True)
        rows = []
        for rate in args.rates:
            for mode, server in servers.items():
                out = args.out / f"{args.model}_{mode}_rate{rate}.jsonl"
                out.unlink(missing_ok=True)
                result = run_client(server, model_path, dataset, rate, args, slo_ms, out)
                row = {"mode": mode, "rate": rate, **{k: result.get(k) for k in METRICS}}
                if mode != "ar":
                    row["accept_length"] = magicdec_info(server.url).get("avg_accept_length")
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        for server in servers.values():
            server.stop()
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "idle_ar_tpot_ms": idle,
               "slo_tpot_ms": slo_ms, "shapes": shapes, "rows": rows}  # fmt: skip
    (args.out / f"{args.model}_summary.json").write_text(json.dumps(summary, indent=1))
    print(table(rows, slo_ms))


def table(rows: list[dict], slo_ms: float) -> str:
    lines = [
        "| rate req/s | mode | done | out tok/s | TTFT P50 / P99 s | TPOT P50 / P99 ms "
        f"| ITL P50 / P99 ms | goodput req/s (TPOT <= {slo_ms:.0f} ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['rate']} | {row['mode']} | {row['completed']} "
            f"| {row['output_throughput']:.1f} "
            f"| {row['median_ttft_ms'] / 1e3:.1f} / {row['p99_ttft_ms'] / 1e3:.1f} "
            f"| {row['median_tpot_ms']:.0f} / {row['p99_tpot_ms']:.0f} "
            f"| {row['median_itl_ms']:.0f} / {row['p99_itl_ms']:.0f} "
            f"| {row['request_goodput']:.4f} ({100 * row['slo_attainment']:.0f}%) |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
