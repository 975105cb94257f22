"""MagicDec's cost model: tokens per round Ω(γ, α), time per round, and the γ that pays.

With per-token acceptance α (each draft token accepted with probability α given the ones before
were), a round of γ drafts commits Ω(γ, α) = (1 − α^(γ+1)) / (1 − α) tokens on average, the
target's own token included, and costs γ·T_draft + T_verify(γ) against T_decode per plain step.
Speculation pays when Ω·T_decode exceeds that; `CostModel` measures the T's online and picks γ
per batch (`--magicdec-gamma auto`), and with several KV budgets (`--magicdec-budget auto`) the
budget too: a larger budget raises α and T_draft, nothing else.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field, replace


def expected_tokens_per_round(gamma: int, alpha: float) -> float:
    """Ω(γ, α) = 1 + α + … + α^γ."""
    return sum(alpha**k for k in range(gamma + 1))


def alpha_from_accept_length(mean_accepted: float, gamma: int) -> float:
    """The per-token α whose Ω(γ, α) equals a measured mean of tokens per round (bisection)."""
    if not 1.0 <= mean_accepted <= gamma + 1:
        raise ValueError(f"mean tokens per round must lie in [1, {gamma + 1}], got {mean_accepted}")
    low, high = 0.0, 1.0
    for _ in range(60):
        alpha = (low + high) / 2
        if expected_tokens_per_round(gamma, alpha) < mean_accepted:
            low = alpha
        else:
            high = alpha
    return (low + high) / 2


def round_time(gamma: int, t_draft: float, t_verify: float) -> float:
    """Seconds per speculative round: γ draft steps, then one verify pass of γ+1 tokens."""
    return gamma * t_draft + t_verify


def cost_name(gamma: int) -> str | int:
    """How `StepCosts` names the cost of γ: "decode" for plain steps (γ = 0), else γ."""
    return "decode" if gamma == 0 else gamma


@dataclass
class StepCosts:
    """Seconds of one batch's forwards in a (batch size, context) bucket. Timing noise on a
    shared machine only ever adds time, and a bucket's first steps can be several times slower
    than the rest (cold caches and allocator), so each cost is the fastest of its measurements
    over a window; within a bucket (context within 25%) the true cost moves little.

    One window for all of them, reaching back to the oldest of each cost's last `WINDOW`
    measurements (one alone may be an outlier). The γ that runs is measured every round, the
    others only when explored (every 16-256 decisions); were each cost the fastest of its own last
    few, the running γ's would cover the last second or two and the others' minutes, so a few
    slow seconds of the machine made the running γ look dearer than the rest, the next γ was
    measured in the same slow seconds, and γ fell step by step to 0 and stayed there until the
    explorations came round (a suite run at 8 × 7,936 went 3 -> 2 -> 1 -> 0 in six seconds;
    `test_cost_model.py` replays it). Over one window every cost has seen the same stretch of
    the machine. When the running γ's own last `RECENT` rounds say it has become dearer than its
    window does (`moved`), the model explores the others at once (`CostModel.choose`): their
    fresh measurements move the window on, so a lasting change is followed within a dozen rounds
    and a slow spell changes nothing.

    decode  a plain decode step (γ = 0)
    draft   one draft step, the round's bookkeeping included (shown, not used to decide)
    rounds  γ -> a whole speculative round at that γ: its draft steps, bookkeeping and verify,
            at the `reference` budget
    drafts  budget -> one draft step at that budget, where rounds ran at several: a round at
            budget b costs its reference round plus γ · (drafts[b] − drafts[reference]), and is
            recorded as that reference round (`CostModel.record_round`)

    A round at a γ not measured yet is predicted by the least-squares line through the measured
    ones, T_round(γ) = fixed + γ · per_token: verification has a fixed cost beyond a plain step
    (and each verified token an extra one), so a line through (0, T_decode) and one measured γ
    would make every shorter γ look cheaper than it is.
    """

    WINDOW = 2
    RECENT = 4
    KEPT = 1024  # measurements kept per cost (the running γ's: its last 1,024 rounds)

    decode: float | None = None
    draft: float | None = None
    rounds: dict[int, float] = field(default_factory=dict)
    reference: int | None = None
    drafts: dict[int, float] = field(default_factory=dict)
    rounds_since_exploring: int = 0  # the model's decisions since the last exploration
    explorations: int = 0
    since_budget_explored: int = 0  # the same for explorations of other budgets
    budget_explorations: int = 0
    explore_interval: int = 0  # decisions between explorations now (0: not yet set)
    # Per name, its kept measurements and when each was taken (on `clock`: the bucket's count).
    stamps: dict[str | int, list[int]] = field(default_factory=dict)
    samples: dict[str | int, list[float]] = field(default_factory=dict)
    clock: int = 0

    def seconds(self, gamma: int, budget: int | None = None) -> float:
        """Seconds of a batch's forward at γ: a plain step (γ = 0) or a round (`round`), at
        `budget` (None: the reference budget)."""
        if gamma == 0:
            return self.decode
        if budget is None or budget == self.reference:
            return self.round(gamma)
        return self.round(gamma) + gamma * (self.drafts[budget] - self.drafts[self.reference])

    def round(self, gamma: int) -> float:
        """Seconds of a round at γ: measured, or on the line through the measured γs."""
        if gamma in self.rounds:
            return self.rounds[gamma]
        gammas = list(self.rounds)
        if len(gammas) == 1:
            # One point: assume each extra token costs a draft step (verify's share unknown).
            return self.rounds[gammas[0]] + (gamma - gammas[0]) * self.draft
        mean_gamma = sum(gammas) / len(gammas)
        mean_time = sum(self.rounds.values()) / len(gammas)
        per_token = sum((g - mean_gamma) * (self.rounds[g] - mean_time) for g in gammas) / sum(
            (g - mean_gamma) ** 2 for g in gammas
        )
        return mean_time + (gamma - mean_gamma) * max(per_token, 0.0)

    def measured(self, name: str | int, seconds: float) -> None:
        self.clock += 1
        stamps = self.stamps.setdefault(name, [])
        samples = self.samples.setdefault(name, [])
        stamps.append(self.clock)
        samples.append(seconds)
        if len(stamps) > 2 * self.KEPT:
            del stamps[: -self.KEPT], samples[: -self.KEPT]
        # The window holds each γ's (0: plain steps) last `WINDOW` measurements; the draft's
        # costs, with nothing in them under γ = 0 (and a budget's only when it is explored),
        # keep their own last.
        horizon = min(
            (self._window_start(each) for each in self.stamps if not _is_draft(each)),
            default=self.clock,
        )
        for each, kept in self.stamps.items():
            if isinstance(each, tuple):
                # A budget's draft step, the fastest of its own last `WINDOW` whatever the
                # budget: the reference's, measured every round, would otherwise be the fastest
                # of many beside the others' few, and win for its count alone.
                self.drafts[each[1]] = min(self.samples[each][-self.WINDOW :])
                continue
            since = min(bisect_left(kept, horizon), len(kept) - 1)
            fastest = min(self.samples[each][since:])
            if isinstance(each, int):
                self.rounds[each] = fastest
            else:
                setattr(self, each, fastest)

    def moved(self, gamma: int) -> float:
        """How much dearer γ's own last `RECENT` measurements are than its cost over the window
        (0.25: 25%); 0 if it has none."""
        samples = self.samples.get(cost_name(gamma))
        if not samples:
            return 0.0
        return min(samples[-self.RECENT :]) / self.seconds(gamma) - 1

    def as_recently(self, gamma: int) -> StepCosts:
        """These costs with γ's own (0: plain steps) at its last `RECENT` measurements (`moved`),
        for deciding; the measurements are shared, not copied."""
        recent = self.seconds(gamma) * (1 + self.moved(gamma))
        if gamma == 0:
            return replace(self, decode=recent)
        return replace(self, rounds={**self.rounds, gamma: recent})

    def _window_start(self, name: str | int) -> int:
        """When the oldest of `name`'s last `WINDOW` measurements was taken (-1: none yet)."""
        kept = self.stamps.get(name, [-1])
        return kept[-min(self.WINDOW, len(kept))]

    def measured_longest_ago(self, gammas: list[int]) -> int:
        """Of `gammas` (0: plain steps), the one whose last `WINDOW` measurements reach back
        furthest, holding the window open (never measured: first)."""
        return min(gammas, key=lambda gamma: self._window_start(cost_name(gamma)))

    def milliseconds(self) -> dict:
        """The current costs, for `/server_info`."""

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 2)

        shown = {
            "decode_ms": ms(self.decode),
            "draft_ms": ms(self.draft),
            "round_ms": {str(gamma): ms(self.rounds[gamma]) for gamma in sorted(self.rounds)},
        }
        if self.drafts:
            shown["reference_budget"] = self.reference
            shown["draft_ms_by_budget"] = {str(b): ms(self.drafts[b]) for b in sorted(self.drafts)}
        return shown


