"""This machine's roofline and where a MagicDec round stands against it, measured in one run.

    .venv/bin/python -m benchmark.roofline                      # bf16, batch 8 x 7,936, γ = 3
    .venv/bin/python -m benchmark.roofline --dtype float32 --batch 4

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
- the scheduler outside the worker, per decode batch (no floor: the target is ≤ 15 ms);
- throughput: AR and MagicDec tokens/s against the AR floor's (a decoder that only reads weights
  and KV at the measured bandwidth, one token per request per step).

Floors count what a step must read and compute: every weight once (the LM head included), the KV
of every position a row attends to (a draft: the budget's prompt positions, the tokens generated
so far and the round's; a verify: the context and its γ + 1 rows), and 2 FLOPs per weight per row
and 4 per attended (row, key, head dim) per query head. A part's linear time is the native
product's, so where a part's rows take torch's path (bf16 past 8 rows on a CPU with AMX) its linear
time is in "rest".
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmark import round_timers
from benchmark.common import DEFAULT_DATA, best_seconds, load_tokenizer, run_batch
from benchmark.suite import DTYPE_BYTES, MAGICDEC_BUDGET, load_prompts
from sglang_magicdec.model import SMOLLM2, embedded_model_path
from sglang_magicdec.server_process import start_server

REPO_ROOT = Path(__file__).resolve().parents[1]
GEMM_SIZE = 2048


@dataclass(frozen=True)
class Machine:
    bandwidth: float  # bytes/s
    peak: dict[str, float]  # FLOP/s by dtype

    def floor(self, read_bytes: float, flops: float, dtype: str) -> tuple[float, str]:
        """(seconds, what bounds them)."""
        read_s, compute_s = read_bytes / self.bandwidth, flops / self.peak[dtype]
        return (read_s, "bytes") if read_s >= compute_s else (compute_s, "FLOPs")


def measure_machine() -> Machine:
    data = torch.ones(2**28)
    bandwidth = data.numel() * 4 / best_seconds(data.sum)
    del data
    peak = {}
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        a = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        b = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
        peak[name] = 2 * GEMM_SIZE**3 / best_seconds(lambda a=a, b=b: torch.mm(a, b))
    return Machine(bandwidth, peak)


@dataclass(frozen=True)
class Model:
    """What a step of the embedded model reads and computes."""

    params: int  # every weight, the (tied) LM head included: each is read once per step
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def embedded(cls) -> Model:
        from safetensors import safe_open

        folder = Path(embedded_model_path(SMOLLM2))
        config = json.loads((folder / "config.json").read_text())
        params = 0
        for path in folder.glob("*.safetensors"):
            with safe_open(str(path), "pt") as tensors:
                for name in tensors.keys():
                    shape = tensors.get_slice(name).get_shape()
                    params += int(torch.tensor(shape).prod()) if shape else 1
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        return cls(
            params,
            config["num_hidden_layers"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            head_dim,
        )

    def kv_bytes(self, keys: float, element: int) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * keys * element

    def attention_flops(self, rows_times_keys: float) -> float:
        return 4 * self.layers * self.q_heads * self.head_dim * rows_times_keys


@dataclass(frozen=True)
class Floors:
    """A step's floor, whole and by part (seconds, what bounds them)."""

    step: tuple[float, str]
    linear: tuple[float, str]
    attention: tuple[float, str]


def step_floors(
    machine: Machine, model: Model, dtype: str, rows: int, keys_read: float, row_keys: float
) -> Floors:
    """`rows` token rows through every weight; `keys_read` KV positions read (all layers, all
    requests); `row_keys` the sum over rows of the keys each attends to."""
    element = DTYPE_BYTES[dtype]
    weight_bytes, linear_flops = model.params * element, 2 * model.params * rows
    kv_bytes, attention_flops = model.kv_bytes(keys_read, element), model.attention_flops(row_keys)
    return Floors(
        machine.floor(weight_bytes + kv_bytes, linear_flops + attention_flops, dtype),
        machine.floor(weight_bytes, linear_flops, dtype),
        machine.floor(kv_bytes, attention_flops, dtype),
    )


def timed_run(server_args: list[str], env: dict, prompts, new_tokens: int, workdir: Path) -> dict:
    """Start a server with the round timers, warm it, time one batch: the timer deltas, the wall
    time and the decode batches it took."""
    site = workdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(round_timers.SITECUSTOMIZE)
    timers = workdir / "timers.json"
    python_path = [str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    env = {"PYTHONPATH": os.pathsep.join(python_path), round_timers.ENV: str(timers), **env}
    server = start_server(server_args, workdir, env=env)
    try:
        run_batch(server, prompts, 1)  # prefill into the radix cache
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
    return {"parts": parts, "kernels": kernels, "wall": wall}


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
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--out", type=Path, help="also write the numbers as JSON here")
    args = parser.parse_args()

    before = measure_machine()
    model = Model.embedded()
    prompts = load_prompts(args.data, args.context, args.batch, load_tokenizer())
    batch, context, gamma, dtype = args.batch, args.context, args.gamma, args.dtype
    pool = batch * (args.context + 2 * args.new_tokens + 64)
    common = ["--dtype", dtype, "--max-total-tokens", str(pool), "--mem-fraction-static", "0.6"]
    workdir = Path(tempfile.mkdtemp(prefix="roofline-"))
    ar = timed_run(common, {round_timers.TARGET_ENV: "1"}, prompts, args.new_tokens, workdir / "ar")
    speculative = ["--speculative-algorithm", "MAGICDEC", "--speculative-num-steps", str(gamma)]
    md = timed_run(common + speculative, {}, prompts, args.new_tokens, workdir / "magicdec")
    after = measure_machine()
    machine = Machine(
        max(before.bandwidth, after.bandwidth),
        {name: max(before.peak[name], after.peak[name]) for name in before.peak},
    )

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

    ar_decode = per_call(ar, "decode")
    ar_steps = ar["parts"].get("decode", (0, 0.0))[0]
    ar_inside = sum(seconds for _, seconds in ar["parts"].values())
    rounds = md["parts"].get("_speculate", (0, 0.0))[0]
    md_batches = rounds + md["parts"].get("_plain_decode", (0, 0.0))[0]
    md_inside = sum(
        seconds
        for name, (_, seconds) in md["parts"].items()
        if name in ("_extend", "_speculate", "_plain_decode")
    )
    draft_step, verify_pass = per_call(md, "_draft_step"), per_call(md, "_verify")
    tokens = batch * args.new_tokens
    ar_tok_s, md_tok_s = tokens / ar["wall"], tokens / md["wall"]
    floor_tok_s = batch / plain.step[0]

    def described(m: Machine) -> str:
        return (
            f"read {m.bandwidth / 1e9:.1f} GB/s, GEMM {GEMM_SIZE}² bf16 "
            f"{m.peak['bfloat16'] / 1e9:.0f} GFLOP/s, fp32 {m.peak['float32'] / 1e9:.0f} GFLOP/s"
        )

    lines = [
        f"before the servers: {described(before)}; after: {described(after)}; floors from the "
        f"better of each (ridge {dtype}: {machine.peak[dtype] / machine.bandwidth:.1f} FLOP/byte)",
        f"{dtype}, batch {batch} x {context}, {args.new_tokens} tokens, γ = {gamma}: "
        f"{model.params / 1e6:.0f}M weights, KV {model.kv_bytes(1, DTYPE_BYTES[dtype]) / 1e3:.1f}"
        f" kB per token",
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
