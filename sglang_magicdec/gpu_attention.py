"""MagicDec's draft steps on SGLang's CUDA attention backends (fa3, flashinfer, triton).

While MAGICDEC runs, the attention registry's entries for those backends build the backend as
SGLang would and wrap it in `MagicDecAttnBackend` (a backend that owns another, as SGLang's
`HybridAttnBackend` does). Extend, verify and plain decode, with all their CUDA-graph state, stay
with the wrapped ("dense") backend. Only a draft step (DECODE whose spec input carries per-head
slot lists, `spec_info.draft_slots`) takes the sparse path: each (request, KV head) reads its
own slots of SGLang's KV pool in place, through FlashInfer's batch decode when the dense backend
is flashinfer and the draft reads one list in every layer (streaming; `magicdec_kernels.
flat_decode`), our Triton kernel otherwise (`magicdec_kernels.sparse_decode_triton`).

SGLang's dense backends cannot serve the draft themselves: fa3 ignores a spec input's slot list
in DECODE, and none reads a list per KV head.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from sglang_magicdec.config import ALGORITHM
from sglang_magicdec.launch_checks import unsupported_attention
from sglang_magicdec.platforms import CPU_ATTENTION_BACKENDS
from sglang_magicdec.spec_info import HeadSlots, MagicDecInput, draft_slots

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# SGLang backends whose extend/verify/decode MagicDec runs unchanged, adding its draft path.
DENSE_BACKENDS = ("fa3", "flashinfer", "triton")


def check_attention_backends(backends: tuple[str | None, ...], cpu_platform: bool) -> None:
    """The rule MAGICDEC's launch applies to the resolved (prefill, decode) attention backends:
    each must be one the wrapper serves (or, on our CPU platform, our own CPU backends).
    Raises ValueError with a one-line message otherwise."""
    supported = DENSE_BACKENDS + (CPU_ATTENTION_BACKENDS if cpu_platform else ())
    for backend in backends:
        if backend not in supported:
            raise ValueError(
                f"{ALGORITHM} runs on --attention-backend {', '.join(supported)}; got {backend!r}"
            )


def _delegated(name: str) -> property:
    def get(self):
        return getattr(self.dense, name)

    def set_(self, value):
        setattr(self.dense, name, value)

    return property(get, set_)


class MagicDecAttnBackend(AttentionBackend):
    """The dense backend for everything but draft steps, which read per-head slot lists."""

    attn_backend_list: list[AttentionBackend] | None = None  # ours, not the dense backend's

    def __init__(self, model_runner: ModelRunner, dense: AttentionBackend, dense_name: str):
        self.__dict__["dense"] = dense
        self.dense_name = dense_name
        self.draft: HeadSlots | None = None
        self.attn_backend_list = [dense]
        self._pool = model_runner.token_to_kv_pool
        self._flashinfer = None
        if dense_name == "flashinfer":
            from magicdec_kernels.flat_decode import FlashInferFlatDecode

            self._flashinfer = FlashInferFlatDecode(model_runner.device)

    def __getattr__(self, name: str):
        # Attributes the base class does not declare (req_to_token_pool, decode_wrappers, ...).
        dense = self.__dict__.get("dense")
        if dense is None:
            raise AttributeError(name)
        return getattr(dense, name)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        spec_info = forward_batch.spec_info
        self.draft = draft_slots(forward_batch)
        if self.draft is not None:
            if self._flashinfer is not None:
                self._flashinfer.new_step()
            return
        if (
            self.dense_name == "fa3"
            and forward_batch.forward_mode.is_target_verify()
            and isinstance(spec_info, MagicDecInput)
        ):
            # fa3 sizes a verify by its own `speculative_num_draft_tokens` (the server's γ + 1,
            # read at start); a γ = auto round can be narrower. The width is read only here
            # (its forward reads the metadata built now), so it is set for this call and put
            # back. A verify with no spec input (SGLang's warm-up and autotune dummy runs) keeps
            # the server's width.
            server_width = self.dense.speculative_num_draft_tokens
            self.dense.speculative_num_draft_tokens = spec_info.draft_token_num
            try:
                self.dense.init_forward_metadata(forward_batch)
            finally:
                self.dense.speculative_num_draft_tokens = server_width
            return
        self.dense.init_forward_metadata(forward_batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        if self.draft is not None and forward_batch.forward_mode.is_decode():
            return self._draft_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.dense.forward(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if self.draft is not None:
            return self._draft_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def _draft_decode(
        self, q, k, v, layer: RadixAttention, forward_batch, save_kv_cache, sinks=None, **kwargs
    ):
        # Refused at launch from the model's config (`check_attention_features`); this is the
        # same rule where SGLang's layer says it, never a silently different draft.
        unsupported = unsupported_attention(layer, sinks)
        if unsupported is not None:
            raise NotImplementedError(f"{ALGORITHM} drafts cannot compute {unsupported}")
        if save_kv_cache and k is not None:
            self._pool.set_kv_buffer(layer, KVWriteLoc.for_layer(forward_batch, layer), k, v)
        draft = self.draft
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, layer.v_head_dim)
        head_slots = draft.for_layer(layer.layer_id).expand(-1, layer.tp_k_head_num, -1)
        k_cache = self._pool.get_key_buffer(layer.layer_id)
        v_cache = self._pool.get_value_buffer(layer.layer_id)
        if self._flashinfer is not None and not draft.per_layer:
            # One list for every layer: FlashInfer plans it once per draft step (its plan reads
            # the row lengths on the host: one synchronisation per step). Per-layer SnapKV lists
            # would need a plan, and a synchronisation, per layer: those take the Triton kernel.
            self._flashinfer.run(q, k_cache, v_cache, head_slots, draft.kv_lens, layer.scaling, out)
        else:
            from magicdec_kernels.sparse_decode_triton import sparse_decode_triton

            sparse_decode_triton(q, k_cache, v_cache, head_slots, draft.kv_lens, layer.scaling, out)
        return out.view(q.shape[0], -1)


# Everything the base class declares (flags, CUDA-graph hooks, verify-mask plumbing) is the
# dense backend's, read and written through; `__getattr__` only sees undeclared names.
for _name, _value in list(vars(AttentionBackend).items()):
    if not _name.startswith("__") and _name not in vars(MagicDecAttnBackend):
        setattr(MagicDecAttnBackend, _name, _delegated(_name))


def wrap_dense_backends() -> None:
    """Make the registry's fa3/flashinfer/triton factories wrap their backend while MAGICDEC
    runs (decided when a model runner builds its backend, in the scheduler process)."""
    from sglang.srt.layers.attention.attention_registry import (
        ATTENTION_BACKENDS,
        register_attention_backend,
    )

    for name in DENSE_BACKENDS:
        build = ATTENTION_BACKENDS.get(name)
        if build is None or getattr(build, "magicdec_wrapped", False):
            continue

        def build_wrapped(runner, build=build, name=name):
            dense = build(runner)
            if not _magicdec_runs():
                return dense
            if runner.use_mla_backend:
                raise ValueError(f"{ALGORITHM} drafts need multi-head attention (not MLA)")
            logger.info("MagicDec draft steps wrap the %s attention backend", name)
            return MagicDecAttnBackend(runner, dense, name)

        build_wrapped.magicdec_wrapped = True
        register_attention_backend(name)(build_wrapped)


def _magicdec_runs() -> bool:
    from sglang.srt.runtime_context import get_spec

    return str(get_spec().speculative_algorithm or "").upper() == ALGORITHM
