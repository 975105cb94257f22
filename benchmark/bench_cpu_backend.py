"""Our CPU attention backends (`magicdec_cpu`, the native kernel, and `magicdec_cpu_torch`) against
SGLang's stock `torch_native` backend and HF transformers, side by side in one run on this machine.

    .venv/bin/python -m benchmark.bench_cpu_backend

Reports decode tokens/s for (a) one short prompt, (b) a batch of PG-19 prompts (`--batch`,
`--context`; default 4 × 2K).
Prompts are prefilled first (max_new_tokens=1, then served from the radix cache), so the timed
request measures decode. Servers run one at a time; the machine has two cores.

    .venv/bin/python -m benchmark.bench_cpu_backend --kernels   # the CPU path's choices only

`--kernels` times, side by side, what the CPU path is built on, at batch 8 × 8K of SmolLM2's
attention shape: per layer, the time to read the KV at the bandwidth measured in the same run,
the torch reference (`slot_attention_torch`, the `magicdec_cpu_torch` backend) and the native kernel
(`magicdec_cpu`), for 1, 4 and 8
query tokens (decode, verify at γ = 3 and 7) and the SnapKV draft (512 keys per KV head), in
fp32 and bf16, and the native kernel again with every request's keys wrapped over its first 256
slots (`in cache`: the same arithmetic on KV that stays in L2, its compute alone). A kernel that
overlaps its reads with its arithmetic runs at about max(floor, in cache); one that does not, at
about their sum; and the linear layers of a step (batch rows: decode or draft; 4 × batch: a γ = 3
verify), fp32 and bf16, as `F.linear` against the weight-major product (`platforms/torch_ops.py`).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from benchmark.common import best_seconds
from benchmark.server_process import ServerProcess, start_server
from sglang_magicdec.model import SMOLLM2, embedded_model_path

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
SHORT_PROMPT = "The capital of France is"
BACKENDS = ("torch_native", "magicdec_cpu_torch", "magicdec_cpu")


def _decode_rate(server: ServerProcess, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of one concurrent batch, prefill excluded (warmed into the radix cache)."""

    def run(input_ids: list[int], max_new_tokens: int) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        return server.generate({"input_ids": input_ids, "sampling_params": params})

    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda ids: run(ids, 1), prompts))
        start = time.perf_counter()
        results = list(pool.map(lambda ids: run(ids, new_tokens + 1), prompts))
        elapsed = time.perf_counter() - start
    assert all(r["meta_info"]["completion_tokens"] == new_tokens + 1 for r in results)
    return len(prompts) * new_tokens / elapsed


