"""`RoundPenalties` against SGLang's own penalizers fed one token at a time, as a plain server
feeds them: every position of a round's chain, bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.penaltylib.repetition_penalty import apply_scaling_penalties

from sglang_magicdec.penalties import RoundPenalties

VOCAB = 40  # small, so tokens repeat
EOS = 7
PENALIZERS = {
    penaltylib.BatchedFrequencyPenalizer,
    penaltylib.BatchedMinNewTokensPenalizer,
    penaltylib.BatchedPresencePenalizer,
    penaltylib.BatchedRepetitionPenalizer,
}


class FakeBatch:
    """What SGLang's orchestrator reads of a batch (weak-referenced, so not a namespace)."""

    def __init__(self, reqs):
        self.reqs = reqs
        self.device = "cpu"


def make_req(output_ids, frequency=0.0, presence=0.0, repetition=1.0, min_new=0, stop=()):
    params = SimpleNamespace(
        frequency_penalty=frequency,
        presence_penalty=presence,
        repetition_penalty=repetition,
        min_new_tokens=min_new,
        stop_token_ids=set(stop),
    )
    tokenizer = SimpleNamespace(additional_stop_token_ids=None, eos_token_id=EOS)
    return SimpleNamespace(
        sampling_params=params,
        output_ids=list(output_ids),
        eos_token_ids={EOS},
        tokenizer=tokenizer,
    )


def penalised_by_sglang(orchestrator, logits: torch.Tensor) -> torch.Tensor:
    """What a plain step's sampler does (`SamplingBatchInfo.update_penalties`, then
    `_apply_pre_grammar_logits_transforms`)."""
    logits = logits.clone()
    if not orchestrator.is_required:
        return logits
    additive = torch.zeros(logits.shape, dtype=torch.float32)
    orchestrator.accumulate_additive_penalties(additive)
    logits.add_(additive)
    scaling = orchestrator.accumulate_scaling_penalties()
    if scaling is not None:
        apply_scaling_penalties(logits, scaling)
    return logits


REQUESTS = [
    dict(),  # no penalty, beside ones that have
    dict(frequency=0.3),
    dict(presence=0.5),
    dict(repetition=1.1),
    dict(frequency=0.7, presence=0.2, repetition=1.3),
    dict(min_new=12, stop=(3,)),
    dict(min_new=4, repetition=0.9, frequency=-0.4),
]


@pytest.mark.parametrize("seed", range(4))
def test_every_chain_position_is_penalised_as_a_plain_step_would(seed):
    """Request b's output so far, then drafts d_1..d_γ: at chain position j the logits are
    penalised for the output and d_1..d_j exactly as SGLang's penalizers, fed every one of those
    tokens, penalise them; SGLang's own state for the forward (fed one token per round) only
    supplies the stop tokens."""
    gen = torch.Generator().manual_seed(seed)
    gamma = 4
    lengths = torch.randint(0, 30, (len(REQUESTS),), generator=gen).tolist()
    lengths[0] = 0  # a request whose output is still empty
    outputs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    reqs = [make_req(out, **kw) for out, kw in zip(outputs, REQUESTS, strict=True)]
    batch = FakeBatch(reqs)
    # SGLang's state for the forward under speculation: one token per round so far.
    relaxed = penaltylib.BatchedPenalizerOrchestrator(VOCAB, batch, PENALIZERS)
    relaxed.cumulate_output_tokens(torch.tensor([out[-1] if out else 0 for out in outputs]))
    acc_additive = torch.zeros(len(reqs), VOCAB)
    relaxed.accumulate_additive_penalties(acc_additive)
    batch.sampling_info = SimpleNamespace(
        acc_additive_penalties=acc_additive,
        acc_scaling_penalties=relaxed.accumulate_scaling_penalties(),
        vocab_size=VOCAB,
    )
    ours = RoundPenalties.of(batch, "cpu")
    drafts = torch.randint(0, VOCAB, (len(reqs), gamma), generator=gen)
    logits = torch.randn(len(reqs), gamma + 1, VOCAB, generator=gen) * 4

    # The reference: each request alone, its penalizers fed every token.
    expected = torch.empty_like(logits)
    for b, req in enumerate(reqs):
        alone = FakeBatch([req])
        orchestrator = penaltylib.BatchedPenalizerOrchestrator(VOCAB, alone, PENALIZERS)
        for token in req.output_ids:
            orchestrator.cumulate_output_tokens(torch.tensor([token]))
        for j in range(gamma + 1):
            if j:
                orchestrator.cumulate_output_tokens(drafts[b, j - 1 : j])
            expected[b, j] = penalised_by_sglang(orchestrator, logits[b, j : j + 1])[0]

    # The draft's copy, step by step; the verify's, the whole chain at once.
    draft_state, drafted = ours.copy(), logits.clone()
    for j in range(gamma):
        draft_state.apply(drafted[:, j])
        draft_state.advance(drafts[:, j])
    assert torch.equal(drafted[:, :gamma], expected[:, :gamma])
    got = logits.clone()
    chain = torch.cat([torch.zeros(len(reqs), 1, dtype=torch.int64), drafts], dim=1)
    ours.apply_chain(got.view(-1, VOCAB), chain)
    assert torch.equal(got, expected)
    assert not torch.equal(got, logits)  # the penalties did something
    # min_new_tokens: request 5 (12 minimum) has its stop tokens masked while it is short.
    short = [lengths[5] + j < 12 for j in range(gamma + 1)]
    assert [bool(torch.isneginf(got[5, j, EOS])) for j in range(gamma + 1)] == short


def test_a_batch_without_penalties_has_no_state():
    batch = FakeBatch([make_req([1, 2, 3])])
    batch.sampling_info = SimpleNamespace(
        acc_additive_penalties=None, acc_scaling_penalties=None, vocab_size=VOCAB
    )
    assert RoundPenalties.of(batch, "cpu") is None


def test_the_draft_and_the_verify_advance_independent_copies():
    batch = FakeBatch([make_req([1, 1, 2], frequency=0.5, repetition=1.2)])
    batch.sampling_info = SimpleNamespace(
        acc_additive_penalties=torch.zeros(1, VOCAB),
        acc_scaling_penalties=torch.ones(1, VOCAB),
        vocab_size=VOCAB,
    )
    base = RoundPenalties.of(batch, "cpu")
    before = base.additive().clone()
    draft = base.copy()
    draft.advance(torch.tensor([5]))
    assert torch.equal(base.additive(), before)
    assert draft.additive()[0, 5] == -0.5 and before[0, 1] == -1.0
