"""Ω(γ, α) and its inverse."""

import random

import pytest

from sglang_magicdec.cost_model import (
    CostModel,
    StepCosts,
    alpha_from_accept_length,
    bucket_key,
    expected_tokens_per_round,
)


@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.84, 0.99])
def test_inverse_recovers_alpha(gamma, alpha):
    omega = expected_tokens_per_round(gamma, alpha)
    assert alpha_from_accept_length(omega, gamma) == pytest.approx(alpha, abs=1e-9)


def test_closed_form():
    assert expected_tokens_per_round(3, 0.5) == pytest.approx((1 - 0.5**4) / (1 - 0.5))
    assert expected_tokens_per_round(4, 1.0) == 5


def test_rejects_impossible_means():
    with pytest.raises(ValueError):
        alpha_from_accept_length(5.5, 3)


# Synthetic step costs shaped like the paper's: reading weights (W) once per step, reading KV
# (per token of context, per request), and little extra per verified token.
WEIGHTS_S, KV_S_PER_TOKEN, VERIFY_S_PER_TOKEN, BUDGET = 10e-3, 2e-6, 0.4e-3, 512


def linear_costs(
    decode: float, draft: float, verify_per_token: float, gamma_max: int, verify_fixed: float = 0.0
) -> StepCosts:
    """Costs with every γ's round measured: γ drafts, then a verify that costs a plain step plus
    a fixed part plus a part per verified draft token."""
    rounds = {
        gamma: gamma * draft + decode + verify_fixed + gamma * verify_per_token
        for gamma in range(1, gamma_max + 1)
    }
    return StepCosts(decode=decode, draft=draft, rounds=rounds)


def synthetic_costs(batch: int, context: int, gamma_max: int = 8) -> StepCosts:
    return linear_costs(
        decode=WEIGHTS_S + batch * context * KV_S_PER_TOKEN,
        draft=WEIGHTS_S + batch * BUDGET * KV_S_PER_TOKEN,
        verify_per_token=VERIFY_S_PER_TOKEN * batch,
        gamma_max=gamma_max,
    )


def test_picks_plain_decoding_when_drafting_costs_a_full_step():
    model = CostModel(gamma_max=6)
    costs = linear_costs(decode=10e-3, draft=10e-3, verify_per_token=1e-3, gamma_max=6)
    assert model.best(costs, [0.8] * 4).gamma == 0


def test_gamma_grows_with_context_and_batch():
    """At long context a step is dominated by the KV read; the draft reads `BUDGET` tokens
    instead, so speculation pays more (longer γ) as context and batch grow."""
    model = CostModel(gamma_max=8)
    by_context = [model.best(synthetic_costs(8, c), [0.8] * 8).gamma for c in (512, 4096, 32768)]
    assert by_context == sorted(by_context) and by_context[0] < by_context[-1], by_context
    by_batch = [model.best(synthetic_costs(b, 32768), [0.8] * b).gamma for b in (1, 8, 64)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1], by_batch
    assert model.best(synthetic_costs(1, 512), [0.8]).gamma == 0  # short context: no speculation


def test_predicted_speedup_matches_the_formula():
    model = CostModel(gamma_max=3)
    costs = linear_costs(decode=0.1, draft=0.02, verify_per_token=0.01, gamma_max=3)
    decision = model.best(costs, [0.9, 0.9])
    gamma = decision.gamma
    expected = (2 * expected_tokens_per_round(gamma, 0.9) / (gamma * 0.02 + 0.1 + gamma * 0.01)) / (
        2 / 0.1
    )
    assert decision.predicted_speedup == pytest.approx(expected)


