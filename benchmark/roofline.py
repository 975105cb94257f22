"""This machine's roofline and where a MagicDec round stands against it, measured in one run.

    .venv/bin/python -m benchmark.roofline                      # bf16, batch 8 x 7,936, γ = 3
    .venv/bin/python -m benchmark.roofline --dtype float32 --batch 4
    .venv/bin/python -m benchmark.roofline --model-path qwen2.5-coder-0.5b-instruct --context 16000

The machine: its read bandwidth (a torch sum over 1 GiB of float32, both cores) and its GEMM
peaks in bf16 and float32 (torch.mm of 2048², oneDNN), each the best of several tries, measured
before the servers and again after them (a shared machine drifts by tens of percent within
minutes); the floors use the better of each, and both are printed. Between them, two
servers, one after the other, on the same PG-19 prompts: plain decoding (AR) and MAGICDEC at a
fixed γ, each with wall-clock timers inside its scheduler (`round_timers.py`). Each part of a step
is printed beside its floor, the larger of its bytes over the bandwidth and its FLOPs over the
peak, both measured above:

- plain step (the AR server's decode forward), draft step and verify, each split into the linear
  layers and LM head (the native few-row product), attention (the native slot attention) and the
  rest (norms, rotary, sampling, Python);
- the prefill of the prompts (the AR server's, all sent at once) against its FLOP floor;
- the scheduler outside the worker, per decode batch (no floor: the target is ≤ 15 ms);
- throughput: AR and MagicDec tokens/s against the AR floor's (a decoder that only reads weights
  and KV at the measured bandwidth, one token per request per step).

Floors (`floors.py`, as every benchmark's) count what a step must read and compute: every weight
once (an untied input embedding only per token), the KV of every position a row attends to (a
draft: the budget's prompt positions, the tokens generated so far and the round's; a verify: the
context and its γ + 1 rows), and 2 FLOPs per weight per row and 4 per attended (row, key, head
dim) per query head. A part's linear time is the native
product's, so where a part's rows take torch's path (bf16 past 8 rows on a CPU with AMX) its linear
time is in "rest".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmark import round_timers
from benchmark.common import DEFAULT_DATA, run_batch
from benchmark.floors import (
    DTYPE_BYTES,
    GEMM_SIZE,
    Machine,
    ModelShape,
    ar_floor_tok_s,
    measure_machine,
    step_floors,
)
from benchmark.server_process import start_server
from benchmark.suite import MAGICDEC_BUDGET, load_prompts
from sglang_magicdec.model import SMOLLM2, embedded_model, embedded_model_path

REPO_ROOT = Path(__file__).resolve().parents[1]


def model_folder(name_or_path: str) -> str:
    """An embedded model's folder by name, or the folder given."""
    model = embedded_model(name_or_path)
    return embedded_model_path(model) if model is not None else name_or_path


def timed_run(server_args: list[str], env: dict, prompts, new_tokens: int, workdir: Path) -> dict:
    """Start a server with the round timers, warm it, time one batch: the timer deltas, the wall
    time and the decode batches it took, and the prompts' prefill (all at once, after a short
    warm-up prompt that shares no prefix with them)."""
    site = workdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(round_timers.SITECUSTOMIZE)
    timers = workdir / "timers.json"
    python_path = [str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(python_path), round_timers.ENV: str(timers), **env}
    server = start_server(server_args, workdir, env=env)
    try:
        run_batch(server, [prompts[0][-64:]], 1)  # the first forward's cold costs
        started = time.perf_counter()
        run_batch(server, prompts, 1)  # prefill into the radix cache
        prefill = time.perf_counter() - started
        run_batch(server, prompts, 16)  # warm
        before = round_timers.read(str(timers))
        started = time.perf_counter()
        run_batch(server, prompts, new_tokens + 1)  # the first token comes from the extend
        wall = time.perf_counter() - started
        after = round_timers.read(str(timers))
    finally:
        server.stop()
    parts, kernels = {}, {}
    for name, (calls, seconds) in after["parts"].items():
        calls_before, seconds_before = before["parts"].get(name, (0, 0.0))
        parts[name] = (calls - calls_before, seconds - seconds_before)
    for key, seconds in after["kernels"].items():
        kernels[key] = seconds - before["kernels"].get(key, 0.0)
    return {"parts": parts, "kernels": kernels, "wall": wall, "prefill": prefill}


def per_call(run: dict, part: str) -> tuple[float, float, float, float]:
    """(total, linear, attention, rest) seconds per call of a part."""
    calls, seconds = run["parts"].get(part, (0, 0.0))
    if not calls:
        return (float("nan"),) * 4
    linear = run["kernels"].get(f"{part}/linear", 0.0) / calls
    attention = run["kernels"].get(f"{part}/attention", 0.0) / calls
    total = seconds / calls
    return total, linear, attention, total - linear - attention