def _is_draft(name: str | int | tuple) -> bool:
    return name == "draft" or isinstance(name, tuple)


@dataclass(frozen=True)
class Decision:
    gamma: int
    predicted_speedup: float  # predicted tokens/s at `gamma` over plain decoding's
    reason: str  # "model", "exploring", or the calibration step being measured
    budget: int | None = None  # the KV budget the round drafts with (None: the only one)


def grid_ceiling(value: float) -> int:
    """`value` rounded up on the bucket grid: 1 to 8, then four steps per octave (8, 10, 12, 14,
    16, 20, 24, ...), so a bucket spans at most 25%.

    Each cost is the fastest of its measurements in a window, so a bucket must not mix steps of
    very different sizes: with power-of-two buckets, the last rounds of a wave (its requests finish
    at different rounds, the batch shrinks from 8 to 5) were the cheapest of bucket 8 and made
    its rounds look 15-25% cheaper than a full batch's."""
    value = max(1, math.ceil(value))
    if value <= 8:
        return value
    step = 1 << (value.bit_length() - 3)
    return -(-value // step) * step


def bucket_key(bucket: tuple[int, int]) -> str:
    """How a (batch size, mean context) bucket is named in `/server_info`."""
    batch, context = bucket
    return f"batch<={batch},context<={context}"


class CostModel:
    """Picks γ per batch: argmax over γ ∈ {0..γ_max} of predicted tokens/s,
    Σ_requests Ω(γ, α_r) / T_round(γ), against batch / T_decode for γ = 0.

    Step times are measured online by the worker, bucketed by batch size and mean context length
    (`grid_ceiling`). The first bucket calibrates itself: its first rounds are
    `calibration_rounds` plain steps, then as many rounds at γ_max and at γ = 1 (two points of
    the round-time line, see `StepCosts`). A later bucket decides with the costs of its nearest
    calibrated neighbour until its own exploration has measured what it lacks. One round every
    `explore_every` goes to another γ (each in turn, plain decoding first) and keeps every cost
    (and the requests' α) current, so neither a cold first measurement nor a change of load
    fixes γ for good. Each exploration that leaves the bucket's γ where it was doubles the
    bucket's interval, up to `explore_every_max`; a change of its γ resets it: a settled bucket
    (γ = 0 where speculation does not pay, say) spends ever fewer rounds on a γ it loses with.
    A γ predicted to lose by far waits longer still (`exploration_spacing`): explorations cost
    at most `explore_overhead` of the time.

    α is estimated per request from its own verify rounds (accepted drafts / tested drafts),
    starting from a prior worth `prior_weight` drafts: the server's recent acceptance over all
    requests (an exponential average with `recent_decay` per round), or `prior_alpha` before
    this server has verified anything, so a new request starts where requests have been.

    Hysteresis: a bucket keeps its current γ unless another one is predicted faster by more than
    `hysteresis` (relative), so noise in the measured costs does not flap γ round to round.

    A bucket whose running γ's last rounds cost `moved` (relative) more than its costs' common
    window says, enough that another γ would win at that cost, explores the other γs at once,
    the one measured longest ago first (`StepCosts`).

    KV budgets (`budgets`, `--magicdec-budget auto`): a plan is a (γ, budget) pair. A budget
    changes two things only, α and the draft step's cost, so each bucket calibrates its γs at
    one budget (its `reference`, `start_budget` or the nearest below its context) and then
    every other budget below its context with `calibration_rounds` rounds at γ_max: their
    draft steps price the budget's rounds at every γ (`StepCosts.seconds`) and their
    acceptance starts the budget's α (per request and budget, from a prior of the server's
    recent acceptance at that budget). The budgets next to the running one are explored in
    turn, every `explore_every` decisions or as their predicted loss spaces them
    (`exploration_spacing`), never less often: α at a budget rests on the rounds run there,
    and neighbouring budgets are close, so cheap to explore, and often close enough to need
    many rounds to tell apart.
    """

    def __init__(
        self,
        gamma_max: int,
        budgets: tuple[int, ...] = (),
        start_budget: int | None = None,
        prior_alpha: float = 0.7,
        prior_weight: float = 4.0,
        explore_every: int = 16,
        explore_every_max: int = 256,
        calibration_rounds: int = 2,
        hysteresis: float = 0.03,
        recent_decay: float = 0.98,
        moved: float = 0.25,
        explore_overhead: float = 0.02,
    ):
        self.gamma_max = gamma_max
        # One budget (or none named) is never chosen: plans carry budget None.
        self.budgets = tuple(sorted(budgets)) if len(budgets) > 1 else ()
        if start_budget is None and self.budgets:
            start_budget = self.budgets[len(self.budgets) // 2]
        self.start_budget = start_budget
        self.prior_alpha = prior_alpha
        self.prior_weight = prior_weight
        self.explore_every = explore_every
        self.explore_every_max = explore_every_max
        self.calibration_rounds = calibration_rounds
        self.hysteresis = hysteresis
        self.recent_decay = recent_decay
        self.moved = moved
        self.explore_overhead = explore_overhead
        self.costs: dict[tuple[int, int], StepCosts] = {}
        # rid -> budget -> (kept, tested) drafts
        self._drafts: dict[str, dict[int | None, tuple[float, float]]] = {}
        # Decayed (kept, tested) over all requests: None over every budget, else at that one.
        self._recent: dict[int | None, tuple[float, float]] = {}
        self.last: Decision | None = None
        self.decisions: dict[tuple[int, int], Decision] = {}  # the latest per bucket
        # The model's latest γ (and budget) per bucket: calibration and exploration aside.
        self.settled: dict[tuple[int, int], int] = {}
        self.settled_budget: dict[tuple[int, int], int | None] = {}

    @staticmethod
    def bucket(batch_size: int, mean_context: float) -> tuple[int, int]:
        return grid_ceiling(batch_size), grid_ceiling(mean_context)

    def budgets_for(self, bucket: tuple[int, int]) -> list[int | None]:
        """The budgets a bucket's rounds may draft with: those below its context (at or above
        it the draft reads everything, as a plain step does), or the smallest."""
        if not self.budgets:
            return [None]
        return [b for b in self.budgets if b < bucket[1]] or [self.budgets[0]]

    def _reference(self, bucket: tuple[int, int], costs: StepCosts) -> int | None:
        """The budget the bucket's γs are calibrated at."""
        if costs.reference is not None or not self.budgets:
            return costs.reference
        eligible = self.budgets_for(bucket)
        return min(eligible, key=lambda b: abs(math.log2(b / self.start_budget)))

    # -- measurements ------------------------------------------------------------------------

    def record_decode(self, bucket: tuple[int, int], seconds: float) -> None:
        costs = self.costs.setdefault(bucket, StepCosts())
        costs.measured("decode", seconds)

    def record_round(
        self,
        bucket: tuple[int, int],
        gamma: int,
        draft_seconds: float,
        round_seconds: float,
        budget: int | None = None,
    ) -> None:
        """A speculative round: mean seconds per draft step, seconds of the whole round, the
        budget it drafted with (None: the only one). A round at a budget other than the
        bucket's reference is recorded as the reference round it stands for (its draft steps
        at the reference's cost), its draft step as that budget's."""
        costs = self.costs.setdefault(bucket, StepCosts())
        costs.measured("draft", draft_seconds)
        if budget is not None and self.budgets:
            if costs.reference is None:
                costs.reference = budget
            costs.measured(("draft", budget), draft_seconds)
            round_seconds += gamma * (costs.drafts[costs.reference] - draft_seconds)
        costs.measured(gamma, round_seconds)

    def record_acceptance(
        self,
        rids: list[str],
        accept_lens: list[int],
        gamma: int,
        budget: int | None = None,
    ) -> None:
        """A round's acceptance per request: of its γ drafts, the first `accept_len - 1` were
        kept (drafting at `budget`)."""
        budget = budget if self.budgets else None
        round_kept = round_tested = 0
        for rid, accepted in zip(rids, accept_lens, strict=True):
            kept = accepted - 1
            tested = kept + (1 if kept < gamma else 0)  # drafts after a rejection are untested
            by_budget = self._drafts.setdefault(rid, {})
            old_kept, old_tested = by_budget.get(budget, (0.0, 0.0))
            by_budget[budget] = (old_kept + kept, old_tested + tested)
            round_kept += kept
            round_tested += tested
        for key in {None, budget}:
            recent_kept, recent_tested = self._recent.get(key, (0.0, 0.0))
            self._recent[key] = (
                recent_kept * self.recent_decay + round_kept,
                recent_tested * self.recent_decay + round_tested,
            )

    def forget(self, rid: str) -> None:
        self._drafts.pop(rid, None)

    def recent_alphas(self) -> dict[int, float]:
        """The server's recent acceptance at each budget it has drafted with."""
        measured = [(b, kept, tested) for b, (kept, tested) in self._recent.items() if b and tested]
        return {budget: kept / tested for budget, kept, tested in sorted(measured)}

    def prior(self, budget: int | None = None) -> float:
        """α a request starts from: the server's recent acceptance (at `budget` once it has
        some there), once it has some."""
        for key in (budget, None):
            kept, tested = self._recent.get(key, (0.0, 0.0))
            if tested >= self.prior_weight:
                return kept / tested
        return self.prior_alpha

    def alpha(self, rid: str, budget: int | None = None) -> float:
        budget = budget if self.budgets else None
        kept, tested = self._drafts.get(rid, {}).get(budget, (0.0, 0.0))
        return (kept + self.prior(budget) * self.prior_weight) / (tested + self.prior_weight)

    # -- the decision ------------------------------------------------------------------------

    def choose(self, rids: list[str], mean_context: float) -> Decision:
        bucket = self.bucket(len(rids), mean_context)
        costs = self.costs.setdefault(bucket, StepCosts())
        missing = self._uncalibrated(bucket, costs)
        donor = self._nearest_calibrated(bucket) if missing else bucket
        if donor is None:
            gamma, budget = missing[0]
            step = "plain step" if gamma == 0 else f"γ={gamma}"
            if gamma and budget is not None:
                step += f" at budget {budget}"
            decision = Decision(gamma, 1.0, f"calibrating {step}", budget)
        else:
            alphas = {b: [self.alpha(rid, b) for rid in rids] for b in self.budgets_for(donor)}
            settled = self.settled.get(bucket)
            settled_budget = self.settled_budget.get(bucket)
            decision = self.best(self.costs[donor], alphas, settled, settled_budget)
            if (
                decision.gamma != settled
                or decision.budget != settled_budget
                or not costs.explore_interval
            ):
                costs.explore_interval = self.explore_every  # a new plan: look around again soon
            self.settled[bucket] = decision.gamma
            self.settled_budget[bucket] = decision.budget
            if donor != bucket:
                decision = replace(decision, reason=f"as {bucket_key(donor)}")
            costs.rounds_since_exploring += 1
            running = (decision.gamma, decision.budget)
            gammas = [g for g in (0, *range(self.gamma_max, 0, -1)) if g != decision.gamma]
            others = [(g, decision.budget) for g in gammas]
            in_turn = missing[0] if missing else others[costs.explorations % len(others)]
            budget_arms = self._budget_arms(self.costs[donor], alphas, running)
            costs.since_budget_explored += 1
            if (
                donor == bucket
                and costs.moved(decision.gamma) > self.moved
                and self.best(costs.as_recently(decision.gamma), alphas).gamma != decision.gamma
            ):
                # The running γ's last rounds cost more than its window says, enough that another
                # γ would win were that to last: the machine slowed down, or this γ's cost
                # changed. Measuring the others now tells which (their fresh costs move the
                # window on, `StepCosts`). Where no other γ would win (plain steps where rounds
                # cost twice as much), exploring them at once only spends losing rounds.
                explored = costs.measured_longest_ago(gammas)
                decision = Decision(
                    explored, decision.predicted_speedup, "exploring", decision.budget
                )
            elif costs.rounds_since_exploring >= costs.explore_interval and (
                missing
                or costs.rounds_since_exploring
                >= self.exploration_spacing(costs, alphas, running, in_turn)
            ):
                # Every other plan in turn (what this bucket still lacks first, then plain
                # decoding first): a cost measured once (cold, or under another load) must not
                # decide for good.
                costs.explorations += 1
                costs.rounds_since_exploring = 0
                costs.explore_interval = min(2 * costs.explore_interval, self.explore_every_max)
                gamma, budget = in_turn
                decision = Decision(gamma, decision.predicted_speedup, "exploring", budget)
            elif (
                budget_arms
                and not missing
                and costs.since_budget_explored
                >= max(
                    self.explore_every,
                    self.exploration_spacing(
                        costs,
                        alphas,
                        running,
                        arm := budget_arms[costs.budget_explorations % len(budget_arms)],
                    ),
                )
            ):
                costs.budget_explorations += 1
                costs.since_budget_explored = 0
                gamma, budget = arm
                decision = Decision(gamma, decision.predicted_speedup, "exploring", budget)
        self.last = self.decisions[bucket] = decision
        return decision

    def _uncalibrated(self, bucket: tuple[int, int], costs: StepCosts) -> list[tuple]:
        """The plans (γ, budget; γ = 0: plain decoding) this bucket has measured fewer than
        `calibration_rounds` times, of those its model needs: plain steps and rounds at γ_max
        and at γ = 1 at its reference budget; then rounds at γ_max at each other budget."""
        reference = self._reference(bucket, costs)
        needed = dict.fromkeys((0, self.gamma_max, 1))
        missing = [
            (gamma, reference)
            for gamma in needed
            if len(costs.stamps.get(cost_name(gamma), ())) < self.calibration_rounds
        ]
        return missing + [
            (self.gamma_max, budget)
            for budget in self.budgets_for(bucket)
            if budget is not None
            and budget != reference
            and len(costs.stamps.get(("draft", budget), ())) < self.calibration_rounds
        ]

    def _nearest_calibrated(self, bucket: tuple[int, int]) -> tuple[int, int] | None:
        """The calibrated bucket closest to `bucket` (in octaves of batch and context):
        a bucket a batch passes through briefly (the last requests of a wave, say) decides as
        its neighbour does instead of spending its few rounds on calibration."""
        batch, context = bucket
        calibrated = [b for b, costs in self.costs.items() if not self._uncalibrated(b, costs)]
        return min(
            calibrated,
            key=lambda b: abs(math.log2(b[0] / batch)) + abs(math.log2(b[1] / context)),
            default=None,
        )

    def _budget_arms(
        self, costs: StepCosts, alphas: dict[int | None, list[float]], running: tuple
    ) -> list[tuple]:
        """The budgets next to the running one at the running γ (a budget's rate rises, then
        falls, as α and the draft's cost grow with it); should one win, its own neighbours are
        explored next. None while plain steps run: the γs explored at the running budget tell
        whether speculation pays again, and every priced budget is weighed at each decision."""
        gamma, budget = running
        ladder = [b for b in alphas if b is not None and _priced(costs, b)]
        if not gamma or budget not in ladder:
            return []
        at = ladder.index(budget)
        return [(gamma, other) for other in ladder[max(at - 1, 0) : at + 2] if other != budget]

    def exploration_spacing(
        self,
        costs: StepCosts,
        alphas: dict[int | None, list[float]],
        running: tuple[int, int | None],
        explored: tuple[int, int | None],
    ) -> float:
        """Decisions to wait before exploring plan `explored` instead of running `running`
        (each γ, budget), so that explorations cost at most `explore_overhead` of the
        time: a round predicted to lose ℓ decisions' worth of time (its time over the running
        plan's, less its tokens over the running plan's) is explored at most every
        ℓ / explore_overhead decisions, and at least every `explore_every_max`. On the Qwen
        model in float32 a γ = 3 round costs 4.5 plain steps for about 2 steps' tokens; explored
        every 16-64 decisions, as where γs are close, such rounds cost a settled γ = 0 batch
        4-8% against plain decoding."""
        (run_gamma, run_budget), (gamma, budget) = running, explored
        time_ratio = costs.seconds(gamma, budget) / costs.seconds(run_gamma, run_budget)
        lost = time_ratio - self.tokens(gamma, alphas[budget]) / self.tokens(
            run_gamma, alphas[run_budget]
        )
        return min(max(lost, 0.0) / self.explore_overhead, self.explore_every_max)

    def tokens(self, gamma: int, alphas: list[float]) -> float:
        """Expected tokens of the batch's next forward at γ (0: one per request)."""
        if gamma == 0:
            return len(alphas)
        return sum(expected_tokens_per_round(gamma, alpha) for alpha in alphas)

    def best(
        self,
        costs: StepCosts,
        alphas: dict[int | None, list[float]] | list[float],
        current: int | None = None,
        current_budget: int | None = None,
    ) -> Decision:
        """The plan (γ, and the budget among those `alphas` has, each request's α there) with
        the highest predicted tokens/s; `current` (the bucket's γ so far, at `current_budget`)
        stays unless beaten by more than the hysteresis margin. A budget is a candidate once
        its draft step has been measured (`_priced`)."""
        by_budget = alphas if isinstance(alphas, dict) else {None: alphas}
        priced = [b for b in by_budget if _priced(costs, b)]
        plain_budget = current_budget if current_budget in priced else costs.reference
        if plain_budget not in by_budget:
            plain_budget = priced[0]
        rates = {(0, plain_budget): self.tokens(0, by_budget[plain_budget]) / costs.decode}
        for budget in priced:
            for gamma in range(1, self.gamma_max + 1):
                rate = self.tokens(gamma, by_budget[budget]) / costs.seconds(gamma, budget)
                rates[(gamma, budget)] = rate
        best_plan = max(rates, key=rates.__getitem__)
        if current is not None:
            kept = (current, plain_budget if current == 0 else current_budget)
            if kept in rates and rates[best_plan] <= rates[kept] * (1 + self.hysteresis):
                best_plan = kept
        gamma, budget = best_plan
        plain_rate = rates[(0, plain_budget)]
        return Decision(gamma, rates[best_plan] / plain_rate, "model", budget)


def _priced(costs: StepCosts, budget: int | None) -> bool:
    """Whether rounds at `budget` have a cost: the only budget, the reference, or one whose
    draft step has been measured beside the reference's."""
    if budget is None or budget == costs.reference:
        return True
    return budget in costs.drafts and costs.reference in costs.drafts