def test_unmeasured_gamma_lies_on_the_line_through_measured_rounds():
    """With a fixed verify cost beyond a plain step, the line through two measured γs predicts
    the others exactly; one through (0, T_decode) and γ_max would make γ = 1 look cheaper than
    it is (what kept γ = auto at γ = 1 while γ = 3 measured faster)."""
    true = linear_costs(decode=0.3, draft=0.1, verify_per_token=0.05, gamma_max=5, verify_fixed=0.2)
    measured = StepCosts(decode=0.3, draft=0.1, rounds={1: true.rounds[1], 5: true.rounds[5]})
    for gamma in (2, 3, 4):
        assert measured.round(gamma) == pytest.approx(true.rounds[gamma])
    model = CostModel(gamma_max=5)
    alphas = [0.92] * 8
    assert model.best(measured, alphas).gamma == model.best(true, alphas).gamma


def test_calibrates_then_decides_and_explores():
    # explore_overhead: any exploration may cost up to a decision's worth of time here (the
    # schedule, not its spacing by loss: `test_explorations_that_lose_by_far_are_spaced_out`).
    model = CostModel(gamma_max=3, explore_every=2, calibration_rounds=2, explore_overhead=1.0)
    rids = ["a", "b"]
    bucket = CostModel.bucket(2, 1000)
    for seconds in (0.05, 0.01):  # the first step is cold: the fastest calibration step counts
        assert model.choose(rids, 1000).reason == "calibrating plain step"
        model.record_decode(bucket, seconds)
    assert model.costs[bucket].decode == 0.01
    for gamma in (3, 3, 1, 1):  # two points of the round-time line
        assert model.choose(rids, 1000).gamma == gamma
        model.record_round(bucket, gamma, draft_seconds=0.01, round_seconds=0.012 + gamma * 0.01)
    model.record_acceptance(rids, [4, 1], gamma=3)
    decision = model.choose(rids, 1000)
    assert (decision.gamma, decision.reason) == (0, "model")  # a draft step costs a plain step
    model.record_decode(bucket, 0.01)
    model.record_decode(bucket, 0.01)
    assert (model.choose(rids, 1000).gamma, model.last.reason) == (3, "exploring")


def run_rounds(
    model: CostModel,
    rids: list[str],
    context: int,
    count: int,
    plain_seconds: float,
    round_seconds: float,
    draft_seconds: float,
) -> list[int]:
    """`count` rounds at the γ the model picks, each recorded with the given costs; returns
    the γs it explored."""
    bucket = CostModel.bucket(len(rids), context)
    explored = []
    for _ in range(count):
        decision = model.choose(rids, context)
        if decision.reason == "exploring":
            explored.append(decision.gamma)
        if decision.gamma == 0:
            model.record_decode(bucket, plain_seconds)
        else:
            model.record_round(bucket, decision.gamma, draft_seconds, round_seconds)
    return explored


def test_a_new_bucket_decides_as_its_calibrated_neighbour_until_it_has_its_own_costs():
    """The last requests of a wave pass through smaller buckets for a few rounds each: they
    must not spend them on plain-step calibration while a neighbour's costs say γ = 3."""
    model = CostModel(gamma_max=3, explore_every=4, explore_every_max=4, calibration_rounds=1)
    full = CostModel.bucket(8, 8000)
    model.record_decode(full, 0.30)
    for gamma in (1, 3):
        model.record_round(full, gamma, draft_seconds=0.05, round_seconds=0.4 + 0.1 * gamma)
    rids = ["a", "b"]
    model.record_acceptance(rids, [4, 4], gamma=3)
    decision = model.choose(rids, 8000)
    assert decision.gamma == model.best(model.costs[full], [model.alpha(r) for r in rids]).gamma
    assert decision.gamma > 0 and decision.reason == f"as {bucket_key(full)}"
    # Every `explore_every` rounds it measures what it lacks (plain steps first), and decides
    # with its own costs once it has them.
    explored = run_rounds(
        model, rids, 8000, 12, plain_seconds=0.2, round_seconds=0.5, draft_seconds=0.04
    )
    assert explored[:2] == [0, 1], explored  # plain, then γ=1 (γ=3 was measured while borrowing)
    assert model.choose(rids, 8000).reason in ("model", "exploring")


