"""The benchmark suite, one command: throughput AR vs MagicDec (fixed γ and γ = auto) over batch ×
context, the cost model's predicted vs measured speedup, the γ auto picks per point, acceptance vs
draft budget, and the shared-document workload. Writes benchmark/results/suite.md and PNG plots.

    .venv/bin/python -m benchmark.suite                      # the CPU defaults (about 2 hours)
    .venv/bin/python -m benchmark.suite --quick              # a smaller grid
    .venv/bin/python -m benchmark.suite --dtype bfloat16     # weights and KV in bf16
    .venv/bin/python -m benchmark.suite --contexts 12288 --context-length 16384
                                                             # past SmolLM2's 8,192 positions
    .venv/bin/python -m benchmark.suite --base-url http://HOST:PORT --contexts 32768 --batches 16 64
                                                             # throughput of one running server
                                                             # (e.g. on a GPU), nothing started

Each MagicDec mode is measured against an AR server alive at the same time: for every context,
one AR server and then each MagicDec server prefill the same PG-19 prompts (cut to that length)
once and decode a short warm-up at every batch size (a serving process is warm, and γ = auto has
calibrated its buckets); the AR server and the MagicDec one then take turns, point by point, for
`--repeats` rounds. Only one of them runs at a time (this machine has two cores; an idle SGLang
server sleeps), and a speedup is the median of the per-turn ratios, so drift of the machine's
speed between turns cancels out. Decode tokens/s only: every batch decodes from the radix cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmark.common import (
    DEFAULT_DATA,
    RESULTS,
    alpha_of,
    load_tokenizer,
    magicdec_info,
    run_batch,
    save_plot,
)
from benchmark.floors import DTYPE_BYTES, ModelShape, read_bandwidth, read_seconds
from benchmark.server_process import ServerProcess, start_server
from sglang_magicdec.cost_model import CostModel, bucket_key
from sglang_magicdec.model import SMOLLM2, embedded_model_path

SOURCE_FILE = {1024: "pg19_4K", 2048: "pg19_4K", 4096: "pg19_8K", 8192: "pg19_16K"}
SPECULATIVE = ["--speculative-algorithm", "MAGICDEC"]
# SGLang sizes the KV pool from free memory and `--mem-fraction-static`, and `--max-total-tokens`
# only caps it: at the platform's default fraction, 16 × 7,936 float32 tokens do not fit beside
# a second server. Two servers of the largest point fit this machine's 24 GiB at 0.6.
POOL_MEM_FRACTION = "0.6"
MAGICDEC_BUDGET = 512  # the server's default --magicdec-budget


def load_prompts(data: Path, context: int, count: int, tokenizer) -> list[list[int]]:
    name = next((n for length, n in sorted(SOURCE_FILE.items()) if length >= context), "pg19_32K")
    with (data / "pg19" / f"{name}.jsonl").open() as handle:
        texts = [json.loads(line)["text"] for line in handle]
    prompts = [tokenizer(text)["input_ids"][:context] for text in texts]
    prompts = [p for p in prompts if len(p) == context]
    if len(prompts) < count:
        raise SystemExit(f"{name} has only {len(prompts)} documents of {context} tokens")
    return prompts[:count]


def decode_tokens_per_s(
    server: ServerProcess, prompts, new_tokens: int, sampling: dict | None = None
) -> tuple[float, list]:
    start = time.perf_counter()
    # The first token comes from prefill.
    results = run_batch(server, prompts, new_tokens + 1, sampling)
    return len(prompts) * new_tokens / (time.perf_counter() - start), results


def full_batch_decision(url: str, batch: int, context: int, new_tokens: int) -> dict:
    """γ = auto's latest decision for the whole batch: requests finish at different rounds, so
    the very last decision is often for a smaller batch."""
    bucket = CostModel.bucket(batch, context + new_tokens / 2)
    return magicdec_info(url).get("gamma_by_bucket", {}).get(bucket_key(bucket), {})


def measure_against_ar(
    servers: dict[str, ServerProcess],
    prompts,
    context,
    batches,
    new_tokens,
    repeats,
    progress,
    sampling: dict | None = None,
) -> list[dict]:
    """`servers`: {"ar": …, mode: …}, both holding `prompts` prefilled."""
    mode = next(name for name in servers if name != "ar")
    turns: dict[int, list[tuple[float, float]]] = {batch: [] for batch in batches}
    alphas: dict[int, list[float]] = {batch: [] for batch in batches}
    for turn in range(repeats):
        for batch in batches:
            # Who goes first alternates, so that neither always follows the other's work.
            order = ["ar", mode] if turn % 2 == 0 else [mode, "ar"]
            measured = {
                name: decode_tokens_per_s(servers[name], prompts[:batch], new_tokens, sampling)
                for name in order
            }
            (ar, _), (spec, results) = measured["ar"], measured[mode]
            turns[batch].append((ar, spec))
            if not is_auto(mode):  # with γ = auto, rounds of different γ make α ill-defined
                alphas[batch].append(alpha_of(results, magicdec_info(servers[mode].url)["gamma"]))
            progress.update()
    points = []
    for batch in batches:
        decision = full_batch_decision(servers[mode].url, batch, context, new_tokens)
        points.append(
            {
                "mode": mode,
                "context": context,
                "batch": batch,
                "ar_tokens_per_s": statistics.median(ar for ar, _ in turns[batch]),
                "tokens_per_s": statistics.median(spec for _, spec in turns[batch]),
                "speedup": statistics.median(spec / ar for ar, spec in turns[batch]),
                "alpha": statistics.median(alphas[batch]) if alphas[batch] else None,
                "gamma": decision.get("gamma"),
                "budget": decision.get("budget"),
                "predicted_speedup": decision.get("predicted_speedup"),
                # The server's own step costs (γ = auto measures them; fixed γ does not).
                "decode_ms": decision.get("decode_ms"),
                "draft_ms": decision.get("draft_ms"),
                "round_ms": decision.get("round_ms", {}),  # per γ
                # Budget = auto: each budget's draft step, and the server's α at each.
                "draft_ms_by_budget": decision.get("draft_ms_by_budget"),
                "alpha_by_budget": magicdec_info(servers[mode].url).get("alpha_by_budget"),
            }
        )
    return points


def measure_server(url: str, prompts_by_context, batches, new_tokens, repeats) -> list[dict]:
    """`--base-url`: one running server's decode tokens/s, nothing to compare against."""
    client = ServerProcess(url, None, None)  # type: ignore[arg-type]
    points = []
    for context, prompts in prompts_by_context.items():
        run_batch(client, prompts, 1)
        for batch in batches:
            rates = [
                decode_tokens_per_s(client, prompts[:batch], new_tokens)[0] for _ in range(repeats)
            ]
            points.append(
                {"context": context, "batch": batch, "tokens_per_s": statistics.median(rates)}
            )
    return points


