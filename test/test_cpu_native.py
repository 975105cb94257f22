"""The native CPU slot attention (csrc/slot_attention.cpp), every instruction set the CPU has, and
its torch reference, against a float64 softmax computed one query row and head at a time."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest
import torch

from magicdec_kernels import loader
from magicdec_kernels.cpu_native import (
    slot_attention,
    slot_attention_torch,
    supports_native,
)
from magicdec_kernels.loader import native

pytestmark = pytest.mark.skipif(
    native() is None,
    reason="the native CPU kernel extension did not build or load (see the logged warning)",
)


@dataclass
class Case:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    q_indptr: torch.Tensor
    head_slots: torch.Tensor
    kv_lens: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.q_indptr,
            self.head_slots,
            self.kv_lens,
            self.scale,
        )


def _make_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    group: int,
    num_kv_heads: int,
    head_dim: int,
    v_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    head_major: bool = True,
    contiguous_slots: bool = False,
    per_head: bool = True,
    seed: int = 0,
) -> Case:
    """Random q and pool, and slot lists laid out as asked (padded past kv_len with slots that
    are outside the pool, so reading padding fails loudly)."""
    gen = torch.Generator().manual_seed(seed)
    v_dim = v_dim or head_dim
    batch, num_q_heads = len(q_lens), group * num_kv_heads
    pool_slots = 2 * sum(kv_lens) + 64
    if head_major:  # the server's pool: [Hkv, slots, D] storage viewed as [slots, Hkv, D]
        k_cache = torch.randn(num_kv_heads, pool_slots, head_dim, generator=gen).permute(1, 0, 2)
        v_cache = torch.randn(num_kv_heads, pool_slots, v_dim, generator=gen).permute(1, 0, 2)
    else:
        k_cache = torch.randn(pool_slots, num_kv_heads, head_dim, generator=gen)
        v_cache = torch.randn(pool_slots, num_kv_heads, v_dim, generator=gen)
    list_heads = num_kv_heads if per_head else 1
    width = max(kv_lens) + 5
    # [B, W, heads] then permuted: head_slots with non-standard strides.
    head_slots = torch.full((batch, width, list_heads), pool_slots + 7, dtype=torch.int64)
    for b, kv_len in enumerate(kv_lens):
        for h in range(list_heads):
            if contiguous_slots:
                start = int(torch.randint(0, pool_slots - kv_len + 1, (1,), generator=gen))
                head_slots[b, :kv_len, h] = torch.arange(start, start + kv_len)
            else:
                head_slots[b, :kv_len, h] = torch.randperm(pool_slots, generator=gen)[:kv_len]
    head_slots = head_slots.permute(0, 2, 1)
    # q as a slice of a wider tensor (like q out of a fused qkv projection): strided rows.
    q_wide = torch.randn(sum(q_lens), num_q_heads + 1, head_dim, generator=gen)
    q = q_wide[:, :num_q_heads]
    scale = head_dim**-0.5 * float(torch.empty(1).uniform_(0.5, 3.0, generator=gen))
    return Case(
        q=q.to(dtype),
        k_cache=k_cache.to(dtype),
        v_cache=v_cache.to(dtype),
        q_indptr=torch.tensor([0, *q_lens]).cumsum(0),
        head_slots=head_slots,
        kv_lens=torch.tensor(kv_lens),
        scale=scale,
    )


@contextmanager
def _threads(count: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _oracle(case: Case) -> torch.Tensor:
    """float64 softmax attention, one query row and head at a time."""
    # Thousands of tiny ops: one thread (thread handoffs per op cost more than the op).
    with _threads(1):
        return _oracle_rows(case)


def _oracle_rows(case: Case) -> torch.Tensor:
    q, k_cache, v_cache = case.q, case.k_cache, case.v_cache
    num_q_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(q.shape[0], num_q_heads, v_cache.shape[2], dtype=torch.float64)
    bounds = case.q_indptr.tolist()
    for b, kv_len in enumerate(case.kv_lens.tolist()):
        q_len = bounds[b + 1] - bounds[b]
        for kv_head in range(num_kv_heads):
            list_head = kv_head if case.head_slots.shape[1] > 1 else 0
            slots = case.head_slots[b, list_head, :kv_len]
            keys = k_cache[:, kv_head].double()[slots]
            values = v_cache[:, kv_head].double()[slots]
            for i in range(q_len):
                visible = min(max(kv_len - q_len + i + 1, 0), kv_len)
                if visible == 0:
                    continue  # sees no key: zeros
                row = bounds[b] + i
                for head in range(kv_head * group, (kv_head + 1) * group):
                    scores = keys[:visible] @ q[row, head].double() * case.scale
                    out[row, head] = torch.softmax(scores, dim=0) @ values[:visible]
    return out


def _check(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    else:  # bf16 output: one rounding of ~0.4%, on inputs that were bf16 already
        torch.testing.assert_close(got.double(), expected, rtol=1.6e-2, atol=1.6e-2)


def _all_paths(case: Case) -> dict[str, torch.Tensor]:
    """The native kernel under every instruction set this CPU has, and the torch reference."""
    module = native()
    results = {}
    for isa in module.isas():
        out = case.q.new_full((case.q.shape[0], case.q.shape[1], case.v_cache.shape[2]), 7.0)
        results[isa] = module.slot_attention(*case.args(), out, isa)
    with _threads(1):
        results["torch"] = slot_attention_torch(*case.args())
    return results


def _check_paths(results: dict[str, torch.Tensor], expected: torch.Tensor, dtype) -> None:
    for path, got in results.items():
        try:
            _check(got, expected, dtype)
        except AssertionError as error:
            raise AssertionError(f"{path}: {error}") from None


# Ragged: no keys, one key, short, a few blocks, longer; q_len 1 (decode) to 8 (verify), and
# q_len > kv_len (rows that see nothing get zeros).
RAGGED_Q_LENS = [1, 1, 4, 8, 2, 3, 1]
RAGGED_KV_LENS = [0, 1, 37, 300, 1, 700, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_major", [True, False], ids=["head-major", "token-major"])
@pytest.mark.parametrize("per_head", [True, False], ids=["per-head-lists", "shared-list"])
@pytest.mark.parametrize("contiguous_slots", [False, True], ids=["random-slots", "contiguous"])
@pytest.mark.parametrize(
    # SmolLM2 (3 x 3 KV heads), Qwen2.5-0.5B (7 x 2), Qwen2.5-1.5B (6 x 2 at head dim 128)
    "group,num_kv_heads,head_dim",
    [(1, 1, 64), (3, 3, 64), (7, 2, 64), (4, 2, 128), (6, 2, 128), (2, 1, 128)],
)
def test_matches_oracle(
    dtype, head_major, per_head, contiguous_slots, group, num_kv_heads, head_dim
):
    case = _make_case(
        RAGGED_Q_LENS,
        RAGGED_KV_LENS,
        group=group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        head_major=head_major,
        contiguous_slots=contiguous_slots,
        per_head=per_head,
        seed=group * 100 + head_dim + num_kv_heads,
    )
    expected = _oracle(case)
    _check_paths(_all_paths(case), expected, dtype)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_lists_split_and_merge(threads, dtype):
    """Lists long enough to be split into key chunks (partial outputs merged by log-sum-exp)."""
    case = _make_case(
        [1, 4],
        [5000, 3001],
        group=4,
        num_kv_heads=1,
        head_dim=64,
        dtype=dtype,
        contiguous_slots=False,
        seed=threads,
    )
    with _threads(threads):
        results = _all_paths(case)
    expected = _oracle(case)
    _check_paths(results, expected, dtype)


def test_many_query_rows():
    """More rows than one task holds (a prefill chunk): several row tiles share a list."""
    case = _make_case([40, 70], [100, 60], group=2, num_kv_heads=2, head_dim=64, seed=5)
    expected = _oracle(case)
    _check_paths(_all_paths(case), expected, torch.float32)


def test_peaked_scores():
    """Large scores: the running max moves often and the rescaling must stay exact."""
    case = _make_case([4, 1], [900, 400], group=2, num_kv_heads=1, head_dim=64, seed=11)
    case.scale = 1.0  # scores of several tens
    expected = _oracle(case)
    _check_paths(_all_paths(case), expected, torch.float32)


def test_writes_out_in_place_and_only_request_rows():
    case = _make_case([2, 3], [50, 80], group=2, num_kv_heads=2, head_dim=64, seed=3)
    expected = _oracle(case)
    num_q, num_q_heads = case.q.shape[:2]
    # One padding row past the last request, and a strided out (last dim contiguous).
    storage = torch.full((num_q + 1, num_q_heads, 80), 5.0)
    out = storage[:, :, :64]
    q = torch.cat([case.q, case.q[:1]])
    result = slot_attention(q, *case.args()[1:], out=out)
    assert result is out
    _check(out[:num_q], expected, torch.float32)
    assert torch.all(out[num_q] == 5.0) and torch.all(storage[..., 64:] == 5.0)


@pytest.mark.parametrize("head_dim,v_dim", [(128, 64), (80, 48)])
def test_other_head_dims(head_dim, v_dim):
    """A value head dim unlike the key one, and dims that are multiples of 16 but not of 32."""
    case = _make_case(
        [1, 4, 2], [90, 33, 300], group=2, num_kv_heads=2, head_dim=head_dim, v_dim=v_dim, seed=9
    )
    _check_paths(_all_paths(case), _oracle(case), torch.float32)


def test_slot_outside_pool_raises():
    case = _make_case([1], [40], group=1, num_kv_heads=1, head_dim=64, seed=1)
    case.head_slots[0, 0, 17] = case.k_cache.shape[0]
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        slot_attention(*case.args())


def test_unsupported_head_dim_uses_torch():
    case = _make_case([1, 2], [30, 20], group=2, num_kv_heads=1, head_dim=40, seed=2)
    assert not supports_native(case.q, case.k_cache, case.v_cache)
    out = case.q.new_empty(case.q.shape)
    with pytest.raises(RuntimeError, match="multiples of 16"):
        native().slot_attention(*case.args(), out)
    _check(slot_attention(*case.args()), _oracle(case), torch.float32)


def test_instruction_sets():
    isas = native().isas()
    assert isas[0] == native().best_isa() and isas[-1] == "scalar"
    # else native() would have been None
    assert native().best_isa() in ("avx512bf16", "avx512", "avx2")


def test_build_failure_is_one_warning(monkeypatch, caplog):
    def failing_build(verbose: bool = False):
        raise RuntimeError(
            "Error building extension:\nx.cpp:1:1: error: no compiler\nninja: stopped"
        )

    monkeypatch.setattr(loader, "build", failing_build)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert loader.native.__wrapped__() is None
    assert [record.getMessage() for record in caplog.records] == [
        "native CPU kernels unavailable (build failed: x.cpp:1:1: error: no compiler)"
    ]


def _decode_row(case: Case, b: int, token: int, isa: str, extra: int) -> torch.Tensor:
    """Request b's verify row `token` as a plain decode step computes it: one query row over the
    first kv_len - q_len + token + 1 slots of its list, in a batch with `extra` other requests
    (their own lists and rows: the batch must not matter)."""
    bounds = case.q_indptr.tolist()
    q_len = bounds[b + 1] - bounds[b]
    seen = int(case.kv_lens[b]) - q_len + token + 1
    others = [o for o in range(len(bounds) - 1) if o != b][:extra]
    rows = [bounds[b] + token] + [bounds[o] for o in others]
    q = case.q[rows].contiguous()
    head_slots = case.head_slots[[b, *others]]
    kv_lens = torch.tensor([seen] + [int(case.kv_lens[o]) for o in others])
    out = q.new_zeros(q.shape[0], q.shape[1], case.v_cache.shape[2])
    q_indptr = torch.arange(len(rows) + 1)
    native().slot_attention(q, case.k_cache, case.v_cache, q_indptr, head_slots, kv_lens,
                            case.scale, out, isa)  # fmt: skip
    return out[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_verify_row_is_the_decode_row_of_its_token(dtype):
    """Row invariance, which exact speculative decoding rests on: verify row j of a request
    computes, bit for bit, what a plain decode step of that token computes (its list cut to what
    it sees, whatever else is in either batch), on every instruction set; lists that cross the
    kernel's key chunks, and tokens whose rows straddle a chunk boundary."""
    q_lens = [4, 4, 1, 8]
    kv_lens = [2049, 4100, 700, 2055]  # rows seeing 2046..2049 keys: across the 2048 boundary
    case = _make_case(
        q_lens, kv_lens, group=3, num_kv_heads=3, head_dim=64, dtype=dtype, seed=21,
        contiguous_slots=True,
    )  # fmt: skip
    module = native()
    for isa in module.isas():
        verify = case.q.new_zeros(case.q.shape[0], case.q.shape[1], case.v_cache.shape[2])
        module.slot_attention(*case.args(), verify, isa)
        for b, q_len in enumerate(q_lens):
            start = int(case.q_indptr[b])
            for token in range(q_len):
                for extra in (0, 2):
                    decode = _decode_row(case, b, token, isa, extra)
                    assert torch.equal(decode, verify[start + token]), (isa, b, token, extra)