def test_a_settled_bucket_explores_ever_less_often_until_its_gamma_changes():
    """Where plain steps win (γ = 0 settled), each exploration that confirms it doubles the
    interval to the next (16, 32, 64 decisions...): exploring costs ever less of a long run.
    Once rounds become cheap the model's γ changes, and the interval is back to 16."""
    model = CostModel(gamma_max=3, explore_every=16, calibration_rounds=1, explore_overhead=1.0)
    rids = ["a", "b"]
    slow = {"plain_seconds": 0.1, "round_seconds": 0.5, "draft_seconds": 0.1}
    explored_at = []
    for index in range(3 + 16 + 32 + 64 + 10):  # calibration (plain, γ=3, γ=1), then decisions
        if run_rounds(model, rids, 1000, 1, **slow):
            explored_at.append(index)
    assert model.settled[CostModel.bucket(2, 1000)] == 0
    gaps = [b - a for a, b in zip(explored_at[:-1], explored_at[1:], strict=True)]
    assert gaps == [32, 64], explored_at
    bucket = CostModel.bucket(2, 1000)
    for gamma in (1, 3):  # a bucket's cost is the fastest of its measurements in its window
        model.record_round(bucket, gamma, draft_seconds=0.01, round_seconds=0.11)
    for _ in range(8):
        model.record_acceptance(rids, [4, 4], gamma=3)
    assert model.choose(rids, 1000).gamma > 0
    assert model.costs[bucket].explore_interval == 16


def test_exploration_visits_every_other_gamma_in_turn():
    """Speculation winning on a bad plain-step measurement (or one γ on a cold round) must not
    go unchecked: every `explore_every` rounds one other γ is measured, plain decoding first."""
    model = CostModel(gamma_max=3, explore_every=3, explore_every_max=3, calibration_rounds=1)
    rids = ["a"]
    bucket = CostModel.bucket(1, 1000)
    model.record_decode(bucket, 0.5)  # an outlier
    model.record_round(bucket, 3, draft_seconds=0.12, round_seconds=0.5)
    model.record_round(bucket, 1, draft_seconds=0.12, round_seconds=0.5)
    for _ in range(8):
        model.record_acceptance(rids, [4], gamma=3)
    explored = run_rounds(
        model, rids, 1000, 12, plain_seconds=0.5, round_seconds=0.5, draft_seconds=0.12
    )
    assert explored == [0, 2, 1, 0], explored  # the model's γ is 3; the others in turn
    for _ in range(10):
        model.record_decode(bucket, 0.1)  # the real plain-step cost
    best = model.best(model.costs[bucket], [model.alpha("a")])
    assert best.gamma == 0  # a draft step costs more than a plain step


def test_alpha_per_request_from_its_rounds():
    model = CostModel(gamma_max=3, prior_alpha=0.5, prior_weight=2, recent_decay=1.0)
    assert model.alpha("new") == 0.5  # nothing verified yet: the configured prior
    model.record_acceptance(["r"], [4], gamma=3)  # 3 kept of 3 tested
    model.record_acceptance(["r"], [2], gamma=3)  # 1 kept, then a rejection: 2 tested
    server_alpha = 4 / 5
    assert model.prior() == pytest.approx(server_alpha)
    assert model.alpha("r") == pytest.approx((4 + server_alpha * 2) / (5 + 2))
    model.forget("r")
    assert model.alpha("r") == pytest.approx(server_alpha)


def test_new_requests_start_from_the_servers_recent_acceptance():
    """A new request's α is the recent acceptance of the server, weighted to the latest rounds,
    not the fixed prior: at α ≈ 0.9 a batch of fresh requests must not look like α = 0.7."""
    model = CostModel(gamma_max=3, prior_alpha=0.7, prior_weight=4, recent_decay=0.9)
    for _ in range(50):  # a long stretch of poor acceptance, long ago
        model.record_acceptance(["old"], [1], gamma=3)
    for _ in range(50):  # recent rounds: everything accepted
        model.record_acceptance(["recent"], [4], gamma=3)
    assert model.alpha("fresh") > 0.95


