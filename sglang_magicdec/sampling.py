"""Exact speculative sampling for a chain draft (Leviathan et al., 2023; Chen et al., 2023).

Draft token x_j, drawn from the draft's distribution q_j, is kept with probability
min(1, p_j(x_j) / q_j(x_j)), p_j being the target's; at the first rejection the round ends with a
token drawn from the normalised positive part of p_j − q_j; when all γ are kept, a bonus token is
drawn from p_{γ+1}. Every committed token is then distributed exactly as the target samples it.
p and q are both taken after SGLang's sampling transforms (temperature, then top-k, top-p and
min-p as `top_k_top_p_min_p_sampling_from_probs_torch` applies them), so "the target" means the
request's own sampling parameters. Greedy rows (SGLang stores temperature 0 as top-k 1) are
one-hot, for which this reduces to greedy acceptance.

All randomness comes in as uniforms, so tests can drive the sampler exactly. Requests with a
`sampling_seed` are sampled by `seeded_sample` instead, a coupling that makes their output a
function of the seed alone (reproducible at any γ), at some cost in acceptance. SGLang's own chain
sampling is a CUDA kernel (sgl_kernel); this is the torch version, used on every platform.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Filters:
    """The rows' top-k, top-p and min-p ([N] each, on the device) and `candidates`, the largest
    top-k of any row, a host int (no device read): no row keeps more tokens than that, so only
    that many need sorting (SGLang's "no top-k" is 1 << 30: then the whole vocabulary)."""

    top_ks: torch.Tensor
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    candidates: int

    def repeat_interleave(self, width: int) -> Filters:
        """Each row's filters `width` times (a verify's rows)."""
        return Filters(
            self.top_ks.repeat_interleave(width),
            self.top_ps.repeat_interleave(width),
            self.min_ps.repeat_interleave(width),
            self.candidates,
        )

    def index_select(self, rows: torch.Tensor) -> Filters:
        return Filters(
            self.top_ks.index_select(0, rows),
            self.top_ps.index_select(0, rows),
            self.min_ps.index_select(0, rows),
            self.candidates,
        )


def sampling_probs(
    logits: torch.Tensor, temperatures: torch.Tensor, filters: Filters | None
) -> torch.Tensor:
    """[N, V] logits → [N, V] normalised float32 probabilities after the sampling transforms:
    temperature ([N] or [N, 1]), then `filters`, or None when no row of the batch filters (the
    sort over the vocabulary is then skipped)."""
    probs = torch.softmax(logits.float() / temperatures.view(-1, 1).float(), dim=-1)
    return probs if filters is None else filtered_probs(probs, filters)


def filtered_probs(probs: torch.Tensor, filters: Filters) -> torch.Tensor:
    """Top-k, then top-p and min-p, of [N, V] probabilities (after temperature), renormalised.
    Only the `filters.candidates` most probable tokens of each row are sorted (a full sort of a
    large vocabulary costs milliseconds a row on a CPU); every other token is dropped by top-k
    anyway. A row that drops nothing is returned as it came, bit for bit, so a row's
    distribution does not depend on whether other rows of its batch filter."""
    vocab = probs.shape[-1]
    candidates = min(filters.candidates, vocab)
    if candidates < vocab:
        sorted_probs, order = probs.topk(candidates, dim=-1)  # sorted, most probable first
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(candidates, device=probs.device)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    dropped = (rank[None, :] >= filters.top_ks.view(-1, 1)) | (
        mass_before > filters.top_ps.view(-1, 1)
    )
    dropped |= sorted_probs < sorted_probs[:, :1] * filters.min_ps.view(-1, 1)
    sorted_probs = sorted_probs.masked_fill(dropped, 0.0)
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    renormalised = filtered / filtered.sum(dim=-1, keepdim=True)
    drops_any = dropped.any(dim=-1, keepdim=True) | (candidates < vocab)
    return torch.where(drops_any, renormalised, probs)


_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' "lowbias32") of int64 tensors holding values in
    [0, 2^32), on any device. Products are split in 16-bit halves so no int64 overflows."""

    def times(x: torch.Tensor, constant: int) -> torch.Tensor:
        low = x * (constant & 0xFFFF)
        high = ((x * (constant >> 16)) & 0xFFFF) << 16
        return (low + high) & _MASK32

    x = x ^ (x >> 16)
    x = times(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = times(x, 0x846CA68B)
    return x ^ (x >> 16)


def _mix32_wrapping(x: torch.Tensor) -> torch.Tensor:
    """`_mix32` of int32 tensors holding the 32 bits in two's complement, in place: int32
    products wrap modulo 2^32 (on CPU and CUDA alike), so each multiplication is one, and
    right shifts are masked to be logical. A quarter of the int64 version's memory traffic,
    for the [rows, vocabulary] part of `counter_uniforms`."""
    shifted = x >> 16
    x ^= shifted.bitwise_and_(0xFFFF)
    x *= 0x7FEB352D
    shifted = x >> 15
    x ^= shifted.bitwise_and_(0x1FFFF)
    x *= 0x846CA68B - 2**32  # the constant's bits as an int32
    shifted = x >> 16
    return x.bitwise_xor_(shifted.bitwise_and_(0xFFFF))


def _as_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as int32 tensors of the same 32 bits."""
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def counter_uniforms(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """[N, vocab] uniforms in (0, 1), a pure function of (seed, position, token id): a
    counter-based generator (a hash of the counter, as Philox is), computed where the tensors
    live, with nothing drawn on the host. seeds, positions: [N] int64 (seeds < 2^63)."""
    key = _mix32((seeds & _MASK32) ^ 0x9E3779B9)
    key = _mix32(key ^ ((seeds >> 32) & _MASK32))
    key = _mix32(key ^ (positions & _MASK32))
    token_ids = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    token_keys = _as_int32(_mix32(token_ids ^ 0x85EBCA6B))
    bits = _mix32_wrapping(_as_int32(key)[:, None] ^ token_keys[None, :])
    # 24 bits, as torch.rand's float32; the half step keeps 0 out (log of 0).
    bits = (bits >> 8).bitwise_and_(0xFFFFFF)
    return (bits.to(torch.float32) + 0.5) / 2**24


def seeded_sample(
    probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """One token per row of [N, V] probabilities that depends on nothing but the row's seed, its
    position and the distribution: an exponential race, argmax_v p_v / E_v, the E_v ~ Exp(1)
    taken from `counter_uniforms(seed, position)` (the Gumbel-max trick in another form).
    Over random seeds it is a sample of `probs`.

    A request with `sampling_seed` takes every token this way: the draft proposes
    `seeded_sample(q)`, the target keeps it while it equals `seeded_sample(p)` (so acceptance is
    greedy acceptance, and a draft close to the target mostly wins the same race), and plain steps
    take `seeded_sample(p)` too. The token at a position is thus the same whether a draft, a verify
    pass or a plain step produced it, however γ split the request into rounds and whatever ran
    beside it in the batch."""
    exponentials = -torch.log(counter_uniforms(seeds, positions, probs.shape[-1]))
    return (probs.float() / exponentials).argmax(dim=-1)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row: [N, V] probabilities, [N] uniforms in [0, 1)."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype)[:, None] * cdf[:, -1:]
    tokens = torch.searchsorted(cdf, target, right=True)[:, 0]
    # Never land on a zero-probability token through rounding at the top of the CDF.
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).to(torch.int64).argmax(dim=-1)
    return torch.minimum(tokens, last_nonzero)


def chain_rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a chain of γ drafts per row.

    draft_tokens     [B, γ]        x_1..x_γ, drawn from draft_probs
    draft_probs      [B, γ, V]     q_1..q_γ
    target_probs     [B, γ+1, V]   p_1..p_{γ+1} (p_j conditioned on x_<j)
    accept_uniforms  [B, γ]        u_j: x_j is kept iff u_j · q_j(x_j) < p_j(x_j)
    final_uniforms   [B]           the draw of the residual or bonus token

    Returns (tokens [B, γ+1], accept_lens [B]): row b commits tokens[b, :accept_lens[b]] (the
    kept drafts, then the residual or bonus token); the rest of the row is padding.
    """
    batch, gamma = draft_tokens.shape
    rows = torch.arange(batch, device=draft_tokens.device)
    p_of_draft = target_probs[:, :gamma].gather(-1, draft_tokens[..., None])[..., 0]
    q_of_draft = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]
    kept = accept_uniforms.to(q_of_draft.dtype) * q_of_draft < p_of_draft
    num_kept = kept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [B] in 0..γ
    # The position after the kept drafts: a residual (rejection) or the bonus distribution.
    p_next = target_probs[rows, num_kept]
    no_draft = draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])
    q_next = torch.cat([draft_probs, no_draft], dim=1)[rows, num_kept]
    residual = (p_next - q_next).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    # p == q on a rejected row (possible only through rounding): p itself is the right law.
    final = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    last = sample_from(final, final_uniforms)
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(batch, 1)], dim=1)
    tokens[rows, num_kept] = last
    return tokens, (num_kept + 1).to(torch.int32)


def greedy_accept(tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Greedy verification of a chain: [B] tokens committed per request.

    `tokens` [B, γ+1] are the round's x0 and drafts d1..dγ; `target` [B, γ+1] the target's
    argmax after each prefix tokens[:, :j+1]. Draft d_j is kept while every draft before it
    was; the target's own token after the last kept one is committed too, so 1..γ+1.
    """
    agrees = tokens[:, 1:] == target[:, :-1]
    return agrees.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32) + 1
