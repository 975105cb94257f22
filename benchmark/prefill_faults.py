"""A prefill's CPU time in the kernel: a plain server's scheduler prefills distinct PG-19 prompts
one at a time, and each prefill's wall time, the scheduler's user and system CPU time and its
resident memory are read from /proc, under each allocator environment given, servers in turn.

glibc returns every freed block over 32 MiB to the kernel, so each layer of a prefill faults its
activations in again, zeroed (a 4,096-token chunk of the 0.5B's MLP is 160 MB); the system column
is that cost. The variants are environments for the server (its scheduler inherits them):

    .venv/bin/python -m benchmark.prefill_faults                  # Qwen fp32, 3 x 4,090 tokens
    .venv/bin/python -m benchmark.prefill_faults --variant THP_MEM_ALLOC_ENABLE=1 \
        --variant GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from benchmark.common import DEFAULT_DATA, MODELS
from benchmark.server_process import start_server
from benchmark.suite import load_prompts
from sglang_magicdec.model import embedded_model_path


def scheduler_times(server) -> tuple[float, float, float]:
    """(user s, system s, resident GB) of the server's scheduler process."""
    scheduler = server.scheduler()
    cpu = scheduler.cpu_times()
    return cpu.user, cpu.system, scheduler.memory_info().rss / 1e9


def measure(env: dict[str, str], prompts: list[list[int]], args, log_dir: Path) -> list[dict]:
    server_args = ["--dtype", args.dtype, "--max-total-tokens", str(args.tokens * 2 + 1024)]
    server = start_server(server_args, log_dir, env=env, model=MODELS[args.model].name)
    rows = []
    try:
        for ids in prompts:
            user, system, _ = scheduler_times(server)
            start = time.monotonic()
            server.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
            wall = time.monotonic() - start
            user_after, system_after, rss = scheduler_times(server)
            used = {"user": user_after - user, "system": system_after - system}
            rows.append({"wall": wall, **used, "rss": rss})
    finally:
        server.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tokens", type=int, default=4090, help="per prompt (one chunk: 4,096)")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path(MODELS[args.model]))
    prompts = load_prompts(DEFAULT_DATA, args.tokens, args.prompts, tokenizer)
    variants = {"glibc defaults": {}}
    for variant in args.variant:
        variants[variant] = dict(pair.split("=", 1) for pair in variant.split(","))
    print(f"{args.model} {args.dtype}, {args.prompts} prompts of {args.tokens} tokens, one by one")
    print("| environment | wall s per prefill | scheduler user s | system s | resident GB |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as log_dir:
        for name, env in variants.items():
            rows = measure(env, prompts, args, Path(log_dir))
            cells = [
                " / ".join(f"{row[key]:.1f}" for row in rows) for key in ("wall", "user", "system")
            ]
            median = statistics.median(row["wall"] for row in rows)
            print(f"| {name} | {cells[0]} (median {median:.1f}) | {cells[1]} | {cells[2]} | "
                  f"{rows[-1]['rss']:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