def test_hysteresis_keeps_gamma_against_small_predicted_gains():
    costs = linear_costs(decode=0.100, draft=0.010, verify_per_token=0.002, gamma_max=3)
    alphas = [0.8] * 4
    best = CostModel(gamma_max=3).best(costs, alphas).gamma
    rates = {
        gamma: sum(expected_tokens_per_round(gamma, a) for a in alphas) / costs.round(gamma)
        for gamma in range(1, 4)
    }
    runner_up = max((g for g in rates if g != best), key=rates.__getitem__)
    gain = rates[best] / rates[runner_up] - 1
    # A margin above the predicted gain keeps the current γ; one below it lets the best win.
    assert CostModel(3, hysteresis=gain * 1.1).best(costs, alphas, runner_up).gamma == runner_up
    assert CostModel(3, hysteresis=gain * 0.9).best(costs, alphas, runner_up).gamma == best
    # Against γ = 0 (plain rate far below) the best γ wins at the default margin.
    assert CostModel(3).best(costs, alphas, current=0).gamma == best


def test_bucket_grid_spans_at_most_a_quarter():
    from sglang_magicdec.cost_model import grid_ceiling

    assert [grid_ceiling(v) for v in (0, 1, 5, 8, 9, 11, 16, 17, 33)] == [
        1,
        1,
        5,
        8,
        10,
        12,
        16,
        20,
        40,
    ]
    assert [grid_ceiling(v) for v in (4000, 4096, 4097, 7968.5, 8192)] == [
        4096,
        4096,
        5120,
        8192,
        8192,
    ]
    for value in range(1, 5000):
        ceiling = grid_ceiling(value)
        assert value <= ceiling < value * 1.25 + 1


def test_a_shrinking_batch_does_not_make_the_full_batch_look_cheaper():
    """The last rounds of a wave run fewer requests (they finish at different rounds): their
    cheaper rounds must not become the full batch's cost, which is the fastest in its window."""
    model = CostModel(gamma_max=3)
    full, tail = CostModel.bucket(8, 4096), CostModel.bucket(5, 4096)
    assert full != tail
    model.record_round(full, 2, draft_seconds=0.03, round_seconds=0.31)
    model.record_round(tail, 2, draft_seconds=0.02, round_seconds=0.22)
    assert model.costs[full].round(2) == 0.31


# A batch of 8 at 7,936 tokens on a 2-core Xeon (SmolLM2, float32), as a server measured it:
# plain step 210 ms, draft step 60 ms, a verify of γ + 1 tokens 222 + 38 γ ms; α 0.9. γ = 3 is
# the best (γ = 2 within 3%, γ = 1 11% and plain steps 29% slower).
def true_seconds(gamma: int) -> float:
    return 0.210 if gamma == 0 else gamma * 0.060 + 0.222 + 0.038 * gamma


def tokens_per_second(gamma: int, alpha: float = 0.9) -> float:
    return expected_tokens_per_round(gamma, alpha) / true_seconds(gamma)


def serve(model: CostModel, decisions: int, slowdown, seed: int = 0) -> list:
    """`decisions` batches of 8 requests at α 0.9, each timed at its γ's true cost times
    `slowdown(index, γ)` and a little noise (noise only adds time); the model's decisions."""
    rng = random.Random(seed)
    rids = [f"r{i}" for i in range(8)]
    bucket = CostModel.bucket(8, 7950)
    made = []
    for index in range(decisions):
        decision = model.choose(rids, 7950)
        seconds = true_seconds(decision.gamma) * slowdown(index, decision.gamma)
        seconds *= 1 + abs(rng.gauss(0, 0.04))
        if decision.gamma == 0:
            model.record_decode(bucket, seconds)
        else:
            model.record_round(bucket, decision.gamma, 0.060, seconds)
            accepted = []
            for _ in rids:
                kept = 0
                while kept < decision.gamma and rng.random() < 0.9:
                    kept += 1
                accepted.append(kept + 1)
            model.record_acceptance(rids, accepted, decision.gamma)
        made.append(decision)
    return made


