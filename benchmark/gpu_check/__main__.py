"""The GPU check: the server's own attention kernels in a decoder step at model shape, timed.

    OUT=benchmark/results/gpu bash benchmark/gpu_check.sh     # on the GPU machine
    TRITON_INTERPRET=1 python -m benchmark.gpu_check --device cpu --tiny   # the same path on CPU

1. Checks every kernel it times against a float64 oracle on ragged contexts (`checks.py`).
2. Times a plain decode step, a SnapKV draft step (budget + recent slots per layer and KV head,
   with each draft kernel the wrapper backend can run) and verify steps of γ + 1 = 2..7 tokens, at
   Llama-3.1-8B and SmolLM2 shape, bf16, each batch × context (`step.py`).
3. Predicts the speedup with `sglang_magicdec.cost_model` (Ω and the round time) from those times.

What cannot run here (SGLang's kernels without SGLang, FlashInfer without FlashInfer, CUDA graphs
on CPU) is reported with the reason. Writes $OUT/gpu_check.json and $OUT/gpu_check.md and prints
the summary table last; exits 1 if a kernel check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from benchmark.gpu_check.attention import Layout, dense_decode, dense_verify, draft_kernels
from benchmark.gpu_check.checks import run_checks
from benchmark.gpu_check.step import MODEL_SHAPES, TINY_SHAPES, Decoder, time_step
from sglang_magicdec.cost_model import expected_tokens_per_round, round_time

ALPHAS = (0.8, 0.84, 0.9)
RECENT_WINDOW = 32  # the SnapKV draft's recent tokens besides its budget
SLOT_LIST_LAYERS = 4  # distinct per-layer draft lists, cycled (index lists are small)
MEMORY_HEADROOM_BYTES = 8 * 2**30
# The targets, at Llama-3.1-8B shape, batch 16 × 32K.
TARGETS = {"draft/decode": 0.25, "verify(3)/decode": 1.10}


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_dir = Path(os.environ.get("OUT", "benchmark/results/gpu"))
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"environment": environment(device), "checks": [], "points": []}
    for check in run_checks(device, dtype):
        print(f"[{check.status}] {check.name}: {check.detail}", flush=True)
        results["checks"].append(asdict(check))
    shapes = TINY_SHAPES if args.tiny else MODEL_SHAPES
    for shape_name in args.shapes:
        for batch in args.batches:
            point = time_point(shapes[shape_name], batch, args, device, dtype)
            results["points"].append(point)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # this point's weights and KV
            print(json.dumps(point), flush=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(results, indent=1))
    report = markdown(results)
    (out_dir / "gpu_check.md").write_text(report)
    print(report, end="")
    return 1 if any(check["status"] == "FAIL" for check in results["checks"]) else 0


def time_point(shape, batch: int, args, device: torch.device, dtype) -> dict:
    point = {"shape": shape.name, "batch": batch, "context": args.context}
    layout = Layout([args.context] * batch, shape.kv_heads, shape.head_dim)
    element = torch.empty((), dtype=dtype).element_size()
    kv_layers = shape.layers
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        weights = (
            shape.layers * shape.layer_weight_elements() + shape.hidden * shape.vocab
        ) * element
        room = free - weights - MEMORY_HEADROOM_BYTES
        kv_layers = min(shape.layers, room // shape.kv_layer_bytes(layout.slots, element))
        if kv_layers < 2:
            return {
                **point,
                "skipped": f"KV of 2 layers does not fit in {free / 2**30:.0f} GiB free",
            }
    point["kv_buffers"] = kv_layers
    decoder = Decoder(shape, kv_layers, layout.slots, dtype, device)
    generator = torch.Generator().manual_seed(args.seed)

    def timed(attend, tokens: int) -> dict:
        x = torch.randn(batch * tokens, shape.hidden, device=device).to(dtype)
        new_slots = layout.new_slots(tokens, device)
        timing = time_step(lambda: decoder.step(x, new_slots, attend), device, args.iters)
        return {**asdict(timing), "ms": timing.ms}

    attend, point["decode_kernel"] = dense_decode(layout, shape.q_heads, device)
    point["decode"] = timed(attend, 1)
    head_slots = layout.draft_slots(
        min(SLOT_LIST_LAYERS, shape.layers), args.budget, RECENT_WINDOW, generator, device
    )
    point["draft_slots_per_head"] = head_slots.shape[-1]
    point["draft"] = {}
    for name, attend in draft_kernels(head_slots, device).items():
        point["draft"][name] = {"skipped": attend} if isinstance(attend, str) else timed(attend, 1)
    point["verify"] = {}
    for gamma in range(1, args.max_gamma + 1):
        attend, point["verify_kernel"] = dense_verify(layout, gamma + 1, device)
        point["verify"][gamma] = timed(attend, gamma + 1)
    point["predicted"] = predict(point)
    return point


def predict(point: dict) -> dict:
    """The fastest draft kernel's speedup per α and γ: Ω(γ, α)·T_decode / round_time."""
    drafts = {name: t["ms"] for name, t in point["draft"].items() if "ms" in t}
    draft_kernel = min(drafts, key=drafts.get)
    t_decode, t_draft = point["decode"]["ms"], drafts[draft_kernel]
    per_alpha = {}
    for alpha in ALPHAS:
        per_gamma = {
            gamma: expected_tokens_per_round(gamma, alpha)
            * t_decode
            / round_time(gamma, t_draft, verify["ms"])
            for gamma, verify in point["verify"].items()
        }
        best = max(per_gamma, key=per_gamma.get)
        per_alpha[alpha] = {"per_gamma": per_gamma, "best_gamma": best, "speedup": per_gamma[best]}
    return {"draft_kernel": draft_kernel, "t_draft_ms": t_draft, "per_alpha": per_alpha}


