"""MagicDec's cost arithmetic: tokens per round Ω(γ, α) and what a measured round says of α.

With per-token acceptance α (each draft token accepted with probability α given the ones before
were), a round of γ drafts commits Ω(γ, α) = (1 − α^(γ+1)) / (1 − α) tokens on average, the
target's own token included.
"""

from __future__ import annotations


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