@pytest.mark.parametrize("seed", range(4))
def test_a_slow_spell_of_the_machine_does_not_walk_gamma_down(seed):
    """15 rounds at 1.6x every cost (the machine, not γ): the running γ's rounds must not look
    dearer than the other γs' older, faster measurements. Each cost the fastest of its own last
    four walked γ 3 -> 2 -> 1 -> 0 within the spell and kept it off γ = 3 for hundreds of rounds
    (as a suite run did at 8 x 7,936: 3 -> 2 -> 1 -> 0 in six seconds)."""
    spell = range(120, 135)
    made = serve(CostModel(gamma_max=3), 400, lambda i, g: 1.6 if i in spell else 1.0, seed)
    modelled = [d.gamma for d in made[spell.start :] if d.reason == "model"]
    assert set(modelled) <= {2, 3}, modelled  # within 3% of the best
    rates = [tokens_per_second(d.gamma) for d in made[spell.start :]]
    assert sum(rates) / len(rates) >= 0.97 * tokens_per_second(3)


def test_a_lasting_change_of_the_running_gammas_cost_is_followed_within_a_few_rounds():
    """From decision 300 on a γ = 3 round costs 1.5x (γ = 2 is then the best): the model's own
    rounds show it, it measures the others at once, and moves within a dozen rounds rather than
    when the regular explorations come round (every 256 decisions by then)."""
    made = serve(CostModel(gamma_max=3), 400, lambda i, g: 1.5 if (g == 3 and i >= 300) else 1)
    assert {d.gamma for d in made[200:300] if d.reason == "model"} == {3}
    moved_at = next(i for i in range(300, 400) if made[i].reason == "model" and made[i].gamma != 3)
    assert moved_at - 300 <= 12
    assert all(d.gamma == 2 for d in made[moved_at:] if d.reason == "model")


def test_every_cost_is_the_fastest_over_one_window():
    """The window holds every cost's last two measurements: a γ measured every round keeps its
    faster rounds from as far back as the plain steps' last two, however many slow ones follow."""
    costs = StepCosts()
    costs.measured("decode", 0.20)
    costs.measured("decode", 0.21)
    for seconds in (0.50, 0.51, 0.80, 0.81, 0.82, 0.83, 0.84):
        costs.measured(3, seconds)
    assert (costs.decode, costs.rounds[3]) == (0.20, 0.50)
    assert costs.moved(3) == pytest.approx(0.81 / 0.50 - 1)
    assert costs.measured_longest_ago([0, 1, 2]) == 1  # never measured: first
    assert costs.measured_longest_ago([0, 3]) == 0
    costs.measured("decode", 0.32)  # plain steps measured again, as slow as the rounds
    costs.measured("decode", 0.33)
    assert (costs.decode, costs.rounds[3]) == (0.32, 0.83)
    costs.measured(3, 0.85)
    assert (costs.decode, costs.rounds[3]) == (0.32, 0.84)


def test_one_slow_plain_step_after_calibration_is_not_the_plain_steps_cost():
    """A Qwen server's calibration (8 x 16K, float32), then its first plain step ran slow: a
    window that held only each cost's latest measurement made plain steps look 30% dearer and
    sent the batch to γ = 1 rounds that lost to them."""
    model = CostModel(gamma_max=3)
    bucket = CostModel.bucket(8, 16050)
    for seconds in (0.2576, 0.2608):
        model.record_decode(bucket, seconds)
    for gamma, seconds in ((3, 0.9057), (3, 0.9799), (1, 0.5502), (1, 0.5616)):
        model.record_round(bucket, gamma, draft_seconds=0.12, round_seconds=seconds)
    model.record_decode(bucket, 0.3404)
    costs = model.costs[bucket]
    assert costs.decode == 0.2608
    assert model.best(costs, [0.8] * 8).gamma == 0


