"""The benchmark suite, one command: throughput AR vs MagicDec (fixed γ and γ = auto) over batch ×
context, the cost model's predicted vs measured speedup, the γ auto picks per point, acceptance vs
draft budget, and the shared-document workload. Writes benchmark/results/suite.md and PNG plots.

    .venv/bin/python -m benchmark.suite                      # the CPU defaults (about 2 hours)
    .venv/bin/python -m benchmark.suite --quick              # a smaller grid (about 25 minutes)
    .venv/bin/python -m benchmark.suite --base-url http://HOST:PORT --contexts 32768 --batches 16 64
                                                             # throughput of one running server
                                                             # (e.g. on a GPU), nothing started

Servers run one after the other (never two at once: this machine has two cores). Each context's
prompts (PG-19, cut to that many tokens) are prefilled once; every batch size then decodes from
the radix cache, so tokens/s is decode only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from tqdm import tqdm

from benchmark.common import DEFAULT_DATA, RESULTS, alpha_of, load_tokenizer, run_batch, save_plot
from sglang_magicdec.cost_model import CostModel
from sglang_magicdec.server_process import ServerProcess, start_server

SOURCE_FILE = {1024: "pg19_4K", 2048: "pg19_4K", 4096: "pg19_8K", 8192: "pg19_16K"}
SPECULATIVE = ["--speculative-algorithm", "MAGICDEC"]


def load_prompts(data: Path, context: int, count: int, tokenizer) -> list[list[int]]:
    name = next((n for length, n in sorted(SOURCE_FILE.items()) if length >= context), "pg19_32K")
    with (data / "pg19" / f"{name}.jsonl").open() as handle:
        texts = [json.loads(line)["text"] for line in handle]
    prompts = [tokenizer(text)["input_ids"][:context] for text in texts]
    prompts = [p for p in prompts if len(p) == context]
    if len(prompts) < count:
        raise SystemExit(f"{name} has only {len(prompts)} documents of {context} tokens")
    return prompts[:count]


def server_magicdec_info(url: str) -> dict:
    state = requests.get(f"{url}/get_server_info", timeout=30).json()
    return state.get("internal_states", [{}])[0].get("magicdec") or {}


def measure_throughput(
    url: str, server: ServerProcess | None, prompts_by_context, batches, new_tokens, progress
) -> list[dict]:
    client = server or ServerProcess(url, None, None)  # type: ignore[arg-type]
    points = []
    for context, prompts in prompts_by_context.items():
        run_batch(client, prompts, 1)  # prefill once; the batches below hit the radix cache
        for batch in batches:
            start = time.perf_counter()
            results = run_batch(client, prompts[:batch], new_tokens + 1)
            elapsed = time.perf_counter() - start
            info = server_magicdec_info(url)
            # The decision for the full batch: requests finish at different rounds, so the last
            # decision is often for a smaller batch.
            size, mean_context = CostModel.bucket(batch, context + new_tokens / 2)
            decision = info.get("gamma_by_bucket", {}).get(
                f"batch<={size},context<={mean_context}", {}
            )
            point = {
                "context": context,
                "batch": batch,
                "tokens_per_s": batch * new_tokens / elapsed,
                "alpha": alpha_of(results, info.get("gamma", 3)) if info else None,
                "gamma": decision.get("gamma"),
                "predicted_speedup": decision.get("predicted_speedup"),
            }
            points.append(point)
            progress.update()
    return points


def throughput_table(rows: dict[str, list[dict]]) -> str:
    modes = [m for m in rows if m != "ar"]
    head = "| context | batch | AR tok/s | " + " | ".join(f"{m} tok/s | {m} / AR" for m in modes)
    lines = [
        head + " | auto γ | auto predicted | α (fixed γ) |",
        "|---" * (3 + 2 * len(modes) + 3) + "|",
    ]
    for i, ar in enumerate(rows["ar"]):
        cells = [str(ar["context"]), str(ar["batch"]), f"{ar['tokens_per_s']:.1f}"]
        for mode in modes:
            point = rows[mode][i]
            cells += [
                f"{point['tokens_per_s']:.1f}",
                f"{point['tokens_per_s'] / ar['tokens_per_s']:.2f}x",
            ]
        auto = rows.get("auto", [None] * len(rows["ar"]))[i]
        fixed = rows.get("fixed", [None] * len(rows["ar"]))[i]
        cells.append(str(auto["gamma"]) if auto else "-")
        cells.append(
            f"{auto['predicted_speedup']:.2f}x" if auto and auto["predicted_speedup"] else "-"
        )
        cells.append(f"{fixed['alpha']:.3f}" if fixed and fixed["alpha"] is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_script(module: str, args: list[str]) -> None:
    """Run another benchmark of the suite in its own process (it starts its own servers)."""
    subprocess.run([sys.executable, "-m", module, *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--quick", action="store_true", help="a smaller grid, for CPU")
    parser.add_argument("--contexts", type=int, nargs="+")
    parser.add_argument("--batches", type=int, nargs="+")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--base-url", help="measure this running server's throughput only")
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--skip-shared-doc", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    contexts = args.contexts or ([1024, 4096] if args.quick else [1024, 4096, 8192])
    batches = args.batches or ([1, 8] if args.quick else [1, 4, 8, 16])
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = load_tokenizer()
    prompts = {c: load_prompts(args.data, c, max(batches), tokenizer) for c in contexts}
    if args.base_url:
        modes = {"server": None}
    else:
        gamma = ["--speculative-num-steps", str(args.gamma)]
        modes = {
            "ar": [],
            "fixed": [*SPECULATIVE, *gamma],
            "auto": [*SPECULATIVE, *gamma, "--magicdec-gamma", "auto"],
        }
    progress = tqdm(total=len(modes) * len(contexts) * len(batches), desc="throughput", unit="pt")
    rows: dict[str, list[dict]] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-suite-"))
    for mode, mode_args in modes.items():
        if mode_args is None:
            rows[mode] = measure_throughput(
                args.base_url, None, prompts, batches, args.new_tokens, progress
            )
            continue
        server = start_server(["--dtype", "float32", *mode_args], log_dir)
        try:
            rows[mode] = measure_throughput(
                server.url, server, prompts, batches, args.new_tokens, progress
            )
        finally:
            server.stop()
    progress.close()
    (args.out / "throughput.json").write_text(json.dumps(rows, indent=2))
    if args.base_url:
        print(json.dumps(rows, indent=2))
        return

    sections = [
        f"# Benchmark suite (CPU, float32, SmolLM2-135M, γ={args.gamma}, {args.new_tokens} "
        "new tokens, greedy, default draft)\n",
        "## Throughput: AR vs MagicDec (fixed γ and γ = auto)\n",
        throughput_table(rows),
    ]
    series = {}
    for mode in ("fixed", "auto"):
        for context in contexts:
            points = [
                (a, m)
                for a, m in zip(rows["ar"], rows[mode], strict=True)
                if a["context"] == context
            ]
            series[f"{mode}, context {context}"] = (
                [a["batch"] for a, _ in points],
                [m["tokens_per_s"] / a["tokens_per_s"] for a, m in points],
            )
    save_plot(
        args.out / "throughput.png", series, "batch size", "MagicDec / AR tokens/s", log_x=True
    )
    measured = [
        m["tokens_per_s"] / a["tokens_per_s"] for a, m in zip(rows["ar"], rows["auto"], strict=True)
    ]
    predicted = [m["predicted_speedup"] or 1.0 for m in rows["auto"]]
    save_plot(
        args.out / "cost_model.png",
        {"auto: predicted vs measured": (predicted, measured), "y = x": ([0.5, 2], [0.5, 2])},
        "predicted speedup (cost model)",
        "measured speedup over AR",
    )
    sections.append(
        "\nCost model: predicted (the server's decision for the full batch) vs measured speedup "
        "of γ = auto over AR: "
        + ", ".join(f"{p:.2f}→{m:.2f}" for p, m in zip(predicted, measured, strict=True))
    )
    if not args.skip_acceptance:
        acceptance = ["--datasets", "pg19_4K", "--docs", "2"] if args.quick else []
        run_script(
            "benchmark.bench_acceptance", [*acceptance, "--out", str(args.out / "acceptance")]
        )
        sections += ["\n## Acceptance vs budget\n", (args.out / "acceptance.md").read_text()]
    if not args.skip_shared_doc:
        run_script("benchmark.bench_shared_doc", ["--out", str(args.out / "shared_doc")])
        sections += ["\n## Shared document\n", (args.out / "shared_doc.md").read_text()]
    (args.out / "suite.md").write_text("\n".join(sections) + "\n")
    print("\n".join(sections))


if __name__ == "__main__":
    main()
