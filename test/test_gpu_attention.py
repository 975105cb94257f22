"""The GPU draft path in pieces, without a GPU: the attention-backend rule MAGICDEC's launch
applies, and the flattened per-(request, KV head) rows FlashInfer's decode reads, checked against
the float64 oracle through SGLang's own Triton decode kernel (the same CSR form) under Triton's
CPU interpreter. The whole server on that path: `test_triton_backend_server.py`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from magicdec_kernels.flat_decode import flat_queries, flat_rows, flatten_head_slots
from sglang_magicdec.gpu_attention import DENSE_BACKENDS, check_attention_backends
from test.helpers import REPO
from test.test_kernels import _sparse_case


@pytest.mark.parametrize("backend", DENSE_BACKENDS)
@pytest.mark.parametrize("cpu_platform", [False, True])
def test_rule_accepts_the_wrapped_backends(backend, cpu_platform):
    check_attention_backends((backend, backend), cpu_platform)


@pytest.mark.parametrize("backend", ["magicdec_cpu", "magicdec_cpu_torch"])
def test_rule_accepts_the_cpu_backends_on_the_cpu_platform_only(backend):
    check_attention_backends((backend, backend), cpu_platform=True)
    with pytest.raises(ValueError, match=f"got '{backend}'"):
        check_attention_backends((backend, backend), cpu_platform=False)


@pytest.mark.parametrize(
    "backends", [("torch_native", "torch_native"), ("fa3", "trtllm_mha"), ("flex_attention", "fa3")]
)
def test_rule_refuses_other_backends_in_one_line(backends):
    """trtllm_mha (SGLang's Blackwell default) and torch_native cannot read a per-head draft."""
    with pytest.raises(ValueError) as refused:
        check_attention_backends(backends, cpu_platform=False)
    message = str(refused.value)
    assert "\n" not in message
    assert all(name in message for name in DENSE_BACKENDS)
    assert next(b for b in backends if b not in DENSE_BACKENDS) in message


def test_flattened_rows_read_each_heads_own_slots():
    q, k_cache, _, head_slots, kv_lens = _sparse_case([5, 1, 12], 3, 2, seed=3)
    kv_indptr, kv_indices = flatten_head_slots(head_slots, kv_lens)
    assert kv_indptr.dtype == kv_indices.dtype == torch.int32  # what FlashInfer takes
    rows = flat_rows(k_cache)
    num_kv_heads = k_cache.shape[1]
    for request, length in enumerate(kv_lens.tolist()):
        for head in range(num_kv_heads):
            row = request * num_kv_heads + head
            start, end = kv_indptr[row].item(), kv_indptr[row + 1].item()
            assert end - start == length
            got = rows[kv_indices[start:end].long(), 0]
            assert torch.equal(got, k_cache[head_slots[request, head, :length], head])
            # Query heads head·group .. (head+1)·group−1 sit on that row.
            group = q.shape[1] // num_kv_heads
            flat_q = flat_queries(q, num_kv_heads)[row]
            assert torch.equal(flat_q, q[request, head * group : (head + 1) * group])


# Run in a child: TRITON_INTERPRET must be set before Triton decorates SGLang's kernels.
FLAT_DECODE_THROUGH_SGLANG_TRITON = textwrap.dedent(
    """
    import torch
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd

    from magicdec_kernels.flat_decode import flat_queries, flat_rows, flatten_head_slots
    from test.test_kernels import _sparse_case, assert_close, naive_sparse_decode

    # (per-request slot counts, KV heads, GQA group): ragged; a draft row always has a slot.
    for lengths, num_kv_heads, group in [
        ([1, 37, 100, 5], 2, 1), ([64, 1, 33], 2, 3), ([17, 90, 2], 3, 4), ([40, 7], 1, 2)
    ]:
        q, k_cache, v_cache, head_slots, kv_lens = _sparse_case(lengths, num_kv_heads, group, 5)
        kv_indptr, kv_indices = flatten_head_slots(head_slots, kv_lens)
        queries = flat_queries(q, num_kv_heads)
        rows, heads, max_splits = queries.shape[0], queries.shape[1], 4
        out = torch.empty(rows, heads, v_cache.shape[2])
        decode_attention_fwd(
            queries, flat_rows(k_cache), flat_rows(v_cache), out, kv_indptr, kv_indices,
            torch.empty(rows, heads, max_splits, v_cache.shape[2]),
            torch.empty(rows, heads, max_splits),
            torch.full((rows,), 2, dtype=torch.int32), max_splits, 0.125, 1.0, 1.0,
        )
        expected = naive_sparse_decode(q, k_cache, v_cache, head_slots, kv_lens, 0.125)
        assert_close(out.view(q.shape[0], -1, v_cache.shape[2]), expected)
    print("checked")
    """
)


def test_flattened_decode_matches_oracle_through_sglang_triton_kernel():
    result = subprocess.run(
        [sys.executable, "-c", FLAT_DECODE_THROUGH_SGLANG_TRITON],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "checked" in result.stdout