def test_a_slow_spell_of_plain_steps_where_rounds_lose_by_far_explores_nothing():
    """The Qwen model at 8 x 8K in float32 on a Xeon without matrix units (a MAGICDEC server's
    costs there): plain steps 172 ms, rounds 395 / 607 / 781 ms at γ = 1 / 2 / 3, α 0.5. Plain
    steps running 40% slower for a while would not make any round win, so the model must not
    spend rounds measuring them at once (it explored γ = 3, 1, 3 and 2 in a row there, each
    round costing 2.3-4.5 plain steps); a slowdown that would change the choice still does."""
    costs = {0: 0.172, 1: 0.395, 2: 0.607, 3: 0.781}

    def run(plain_slowdown: float) -> list:
        model = CostModel(gamma_max=3)
        rids = [f"r{i}" for i in range(8)]
        bucket = CostModel.bucket(8, 8050)
        made = []
        for index in range(120):
            decision = model.choose(rids, 8050)
            seconds = costs[decision.gamma]
            if decision.gamma == 0:
                model.record_decode(bucket, seconds * (plain_slowdown if index >= 60 else 1))
            else:
                model.record_round(bucket, decision.gamma, 0.14, seconds)
                model.record_acceptance(rids, [1 + (i % 2) for i in range(8)], decision.gamma)
            made.append(decision)
        return made

    slow = run(1.4)
    assert {d.gamma for d in slow[20:] if d.reason == "model"} == {0}
    exploring = [i for i, d in enumerate(slow) if d.reason == "exploring" and i >= 60]
    regular = [i for i, d in enumerate(run(1.0)) if d.reason == "exploring" and i >= 60]
    assert exploring == regular  # only the regular explorations
    # Plain steps 2.5x dearer would lose to γ = 1 rounds (30 tokens/s against 19): explored.
    much_slower = run(2.5)
    assert len([d for d in much_slower[60:70] if d.reason == "exploring"]) >= 2


def test_explorations_that_lose_by_far_are_spaced_out():
    """The Qwen model's costs at 8 x 8K in float32 on a Xeon without matrix units, settled on
    plain steps: a γ = 3 round costs 4.5 plain steps for about 2 steps' tokens. Explored on the
    regular schedule (16, 32, 64 ... decisions), such rounds cost 4-8% of a 64-token batch;
    spaced by their predicted loss they cost at most `explore_overhead` (2%) of the time, and
    every γ is still explored at least every `explore_every_max` decisions. Where the γs are
    close (the default-sampling suite's costs), the regular schedule is unchanged."""
    costs = {0: 0.172, 1: 0.395, 2: 0.607, 3: 0.781}
    rids = [f"r{i}" for i in range(8)]

    def lost_share(model: CostModel, decisions: int) -> tuple[float, list[int]]:
        bucket = CostModel.bucket(8, 8050)
        lost = total = 0.0
        explored_at = []
        for index in range(decisions):
            decision = model.choose(rids, 8050)
            seconds = costs[decision.gamma]
            total += seconds
            if decision.gamma == 0:
                model.record_decode(bucket, seconds)
                continue
            accepted = [1 + (i % 2) for i in range(8)]  # 1.5 tokens per request round
            model.record_round(bucket, decision.gamma, 0.14, seconds)
            model.record_acceptance(rids, accepted, decision.gamma)
            if decision.reason == "exploring":
                explored_at.append(index)
                lost += seconds - sum(accepted) / len(rids) * costs[0]
        return lost / total, explored_at

    # The first 140 decisions (two 64-token batches): 3 losing rounds on the regular schedule.
    spaced, _ = lost_share(CostModel(gamma_max=3), 140)
    unspaced, _ = lost_share(CostModel(gamma_max=3, explore_overhead=float("inf")), 140)
    assert unspaced > 0.03 and spaced <= 0.02, (spaced, unspaced)
    _, explored_at = lost_share(CostModel(gamma_max=3), 1000)
    assert len(explored_at) >= 3  # each of γ = 1, 2, 3 still measured now and then
    assert max(b - a for a, b in zip(explored_at, explored_at[1:], strict=False)) <= 256 + 1

    # Close γs (a γ = 2 or 3 round within 3% of each other): explored at 16, 32, 64 ...
    def explored(model: CostModel) -> list[int]:
        made = serve(model, 200, lambda index, gamma: 1.0)
        return [i for i, d in enumerate(made) if d.reason == "exploring"]

    assert explored(CostModel(gamma_max=3)) == explored(
        CostModel(gamma_max=3, explore_overhead=float("inf"))
    )


