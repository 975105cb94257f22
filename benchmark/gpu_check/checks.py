"""Every kernel the check times, against the float64 oracle on ragged contexts, before timing."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from benchmark.gpu_check.attention import (
    Layout,
    dense_decode,
    dense_verify,
    draft_kernels,
    oracle,
)

# (context per request, KV heads, GQA group, head_dim): ragged and uniform, GQA groups 1-4.
CASES = [
    ([37, 130, 64], 2, 4, 64),
    ([200, 9], 3, 3, 64),
    ([90, 150, 20, 61], 1, 1, 128),
    ([64, 64], 2, 2, 64),  # uniform: the SDPA stand-in runs unmasked, as when timing
]
REL_TOL = {torch.float32: 2e-4, torch.bfloat16: 2e-2}
VERIFY_TOKENS = 4  # γ = 3


@dataclass
class Check:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str = ""


def run_checks(device: torch.device, dtype: torch.dtype) -> list[Check]:
    generator = torch.Generator().manual_seed(0)
    results = []
    for lens, kv_heads, group, head_dim in CASES:
        case = f"lens={lens} Hkv={kv_heads} group={group} D={head_dim} {dtype}"
        layout = Layout(lens, kv_heads, head_dim)
        k_buffer, v_buffer = (
            torch.randn(layout.slots, kv_heads, head_dim, generator=generator).to(device, dtype)
            for _ in range(2)
        )
        q_heads = kv_heads * group

        def queries(rows: int, q_heads=q_heads, head_dim=head_dim) -> torch.Tensor:
            return torch.randn(rows, q_heads, head_dim, generator=generator).to(device, dtype)

        batch = layout.batch
        context = [b * layout.stride + torch.arange(n) for b, n in enumerate(lens)]
        q = queries(batch)
        attend, name = dense_decode(layout, q_heads, device)
        decode_lists = [
            [torch.cat([context[b], context[b][-1:] + 1])] * kv_heads for b in range(batch)
        ]
        results.append(
            _compare(f"decode [{name}] {case}", attend, q, k_buffer, v_buffer, decode_lists)
        )

        q = queries(batch * VERIFY_TOKENS)
        attend, name = dense_verify(layout, VERIFY_TOKENS, device)
        verify_lists = [
            [torch.cat([context[b], context[b][-1] + 1 + torch.arange(t + 1)])] * kv_heads
            for b in range(batch)
            for t in range(VERIFY_TOKENS)
        ]
        results.append(
            _compare(f"verify(γ=3) [{name}] {case}", attend, q, k_buffer, v_buffer, verify_lists)
        )

        chosen, recent = min(lens) // 2, min(lens) // 4
        head_slots = layout.draft_slots(2, chosen, recent, generator, device)
        q = queries(batch)
        for name, attend in draft_kernels(head_slots, device).items():
            if isinstance(attend, str):
                results.append(Check(f"draft [{name}] {case}", "SKIP", attend))
                continue
            layer = 1  # the second layer's lists: each layer reads its own
            lists = [[head_slots[layer, b, h] for h in range(kv_heads)] for b in range(batch)]
            results.append(
                _compare(
                    f"draft [{name}] {case}",
                    lambda _, *a, attend=attend, layer=layer: attend(layer, *a),
                    q,
                    k_buffer,
                    v_buffer,
                    lists,
                )
            )
    return results


def _compare(name, attend, q, k_buffer, v_buffer, slot_lists) -> Check:
    try:
        got = attend(0, q, k_buffer, v_buffer).double().cpu()
    except Exception as error:
        return Check(name, "FAIL", f"raised {type(error).__name__}: {error}"[:300])
    expected = oracle(q, k_buffer, v_buffer, slot_lists)
    error = ((got - expected).norm() / expected.norm()).item()
    tolerance = REL_TOL[q.dtype]
    status = "PASS" if error <= tolerance else "FAIL"
    return Check(name, status, f"relative error {error:.2e} (tolerance {tolerance:.0e})")
