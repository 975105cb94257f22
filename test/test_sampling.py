"""The rejection sampler against the exact laws it must produce, on random small distributions."""

from __future__ import annotations

import pytest
import torch

from sglang_magicdec.sampling import (
    Filters,
    chain_rejection_sample,
    counter_uniforms,
    filtered_probs,
    greedy_accept,
    sample_from,
    sampling_probs,
    seeded_sample,
)

SAMPLES = 400_000
# 5 standard deviations of a frequency estimated from SAMPLES draws (p(1-p) <= 1/4).
TOLERANCE = 5 * (0.25 / SAMPLES) ** 0.5


def random_distribution(generator, vocab: int, sharpness: float = 1.5) -> torch.Tensor:
    probs = torch.softmax(torch.randn(vocab, generator=generator) * sharpness, dim=0)
    probs[torch.randint(vocab, (1,), generator=generator)] = 0.0  # a token one side never draws
    return probs / probs.sum()


def random_chains(generator, vocab: int, gamma: int):
    """γ draft distributions q, γ + 1 target distributions p, and SAMPLES chains drawn from q."""
    q = torch.stack([random_distribution(generator, vocab) for _ in range(gamma)])
    p = torch.stack([random_distribution(generator, vocab) for _ in range(gamma + 1)])
    draft_tokens = torch.stack(
        [
            torch.multinomial(q[j], SAMPLES, replacement=True, generator=generator)
            for j in range(gamma)
        ],
        dim=1,
    )
    return q, p, draft_tokens


