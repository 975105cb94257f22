"""γ (and the draft's KV budget) per decode batch: fixed (`--speculative-num-steps`,
`--magicdec-budget`), or under `--magicdec-gamma auto` the cost model's pick (`cost_model.py`),
from the step costs the worker's `RoundClock` timed and the acceptance it reports after each
round; under `--magicdec-budget auto` too the budget.

Tensor-parallel ranks must run the same round, but each rank times its own steps, so each cost
model may pick a different plan: the first rank's choice is broadcast to every rank.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch

from sglang_magicdec import radix_events
from sglang_magicdec.cost_model import CostModel, Decision, StepCosts, bucket_key
from sglang_magicdec.round_clock import RoundClock
from sglang_magicdec.spec_info import host_seq_lens

logger = logging.getLogger(__name__)


class GammaController(radix_events.RadixCacheListener):
    def __init__(
        self,
        gamma_max: int,
        auto: bool,
        tp_group,
        budgets: tuple[int, ...] = (512,),
    ):
        self.gamma_max = gamma_max
        self.budgets = budgets  # one: the fixed budget; several: the cost model picks
        self.cost_model = CostModel(gamma_max=gamma_max, budgets=budgets) if auto else None
        self.tp_group = tp_group
        if auto:
            radix_events.subscribe(self)  # to forget a released request's acceptance

    def choose(self, batch: ScheduleBatch) -> tuple[int, int]:
        """γ for this batch's round (0: a plain decode step) and the budget it drafts with."""
        if self.cost_model is None:
            return self.gamma_max, self.budgets[0]
        previous = self.cost_model.last
        mean_context = mean_committed(batch)
        decision = self.cost_model.choose([req.rid for req in batch.reqs], mean_context)
        if decision.budget is None:
            decision = replace(decision, budget=self.budgets[0])
        if self.tp_group.world_size > 1:
            decision = self._decided_by_first_rank(decision)
        if previous is None or (previous.gamma, previous.budget) != (
            decision.gamma,
            decision.budget,
        ):
            logger.info(
                "MagicDec γ %s -> %d, budget %d (batch %d, mean context %d, %s, predicted %.2fx)",
                "-" if previous is None else previous.gamma,
                decision.gamma,
                decision.budget,
                len(batch.reqs),
                mean_context,
                decision.reason,
                decision.predicted_speedup,
            )
        self.cost_model.last = decision
        return decision.gamma, decision.budget

    # -- costs: only under γ = auto, which decides on them ------------------------------------

    def bucket(self, batch: ScheduleBatch) -> tuple[int, int] | None:
        """The cost-model bucket a batch's costs are recorded in (None: nothing is recorded)."""
        if self.cost_model is None:
            return None
        return CostModel.bucket(len(batch.reqs), mean_committed(batch))

    def record_round(
        self,
        bucket: tuple[int, int] | None,
        gamma: int,
        rids: list[str],
        accept_lens: torch.Tensor,
        clock: RoundClock,
        budget: int | None = None,
    ) -> None:
        """A round of `gamma` draft steps at `budget`, as `clock` timed its phases (a draft
        step's cost is the round's time but the verify's, bookkeeping included), whose requests
        accepted `accept_lens`."""
        if bucket is None:
            return
        round_seconds = clock.seconds["round"]
        draft_seconds = (round_seconds - clock.seconds["verify"]) / gamma
        self.cost_model.record_round(bucket, gamma, draft_seconds, round_seconds, budget)
        self.cost_model.record_acceptance(rids, accept_lens.tolist(), gamma, budget)

    def record_decode(self, bucket: tuple[int, int] | None, clock: RoundClock) -> None:
        if bucket is not None:
            self.cost_model.record_decode(bucket, clock.seconds["plain_decode"])

    def request_released(self, rid: str) -> None:
        self.cost_model.forget(rid)

    def _decided_by_first_rank(self, decision: Decision) -> Decision:
        plan = first_rank_values(self.tp_group, torch.tensor([decision.gamma, decision.budget]))
        gamma, budget = plan.tolist()
        if (gamma, budget) != (decision.gamma, decision.budget):
            reason = "first TP rank's choice"
            decision = replace(decision, gamma=gamma, budget=budget, reason=reason)
        return decision

    def info(self) -> dict:
        """The γ block of `/server_info`'s `magicdec`."""
        if self.cost_model is None:
            return {
                "gamma_mode": "fixed",
                "current_gamma": self.gamma_max,
                "current_budget": self.budgets[0],
            }
        last = self.cost_model.last
        return {
            "gamma_mode": "auto",
            "current_gamma": None if last is None else last.gamma,
            "current_budget": None if last is None else last.budget,
            "predicted_speedup": None if last is None else last.predicted_speedup,
            "gamma_reason": None if last is None else last.reason,
            "alpha_prior": self.cost_model.prior(),
            **self._alpha_by_budget(),
            # The latest decision per (batch size, mean context) bucket, both rounded up on
            # `cost_model.grid_ceiling`'s grid.
            "gamma_by_bucket": {
                bucket_key(bucket): {
                    "gamma": decision.gamma,
                    "budget": decision.budget or self.budgets[0],
                    "predicted_speedup": decision.predicted_speedup,
                    "reason": decision.reason,
                    "model_gamma": self.cost_model.settled.get(bucket),
                    **self._model_budget(bucket),
                    **self.cost_model.costs.get(bucket, StepCosts()).milliseconds(),
                }
                for bucket, decision in sorted(self.cost_model.decisions.items())
            },
        }

    def _alpha_by_budget(self) -> dict:
        """The server's recent acceptance per budget (shown where the model chooses one)."""
        if not self.cost_model.budgets:
            return {}
        return {"alpha_by_budget": self.cost_model.recent_alphas()}

    def _model_budget(self, bucket: tuple[int, int]) -> dict:
        """The cost model's latest budget for `bucket` (shown where it chooses one)."""
        if not self.cost_model.budgets:
            return {}
        return {"model_budget": self.cost_model.settled_budget.get(bucket)}


def mean_committed(batch: ScheduleBatch) -> float:
    """The batch's mean committed length."""
    return int(host_seq_lens(batch).sum()) / max(len(batch.reqs), 1)


def first_rank_values(tp_group, values: torch.Tensor) -> torch.Tensor:
    """`values` (an int64 CPU tensor) replaced in place by the first TP rank's, over the TP
    group's CPU (gloo) group; every rank must call it at the same point."""
    torch.distributed.broadcast(values, src=tp_group.ranks[0], group=tp_group.cpu_group)
    return values
