"""The attention kernels a server step runs, on KV buffers laid out as SGLang's pool lays them out.

Per layer SGLang keeps K and V as `[slots, Hkv, D]`. Here request b's context fills slots
`b·stride ..` (`stride` = longest context + room for the verify's new tokens), so every kernel
reads the pool in place. Each kernel is built once per step (the backends' forward metadata) and
called per layer as `attend(layer, q, k_buffer, v_buffer) -> [rows, Hq, Dv]`; the step has
already written the new tokens' K/V at `new_slots`, as SGLang's `set_kv_buffer` does.

- decode / verify: SGLang's own Triton kernels (`decode_attention_fwd`, `extend_attention_fwd`
  with a causal chain and no custom mask: what its triton backend runs for MAGICDEC) when SGLang
  imports; otherwise torch's SDPA over zero-copy views, reported as a stand-in.
- draft: what `MagicDecAttnBackend` runs for a draft step: our `sparse_decode_triton`,
  FlashInfer's batch decode over flattened (request, KV head) rows when FlashInfer imports, and
  SGLang's Triton decode over the same flattened rows (candidates for "keep the faster").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from magicdec_kernels.flat_decode import flat_queries, flat_rows, flatten_head_slots

# q [rows, Hq, D] (decode/draft: one row per request; verify: γ+1 per request), the layer's
# K and V buffers -> [rows, Hq, Dv].
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# SGLang's default --triton-attention-num-kv-splits.
SGLANG_MAX_KV_SPLITS = 8
MAX_NEW_TOKENS = 8  # verify writes γ + 1 ≤ 7 tokens after the context
FLASHINFER_PER_LAYER = "FlashInfer batch decode, flat rows, planned per layer"


def sglang_kernels() -> tuple[object | None, str]:
    """SGLang's Triton attention module pair, or None and why not (the GPU machine lacks
    SGLang's compiled dependencies, which `sglang.srt.utils` imports)."""
    try:
        from sglang.kernels.ops.attention import decode_attention, extend_attention
    except Exception as error:  # ImportError, or a dependency failing at import
        return None, f"SGLang not importable ({type(error).__name__}: {error})"[:200]
    return (decode_attention, extend_attention), "SGLang Triton"


def flashinfer_available() -> tuple[bool, str]:
    try:
        import flashinfer  # noqa: F401
    except Exception as error:
        return False, f"FlashInfer not importable ({type(error).__name__})"
    return True, "FlashInfer"


