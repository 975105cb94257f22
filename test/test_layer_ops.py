"""A decoder layer's native per-token ops (csrc/layer_ops.cpp), every instruction set the CPU
has, against their torch references and against SGLang's own modules (`forward_native`) on
random ragged shapes in float32 and bfloat16; rows independent of their batch; and SGLang's fused
ops dispatching to them on our platform, with `forward_native` where they do not apply."""

from __future__ import annotations

import pytest
import torch

from magicdec_kernels import cpu_native
from magicdec_kernels.cpu_native import rms_norm, rotary_embedding, silu_and_mul, store_kv
from magicdec_kernels.loader import native
from test.references import (
    rms_norm_torch,
    rotary_embedding_torch,
    silu_and_mul_torch,
    store_kv_torch,
)

pytestmark = pytest.mark.skipif(
    native() is None,
    reason="the native CPU kernel extension did not build or load (see the logged warning)",
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
ROWS = [1, 3, 8, 13, 32, 64, 300]  # decode, ragged verify batches, a prefill chunk (threads)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _isas() -> list[str]:
    return list(native().isas())


def _ulps_apart(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of the last place of `want` (its dtype's)."""
    eps = torch.finfo(want.dtype).eps
    scale = want.double().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return ((got.double() - want.double()).abs() / (scale * eps)).max().item()


# -- RMSNorm -----------------------------------------------------------------------------------


def _native_rms_norm(x, residual, weight, eps, cast, isa):
    out = torch.empty_like(x)
    residual_out = None if residual is None else torch.empty_like(x)
    native().rms_norm(x, residual, weight, eps, cast, out, residual_out, isa)
    return out, residual_out


@DTYPES
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [True, False], ids=["residual", "alone"])
@pytest.mark.parametrize("cast", [False, True], ids=["weight-fp32", "cast-first"])
def test_rms_norm_matches_torch(rows, with_residual, cast, dtype):
    x = _randn(rows, 576, dtype=dtype, seed=rows)
    residual = _randn(rows, 576, dtype=dtype, seed=rows + 1) if with_residual else None
    weight = _randn(576, dtype=dtype, seed=2)
    want, want_residual = rms_norm_torch(x, residual, weight, 1e-5, cast)
    results = {isa: _native_rms_norm(x, residual, weight, 1e-5, cast, isa) for isa in _isas()}
    for isa, (out, residual_out) in results.items():
        if with_residual:
            assert torch.equal(residual_out, want_residual), isa  # one rounding, as torch's
        # The mean of squares is summed in another order than torch's: float32 results within
        # a few ulps; a bf16 result at most one bf16 rounding step away.
        limit = 8 if dtype == torch.float32 else 1
        assert _ulps_apart(out, want) <= limit, f"{isa}: {_ulps_apart(out, want)} ulps"
        assert torch.equal(out, results[_isas()[0]][0]), f"{isa} differs from {_isas()[0]}"


@DTYPES
def test_rms_norm_rows_do_not_depend_on_their_batch(dtype):
    x = _randn(13, 576, dtype=dtype, seed=3)
    residual = _randn(13, 576, dtype=dtype, seed=4)
    weight = _randn(576, dtype=dtype, seed=5)
    for isa in _isas():
        together, _ = _native_rms_norm(x, residual, weight, 1e-6, False, isa)
        for row in range(13):
            alone, _ = _native_rms_norm(
                x[row : row + 1], residual[row : row + 1], weight, 1e-6, False, isa
            )
            assert torch.equal(alone[0], together[row]), f"{isa}: row {row}"


def test_rms_norm_wrapper_declines_what_it_does_not_compute():
    x = torch.randn(4, 64)
    assert rms_norm(x.half(), None, torch.ones(64).half(), 1e-6, False) is None
    assert rms_norm(x, None, torch.ones(64), 1e-6, False) is not None
    # Casting before the weight product needs the weight in x's dtype.
    assert rms_norm(x.bfloat16(), None, torch.ones(64), 1e-6, True) is None
    assert rms_norm(x, torch.randn(4, 64).bfloat16(), torch.ones(64), 1e-6, False) is None


# -- rotary embedding --------------------------------------------------------------------------


def _qkv(tokens: int, dtype: torch.dtype, seed: int, q_heads=9, kv_heads=3, head_size=64):
    """q and k as SGLang's attention splits them from one projection: strided row views."""
    width = (q_heads + 2 * kv_heads) * head_size
    qkv = _randn(tokens, width, dtype=dtype, seed=seed)
    q, k, _ = qkv.split([q_heads * head_size, kv_heads * head_size, kv_heads * head_size], -1)
    return q, k


@DTYPES
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("cache_dtype", ["same", "fp32"])
def test_rotary_is_bit_identical_to_torch(rows, neox, rotary_dim, cache_dtype, dtype):
    cache = _randn(4096, rotary_dim, dtype=torch.float32, seed=7)
    if cache_dtype == "same":
        cache = cache.to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(rows))
    want_q, want_k = _qkv(rows, dtype, seed=rows)
    rotary_embedding_torch(positions, want_q, want_k, cache, 64, neox)
    for isa in _isas():
        q, k = _qkv(rows, dtype, seed=rows)
        native().rotary_embedding(positions, q, k, cache, 64, neox, isa)
        assert torch.equal(q, want_q) and torch.equal(k, want_k), isa


def test_rotary_refuses_positions_outside_its_cache():
    q, k = _qkv(2, torch.float32, seed=1)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rotary_embedding(torch.tensor([0, 4096]), q, k, torch.zeros(4096, 64), 64, True)
    assert not rotary_embedding(torch.tensor([0, 1], dtype=torch.int32), q, k,
                                torch.zeros(4096, 64), 64, True)  # fmt: skip


# -- SiLU and mul ------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [3072, 2 * 577, 2])
def test_silu_and_mul_matches_torch(rows, width, dtype):
    # Wide enough for exp's extremes: saturating, underflowing and around zero.
    x = _randn(rows, width, dtype=dtype, seed=rows) * 12
    want = silu_and_mul_torch(x)
    first = None
    for isa in _isas():
        out = x.new_empty(rows, width // 2)
        native().silu_and_mul(x, out, isa)
        # The product is rounded as torch rounds it; only exp differs (a few float32 ulps,
        # then at most one bf16 rounding step of silu).
        limit = 16 if dtype == torch.float32 else 2
        assert _ulps_apart(out, want) <= limit, f"{isa}: {_ulps_apart(out, want)} ulps"
        first = out if first is None else first
        assert torch.equal(out, first), f"{isa} differs from {_isas()[0]}"


def test_silu_and_mul_of_a_strided_view():
    x = torch.randn(5, 200)[:, :128]
    assert torch.equal(silu_and_mul(x), silu_and_mul(x.contiguous()))


# -- the KV write ------------------------------------------------------------------------------


@DTYPES
@pytest.mark.parametrize("tokens", [1, 8, 37])
def test_store_kv_writes_the_head_major_pool_like_torch(tokens, dtype):
    """The pool's [slots, Hkv, D] view of head-major storage; k and v strided like the
    projection's split."""
    storage = torch.zeros(2, 3, 100, 64, dtype=dtype)  # K and V, [Hkv, slots, D]
    want = storage.clone()
    k_rows, v_rows = _qkv(tokens, dtype, seed=tokens, q_heads=3)
    loc = torch.randperm(100, generator=torch.Generator().manual_seed(tokens))[:tokens]
    k, v = k_rows.view(tokens, 3, 64), v_rows.reshape(tokens, 3, 64)
    assert store_kv(storage[0].permute(1, 0, 2), storage[1].permute(1, 0, 2), loc, k, v)
    store_kv_torch(want[0].permute(1, 0, 2), want[1].permute(1, 0, 2), loc, k, v)
    assert torch.equal(storage, want)


def test_store_kv_refuses_slots_outside_the_pool():
    cache = torch.zeros(10, 1, 16)
    rows = torch.ones(1, 1, 16)
    with pytest.raises(RuntimeError, match="outside the pool"):
        store_kv(cache, cache.clone(), torch.tensor([10]), rows, rows)
    assert not store_kv(cache, cache.clone(), torch.tensor([1]), rows.bfloat16(), rows)


# -- SGLang's fused ops on our platform --------------------------------------------------------


@pytest.fixture(scope="module")
def sglang_ops():
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_magicdec.platforms import is_active

    if not is_active():
        pytest.fail("our CPU platform is not SGLang's current platform in this process")
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.rope_variant import Llama3RotaryEmbedding

    return RMSNorm, SiluAndMul, Llama3RotaryEmbedding


@DTYPES
def test_sglang_modules_dispatch_to_the_native_ops(sglang_ops, dtype):
    from sglang_magicdec.platforms import torch_ops

    rms_norm_cls, silu_cls, rotary_cls = sglang_ops
    norm = rms_norm_cls(576, eps=1e-5).to(dtype)
    norm.weight.data.copy_(_randn(576, dtype=dtype, seed=1))
    x, residual = _randn(8, 576, dtype=dtype, seed=2), _randn(8, 576, dtype=dtype, seed=3)
    got, got_residual = norm(x, residual)
    assert norm._forward_method.__func__ is torch_ops.rms_norm_forward
    want, want_residual = norm.forward_native(x, residual)
    assert torch.equal(got_residual, want_residual)
    assert _ulps_apart(got, want) <= (8 if dtype == torch.float32 else 1)

    silu = silu_cls()
    gate_up = _randn(8, 3072, dtype=dtype, seed=4)
    got = silu(gate_up)
    assert silu._forward_method.__func__ is torch_ops.silu_and_mul_forward
    assert _ulps_apart(got, silu.forward_native(gate_up)) <= (16 if dtype == torch.float32 else 2)

    # Llama 3's scaled RoPE (a subclass that only changes the cache), as Llama-3.1 uses it.
    rope = rotary_cls(64, 64, 8192, 500000, True, dtype, 8.0, 1.0, 4.0, 8192)
    positions = torch.tensor([0, 5, 4095, 8191, 17, 17, 2, 3])
    q, k = _qkv(8, dtype, seed=5)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope(positions, q, k)
    assert rope._forward_method.__func__ is torch_ops.rotary_forward
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_configurations_the_native_ops_do_not_compute_run_forward_native(sglang_ops, monkeypatch):
    """A variance over part of the hidden size, or a residual added after the attention output,
    reach SGLang's own torch code, with its results."""
    rms_norm_cls, _, _ = sglang_ops
    calls = []
    monkeypatch.setattr(cpu_native, "rms_norm", lambda *args: calls.append(args))
    norm = rms_norm_cls(64, var_hidden_size=32)
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    got = norm(x, residual)
    want = norm.forward_native(x, residual)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    plain = rms_norm_cls(64)
    extra = torch.randn(3, 64)
    got = plain(x, residual, post_residual_addition=extra)
    want = plain.forward_native(x, residual, post_residual_addition=extra)
    assert torch.equal(got[0], want[0]) and not calls


@DTYPES
def test_the_cpu_pool_writes_through_the_native_op(sglang_ops, monkeypatch, dtype):
    """SGLang's `set_kv_buffer` on our pool reaches `_store_kv_layer`, which writes natively
    into the head-major storage what SGLang's own write would."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_magicdec.platforms.kv_pool import TorchMoveMHAPool

    pool = TorchMoveMHAPool(64, 1, dtype, 3, 64, 2, "cpu", False)
    calls = []
    native_store = cpu_native.store_kv

    def counted_store(*args):
        calls.append(1)
        return native_store(*args)

    monkeypatch.setattr(cpu_native, "store_kv", counted_store)
    k_rows, v_rows = _qkv(5, dtype, seed=9, q_heads=3)
    loc = torch.tensor([3, 60, 7, 1, 40])
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), KVWriteLoc(loc, None), k_rows, v_rows)
    assert calls == [1]
    want_k, want_v = torch.zeros(65, 3, 64, dtype=dtype), torch.zeros(65, 3, 64, dtype=dtype)
    want_k[loc], want_v[loc] = k_rows.reshape(5, 3, 64), v_rows.reshape(5, 3, 64)
    assert torch.equal(pool.get_key_buffer(1), want_k)
    assert torch.equal(pool.get_value_buffer(1), want_v)
    assert not pool.get_key_buffer(0).any()