def _hf_rate(model_path: str, input_ids: list[int], new_tokens: int, dtype: torch.dtype) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    ids = torch.tensor([input_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        model.generate(
            ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False
        )
        elapsed = time.perf_counter() - start
    return new_tokens / elapsed


def _best_ms(fn) -> float:
    return best_seconds(fn) * 1000


def kernel_timings(batch: int = 8, context: int = 8000, layers: int = 8) -> None:
    """Attention per layer (torch path against the native kernel, decode / verify / draft, fp32
    and bf16, KV of `layers` layers cycled so it comes from memory, not the cache) and a decode
    step's linear layers, each beside the time its bytes take at the bandwidth measured here."""
    import torch.nn.functional as F

    from benchmark.floors import read_bandwidth
    from magicdec_kernels.cpu_native import slot_attention_torch, supports_few_rows
    from magicdec_kernels.loader import native
    from sglang_magicdec.platforms.torch_ops import weight_major_product

    def native_attention(q, k, v, q_indptr, head_slots, kv_lens):
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
        native().slot_attention(q, k, v, q_indptr, head_slots, kv_lens, 0.125, out)

    kv_heads, group, head_dim, budget = 3, 3, 64, 512
    bandwidth = read_bandwidth()
    stride = context + 16
    rows = batch * stride
    print(
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s; batch {batch} x {context} keys, "
        f"{kv_heads} KV heads x group {group}, head dim {head_dim}, head-major pool; "
        f"ms per layer (best of 5 passes over {layers} layers); native: "
        f"{'yes' if native() is not None else 'UNAVAILABLE'}"
    )
    print(
        f"{'dtype':6} {'case':10} {'floor':>7} {'torch':>7} {'native':>7} {'torch/nat':>9} "
        f"{'in cache':>8}"
    )
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        pools = [
            torch.randn(kv_heads, rows, head_dim, generator=generator).to(dtype).permute(1, 0, 2)
            for _ in range(2 * layers)
        ]
        element = torch.finfo(dtype).bits // 8
        for q_len in (1, 4, 8):
            # Request r: `context` committed keys in one run, then its q_len query tokens.
            lists = [torch.arange(r * stride, r * stride + context + q_len) for r in range(batch)]
            kv_lens = torch.full((batch,), context + q_len, dtype=torch.int64)
            head_slots = torch.stack(lists)[:, None]
            q_indptr = torch.arange(batch + 1) * q_len
            q = torch.randn(batch * q_len, kv_heads * group, head_dim).to(dtype)

            def torch_path(k, v, q=q, q_indptr=q_indptr, head_slots=head_slots, kv_lens=kv_lens):
                slot_attention_torch(q, k, v, q_indptr, head_slots, kv_lens, 0.125)

            def native_path(k, v, q=q, q_indptr=q_indptr, head_slots=head_slots, kv_lens=kv_lens):
                native_attention(q, k, v, q_indptr, head_slots, kv_lens)

            in_cache = torch.stack(
                [r * stride + torch.arange(context + q_len) % 256 for r in range(batch)]
            )[:, None]

            def cached_path(k, v, q=q, q_indptr=q_indptr, slots=in_cache, kv_lens=kv_lens):
                native_attention(q, k, v, q_indptr, slots, kv_lens)

            floor = 2 * batch * (context + q_len) * kv_heads * head_dim * element / bandwidth
            _kernel_row(dtype, f"q_len {q_len}", floor, pools, torch_path, native_path, cached_path)
        # The SnapKV draft: per-head lists of `budget` prompt keys scattered over the context.
        head_lists = torch.stack(
            [
                torch.stack(
                    [
                        r * stride + torch.randperm(context, generator=generator)[:budget].sort()[0]
                        for _ in range(kv_heads)
                    ]
                )
                for r in range(batch)
            ]
        )
        draft_lens = torch.full((batch,), budget, dtype=torch.int64)
        q = torch.randn(batch, kv_heads * group, head_dim).to(dtype)

        def torch_draft(k, v, q=q, slots=head_lists, lens=draft_lens):
            slot_attention_torch(q, k, v, torch.arange(batch + 1), slots, lens, 0.125)

        def native_draft(k, v, q=q, slots=head_lists, lens=draft_lens):
            native_attention(q, k, v, torch.arange(batch + 1), slots, lens)

        floor = 2 * batch * budget * kv_heads * head_dim * element / bandwidth
        _kernel_row(dtype, f"draft {budget}", floor, pools, torch_draft, native_draft)
    full_layers = 30
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down

    def all_layers(product, inputs, weights):
        return [product(inputs[w.shape[1]], w) for w in weights]

    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(*shape).to(dtype) for shape in shapes for _ in range(full_layers)]
        weight_ms = sum(w.numel() * w.element_size() for w in weights) / bandwidth * 1000
        for row_count in (batch, 4 * batch):  # a decode or draft step; a γ = 3 verify
            inputs = {k: torch.randn(row_count, k).to(dtype) for k in (576, 1536)}
            step = functools.partial(all_layers, inputs=inputs, weights=weights)
            linear_ms = _best_ms(functools.partial(step, F.linear))
            major_ms = _best_ms(functools.partial(step, weight_major_product))
            native_ms, served = float("nan"), "F.linear"
            if native() is not None:
                # Called directly, so timed also past the rows the server gives it (bf16 on a
                # CPU with AMX: 8); the weights are packed at the first (untimed) call.
                native_ms = _best_ms(functools.partial(step, _few_rows_product))
                if supports_few_rows(inputs[576], weights[0]):
                    served = "native"
            print(
                f"{str(dtype).removeprefix('torch.')} linear layers of {full_layers}, "
                f"{row_count} rows: F.linear {linear_ms:.1f} ms, weight-major {major_ms:.1f} ms, "
                f"native {native_ms:.1f} ms ({weight_ms:.1f} ms to read the weights; "
                f"the server runs {served})"
            )


def _few_rows_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The native few-row product at any row count (`few_rows_linear` declines past its limit)."""
    from magicdec_kernels.cpu_native import packed_rows
    from magicdec_kernels.loader import native

    out = x.new_empty(x.shape[0], weight.shape[0])
    return native().few_rows_linear(x, packed_rows(weight), weight.shape[0], out)


def _kernel_row(
    dtype, case: str, floor_s: float, pools, torch_layer, native_layer, cached_layer=None
) -> None:
    """One printed row: ms per layer of each path, every layer's pool read in turn."""
    from magicdec_kernels.loader import native

    layers = len(pools) // 2

    def over_layers(attend):
        return lambda: [attend(pools[2 * i], pools[2 * i + 1]) for i in range(layers)]

    torch_ms = _best_ms(over_layers(torch_layer)) / layers
    native_ms = cached_ms = float("nan")
    if native() is not None:
        native_ms = _best_ms(over_layers(native_layer)) / layers
        if cached_layer is not None:
            cached_ms = _best_ms(over_layers(cached_layer)) / layers
    name = str(dtype).removeprefix("torch.")
    print(
        f"{name:6} {case:10} {floor_s * 1000:7.2f} {torch_ms:7.2f} {native_ms:7.2f} "
        f"{torch_ms / native_ms:9.2f} {cached_ms:8.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="store_true", help="kernel timings only (no servers)")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens of the batch")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/cpu_backend.json"))
    args = parser.parse_args()
    if args.kernels:
        kernel_timings()
        return

    from transformers import AutoTokenizer

    from benchmark.suite import load_prompts

    model_path = embedded_model_path(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    long_prompts = load_prompts(args.data, args.context, args.batch, tokenizer)
    short_prompt = tokenizer(SHORT_PROMPT)["input_ids"]

    rates: dict[str, dict[str, float]] = {}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-cpu-"))
    pool = ["--max-total-tokens", str(args.batch * (args.context + 2 * args.new_tokens) + 4096)]
    for backend in BACKENDS:
        server = start_server(
            ["--dtype", args.dtype, "--attention-backend", backend, *pool], log_dir
        )
        try:
            rates[backend] = {
                "short_b1": _decode_rate(server, [short_prompt], args.new_tokens),
                "long_batch": _decode_rate(server, long_prompts, args.new_tokens),
            }
        finally:
            server.stop()
        print(f"{backend}: {rates[backend]}", flush=True)
    rates["hf_transformers"] = {
        "short_b1": _hf_rate(model_path, short_prompt, args.new_tokens, getattr(torch, args.dtype))
    }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rates": rates}, indent=2)
    )
    ours, stock, hf = rates["magicdec_cpu"], rates["torch_native"], rates["hf_transformers"]
    ours_torch = rates["magicdec_cpu_torch"]
    label = f"batch {args.batch} x {args.context} ctx"
    print(
        f"\ndecode tokens/s, {args.dtype}, {args.new_tokens} new tokens, "
        f"torch threads {torch.get_num_threads()}"
    )
    print(
        "| case | torch_native | magicdec_cpu_torch | magicdec_cpu | HF transformers "
        "| ours / stock | native / our torch |"
    )
    print("|---|---|---|---|---|---|---|")
    for case, name, hf_rate in (
        ("short_b1", "1 request, short prompt", f"{hf['short_b1']:.1f}"),
        ("long_batch", label, "-"),
    ):
        print(
            f"| {name} | {stock[case]:.1f} | {ours_torch[case]:.1f} | {ours[case]:.1f} | "
            f"{hf_rate} | {ours[case] / stock[case]:.2f}x | {ours[case] / ours_torch[case]:.2f}x |"
        )


if __name__ == "__main__":
    main()