# -- KV budgets (`--magicdec-budget auto`) --------------------------------------------------------

BUDGETS = (256, 512, 1024, 2048, 4096)


def serve_budgets(
    model: CostModel,
    decisions: int,
    draft: dict[int, float],
    alpha: dict[int, float],
    seed: int = 0,
) -> tuple[float, list[tuple[int, int | None]]]:
    """`model` deciding for 8 requests at 8K on a machine where a plain step costs 100 ms, a
    round at (γ, b) a verify of 100 + 10·γ ms plus γ draft steps of draft[b], and each draft
    token at budget b is accepted with probability alpha[b]: the tokens/s it decoded past its
    first 50 decisions, and its plans."""
    rng = random.Random(seed)
    rids = [f"r{i}" for i in range(8)]
    bucket = CostModel.bucket(8, 8000)
    tokens = seconds = 0.0
    plans = []
    for index in range(decisions):
        decision = model.choose(rids, 8000)
        gamma, budget = decision.gamma, decision.budget
        plans.append((gamma, budget))
        if gamma == 0:
            forward, made = 0.100, len(rids)
            model.record_decode(bucket, forward)
        else:
            forward = 0.100 + 0.010 * gamma + gamma * draft[budget]
            accepted = []
            for _ in rids:
                kept = 0
                while kept < gamma and rng.random() < alpha[budget]:
                    kept += 1
                accepted.append(kept + 1)
            made = sum(accepted)
            model.record_round(bucket, gamma, draft[budget], forward, budget)
            model.record_acceptance(rids, accepted, gamma, budget)
        if index >= 50:
            tokens, seconds = tokens + made, seconds + forward
    return tokens / seconds, plans


def best_fixed_plan(draft: dict[int, float], alpha: dict[int, float], gamma_max: int):
    """The fixed (γ, budget) with the highest expected tokens/s on `serve_budgets`' machine."""
    rates = {(0, None): 8 / 0.100}
    for budget in draft:
        for gamma in range(1, gamma_max + 1):
            round_seconds = 0.100 + 0.010 * gamma + gamma * draft[budget]
            rates[(gamma, budget)] = (
                8 * expected_tokens_per_round(gamma, alpha[budget]) / round_seconds
            )
    plan = max(rates, key=rates.__getitem__)
    return plan, rates[plan]