@dataclass
class Layout:
    """Where each request's tokens sit in the pool: context b at slots b·stride + [0, len)."""

    context_lens: list[int]
    kv_heads: int
    head_dim: int

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def stride(self) -> int:
        # A multiple of 64 keeps every request's first slot aligned for the SDPA kernels.
        return -(-(max(self.context_lens) + MAX_NEW_TOKENS) // 64) * 64

    @property
    def slots(self) -> int:
        return self.batch * self.stride

    def new_slots(self, tokens: int, device: torch.device) -> torch.Tensor:
        """The `tokens` new tokens of each request, written right after its context."""
        starts = torch.tensor(self.context_lens, device=device) + torch.arange(
            0, self.slots, self.stride, device=device
        )
        return (starts[:, None] + torch.arange(tokens, device=device)).flatten()

    def csr(self, extra: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_indptr int32, kv_indices int64) over each context plus `extra` new tokens."""
        lens = torch.tensor(self.context_lens, device=device) + extra
        indptr = torch.zeros(self.batch + 1, dtype=torch.int32, device=device)
        indptr[1:] = lens.cumsum(0)
        indices = torch.cat(
            [b * self.stride + torch.arange(n, device=device) for b, n in enumerate(lens.tolist())]
        )
        return indptr, indices

    def draft_slots(
        self, layers: int, chosen: int, recent: int, generator: torch.Generator, device
    ) -> torch.Tensor:
        """A SnapKV draft's head_slots [layers, B, Hkv, chosen + recent + 1]: per layer and KV
        head, `chosen` distinct context positions, then the last `recent` ones and the new token."""
        lists = torch.empty(
            layers, self.batch, self.kv_heads, chosen + recent + 1, dtype=torch.int64
        )
        for b, length in enumerate(self.context_lens):
            assert length >= chosen + recent, (length, chosen, recent)
            base = b * self.stride
            tail = torch.arange(length - recent, length + 1) + base
            for layer in range(layers):
                for head in range(self.kv_heads):
                    picked = torch.randperm(length - recent, generator=generator)[:chosen]
                    lists[layer, b, head] = torch.cat([picked.sort().values + base, tail])
        return lists.to(device)


def dense_decode(layout: Layout, q_heads: int, device) -> tuple[Attend, str]:
    kernels, name = sglang_kernels()
    kv_indptr, kv_indices = layout.csr(1, device)
    if kernels is None:
        return _sdpa(layout, 1, device), f"torch SDPA stand-in: {name}"
    decode_attention = kernels[0]
    batch, splits = layout.batch, SGLANG_MAX_KV_SPLITS
    logits = torch.empty(
        batch, q_heads, splits, layout.head_dim, dtype=torch.float32, device=device
    )
    lse = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=device)
    num_splits = torch.full((batch,), splits, dtype=torch.int32, device=device)

    def attend(layer, q, k_buffer, v_buffer):
        out = q.new_empty(q.shape[0], q_heads, v_buffer.shape[2])
        decode_attention.decode_attention_fwd(
            q, k_buffer, v_buffer, out, kv_indptr, kv_indices, logits, lse, num_splits, splits,
            q.shape[-1] ** -0.5, 1.0, 1.0,
        )  # fmt: skip
        return out

    return attend, f"{name} decode_attention_fwd"


def dense_verify(layout: Layout, tokens: int, device) -> tuple[Attend, str]:
    """γ + 1 = `tokens` queries per request over its context and, causally, each other."""
    kernels, name = sglang_kernels()
    if kernels is None:
        return _sdpa(layout, tokens, device), f"torch SDPA stand-in: {name}"
    extend_attention = kernels[1]
    kv_indptr, kv_indices = layout.csr(0, device)
    qo_indptr = torch.arange(0, (layout.batch + 1) * tokens, tokens, dtype=torch.int32).to(device)
    new_slots = layout.new_slots(tokens, device)

    def attend(layer, q, k_buffer, v_buffer):
        out = torch.empty_like(q)
        extend_attention.extend_attention_fwd(
            q, k_buffer[new_slots], v_buffer[new_slots], out, k_buffer, v_buffer, qo_indptr,
            kv_indptr, kv_indices, None, True, None, tokens, 1.0, 1.0, q.shape[-1] ** -0.5,
        )  # fmt: skip
        return out

    return attend, f"{name} extend_attention_fwd"


def _sdpa(layout: Layout, tokens: int, device) -> Attend:
    """torch SDPA over [B, Hkv, keys, D] views of the pool, zero copy. Each KV head's `group`
    query heads × `tokens` become its query rows, so no kernel has to expand KV for GQA; a mask
    (query t sees its context and new tokens ≤ t) is passed only where some key is hidden, so a
    uniform decode runs on the flash kernel."""
    batch, stride, kv_heads = layout.batch, layout.stride, layout.kv_heads
    width = max(layout.context_lens) + tokens
    lens = torch.tensor(layout.context_lens, device=device)
    last_key = lens[:, None] + torch.arange(tokens, device=device)  # [B, tokens]
    visible = torch.arange(width, device=device)[None, None, :] <= last_key[:, :, None]
    mask = None if bool(visible.all()) else visible[:, None, None]  # [B, 1, 1, tokens, width]

    def attend(layer, q, k_buffer, v_buffer):
        group = q.shape[1] // kv_heads
        k = k_buffer[: batch * stride].view(batch, stride, kv_heads, -1)[:, :width].transpose(1, 2)
        v = v_buffer[: batch * stride].view(batch, stride, kv_heads, -1)[:, :width].transpose(1, 2)
        rows = q.view(batch, tokens, kv_heads, group, -1).permute(0, 2, 3, 1, 4)
        rows_mask = None
        if mask is not None:
            rows_mask = mask.expand(batch, 1, group, tokens, width).reshape(batch, 1, -1, width)
        out = F.scaled_dot_product_attention(
            rows.reshape(batch, kv_heads, group * tokens, -1), k, v, attn_mask=rows_mask
        )
        out = out.view(batch, kv_heads, group, tokens, -1).permute(0, 3, 1, 2, 4)
        return out.reshape(q.shape[0], q.shape[1], -1)

    return attend


def draft_kernels(head_slots: torch.Tensor, device) -> dict[str, Attend | str]:
    """The draft step's candidates over `head_slots` [layers, B, Hkv, W] (SnapKV: a list per layer
    and KV head); a kernel that cannot run here maps to the reason."""
    kv_lens = torch.full((head_slots.shape[1],), head_slots.shape[-1], device=device)
    kernels: dict[str, Attend | str] = {}

    def ours(layer, q, k_buffer, v_buffer):
        from magicdec_kernels.sparse_decode_triton import sparse_decode_triton

        slots = head_slots[layer % head_slots.shape[0]]
        return sparse_decode_triton(q, k_buffer, v_buffer, slots, kv_lens, q.shape[-1] ** -0.5)

    kernels["magicdec sparse_decode_triton"] = ours
    sglang, reason = sglang_kernels()
    if sglang is None:
        kernels["SGLang decode_attention_fwd, flat rows"] = reason
    else:
        decode_attention = sglang[0]
        flat = [flatten_head_slots(slots, kv_lens) for slots in head_slots]  # once per round

        def sglang_flat(layer, q, k_buffer, v_buffer):
            kv_indptr, kv_indices = flat[layer % len(flat)]
            queries = flat_queries(q, k_buffer.shape[1])
            rows, group, splits = queries.shape[0], queries.shape[1], SGLANG_MAX_KV_SPLITS
            out = q.new_empty(rows, group, v_buffer.shape[2])
            decode_attention.decode_attention_fwd(
                queries, flat_rows(k_buffer), flat_rows(v_buffer), out, kv_indptr, kv_indices,
                q.new_empty(rows, group, splits, v_buffer.shape[2], dtype=torch.float32),
                q.new_empty(rows, group, splits, dtype=torch.float32),
                torch.full((rows,), splits, dtype=torch.int32, device=q.device), splits,
                q.shape[-1] ** -0.5, 1.0, 1.0,
            )  # fmt: skip
            return out.view(q.shape[0], q.shape[1], -1)

        kernels["SGLang decode_attention_fwd, flat rows"] = sglang_flat
    usable, reason = flashinfer_available()
    if not usable or device.type != "cuda":
        kernels[FLASHINFER_PER_LAYER] = reason if not usable else "needs CUDA"
    else:
        from magicdec_kernels.flat_decode import FlashInferFlatDecode

        flashinfer = FlashInferFlatDecode(device)

        def flashinfer_flat(layer, q, k_buffer, v_buffer):
            # Planned for every layer's own list: what FlashInfer would cost SnapKV, whose
            # lists differ per layer (the wrapper gives those to the Triton kernel and plans
            # FlashInfer once per step for a list all layers share).
            flashinfer.new_step()
            out = q.new_empty(q.shape[0], q.shape[1], v_buffer.shape[2])
            slots = head_slots[layer % head_slots.shape[0]]
            return flashinfer.run(q, k_buffer, v_buffer, slots, kv_lens, q.shape[-1] ** -0.5, out)

        kernels[FLASHINFER_PER_LAYER] = flashinfer_flat
    return kernels


def oracle(
    q: torch.Tensor, k_buffer, v_buffer, slot_lists: list[list[torch.Tensor]]
) -> torch.Tensor:
    """float64 softmax attention: query row r's KV head h reads slot_lists[r][h]."""
    rows, q_heads, dim = q.shape
    kv_heads = k_buffer.shape[1]
    group = q_heads // kv_heads
    out = torch.empty(rows, q_heads, v_buffer.shape[2], dtype=torch.float64)
    q, k_buffer, v_buffer = q.cpu(), k_buffer.cpu(), v_buffer.cpu()  # once, not per row
    for row in range(rows):
        for head in range(kv_heads):
            slots = slot_lists[row][head].cpu()
            keys = k_buffer[slots, head].double()
            values = v_buffer[slots, head].double()
            queries = q[row, head * group : (head + 1) * group].double()
            probs = torch.softmax(queries @ keys.T * dim**-0.5, dim=-1)
            out[row, head * group : (head + 1) * group] = probs @ values
    return out
