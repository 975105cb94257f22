"""The SGLang internals we rely on outside `HookRegistry` (whose targets `test_hooks.py` checks)
are still there and still mean what we take them to mean: the KV pool's private buffer methods
our CPU pool overrides, the fused ops' `_forward_method` seam, and the spec-input tags and
positions MagicDecInput borrows. Each of these would otherwise change silently: an override
nobody calls any more, a plan of ops SGLang no longer runs, an input SGLang treats as another
kind."""

from __future__ import annotations

import inspect
import re
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.memory_pool import KVWriteLoc, MHATokenToKVPool

from sglang_magicdec.platforms import decode_forward, torch_ops
from sglang_magicdec.platforms.kv_pool import TorchMoveMHAPool


@pytest.fixture(scope="module")
def our_platform():
    """Our plugin loaded, on our CPU platform (our fused-op forwards registered)."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang_magicdec.platforms import is_active

    if not is_active():
        pytest.fail("our CPU platform is not SGLang's current platform in this process")


# -- the KV pool: TorchMoveMHAPool's overrides of MHATokenToKVPool -----------------------------

OVERRIDES = sorted(
    name
    for name, value in vars(TorchMoveMHAPool).items()
    if inspect.isfunction(value) and not name.startswith("__")
)

# size, page_size, dtype, head_num, head_dim, layer_num, device, enable_memory_saver
POOL_ARGS = (32, 1, torch.float32, 2, 16, 3, "cpu", False)


def test_the_pool_overrides_the_methods_sglang_calls():
    """Guards SGLang's private `MHATokenToKVPool` methods we override (`_create_buffers_normal`,
    `_init_kv_copy_and_warmup`, `_store_kv_layer`): renamed or with other parameters in
    SGLang, our override would silently never be called (token-major KV again, SGLang's Triton
    warm-up, SGLang's write)."""
    assert OVERRIDES == ["_create_buffers_normal", "_init_kv_copy_and_warmup", "_store_kv_layer"]
    for name in OVERRIDES:
        theirs = getattr(MHATokenToKVPool, name, None)
        assert callable(theirs), f"SGLang's MHATokenToKVPool has no {name} to override"
        ours = getattr(TorchMoveMHAPool, name)
        assert list(inspect.signature(ours).parameters) == list(
            inspect.signature(theirs).parameters
        ), name


def test_the_pools_buffers_are_head_major(our_platform):
    """Guards `_create_buffers_normal` being how SGLang's constructor makes the buffers: each
    layer's K and V must be a [slots, Hkv, D] view of head-major storage, which our attention
    kernels read a KV head's slots from at memory bandwidth (`kv_pool.py`)."""
    pool = TorchMoveMHAPool(*POOL_ARGS)
    assert pool.kv_cache_layout == "nhd"
    assert len(pool.k_buffer) == len(pool.v_buffer) == 3
    for buffer in (*pool.k_buffer, *pool.v_buffer):
        assert buffer.shape == (33, 2, 16)  # size + page_size slots
        assert buffer.permute(1, 0, 2).is_contiguous() and not buffer.is_contiguous()


def test_sglangs_kv_write_goes_through_our_store(our_platform, monkeypatch):
    """Guards `set_kv_buffer` (SGLang's public write, which every attention backend calls)
    ending in `_store_kv_layer(layer_idx, loc, cache_k, cache_v)`: our native head-major write.
    Reading back through `get_key_buffer` / `get_value_buffer` gives the rows written."""
    pool = TorchMoveMHAPool(*POOL_ARGS)
    calls = []
    store = TorchMoveMHAPool._store_kv_layer

    def spy(self, layer_idx, loc, cache_k, cache_v):
        calls.append((layer_idx, loc.tolist()))
        return store(self, layer_idx, loc, cache_k, cache_v)

    monkeypatch.setattr(TorchMoveMHAPool, "_store_kv_layer", spy)
    generator = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 4, 2, 16, generator=generator)
    loc = torch.tensor([3, 30, 7, 1])
    pool.set_kv_buffer(SimpleNamespace(layer_id=1), KVWriteLoc(loc, None), k, v)
    assert calls == [(1, [3, 30, 7, 1])]
    want_k, want_v = torch.zeros(33, 2, 16), torch.zeros(33, 2, 16)
    want_k[loc], want_v[loc] = k, v
    assert torch.equal(pool.get_key_buffer(1), want_k)
    assert torch.equal(pool.get_value_buffer(1), want_v)
    assert not pool.get_key_buffer(0).any() and not pool.get_key_buffer(2).any()


def test_kv_moves_take_sglangs_torch_path(our_platform):
    """Guards `_init_kv_copy_and_warmup` (called by SGLang's constructor when KV copies are
    enabled, as speculative decoding does) and the `use_native_move_kv_cache` flag SGLang's
    `move_kv_cache` reads: SGLang's own warm-up asserts contiguous buffers and launches a
    Triton kernel, and without the flag `move_kv_cache` asserts a copy config we do not make."""
    pool = TorchMoveMHAPool(*POOL_ARGS, enable_kv_cache_copy=True)
    assert pool.use_native_move_kv_cache and pool._kv_copy_config is None
    generator = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 2, 16, generator=generator)
    for layer in range(3):
        pool.set_kv_buffer(
            SimpleNamespace(layer_id=layer), KVWriteLoc(torch.tensor([4, 9]), None), k, v
        )
    pool.move_kv_cache(torch.tensor([20, 21]), torch.tensor([4, 9]))
    for layer in range(3):
        assert torch.equal(pool.get_key_buffer(layer)[[20, 21]], k)
        assert torch.equal(pool.get_value_buffer(layer)[[20, 21]], v)