@pytest.mark.parametrize(
    "case,draft,alpha",
    [
        # The draft's KV read dominates its step (long context, big batch): small budgets win.
        (
            "small",
            {b: 0.010 + b * 20e-6 for b in BUDGETS},
            dict(zip(BUDGETS, (0.80, 0.82, 0.84, 0.85, 0.86), strict=True)),
        ),
        # The draft's weights dominate (float32 on a CPU) and α climbs with the budget.
        (
            "large",
            {b: 0.010 + b * 1e-6 for b in BUDGETS},
            dict(zip(BUDGETS, (0.50, 0.60, 0.70, 0.80, 0.88), strict=True)),
        ),
    ],
)
def test_chooses_the_budget_with_gamma(case, draft, alpha):
    """Budgets trade α against the draft step's cost; the model, starting at 1,024, prices
    every budget from two rounds each and decodes within 3% of the best fixed (γ, budget) on
    average over 8 servers (the issue's target: γ = auto ≥ 0.97× the best fixed pair), most of
    its rounds at that budget. One server may settle near a wrong pair (α at a budget rests on
    the rounds run there): in 60 servers of three such cases, 3 ended below 0.97 of the best,
    the worst at 0.94."""
    best_plan, best_rate = best_fixed_plan(draft, alpha, gamma_max=4)
    assert best_plan[1] == (256 if case == "small" else 4096)  # the cases do differ
    ratios, at_best_budget = [], []
    for seed in range(8):
        model = CostModel(gamma_max=4, budgets=BUDGETS)
        rate, plans = serve_budgets(model, 2000, draft, alpha, seed)
        ratios.append(rate / best_rate)
        rounds = [plan for plan in plans[200:] if plan[0]]
        at_best_budget.append(sum(plan[1] == best_plan[1] for plan in rounds) / len(rounds))
        # Calibration: γ = 0, 4, 1 at the reference budget, then two rounds at each other.
        assert plans[:14] == [(0, 1024)] * 2 + [(4, 1024)] * 2 + [(1, 1024)] * 2 + [
            (4, budget) for budget in (256, 256, 512, 512, 2048, 2048, 4096, 4096)
        ]
    assert sum(ratios) / len(ratios) >= 0.97, ratios
    assert min(ratios) >= 0.9, ratios
    assert sorted(at_best_budget)[len(at_best_budget) // 2] > 0.8, at_best_budget


def test_no_budget_pays_plain_steps_win():
    """Rounds lose at every budget (a verify costs 2.5 plain steps): the model settles on plain
    steps, and its explorations of other budgets cost little."""
    draft = {b: 0.050 + b * 10e-6 for b in BUDGETS}
    alpha = dict.fromkeys(BUDGETS, 0.6)

    model = CostModel(gamma_max=3, budgets=BUDGETS)
    rids = [f"r{i}" for i in range(8)]
    bucket = CostModel.bucket(8, 8000)
    rng = random.Random(1)
    plain = total = 0.0
    for index in range(1000):
        decision = model.choose(rids, 8000)
        gamma, budget = decision.gamma, decision.budget
        if gamma == 0:
            model.record_decode(bucket, 0.100)
            seconds = 0.100
        else:
            seconds = 0.250 + gamma * draft[budget]
            accepted = [1 + (rng.random() < alpha[budget]) for _ in rids]
            model.record_round(bucket, gamma, draft[budget], seconds, budget)
            model.record_acceptance(rids, accepted, gamma, budget)
        if index >= 50:
            total += seconds
            plain += 0.100 if gamma == 0 else 0.0
    assert model.settled[bucket] == 0
    assert plain / total > 0.97


def test_a_round_at_another_budget_is_recorded_as_its_reference_round():
    """A round at budget b costs its reference-budget round plus γ times the difference of
    their draft steps; recorded as the reference round it stands for."""
    model = CostModel(gamma_max=3, budgets=(256, 1024))
    bucket = CostModel.bucket(4, 4000)
    model.record_round(bucket, 3, 0.020, 0.160, budget=1024)  # the reference: the first round's
    model.record_round(bucket, 3, 0.012, 0.136, budget=256)
    costs = model.costs[bucket]
    assert costs.reference == 1024
    assert costs.drafts == {1024: 0.020, 256: 0.012}
    assert costs.round(3) == pytest.approx(0.160)  # 0.136 + 3 · (0.020 − 0.012) = 0.160 too
    assert costs.seconds(3, 256) == pytest.approx(0.136)
    assert costs.seconds(2, 256) == pytest.approx(costs.round(2) - 2 * 0.008)
    # A budget's α is its own: requests drafting at 256 accept less here.
    model.record_acceptance(["a"], [1], 3, budget=256)
    model.record_acceptance(["a"], [4], 3, budget=1024)
    assert model.alpha("a", 256) < model.alpha("a", 1024)
