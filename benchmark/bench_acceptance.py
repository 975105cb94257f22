"""Acceptance vs draft budget, StreamingLLM and SnapKV, on PG-19 and BookSum, on the CPU server.

    .venv/bin/python benchmark/bench_acceptance.py [--budgets 256 512 1024 2048]
        [--datasets pg19_4K pg19_8K booksum_4K booksum_8K] [--docs 4] [--new-tokens 64]

One server per (draft, budget), never two at once (two cores). Each dataset's first `--docs`
documents, cut to the dataset's length in SmolLM2 tokens (at most the model's 8K context minus the
generation), decode `--new-tokens` greedy tokens concurrently. α is the per-token acceptance that
the mean tokens per verify round implies. Writes benchmark/results/acceptance.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tqdm import tqdm

from benchmark.common import (
    DEFAULT_DATA,
    RESULTS,
    alpha_of,
    load_tokenizer,
    run_batch,
    save_plot,
)
from benchmark.server_process import start_server

DATASETS = {
    "pg19_4K": ("pg19/pg19_4K.jsonl", 4096),
    "pg19_8K": ("pg19/pg19_8K.jsonl", 8192),
    "booksum_4K": ("booksum/booksum_4096.jsonl", 4096),
    "booksum_8K": ("booksum/booksum_8192.jsonl", 8192),
}
MODEL_CONTEXT = 8192


def load_dataset(data: Path, name: str, docs: int, tokenizer, new_tokens: int) -> list[list[int]]:
    path, length = DATASETS[name]
    length = min(length, MODEL_CONTEXT - new_tokens - 8)
    with (data / path).open() as handle:
        texts = [json.loads(line)["text"] for line in handle][:docs]
    return [tokenizer(text)["input_ids"][:length] for text in texts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--drafts", nargs="+", default=["streaming", "snapkv"])
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "acceptance")
    args = parser.parse_args()

    tokenizer = load_tokenizer()
    prompts = {
        name: load_dataset(args.data, name, args.docs, tokenizer, args.new_tokens)
        for name in args.datasets
    }
    log_dir = Path(tempfile.mkdtemp(prefix="bench-acceptance-"))
    rows = []
    configs = [(draft, budget) for draft in args.drafts for budget in args.budgets]
    progress = tqdm(total=len(configs) * len(prompts), desc="acceptance", unit="run")
    for draft, budget in configs:
        server = start_server(
            [
                "--dtype",
                "float32",
                "--speculative-algorithm",
                "MAGICDEC",
                "--speculative-num-steps",
                str(args.gamma),
                "--magicdec-draft",
                draft,
                "--magicdec-budget",
                str(budget),
            ],
            log_dir,
        )
        try:
            for name, dataset in prompts.items():
                results = run_batch(server, dataset, args.new_tokens)
                alpha = alpha_of(results, args.gamma)
                rows.append({"draft": draft, "budget": budget, "dataset": name, "alpha": alpha})
                progress.write(f"{draft:9s} budget {budget:5d} {name:10s} α = {alpha:.3f}")
                progress.update()
        finally:
            server.stop()
    progress.close()

    header = "| dataset | draft | " + " | ".join(f"budget {b}" for b in args.budgets) + " |"
    lines = [header, "|---|---|" + "---|" * len(args.budgets)]
    for name in prompts:
        for draft in args.drafts:
            alphas = {
                r["budget"]: r["alpha"] for r in rows if (r["draft"], r["dataset"]) == (draft, name)
            }
            lines.append(
                f"| {name} | {draft} | "
                + " | ".join(f"{alphas[b]:.3f}" for b in args.budgets)
                + " |"
            )
    table = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(
        json.dumps(
            {"args": vars(args) | {"data": str(args.data), "out": str(args.out)}, "rows": rows},
            indent=2,
        )
    )
    args.out.with_suffix(".md").write_text(
        f"Per-token acceptance α, γ={args.gamma}, {args.docs} documents per dataset, "
        f"{args.new_tokens} greedy tokens.\n\n{table}\n"
    )
    series = {
        f"{draft} {name}": (
            args.budgets,
            [
                next(
                    r["alpha"]
                    for r in rows
                    if (r["draft"], r["dataset"], r["budget"]) == (draft, name, b)
                )
                for b in args.budgets
            ],
        )
        for draft in args.drafts
        for name in prompts
    }
    save_plot(
        args.out.with_suffix(".png"),
        series,
        "draft budget (tokens)",
        "per-token acceptance α",
        log_x=True,
    )
    print(table)


if __name__ == "__main__":
    main()