# -- the fused ops' `_forward_method` ----------------------------------------------------------


def _ops():
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

    q_k = torch.randn(3, 2 * 64, generator=torch.Generator().manual_seed(2))
    rope = RotaryEmbedding(64, 64, 128, 10000, True, torch.float32)
    return [
        (RMSNorm(64), torch_ops.rms_norm_forward, (torch.randn(3, 64),)),
        (SiluAndMul(), torch_ops.silu_and_mul_forward, (torch.randn(3, 128),)),
        (rope, torch_ops.rotary_forward, (torch.tensor([0, 5, 9]), q_k[:, :64], q_k[:, 64:])),
    ]


def test_fused_ops_resolve_and_keep_our_forward_in_forward_method(our_platform):
    """Guards `BaseFusedOp._forward_method` / `_resolve_forward_method`, which
    `decode_forward._dispatches_to` reads to know that SGLang's RMSNorm, SiluAndMul and rotary
    embedding run our registered forwards (`register_oot_forward`), so that calling those
    forwards directly computes what SGLang's layers do. Renamed or no longer caching, the plan
    would read the wrong thing (or fail and fall back)."""
    for op, ours, args in _ops():
        assert op._forward_method is None, type(op).__name__
        resolved = op._resolve_forward_method()
        assert resolved.__func__ is ours and resolved.__self__ is op
        assert op._forward_method is None  # resolving does not cache; the first call does
        op(*args)
        assert op._forward_method.__func__ is ours
        assert decode_forward._dispatches_to(op, ours)
    for op, ours, _ in _ops():  # a fresh op: _dispatches_to resolves and caches it as forward
        assert decode_forward._dispatches_to(op, ours) and op._forward_method.__func__ is ours


def test_fused_ops_run_what_forward_method_holds(our_platform):
    """Guards `BaseFusedOp.forward` calling `_forward_method` when it is set (SGLang pins paths
    by setting it): what `_dispatches_to` reads is what the layer runs. Also that a forced
    fused-op backend is off in the tests (`plan_of` plans nothing under one)."""
    from sglang.kernels.fused_op import get_fused_op_backend

    assert get_fused_op_backend() is None
    for op, _, args in _ops():
        calls = []
        op._forward_method = lambda *a, calls=calls, **kw: calls.append(a) or "pinned"
        assert op(*args) == "pinned" and len(calls) == 1, type(op).__name__


# -- the spec-input tags and positions MagicDecInput borrows -----------------------------------


def test_magicdec_inputs_are_tagged_as_sglang_reads_them():
    """Guards `SpecInputType.EAGLE_DRAFT` (draft steps) and `NGRAM_VERIFY` (verify) and what
    `SpecInput.is_draft_input` / `is_verify_input` make of them: SGLang's ForwardBatch pads
    draft inputs (`_pad_inputs_to_size`) and the attention backends (flashinfer's verify plan,
    the draft backends' asserts) choose their path by them. A tag that moved to the other kind
    would send a MagicDec forward down another algorithm's path."""
    from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

    from sglang_magicdec.spec_info import MagicDecInput

    assert isinstance(SpecInputType.EAGLE_DRAFT, SpecInputType)
    assert isinstance(SpecInputType.NGRAM_VERIFY, SpecInputType)
    draft = MagicDecInput(
        draft_token_num=1,
        positions=torch.tensor([7]),
        head_slots=torch.zeros(1, 1, 1, 4, dtype=torch.int64),
        kv_lens=torch.tensor([3]),
    )
    assert isinstance(draft, SpecInput)
    assert draft.spec_input_type is SpecInputType.EAGLE_DRAFT
    assert draft.is_draft_input() and not draft.is_verify_input()
    verify = MagicDecInput(draft_token_num=4, positions=torch.arange(7, 11))
    assert verify.spec_input_type is SpecInputType.NGRAM_VERIFY
    assert verify.is_verify_input() and not verify.is_draft_input()
    # Neither is EAGLE's verify nor DFLASH's: flashinfer then plans a plain causal chain.
    assert verify.spec_input_type not in (SpecInputType.EAGLE_VERIFY, SpecInputType.DFLASH_VERIFY)


def test_forward_batch_takes_positions_from_spec_info():
    """Guards `ForwardBatch.init_new` taking a forward's positions from `spec_info.positions`
    (what MagicDecInput hands in: S..S+γ per request for a verify, S+step for a draft step);
    else a verify would run at positions `seq_lens - 1`, one per request, for its γ + 1 tokens.
    A real ForwardBatch needs a model runner: `test_decode_forward.py`'s check builds them and
    asserts it for every draft and verify forward; this source-level check fails fast and names
    the line to look at."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    source = inspect.getsource(ForwardBatch.init_new)
    assert re.search(r'getattr\(\s*ret\.spec_info,\s*"positions",\s*None\s*\)', source)
    assert re.search(r"ret\.positions\s*=\s*ret\.spec_info\.positions\b", source)
