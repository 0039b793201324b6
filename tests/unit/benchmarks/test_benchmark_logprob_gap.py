"""benchmarks/logprob_gap.py: the statistics of log pi - log mu that explain an approx_kl spike."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.logprob_gap import gap_summary  # noqa: E402


def test_identical_logprobs_have_no_gap():
    log_mu = torch.tensor([-0.1, -2.0, -12.0])
    s = gap_summary(log_mu.clone(), log_mu)
    assert s["max_rise"] == s["max_fall"] == s["k3_mean"] == s["over_1_nat"] == 0.0
    assert s["tokens"] == 3 and s["lowest_mu"] == pytest.approx(-12.0)


def test_one_token_far_in_the_tail_decides_the_k3_mean():
    """k3 grows like pi / mu: one token at +9 nats outweighs 999 tokens at 0.1 nat (the shape of a KL spike)."""
    log_mu = torch.full((1000,), -1.0)
    log_pi = log_mu + 0.1
    log_pi[7] = log_mu[7] + 9.0
    log_pi[8] = log_mu[8] - 3.0
    s = gap_summary(log_pi, log_mu)
    assert s["max_rise"] == pytest.approx(9.0) and s["max_fall"] == pytest.approx(3.0)
    assert s["over_1_nat"] == pytest.approx(2 / 1000)
    small = math.exp(0.1) - 1.1
    expected = (998 * small + (math.exp(9.0) - 10.0) + (math.exp(-3.0) + 2.0)) / 1000
    assert s["k3_mean"] == pytest.approx(expected, rel=1e-6)
    assert s["k3_top10_share"] > 0.99