def row(label: str, measured: float, floor: tuple[float, str] | None) -> str:
    if floor is None:
        return f"| {label} | {measured * 1e3:.1f} | - | - | - |"
    seconds, bound = floor
    ratio = measured / seconds if seconds > 0 else float("nan")
    return f"| {label} | {measured * 1e3:.1f} | {seconds * 1e3:.1f} | {bound} | {ratio:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bfloat16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=7936)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument(
        "--model-path",
        default=SMOLLM2.name,
        help="an embedded model's name (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct) or "
        "a model folder",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    before = measure_machine()
    folder = model_folder(args.model_path)
    model = ModelShape.of(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = load_prompts(args.data, args.context, args.batch, tokenizer)
    batch, context, gamma, dtype = args.batch, args.context, args.gamma, args.dtype
    pool = batch * (args.context + 2 * args.new_tokens + 64)
    common = ["--model-path", folder, "--dtype", dtype, "--max-total-tokens", str(pool)]
    common += ["--mem-fraction-static", "0.6"]
    workdir = Path(tempfile.mkdtemp(prefix="roofline-"))
    ar = timed_run(common, {round_timers.TARGET_ENV: "1"}, prompts, args.new_tokens, workdir / "ar")
    speculative = ["--speculative-algorithm", "MAGICDEC", "--speculative-num-steps", str(gamma)]
    md = timed_run(common + speculative, {}, prompts, args.new_tokens, workdir / "magicdec")
    after = measure_machine()
    machine = before.better(after)

    # The mean context over the timed tokens; a draft reads the budget, the generated tokens so
    # far and the round's (`benchmark.suite.step_cost_table` counts them alike).
    mean_context = context + args.new_tokens / 2
    plain = step_floors(machine, model, dtype, batch, batch * mean_context, batch * mean_context)
    draft_keys = min(context, MAGICDEC_BUDGET) + args.new_tokens / 2 + gamma / 2
    draft = step_floors(machine, model, dtype, batch, batch * draft_keys, batch * draft_keys)
    width = gamma + 1
    verify = step_floors(
        machine,
        model,
        dtype,
        batch * width,
        batch * (mean_context + width),
        batch * width * (mean_context + width / 2),
    )

    # The prefill: every prompt token through the weights (the LM head for each request's last
    # token only), its KV written once, each token attending to the ones before it.
    prompt_tokens = batch * context
    extend = step_floors(
        machine, model, dtype, prompt_tokens, prompt_tokens, batch * context * (context + 1) / 2,
        head_rows=batch,
    )  # fmt: skip
    ar_decode = per_call(ar, "decode")
    ar_steps = ar["parts"].get("decode", (0, 0.0))[0]
    ar_inside = sum(seconds for _, seconds in ar["parts"].values())
    rounds = md["parts"].get("round", (0, 0.0))[0]
    md_batches = rounds + md["parts"].get("plain_decode", (0, 0.0))[0]
    md_inside = sum(
        seconds
        for name, (_, seconds) in md["parts"].items()
        if name in ("extend", "round", "plain_decode")
    )
    draft_step, verify_pass = per_call(md, "draft_step"), per_call(md, "verify")
    tokens = batch * args.new_tokens
    ar_tok_s, md_tok_s = tokens / ar["wall"], tokens / md["wall"]
    floor_tok_s = ar_floor_tok_s(model, dtype, [mean_context] * batch, machine.bandwidth)

    def described(m: Machine) -> str:
        return (
            f"read {m.bandwidth / 1e9:.1f} GB/s, GEMM {GEMM_SIZE}² bf16 "
            f"{m.peak['bfloat16'] / 1e9:.0f} GFLOP/s, fp32 {m.peak['float32'] / 1e9:.0f} GFLOP/s"
        )

    lines = [
        f"before the servers: {described(before)}; after: {described(after)}; floors from the "
        f"better of each (ridge {dtype}: {machine.peak[dtype] / machine.bandwidth:.1f} FLOP/byte)",
        f"{dtype}, batch {batch} x {context}, {args.new_tokens} tokens, γ = {gamma}: "
        f"{Path(folder).name}: {model.weights / 1e6:.0f}M weights read per step, KV "
        f"{model.kv_bytes_per_token(dtype) / 1e3:.1f} kB per token",
        "",
        "| part | ms | floor ms | bound by | / floor |",
        "|---|---|---|---|---|",
        row("plain step (AR decode forward)", ar_decode[0], plain.step),
        row("  linear + LM head", ar_decode[1], plain.linear),
        row("  attention", ar_decode[2], plain.attention),
        row("  rest", ar_decode[3], None),
        row("draft step", draft_step[0], draft.step),
        row("  linear + LM head", draft_step[1], draft.linear),
        row("  attention", draft_step[2], draft.attention),
        row("  rest", draft_step[3], None),
        row(f"verify ({width} rows per request)", verify_pass[0], verify.step),
        row("  linear + LM head", verify_pass[1], verify.linear),
        row("  attention", verify_pass[2], verify.attention),
        row("  rest", verify_pass[3], None),
        row(f"prefill of the {batch} prompts (AR server, all at once)", ar["prefill"], extend.step),
        row(
            "scheduler outside the worker, AR (per decode batch)",
            (ar["wall"] - ar_inside) / max(ar_steps, 1),
            None,
        ),
        row(
            "scheduler outside the worker, MagicDec (per decode batch)",
            (md["wall"] - md_inside) / max(md_batches, 1),
            None,
        ),
        "",
        f"AR {ar_tok_s:.1f} tok/s, MagicDec {md_tok_s:.1f} tok/s ({md_tok_s / ar_tok_s:.2f}x AR);"
        f" the AR floor {floor_tok_s:.1f} tok/s: AR at {ar_tok_s / floor_tok_s:.2f} of it, "
        f"MagicDec at {md_tok_s / floor_tok_s:.2f}; {md_batches} MagicDec decode batches "
        f"({tokens / max(md_batches, 1) / batch:.2f} tokens per request each)",
    ]
    print("\n".join(lines))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "machine_before": vars(before),
                    "machine_after": vars(after),
                    "ar": ar,
                    "magicdec": md,
                    "table": lines,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