def verify_chains(generator, q, p, draft_tokens):
    """`chain_rejection_sample` of every chain against the same q and p, fresh uniforms."""
    gamma = draft_tokens.shape[1]
    return chain_rejection_sample(
        draft_tokens,
        q.expand(SAMPLES, -1, -1),
        p.expand(SAMPLES, -1, -1),
        torch.rand(SAMPLES, gamma, generator=generator),
        torch.rand(SAMPLES, generator=generator),
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_committed_tokens_follow_the_target(seed):
    """First committed token ~ p_1 exactly; given the first draft was kept, the second ~ p_2;
    acceptance rate of the first draft = Σ min(p_1, q_1)."""
    generator = torch.Generator().manual_seed(seed)
    vocab, gamma = 6, 2
    q, p, draft_tokens = random_chains(generator, vocab, gamma)
    tokens, accept_lens = verify_chains(generator, q, p, draft_tokens)
    first = torch.bincount(tokens[:, 0], minlength=vocab).float() / SAMPLES
    assert torch.allclose(first, p[0], atol=TOLERANCE), (first, p[0])
    first_kept = accept_lens >= 2
    assert first_kept.float().mean().item() == pytest.approx(
        torch.minimum(p[0], q[0]).sum().item(), abs=TOLERANCE
    )
    second = torch.bincount(tokens[first_kept, 1], minlength=vocab).float() / first_kept.sum()
    assert torch.allclose(second, p[1], atol=3 * TOLERANCE), (second, p[1])
    # The bonus token after two kept drafts ~ p_3.
    all_kept = accept_lens == 3
    bonus = torch.bincount(tokens[all_kept, 2], minlength=vocab).float() / all_kept.sum()
    assert torch.allclose(bonus, p[2], atol=6 * TOLERANCE), (bonus, p[2])


def test_greedy_rows_accept_exactly_the_argmax():
    vocab = 5
    target = torch.nn.functional.one_hot(torch.tensor([[1, 3, 4], [2, 2, 0]]), vocab).float()
    draft = torch.nn.functional.one_hot(torch.tensor([[1, 0], [2, 2]]), vocab).float()
    tokens, accept_lens = chain_rejection_sample(
        torch.tensor([[1, 0], [2, 2]]), draft, target, torch.rand(2, 2), torch.rand(2)
    )
    assert accept_lens.tolist() == [2, 3]
    assert tokens[0, :2].tolist() == [1, 3] and tokens[1].tolist() == [2, 2, 0]


def test_sampling_probs_transforms():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4))
    probs = sampling_probs(
        logits,
        temperatures=torch.tensor([1.0, 1.0, 1.0, 1.0]),
        filters=Filters(
            torch.tensor([4, 2, 4, 1]),
            torch.tensor([1.0, 1.0, 0.7, 1.0]),
            torch.tensor([0.0, 0.0, 0.0, 0.0]),
            candidates=4,
        ),
    )
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(probs[1], torch.tensor([0.625, 0.375, 0, 0]))
    # top-p 0.7: tokens whose preceding mass is <= 0.7 stay (SGLang's rule): 0.5, 0.3.
    assert torch.allclose(probs[2], torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(probs[3], torch.tensor([1.0, 0, 0, 0]))
    only_min_p = Filters(torch.tensor([4]), torch.tensor([1.0]), torch.tensor([0.5]), 4)
    min_p = sampling_probs(logits[:1], torch.tensor([1.0]), only_min_p)
    assert torch.allclose(min_p[0], torch.tensor([0.625, 0.375, 0, 0]))
    hot = sampling_probs(logits[:1], torch.tensor([0.5]), filters=None)
    assert torch.allclose(hot[0], torch.softmax(logits[0] / 0.5, dim=0))


def test_a_row_that_filters_nothing_keeps_its_probabilities_bit_for_bit():
    """Whether its batch filters (another row has a top-p) or not (no sort at all), a row with
    no top-k, top-p or min-p gets the same probabilities: its seeded draws cannot depend on
    what runs beside it."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    temperatures = torch.tensor([0.7, 0.7, 0.7])
    alone = sampling_probs(logits, temperatures, filters=None)
    filters = Filters(torch.tensor([1 << 30, 50, 1 << 30]), torch.tensor([1.0, 1.0, 0.9]),
                      torch.tensor([0.0, 0.0, 0.0]), candidates=1 << 30)  # fmt: skip
    beside = sampling_probs(logits, temperatures, filters)
    assert torch.equal(beside[0], alone[0])
    assert not torch.equal(beside[1], alone[1]) and not torch.equal(beside[2], alone[2])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sorting_only_the_top_k_candidates_changes_no_probability(seed):
    """Rows that all have a top-k (ragged, with top-p and min-p on some): sorting only the
    largest top-k's most probable tokens gives, bit for bit, what sorting the whole vocabulary
    gives. (Where probabilities tie at a top-k or top-p boundary, which of the tied tokens is
    kept is the order the sort returns them in, with either sort.)"""
    generator = torch.Generator().manual_seed(seed)
    rows, vocab = 9, 2000
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=generator), dim=-1)
    top_ks = torch.randint(1, 60, (rows,), generator=generator)
    some_top_p = 0.5 + 0.5 * torch.rand(rows, generator=generator)
    top_ps = torch.where(torch.arange(rows) % 3 == 0, 1.0, some_top_p)
    min_ps = torch.where(torch.arange(rows) % 4 == 1, 0.05, 0.0)
    cut = Filters(top_ks, top_ps, min_ps, candidates=int(top_ks.max()))
    whole = Filters(top_ks, top_ps, min_ps, candidates=1 << 30)
    assert torch.equal(filtered_probs(probs, cut), filtered_probs(probs, whole))


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 3)
    assert sample_from(probs, torch.tensor([0.0, 0.3, 0.9999999])).tolist() == [1, 3, 3]


def test_greedy_accept_keeps_the_agreeing_prefix_plus_the_targets_token():
    tokens = torch.tensor(
        [
            [5, 1, 2, 3],  # all three drafts agree: 3 drafts + the bonus token
            [5, 1, 9, 3],  # second draft wrong: d1 + the target's correction
            [5, 9, 2, 3],  # first draft wrong, later ones agree by chance: only the correction
            [5, 1, 2, 9],  # last draft wrong
        ]
    )
    target = torch.tensor([[1, 2, 3, 4]] * 4)
    assert greedy_accept(tokens, target).tolist() == [4, 2, 1, 3]
    assert greedy_accept(tokens, target).dtype == torch.int32


def test_greedy_accept_with_gamma_one():
    tokens = torch.tensor([[7, 8], [7, 0]])
    target = torch.tensor([[8, 4], [8, 4]])
    assert greedy_accept(tokens, target).tolist() == [2, 1]


def test_seeded_sample_follows_the_distribution_over_seeds():
    """One draw per seed at a fixed position: the tokens follow the distribution."""
    generator = torch.Generator().manual_seed(3)
    vocab, draws = 6, 200_000
    probs = random_distribution(generator, vocab)
    tokens = seeded_sample(probs.expand(draws, -1), torch.arange(draws), torch.full((draws,), 17))
    frequencies = torch.bincount(tokens, minlength=vocab).float() / draws
    assert torch.allclose(frequencies, probs, atol=5 * (0.25 / draws) ** 0.5), (frequencies, probs)


def test_seeded_sample_depends_only_on_seed_position_and_distribution():
    """The same (seed, position, distribution) gives the same token in any row of any batch;
    another position or seed draws afresh, and where draft and target agree the coupled draft
    is kept: with q = p every draft of a chain is accepted."""
    generator = torch.Generator().manual_seed(4)
    vocab, rows = 50, 64
    probs = torch.stack([random_distribution(generator, vocab, 0.5) for _ in range(rows)])
    seeds, positions = torch.arange(rows) * 7 + 1, torch.arange(rows) + 100
    tokens = seeded_sample(probs, seeds, positions)
    order = torch.randperm(rows, generator=generator)
    assert torch.equal(seeded_sample(probs[order], seeds[order], positions[order]), tokens[order])
    assert torch.equal(seeded_sample(probs[:5], seeds[:5], positions[:5]), tokens[:5])
    assert not torch.equal(seeded_sample(probs, seeds, positions + 1), tokens)
    assert not torch.equal(seeded_sample(probs, seeds + 1, positions), tokens)
    # A chain of γ = 4 whose draft distribution equals the target's: every draft is kept.
    gamma = 4
    chain = probs[: gamma + 1]
    chain_positions = torch.arange(gamma + 1) + 10
    target = seeded_sample(chain, torch.full((gamma + 1,), 9), chain_positions)
    drafts = seeded_sample(chain[:gamma], torch.full((gamma,), 9), chain_positions[:gamma])
    tokens_in_round = torch.cat([torch.tensor([0]), drafts])[None]
    assert greedy_accept(tokens_in_round, target[None]).item() == gamma + 1


def test_counter_uniforms_are_the_hash_written_out_in_python_integers():
    """The vectorised hash (int32 products wrapping modulo 2^32) is lowbias32 over the counter
    (seed, position, token id) as its definition reads, computed here in Python integers."""
    mask = 0xFFFFFFFF

    def mix32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & mask
        x ^= x >> 15
        x = (x * 0x846CA68B) & mask
        return x ^ (x >> 16)

    generator = torch.Generator().manual_seed(3)
    seeds = torch.cat([torch.randint(0, 2**63 - 1, (5,), generator=generator),
                       torch.tensor([0, 2**32 - 1, 2**32, 2**63 - 1])])  # fmt: skip
    positions = torch.randint(0, 2**40, (seeds.numel(),), generator=generator)
    vocab = 257
    uniforms = counter_uniforms(seeds, positions, vocab)
    for row, (seed, position) in enumerate(zip(seeds.tolist(), positions.tolist(), strict=True)):
        key = mix32(mix32(mix32((seed & mask) ^ 0x9E3779B9) ^ (seed >> 32)) ^ (position & mask))
        expected = [((mix32(key ^ mix32(t ^ 0x85EBCA6B)) >> 8) + 0.5) / 2**24 for t in range(vocab)]
        assert torch.equal(uniforms[row], torch.tensor(expected, dtype=torch.float32)), row
