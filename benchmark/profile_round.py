"""Where a MagicDec round's time goes, in a MAGICDEC server's scheduler while a batch of PG-19
prompts decodes: wall time per decode batch, split into the round's parts (draft steps, verify,
draft lists, commit, the rest of the worker, the scheduler outside it) and, within each, the
native linear product and attention kernel against everything else (norms, rotary, SGLang's
per-layer Python).

    .venv/bin/python -m benchmark.profile_round                     # fp32, batch 8 x 7,936
    .venv/bin/python -m benchmark.profile_round --dtype bfloat16 --batch 4
    .venv/bin/python -m benchmark.profile_round --py-spy            # and Python frames
    .venv/bin/python -m benchmark.profile_round --model qwen --batch 4 --context 16000 \
        --sampling '{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}'

The split comes from wall-clock timers inside the scheduler (`benchmark/round_timers.py`).
`--py-spy` adds each Python frame's share of the draft steps and verify passes (time inside a
native call charged to the frame that made it). On two cores read those shares with care: the
sampler takes CPU from the kernels' second thread, so native calls look larger than they are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmark import round_timers
from benchmark.common import DEFAULT_DATA, MODELS, magicdec_info, run_batch
from benchmark.server_process import start_server
from benchmark.suite import load_prompts
from sglang_magicdec.model import embedded_model_path

REPO_ROOT = Path(__file__).resolve().parents[1]
PY_SPY_PHASES = {"draft steps": "MagicDecWorker._draft_step", "verify": "MagicDecWorker._verify"}
# Rows of the table: a part of the round (its time without the parts nested in it).
ROWS = {
    "extend": "extend (prefill)",
    "draft_step": "draft steps",
    "verify": "verify",
    "draft_round": "draft lists",
    "commit": "commit",
    "round": "rest of the round",
    "plain_decode": "plain steps (γ = 0)",
}
NESTED = {"round": ("draft_round", "draft_step", "verify", "commit")}
NOT_RUN = (0, 0.0)  # a part's [calls, seconds] before its first call


def function_shares(raw: Path, under: str, top: int) -> list[tuple[str, float]]:
    """Each function's share of the samples, among the stacks that pass through `under`, where
    it is the innermost Python frame (so a native call's time is its caller's)."""
    innermost: Counter[str] = Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if any(frame.startswith(under) for frame in frames):
            innermost[re.sub(r" \(.*/", " (", frames[-1])] += int(count)
    total = sum(innermost.values())
    return [(name, count / total) for name, count in innermost.most_common(top)] if total else []


def timer_deltas(before: dict, after: dict) -> tuple[dict[str, list], dict[str, float]]:
    """What the timers added between two reads: part -> [calls, seconds], 'part/kernel' -> s."""
    parts = {}
    for name, (calls, seconds) in after["parts"].items():
        calls_before, seconds_before = before["parts"].get(name, NOT_RUN)
        parts[name] = [calls - calls_before, seconds - seconds_before]
    kernels = {
        key: seconds - before["kernels"].get(key, 0.0) for key, seconds in after["kernels"].items()
    }
    return parts, kernels


def print_round_table(parts: dict[str, list], kernels: dict[str, float], wall: float) -> None:
    """Milliseconds per decode batch, each part split into the kernels and the rest."""
    rounds = parts.get("round", NOT_RUN)[0]
    batches = rounds + parts.get("plain_decode", NOT_RUN)[0]
    if not batches:
        print("no decode batch ran")
        return
    per_batch = 1000 / batches
    print(
        f"wall {wall:.1f} s for {batches} decode batches "
        f"({rounds} rounds): {wall * per_batch:.0f} ms each"
    )
    print(f"{'ms per decode batch':24} {'total':>7} {'linear':>7} {'attention':>9} {'rest':>7}")
    in_worker = 0.0
    for name, label in ROWS.items():
        calls, seconds = parts.get(name, NOT_RUN)
        seconds -= sum(parts.get(inner, NOT_RUN)[1] for inner in NESTED.get(name, ()))
        if not calls:
            continue
        in_worker += seconds
        linear = kernels.get(f"{name}/linear", 0.0)
        attention = kernels.get(f"{name}/attention", 0.0)
        if name == "draft_step":
            label = f"{label} (x{calls / rounds:.2f})"
        print(
            f"{label:24} {seconds * per_batch:7.1f} {linear * per_batch:7.1f} "
            f"{attention * per_batch:9.1f} {(seconds - linear - attention) * per_batch:7.1f}"
        )
    outside = wall - in_worker
    print(f"{'scheduler, outside':24} {outside * per_batch:7.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=7936)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", default="3", help="γ, or auto")
    parser.add_argument("--py-spy", action="store_true", help="also sample Python frames")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--sampling", type=json.loads, help="the measured batch's sampling parameters as JSON"
    )
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model_path = embedded_model_path(MODELS[args.model])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = load_prompts(DEFAULT_DATA, args.context, args.batch, tokenizer)
    pool = args.batch * (args.context + 2 * args.new_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="profile-round-"))
    site = workdir / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(round_timers.SITECUSTOMIZE)
    timers_path = workdir / "timers.json"
    python_path = [str(site), str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]
    gamma = (
        ["--magicdec-gamma", "auto", "--speculative-num-steps", "3"]
        if args.gamma == "auto"
        else ["--speculative-num-steps", args.gamma]
    )
    server = start_server(
        ["--model-path", str(model_path), "--dtype", args.dtype, "--max-total-tokens", str(pool),
         "--speculative-algorithm", "MAGICDEC", *gamma],
        workdir,
        env={"PYTHONPATH": os.pathsep.join(python_path), round_timers.ENV: str(timers_path)},
    )  # fmt: skip
    raw = workdir / "scheduler.raw"
    spy = None
    try:
        run_batch(server, prompts, 1)  # prefill into the radix cache
        run_batch(server, prompts, 16, args.sampling)  # warm
        if args.py_spy:
            scheduler = server.scheduler()
            spy = subprocess.Popen(
                [str(Path(sys.executable).with_name("py-spy")), "record", "-f", "raw", "-r", "50",
                 "-p", str(scheduler.pid), "-o", str(raw), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
        before = round_timers.read(str(timers_path))
        started = time.perf_counter()
        run_batch(server, prompts, args.new_tokens, args.sampling)
        wall = time.perf_counter() - started
        after = round_timers.read(str(timers_path))
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
            spy.wait()
        info = magicdec_info(server.url)
    finally:
        server.stop()
    print(
        f"{args.model} {args.dtype}, batch {args.batch} x {args.context}, γ = {args.gamma}, "
        f"{json.dumps(args.sampling) if args.sampling else 'greedy'}: "
        f"{info['avg_accept_length']:.2f} tokens per request round"
    )
    print_round_table(*timer_deltas(before, after), wall)
    if spy is None:
        return
    for phase, frame in PY_SPY_PHASES.items():
        print(f"\n{phase}: innermost Python frame, share of their samples (py-spy)")
        for name, share in function_shares(raw, frame, args.top):
            print(f"  {100 * share:5.1f}%  {name}")


if __name__ == "__main__":
    main()
