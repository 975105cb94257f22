"""SGLang's sampling penalties at every position of a speculative round, as a plain decode step
applies them.

SGLang's penalizers keep per-request state over the output so far and rewrite a step's logits
from it (`SamplingBatchInfo._apply_pre_grammar_logits_transforms`): logits += additive, where
additive is minus the frequency penalty per occurrence of a token, minus the presence penalty
once a token occurred, and -inf on stop tokens while the output is shorter than min_new_tokens;
then logits are divided (positive) or multiplied (negative) by the repetition penalty where a
token occurred. A round needs that state at each position of its chain: draft step j and verify
row j predict the token after the output so far and the drafts d_1..d_j, so d_1..d_j count too.

SGLang's scheduler feeds its penalizers one token per speculative round (the last committed one:
its own algorithms apply penalties "relaxed"), so the copy of the state a forward receives misses
the round's other tokens. `RoundPenalties` rebuilds the state from each request's output tokens
instead, with the penalizers' own tensor operations (a scatter-add of the frequency penalty per
occurrence, as they add it once per step), and advances it through the chain. So a greedy request
with penalties commits the tokens a plain server's would, and sampling draws from the same law.
The stop tokens of min_new_tokens are read off the forward's own additive penalties (their -inf
entries): SGLang decides that set, and its state lags ours, so the mask is there while we need it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sglang_magicdec.spec_info import to_device


@dataclass
class RoundPenalties:
    """The penalty state of a batch at one position of a round: `of` builds it at the round's
    first position, `advance` moves it one token along each request's chain. The per-request
    penalties are [B, 1] float32, None where no request of the batch sets one (SGLang's
    penalizers then do nothing either)."""

    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    repetition: torch.Tensor | None
    min_new_tokens: torch.Tensor | None  # [B, 1] int64
    stop_penalties: torch.Tensor | None  # [B, V]: -inf on each request's stop tokens, else 0
    frequency_sums: torch.Tensor | None  # [B, V] the frequency penalty, once per occurrence
    presence_sums: torch.Tensor | None  # [B, V] the presence penalty where a token occurred
    repetition_scales: torch.Tensor | None  # [B, V] the repetition penalty there, else 1
    output_lens: torch.Tensor  # [B, 1] int64: output tokens counted, drafts included
    # [B, L] int64: every token counted (repeats included), padded with 0; a penalty changes
    # the logits of these tokens only (and of the stop tokens).
    occurrences: torch.Tensor

    @classmethod
    def of(cls, batch, device: torch.device | str) -> RoundPenalties | None:
        """The state before the token after each request's output (None: the batch has no
        penalties). `batch.sampling_info` is the forward's copy (SGLang's additive and scaling
        penalties set where its penalizers are required)."""
        info = batch.sampling_info
        if info.acc_additive_penalties is None and info.acc_scaling_penalties is None:
            return None
        params = [req.sampling_params for req in batch.reqs]

        def per_request(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(value == neutral for value in values):
                return None
            return to_device(torch.tensor(values, dtype=torch.float32)[:, None], device)

        frequency = per_request([p.frequency_penalty for p in params], 0.0)
        presence = per_request([p.presence_penalty for p in params], 0.0)
        repetition = per_request([p.repetition_penalty for p in params], 1.0)
        min_new = [p.min_new_tokens for p in params]
        outputs = [req.output_ids for req in batch.reqs]
        lens = torch.tensor([len(ids) for ids in outputs], dtype=torch.int64)
        min_new_tokens = stop_penalties = None
        if any(min_new) and info.acc_additive_penalties is not None:
            min_new_tokens = to_device(torch.tensor(min_new, dtype=torch.int64)[:, None], device)
            stop = torch.isneginf(info.acc_additive_penalties)
            stop_penalties = torch.zeros_like(info.acc_additive_penalties).masked_fill_(
                stop, float("-inf")
            )
        # Every output token as an index; padding goes to an extra column, dropped after.
        vocab = info.vocab_size
        width = max(int(lens.max()), 1)
        padded = torch.full((len(outputs), width), vocab, dtype=torch.int64)
        for row, ids in enumerate(outputs):
            padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
        padded = to_device(padded, device)

        def counted(penalty: torch.Tensor | None, fill: float, add: bool) -> torch.Tensor | None:
            if penalty is None:
                return None
            sums = torch.full((len(outputs), vocab + 1), fill, dtype=torch.float32, device=device)
            src = penalty.expand(padded.shape)
            if add:
                sums.scatter_add_(1, padded, src)
            else:
                sums.scatter_(1, padded, src)
            return sums[:, :vocab].contiguous()

        return cls(
            frequency=frequency,
            presence=presence,
            repetition=repetition,
            min_new_tokens=min_new_tokens,
            stop_penalties=stop_penalties,
            frequency_sums=counted(frequency, 0.0, add=True),
            presence_sums=counted(presence, 0.0, add=False),
            repetition_scales=counted(repetition, 1.0, add=False),
            output_lens=to_device(lens[:, None], device),
            occurrences=torch.where(padded == vocab, 0, padded),
        )

    def additive(self) -> torch.Tensor:
        """[B, V] the additive penalties at this position (SGLang's `acc_additive_penalties`)."""
        template = next(
            t
            for t in (
                self.frequency_sums,
                self.presence_sums,
                self.repetition_scales,
                self.stop_penalties,
            )
            if t is not None
        )
        additive = torch.zeros_like(template)
        if self.frequency_sums is not None:
            additive.sub_(self.frequency_sums)
        if self.presence_sums is not None:
            additive.sub_(self.presence_sums)
        if self.min_new_tokens is not None:
            short = self.output_lens < self.min_new_tokens
            additive.add_(torch.where(short, self.stop_penalties, 0.0))
        return additive

    def scaling(self) -> torch.Tensor | None:
        """[B, V] the scaling penalties at this position (`acc_scaling_penalties`), or None."""
        return None if self.repetition_scales is None else self.repetition_scales.clone()

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise [B, V] logits (a view is fine) in place, as SGLang's sampler does. Only the
        counted tokens' logits change (their additive penalty, then their scaling, element by
        element as SGLang computes them; elsewhere SGLang adds 0 and divides by 1), so only
        those are rewritten: a repeated or padding index writes the same value again. The stop
        tokens' -inf stays -inf however it is scaled."""
        index = self.occurrences
        values = logits.gather(1, index)
        if self.frequency_sums is not None or self.presence_sums is not None:
            additive = torch.zeros_like(values)
            if self.frequency_sums is not None:
                additive.sub_(self.frequency_sums.gather(1, index))
            if self.presence_sums is not None:
                additive.sub_(self.presence_sums.gather(1, index))
            values.add_(additive)
        if self.repetition_scales is not None:
            scales = self.repetition_scales.gather(1, index)
            values = torch.where(values < 0, values * scales, values / scales)
        logits.scatter_(1, index, values)
        if self.min_new_tokens is not None:
            short = self.output_lens < self.min_new_tokens
            logits.add_(torch.where(short, self.stop_penalties, 0.0))

    def apply_chain(self, logits: torch.Tensor, tokens: torch.Tensor) -> None:
        """Penalise a verify's logits [B·W, V] in place: request b's row j for the output and
        tokens[b, 1..j] (`tokens` [B, W]: x0, then the drafts). Advances this state along the
        chain, so it serves one verify."""
        rows = logits.view(tokens.shape[0], tokens.shape[1], -1)
        for j in range(tokens.shape[1]):
            if j:
                self.advance(tokens[:, j])
            self.apply(rows[:, j])

    def advance(self, tokens: torch.Tensor) -> None:
        """Count `tokens` [B], the next token of each request's chain, as the penalizers'
        `cumulate_output_tokens` does."""
        index = tokens.to(torch.int64)[:, None]
        if self.frequency_sums is not None:
            self.frequency_sums.scatter_add_(1, index, self.frequency)
        if self.presence_sums is not None:
            self.presence_sums.scatter_(1, index, self.presence)
        if self.repetition_scales is not None:
            self.repetition_scales.scatter_(1, index, self.repetition)
        self.output_lens = self.output_lens + 1
        self.occurrences = torch.cat([self.occurrences, index], dim=1)

    def copy(self) -> RoundPenalties:
        """An independent state at the same position (the draft advances one, the verify
        another)."""

        def cloned(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.clone()

        return replace(
            self,
            frequency_sums=cloned(self.frequency_sums),
            presence_sums=cloned(self.presence_sums),
            repetition_scales=cloned(self.repetition_scales),
        )
