"""The acceptors of a round (acceptance.py) and the γ controller (gamma.py), on hand-built
batches: what each acceptor proposes and accepts, that seeded rows follow their seed alone, and
that γ = auto times rounds and decides from the cost model while fixed γ never times."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_magicdec.acceptance import (
    GreedyAcceptor,
    SampledAcceptor,
    SeededRows,
    acceptor_for,
)
from sglang_magicdec.gamma import GammaController
from sglang_magicdec.round_clock import RoundClock
from sglang_magicdec.sampling import (
    greedy_accept,
    seeded_sample,
)

VOCAB = 11
TOP_K_ALL = 1 << 30  # SGLang's top-k of a request that sets none


def make_batch(seeds: list[int | None], top_ks: list[int], seq_lens: list[int]):
    """What the acceptors and the controller read of a ScheduleBatch."""
    count = len(seeds)
    reqs = [
        SimpleNamespace(rid=f"r{i}", sampling_params=SimpleNamespace(sampling_seed=s, top_k=k))
        for i, (s, k) in enumerate(zip(seeds, top_ks, strict=True))
    ]
    info = SimpleNamespace(
        is_all_greedy=all(k == 1 for k in top_ks),
        temperatures=torch.full((count, 1), 0.9),
        top_ks=torch.tensor(top_ks),
        top_ps=torch.ones(count),
        min_ps=torch.zeros(count),
        # SGLang's host flags: which filters any row applies (top-k 1 marks a greedy row).
        need_top_k_sampling=any(k != TOP_K_ALL for k in top_ks),
        need_top_p_sampling=False,
        need_min_p_sampling=False,
    )
    lengths = torch.tensor(seq_lens)
    return SimpleNamespace(reqs=reqs, sampling_info=info, seq_lens=lengths, seq_lens_cpu=lengths)


def run_round(acceptor, gamma: int, batch_size: int, generator: torch.Generator):
    """Propose γ drafts from random draft logits, then accept against random target logits."""
    tokens = torch.zeros(batch_size, 1, dtype=torch.int64)
    for step in range(gamma):
        logits = torch.randn(batch_size, VOCAB, generator=generator)
        tokens = torch.cat([tokens, acceptor.propose(logits, step)[:, None]], dim=1)
    target_logits = torch.randn(batch_size * (gamma + 1), VOCAB, generator=generator)
    return tokens, target_logits, *acceptor.accept(tokens, target_logits)


def test_all_greedy_batch_gets_the_greedy_acceptor():
    batch = make_batch([None, 5], [1, 1], [10, 20])
    acceptor = acceptor_for(batch, 3, batch.seq_lens, torch.Generator(), "cpu")
    assert isinstance(acceptor, GreedyAcceptor)
    tokens, target_logits, target, accept_lens = run_round(acceptor, 3, 2, torch.Generator())
    assert torch.equal(target, target_logits.argmax(-1).view(2, 4))
    assert torch.equal(accept_lens, greedy_accept(tokens, target))


def test_sampled_acceptor_keeps_greedy_rows_greedy():
    """A greedy row (top-k 1) of a sampled batch proposes the draft's argmax and accepts as
    greedy verification does."""
    batch = make_batch([None, None], [1, 4], [10, 20])
    acceptor = acceptor_for(batch, 3, batch.seq_lens, torch.Generator().manual_seed(0), "cpu")
    assert isinstance(acceptor, SampledAcceptor)
    generator = torch.Generator().manual_seed(1)
    draft_logits = [torch.randn(2, VOCAB, generator=generator) for _ in range(3)]
    tokens = torch.zeros(2, 1, dtype=torch.int64)
    for step, logits in enumerate(draft_logits):
        tokens = torch.cat([tokens, acceptor.propose(logits, step)[:, None]], dim=1)
    assert tokens[0, 1:].tolist() == [int(logits[0].argmax()) for logits in draft_logits]
    target_logits = torch.randn(8, VOCAB, generator=generator)
    target, accept_lens = acceptor.accept(tokens, target_logits)
    greedy_target = target_logits.argmax(-1).view(2, 4)[:1]
    expected = int(greedy_accept(tokens[:1], greedy_target)[0])
    assert int(accept_lens[0]) == expected
    assert torch.equal(target[0, :expected], greedy_target[0, :expected])


@pytest.mark.parametrize("uniform_seed", [0, 1, 2])
@pytest.mark.parametrize("top_k", [VOCAB, TOP_K_ALL])  # a filter that drops nothing; none
def test_seeded_rows_depend_on_their_seed_not_on_the_uniforms(uniform_seed, top_k):
    """Row 1 samples with a seed: its drafts are the seeded draws of the draft's distribution at
    S + step, its accepted chain the seeded draws of the target's, whatever uniforms the round
    drew, and whether the batch's rows are filtered or not; row 0 (unseeded) follows the
    uniforms."""
    batch = make_batch([None, 1234], [top_k, top_k], [10, 20])
    rng = torch.Generator().manual_seed(uniform_seed)
    acceptor = acceptor_for(batch, 2, batch.seq_lens, rng, "cpu")
    assert isinstance(acceptor, SampledAcceptor) and acceptor.seeded is not None
    tokens, target_logits, target, accept_lens = run_round(
        acceptor, 2, 2, torch.Generator().manual_seed(7)
    )
    draft_probs = torch.stack(acceptor.draft_probs, dim=1)[1]  # [γ, V] of row 1
    for step in range(2):
        expected = seeded_sample(
            draft_probs[step : step + 1], torch.tensor([1234]), torch.tensor([20 + step])
        )
        assert int(tokens[1, step + 1]) == int(expected[0])
    target_probs = torch.softmax(target_logits.view(2, 3, VOCAB)[1] / 0.9, dim=-1)
    coupled = seeded_sample(target_probs, torch.full((3,), 1234), torch.arange(20, 23))
    assert torch.equal(target[1], coupled)
    assert int(accept_lens[1]) == int(greedy_accept(tokens[1:], coupled[None])[0])


def test_seeded_rows_of_a_batch():
    batch = make_batch([None, 3, 4], [VOCAB, 1, VOCAB], [1, 2, 3])
    seeded = SeededRows.of(batch, "cpu")
    assert seeded.index.tolist() == [2] and seeded.seeds.tolist() == [4]  # top-k 1 needs none
    assert SeededRows.of(make_batch([None], [VOCAB], [1]), "cpu") is None


class FakeGroup:
    world_size = 1


def test_fixed_gamma_never_times_and_reports_itself():
    control = GammaController(3, auto=False, tp_group=FakeGroup())
    batch = make_batch([None], [1], [100])
    assert control.choose(batch) == (3, 512)
    assert control.bucket(batch) is None
    clock = RoundClock(timed=False, on_cuda=False)
    control.record_round(None, 3, ["r0"], torch.tensor([4]), clock)  # nothing to record
    assert control.info() == {"gamma_mode": "fixed", "current_gamma": 3, "current_budget": 512}


@pytest.mark.parametrize(("round_seconds", "expected_gamma"), [(0.200, 0), (0.012, 2)])
def test_auto_gamma_decides_from_the_rounds_it_timed(round_seconds, expected_gamma):
    """Under γ = auto the controller first calibrates (plain steps and rounds it times), then
    the cost model decides from those times: against 10 ms plain steps, a round dearer than
    its tokens' worth of plain steps makes it pick γ = 0, a cheap one the largest γ."""
    control = GammaController(2, auto=True, tp_group=FakeGroup())
    batch = make_batch([None, None], [1, 1], [4096, 4096])
    clock = RoundClock(timed=True, on_cuda=False)
    clock.seconds = {"plain_decode": 0.010, "round": round_seconds, "verify": round_seconds / 2}
    reasons = []
    for _ in range(40):
        gamma, budget = control.choose(batch)
        assert budget == 512  # the only one
        reasons.append((control.cost_model.last.reason, gamma))
        bucket = control.bucket(batch)
        assert bucket is not None
        if gamma == 0:
            control.record_decode(bucket, clock)
        else:
            accept_lens = torch.tensor([gamma + 1] * 2)
            control.record_round(bucket, gamma, ["r0", "r1"], accept_lens, clock)
    assert reasons[0][0].startswith("calibrating")
    model_gammas = {gamma for reason, gamma in reasons if reason == "model"}
    assert model_gammas == {expected_gamma}, reasons
    info = control.info()
    assert info["gamma_mode"] == "auto"
    (bucket,) = info["gamma_by_bucket"].values()
    assert bucket["model_gamma"] == expected_gamma
