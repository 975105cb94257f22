"""Where a MagicDec round's time goes: py-spy on a MAGICDEC server's scheduler while a batch of
PG-19 prompts decodes, then each function's share of the draft steps and of the verify passes.

    .venv/bin/python -m benchmark.profile_round                     # fp32, batch 8 x 7,936
    .venv/bin/python -m benchmark.profile_round --dtype bfloat16 --batch 4

py-spy samples the scheduler's Python stack; time inside a native call (a matmul, our attention
kernel) is charged to the Python frame that made it, so each phase's list reads as "where the
time is": the frame that called into C, or Python itself.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import psutil

from benchmark.common import DEFAULT_DATA, load_tokenizer, magicdec_info, run_batch
from benchmark.suite import load_prompts
from sglang_magicdec.server_process import start_server

PHASES = {"draft steps": "MagicDecWorker._draft_step", "verify": "MagicDecWorker._verify"}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=7936)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()

    prompts = load_prompts(DEFAULT_DATA, args.context, args.batch, load_tokenizer())
    pool = args.batch * (args.context + 2 * args.new_tokens)
    workdir = Path(tempfile.mkdtemp(prefix="profile-round-"))
    server = start_server(
        ["--dtype", args.dtype, "--max-total-tokens", str(pool), "--speculative-algorithm",
         "MAGICDEC", "--speculative-num-steps", str(args.gamma)],
        workdir,
    )  # fmt: skip
    raw = workdir / "scheduler.raw"
    try:
        run_batch(server, prompts, 1)  # prefill into the radix cache
        run_batch(server, prompts, 16)  # warm
        # The scheduler is the child that has done the work so far.
        children = psutil.Process(server.process.pid).children(recursive=True)
        scheduler = max(children, key=lambda child: child.cpu_times().user)
        spy = subprocess.Popen(
            [str(Path(sys.executable).with_name("py-spy")), "record", "-f", "raw", "-r", "50",
             "-p", str(scheduler.pid), "-o", str(raw), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        run_batch(server, prompts, args.new_tokens)
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on an interrupt
        spy.wait()
        info = magicdec_info(server.url)
    finally:
        server.stop()
    print(
        f"{args.dtype}, batch {args.batch} x {args.context}, γ = {args.gamma}: "
        f"{info['verify_rounds']} rounds, {info['avg_accept_length']:.2f} tokens per round"
    )
    for phase, frame in PHASES.items():
        print(f"\n{phase}: innermost Python frame, share of their samples")
        for name, share in function_shares(raw, frame, args.top):
            print(f"  {100 * share:5.1f}%  {name}")


if __name__ == "__main__":
    main()
