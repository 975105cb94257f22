"""Ω(γ, α) and its inverse."""

import pytest

from sglang_magicdec.cost_model import alpha_from_accept_length, expected_tokens_per_round


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