def markdown(results: dict) -> str:
    env = results["environment"]
    checks = results["checks"]
    counts = {s: sum(c["status"] == s for c in checks) for s in ("PASS", "FAIL", "SKIP")}
    lines = [
        f"# MagicDec GPU check: {env['device_name']}, torch {env['torch']}, triton {env['triton']}",
        "",
        "Kernel checks against float64: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n),
    ]
    lines += [
        f"- {c['status']}: {c['name']}: {c['detail']}" for c in checks if c["status"] != "PASS"
    ]
    lines.append("")
    for point in results["points"]:
        label = f"{point['shape']} {point['batch']}×{point['context']}"
        if "skipped" in point:
            lines.append(f"- {label}: skipped: {point['skipped']}")
            continue
        lines.append(f"- {label}: decode {point['decode_kernel']}; verify {point['verify_kernel']}")
        for name, timing in point["draft"].items():
            figure = f"{timing['ms']:.3f} ms" if "ms" in timing else f"skipped: {timing['skipped']}"
            lines.append(f"  - draft via {name}: {figure}")
        graphs = [
            f"{kind} {t['graph_ms']:.3f} ms"
            for kind, t in [("decode", point["decode"]), ("verify(3)", point["verify"].get(3, {}))]
            if t.get("graph_ms")
        ]
        if graphs:
            lines.append(f"  - replayed as CUDA graphs: {', '.join(graphs)}")
    alpha_heads = " | ".join(f"α={a}: best" for a in ALPHAS)
    lines += [
        "",
        "Eager step times (MAGICDEC runs with CUDA graphs off); draft = the fastest draft kernel.",
        "",
        "| shape | batch×context | T_decode ms | T_draft ms | draft/decode | verify(3)/decode | "
        f"{alpha_heads} |",
        "|---|---|---|---|---|---|" + "---|" * len(ALPHAS),
    ]
    for point in results["points"]:
        if "skipped" in point:
            continue
        predicted, t_decode = point["predicted"], point["decode"]["ms"]
        verify3 = point["verify"].get(3, point["verify"][max(point["verify"])])["ms"]
        best = " | ".join(
            f"{p['speedup']:.2f}× (γ {p['best_gamma']})" for p in predicted["per_alpha"].values()
        )
        lines.append(
            f"| {point['shape']} | {point['batch']}×{point['context']} | {t_decode:.3f} | "
            f"{predicted['t_draft_ms']:.3f} | {predicted['t_draft_ms'] / t_decode:.3f} | "
            f"{verify3 / t_decode:.3f} | {best} |"
        )
    return "\n".join(lines) + "\n"


def environment(device: torch.device) -> dict:
    import triton

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "device_name": platform.machine(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", ""),
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="toy shapes and sizes (CPU run)")
    parser.add_argument(
        "--shapes", nargs="+", choices=sorted(MODEL_SHAPES), default=["llama8b", "smollm2"]
    )
    parser.add_argument("--batches", nargs="+", type=int, help="default 16 64 (tiny: 2)")
    parser.add_argument("--context", type=int, help="tokens per request (default 32768; tiny 96)")
    parser.add_argument("--budget", type=int, help="draft's chosen slots per head (512; tiny 16)")
    parser.add_argument("--max-gamma", type=int, default=6, help="verify timed for γ = 1..this")
    parser.add_argument("--iters", type=int, help="timed calls per step, median (10; tiny 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    defaults = (
        {"batches": [2], "context": 96, "budget": 16, "iters": 2}
        if args.tiny
        else {"batches": [16, 64], "context": 32768, "budget": 512, "iters": 10}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("no CUDA device here; on CPU: TRITON_INTERPRET=1 ... --device cpu --tiny")
    return args


if __name__ == "__main__":
    sys.exit(main())