def throughput_table(points: list[dict]) -> str:
    lines = [
        "| mode | context | batch | AR tok/s | MagicDec tok/s | speedup (median of turns) "
        "| α | auto γ (@ budget) | auto predicted |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        auto = is_auto(point["mode"])
        alpha, predicted = point["alpha"], point["predicted_speedup"]
        lines.append(
            f"| {point['mode']} | {point['context']} | {point['batch']} "
            f"| {point['ar_tokens_per_s']:.1f} | {point['tokens_per_s']:.1f} "
            f"| {point['speedup']:.2f}x | {'-' if alpha is None else f'{alpha:.3f}'} "
            f"| {auto_plan(point) if auto else '-'} "
            f"| {f'{predicted:.2f}x' if auto and predicted else '-'} |"
        )
    return "\n".join(lines)


def auto_plan(point: dict) -> str:
    """γ = auto's choice for the full batch: its γ, and its budget where it chooses one."""
    if "budget=auto" in point["mode"]:
        return f"{point['gamma']} @ {point.get('budget')}"
    return str(point["gamma"])


def is_auto(mode: str) -> bool:
    return mode.startswith("auto")


def step_cost_table(
    points: list[dict], bandwidth: float, budget: int, new_tokens: int, dtype: str
) -> str:
    """Each γ = auto point's measured plain and draft step against the time to read its bytes
    (weights + the KV it reads) at the measured bandwidth, and its whole rounds per γ against a
    plain step (MagicDec's premise: a round costs about one plain step plus γ cheap drafts)."""
    model = ModelShape.of(embedded_model_path(SMOLLM2))
    weights, kv_per_token = model.weight_bytes(dtype), model.kv_bytes_per_token(dtype)
    lines = [
        f"Read bandwidth (torch sum over 1 GiB, best of 5): {bandwidth / 1e9:.1f} GB/s; weights "
        f"{weights / 1e6:.0f} MB, KV {kv_per_token / 1e3:.1f} kB per token (all layers).\n",
        "| context | batch | plain step ms | plain floor ms | plain / floor "
        "| draft step ms | draft floor ms | draft / floor | round ms per γ (/ plain step) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for point in points:
        if not is_auto(point["mode"]) or point["decode_ms"] is None:
            continue
        batch, context = point["batch"], point["context"]
        plain_floor = read_seconds(model, dtype, batch * (context + new_tokens / 2), bandwidth)
        # The draft reads its budget of prompt KV, the tokens generated so far and the round's.
        draft_tokens = min(context, point.get("budget") or budget) + new_tokens / 2
        draft_floor = read_seconds(model, dtype, batch * draft_tokens, bandwidth)
        draft_ms = point["draft_ms"]
        rounds = ", ".join(
            f"γ={gamma}: {ms:.0f} ({ms / point['decode_ms']:.2f})"
            for gamma, ms in point.get("round_ms", {}).items()
        )
        lines.append(
            f"| {context} | {batch} | {point['decode_ms']:.1f} | {plain_floor * 1e3:.1f} "
            f"| {point['decode_ms'] / (plain_floor * 1e3):.2f} "
            f"| {'-' if draft_ms is None else f'{draft_ms:.1f}'} | {draft_floor * 1e3:.1f} "
            f"| {'-' if draft_ms is None else f'{draft_ms / (draft_floor * 1e3):.2f}'} "
            f"| {rounds or '-'} |"
        )
    return "\n".join(lines)


def auto_vs_fixed(points: list[dict]) -> str:
    """γ = auto's speedup against the best fixed γ's at each point (all measured against AR)."""
    best: dict[tuple[int, int], dict] = {}
    for p in points:
        key = (p["context"], p["batch"])
        if not is_auto(p["mode"]) and (key not in best or p["speedup"] > best[key]["speedup"]):
            best[key] = p
    pairs = [
        f"{p['mode']} at {p['context']}×{p['batch']}: {p['speedup'] / best[key]['speedup']:.2f} "
        f"(best fixed: {best[key]['mode']})"
        for p in points
        if is_auto(p["mode"]) and (key := (p["context"], p["batch"])) in best
    ]
    return "γ = auto / best fixed γ speedup: " + ", ".join(pairs)


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
    parser.add_argument("--repeats", type=int, default=3, help="turns per point (median)")
    parser.add_argument("--gamma", type=int, default=3, help="fixed γ, and γ = auto's largest")
    parser.add_argument(
        "--fixed-gammas", type=int, nargs="+", help="fixed γ values to measure (default: --gamma)"
    )
    parser.add_argument(
        "--budgets",
        type=int,
        nargs="+",
        help=f"SnapKV budgets, each measured at every fixed γ (default: the server's, "
        f"{MAGICDEC_BUDGET})",
    )
    parser.add_argument(
        "--auto-budget",
        action="store_true",
        help="also measure γ and budget = auto (--magicdec-budget auto)",
    )
    parser.add_argument(
        "--sampling",
        type=json.loads,
        help="sampling parameters as JSON (default greedy), e.g. Qwen's published defaults: "
        '\'{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}\'',
    )
    parser.add_argument("--base-url", help="measure this running server's throughput only")
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--skip-shared-doc", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="float32")
    parser.add_argument(
        "--context-length",
        type=int,
        help="raise the model's position limit (SmolLM2: 8,192) to measure past it",
    )
    args = parser.parse_args()
    contexts = args.contexts or ([1024, 4096] if args.quick else [1024, 4096, 8192])
    batches = args.batches or ([1, 8] if args.quick else [1, 4, 8, 16])
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = load_tokenizer()
    prompts = {c: load_prompts(args.data, c, max(batches), tokenizer) for c in contexts}
    bandwidth = read_bandwidth()
    if args.base_url:
        points = measure_server(args.base_url, prompts, batches, args.new_tokens, args.repeats)
        (args.out / "throughput.json").write_text(json.dumps(points, indent=2))
        print(json.dumps(points, indent=2))
        return

    modes = {
        f"γ={gamma}" + (f", budget={budget}" if budget else ""): [
            *SPECULATIVE,
            "--speculative-num-steps",
            str(gamma),
            *(["--magicdec-budget", str(budget)] if budget else []),
        ]
        for gamma in args.fixed_gammas or [args.gamma]
        for budget in args.budgets or [None]
    }
    auto_max = [*SPECULATIVE, "--speculative-num-steps", str(args.gamma)]
    modes["auto"] = [*auto_max, "--magicdec-gamma", "auto"]
    if args.auto_budget:
        modes["auto, budget=auto"] = [*modes["auto"], "--magicdec-budget", "auto"]
    progress = tqdm(
        total=len(modes) * len(contexts) * len(batches) * args.repeats, desc="throughput", unit="pt"
    )
    log_dir = Path(tempfile.mkdtemp(prefix="bench-suite-"))
    points: list[dict] = []
    for context in contexts:
        # The pool holds the largest batch at this context, and no more: two servers are alive.
        pool_size = max(batches) * (context + 2 * args.new_tokens)
        pool = ["--max-total-tokens", str(pool_size), "--mem-fraction-static", POOL_MEM_FRACTION]
        common = ["--dtype", args.dtype, *pool]
        env = None
        if args.context_length:
            common += ["--context-length", str(args.context_length)]
            env = {"SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1"}
        servers: dict[str, ServerProcess] = {}
        try:
            # One AR server per context, measured against each MagicDec mode in turn.
            for name, server_args in (("ar", []), *modes.items()):
                server = start_server([*common, *server_args], log_dir, env=env)
                servers[name] = server
                pool_held = server.server_info()["max_total_num_tokens"]
                if pool_held < pool_size:
                    # The prompts would be evicted between turns: every turn would time a prefill.
                    raise SystemExit(
                        f"{name} server's KV pool holds {pool_held} tokens, "
                        f"{pool_size} needed for {max(batches)} × {context}: free memory"
                    )
                run_batch(server, prompts[context], 1)  # prefill once, into the radix cache
                for batch in batches:
                    run_batch(server, prompts[context][:batch], 16)  # warm-up
                if name == "ar":
                    continue
                points += measure_against_ar(
                    {"ar": servers["ar"], name: server},
                    prompts[context],
                    context,
                    batches,
                    args.new_tokens,
                    args.repeats,
                    progress,
                    args.sampling,
                )
                servers.pop(name).stop()
        finally:
            for server in servers.values():
                server.stop()
        # Kept as each context finishes: a later point that fails must not take these with it.
        (args.out / "throughput.json").write_text(json.dumps(points, indent=2))
    progress.close()

    sections = [
        f"# Benchmark suite (CPU, {args.dtype}, SmolLM2-135M"
        + (f" with positions raised to {args.context_length}" if args.context_length else "")
        + f", γ={args.gamma}, {args.new_tokens} new tokens, "
        + (f"sampling {json.dumps(args.sampling)}" if args.sampling else "greedy")
        + ", default draft, median of "
        f"{args.repeats} turns)\n",
        "## Throughput: AR vs MagicDec (fixed γ and γ = auto)\n",
        throughput_table(points),
        "\n" + auto_vs_fixed(points),
        "\n## Step costs against this machine's read bandwidth\n",
        step_cost_table(points, bandwidth, MAGICDEC_BUDGET, args.new_tokens, args.dtype),
    ]
    series = {
        f"{mode}, context {context}": (
            [p["batch"] for p in points if p["mode"] == mode and p["context"] == context],
            [p["speedup"] for p in points if p["mode"] == mode and p["context"] == context],
        )
        for mode in modes
        for context in contexts
    }
    save_plot(
        args.out / "throughput.png", series, "batch size", "MagicDec / AR tokens/s", log_x=True
    )
    auto = [p for p in points if is_auto(p["mode"])]
    predicted = [p["predicted_speedup"] or 1.0 for p in auto]
    measured = [p["speedup"] for p in auto]
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
