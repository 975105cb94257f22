"""The KV pool in transparent huge pages against 4 KiB pages: the native slot attention over both,
side by side in one process (interleaved repeats, median of the best-of-5 times).

    .venv/bin/python -m benchmark.bench_huge_pages

bf16 at batch 8 × 7,936 of SmolLM2's attention shape (3 KV heads, group 3, head dim 64), 8
layers' K and V per arm: decode (1 query token), a γ = 3 verify (4) and a sparse draft over 600
scattered slots per KV head. The huge-page arm allocates as the CPU KV pool does
(`platforms/kv_pool.huge_page_zeros`); the other with torch.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmark.common import best_seconds
from magicdec_kernels import cpu_native
from sglang_magicdec.platforms.kv_pool import huge_page_zeros

BATCH, CONTEXT, KV_HEADS, GROUP, HEAD_DIM, LAYERS = 8, 7936, 3, 3, 64, 8
ROWS = BATCH * (CONTEXT + 16)  # each request's slots, then a gap


def kv_buffer(huge: bool, generator: torch.Generator) -> torch.Tensor:
    """One layer's K or V: a [slots, Hkv, D] view of head-major storage, random bf16."""
    numel = KV_HEADS * ROWS * HEAD_DIM
    storage = (
        huge_page_zeros(numel, torch.bfloat16) if huge else torch.zeros(numel, dtype=torch.bfloat16)
    )
    storage.copy_(torch.randn(numel, generator=generator))
    return storage.view(KV_HEADS, ROWS, HEAD_DIM).permute(1, 0, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=4)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    pools = {
        huge: [kv_buffer(huge, generator) for _ in range(2 * LAYERS)] for huge in (False, True)
    }
    stride = CONTEXT + 16
    cases = []
    for name, q_len in (("decode", 1), ("verify γ=3", 4)):
        q = torch.randn(BATCH * q_len, KV_HEADS * GROUP, HEAD_DIM, generator=generator)
        slots = torch.stack(
            [torch.arange(b * stride, b * stride + CONTEXT + q_len) for b in range(BATCH)]
        )[:, None]
        indptr = torch.arange(BATCH + 1) * q_len
        cases.append((name, q.bfloat16(), indptr, slots, torch.full((BATCH,), CONTEXT + q_len)))
    scattered = torch.stack(
        [
            torch.stack(
                [
                    b * stride + torch.randperm(CONTEXT, generator=generator)[:600].sort().values
                    for _ in range(KV_HEADS)
                ]
            )
            for b in range(BATCH)
        ]
    )
    q = torch.randn(BATCH, KV_HEADS * GROUP, HEAD_DIM, generator=generator).bfloat16()
    cases.append(
        ("draft, 600 slots", q, torch.arange(BATCH + 1), scattered, torch.full((BATCH,), 600))
    )
    times: dict[tuple[str, bool], list[float]] = {}
    for repeat in range(args.repeats):
        for name, q, indptr, slots, lens in cases:
            out = torch.empty_like(q)
            for huge in (False, True) if repeat % 2 == 0 else (True, False):
                kv = pools[huge]

                def attend_all_layers(kv=kv, q=q, indptr=indptr, slots=slots, lens=lens, out=out):
                    for layer in range(LAYERS):
                        cpu_native.slot_attention(
                            q, kv[2 * layer], kv[2 * layer + 1], indptr, slots, lens, 0.125, out
                        )

                per_layer_ms = best_seconds(attend_all_layers) * 1e3 / LAYERS
                times.setdefault((name, huge), []).append(per_layer_ms)
    print(
        f"bf16 slot attention, batch {BATCH} x {CONTEXT}, ms per layer (median of {args.repeats})"
    )
    print("| case | 4 KiB pages | huge pages | huge / 4 KiB |\n|---|---|---|---|")
    for name, *_ in cases:
        small, huge = (statistics.median(times[(name, arm)]) for arm in (False, True))
        print(f"| {name} | {small:.3f} | {huge:.3f} | {huge / small:.2f} |")


if __name__ == "__main__":
    main()
