"""The DAPO math (learner/dapo.py) against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from learner import dapo
from services.config import load_settings

LOG = math.log


# -- advantages (Eq. 9) and dynamic sampling (Eq. 11) ------------------------------------------------------------
def test_group_advantages_use_the_sample_std():
    # mean 0, sample std sqrt(4/3): A = +-sqrt(3)/2 (population std 1 would give +-1).
    adv = dapo.group_advantages([1.0, -1.0, -1.0, 1.0], eps=0.0)
    assert torch.allclose(adv, torch.tensor([1, -1, -1, 1]) * math.sqrt(3) / 2)
    # mean -0.5, deviations (1.5, -0.5, -0.5, -0.5), sample variance (2.25 + 3 * 0.25) / 3 = 1.
    adv = dapo.group_advantages([1.0, -1.0, -1.0, -1.0], eps=0.0)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))
    with_eps = dapo.group_advantages([1.0, -1.0, -1.0, -1.0], eps=1.0)  # the same over std + eps = 2
    assert torch.allclose(with_eps, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_group_advantages_of_degenerate_groups_are_zero():
    assert torch.equal(dapo.group_advantages([1.0, 1.0, 1.0]), torch.zeros(3))
    assert torch.equal(dapo.group_advantages([-1.0]), torch.zeros(1))
    with pytest.raises(ValueError):
        dapo.group_advantages(torch.zeros(2, 2))


@pytest.mark.parametrize(
    "values, informative",
    [([1, 1, 1, 1], False), ([-1, -1, -1], False), ([1], False), ([1, -1, -1], True), ([-1, -1, -0.25], True)],
)
def test_is_informative_means_spread(values, informative):
    assert dapo.is_informative(values) is informative


def test_filter_on_accuracy_drops_an_all_correct_group_that_a_reward_filter_keeps():
    # 16 correct answers, one ran 12 tokens into a 4,096-token overlong buffer (Eq. 13: penalty 12 / 4096).
    rewards = [1.0] * 15 + [1.0 - 12 / 4096]
    correct = [True] * 16
    # The reward filter keeps it, and the advantages turn the tiny penalty into a full-scale push against a
    # correct answer: -3.75 for the long one, +0.25 for the 15 others.
    assert dapo.is_informative(dapo.filter_values(correct, rewards, "reward"))
    advantages = dapo.group_advantages(rewards, eps=0.0)
    assert advantages[-1].item() == pytest.approx(-3.75, abs=1e-6)
    assert advantages[:-1] == pytest.approx([0.25] * 15, abs=1e-6)
    # Eq. 11 (accuracy): 0 < #correct < G fails, the group is dropped. Same for all wrong with one long.
    assert not dapo.is_informative(dapo.filter_values(correct, rewards, "acc"))
    wrong = [-1.0] * 15 + [-1.0 - 12 / 4096]
    assert not dapo.is_informative(dapo.filter_values([False] * 16, wrong, "acc"))
    assert dapo.is_informative(dapo.filter_values([True] + [False] * 15, [1.0] + wrong[1:], "acc"))
    with pytest.raises(ValueError):
        dapo.filter_values(correct, rewards, "spread")


# -- clip-higher (Eq. 10) and dual clip --------------------------------------------------------------------------
RATIOS = torch.tensor([0.5, 0.9, 1.0, 1.25, 1.5, 3.0])


def _surrogate(ratios, advantage, **kwargs):
    logp = torch.log(ratios).clone().requires_grad_(True)
    out = dapo.clipped_surrogate(logp, torch.zeros_like(logp), torch.tensor(advantage), **kwargs)
    out.loss.sum().backward()
    return out, logp.grad


def test_clip_higher_positive_advantage():
    out, grad = _surrogate(RATIOS, 1.0, clip_low=0.2, clip_high=0.28)
    # -min(r, clip(r, 0.8, 1.28)): the upper bound 1.28 caps 1.5 and 3.0; 1.25 passes.
    assert torch.allclose(out.loss, -torch.tensor([0.5, 0.9, 1.0, 1.25, 1.28, 1.28]))
    assert out.clipped_high.tolist() == [False, False, False, False, True, True]
    assert not out.clipped_low.any()
    # d(-r)/d(log r) = -r where the ratio is live, 0 where the clip holds it.
    assert torch.allclose(grad, -RATIOS * ~out.clipped_high)


def test_clip_higher_negative_advantage():
    out, grad = _surrogate(RATIOS, -2.0, clip_low=0.2, clip_high=0.28)
    # -min(-2r, -2 clip(r)) = 2 max(r, clip(r)): only the lower bound binds (0.5 -> 0.8).
    assert torch.allclose(out.loss, 2 * torch.tensor([0.8, 0.9, 1.0, 1.25, 1.5, 3.0]))
    assert out.clipped_low.tolist() == [True, False, False, False, False, False]
    assert not out.clipped_high.any() and not out.clipped_dual.any()
    assert torch.allclose(grad, 2 * RATIOS * ~out.clipped_low)


def test_clip_higher_is_asymmetric():
    # The same distance from 1 is clipped below (0.75 < 0.8) but not above (1.25 < 1.28).
    ratios = torch.tensor([0.75, 1.25])
    low, _ = _surrogate(ratios, -1.0, clip_low=0.2, clip_high=0.28)
    high, _ = _surrogate(ratios, 1.0, clip_low=0.2, clip_high=0.28)
    assert low.clipped_low.tolist() == [True, False]
    assert high.clipped_high.tolist() == [False, False]
    symmetric, _ = _surrogate(ratios, 1.0, clip_low=0.2, clip_high=0.2)
    assert symmetric.clipped_high.tolist() == [False, True]


def test_dual_clip_bounds_negative_advantages_only():
    out, grad = _surrogate(RATIOS, -2.0, clip_low=0.2, clip_high=0.28, dual_clip=2.0)
    # min(2 max(r, clip(r)), 2 * c) with c = 2: only r = 3 is held at c |A| = 4.
    assert torch.allclose(out.loss, torch.tensor([1.6, 1.8, 2.0, 2.5, 3.0, 4.0]))
    assert out.clipped_dual.tolist() == [False] * 5 + [True]
    assert grad[-1] == 0 and grad[-2] != 0
    positive, _ = _surrogate(RATIOS, 1.0, clip_low=0.2, clip_high=0.28, dual_clip=2.0)
    plain, _ = _surrogate(RATIOS, 1.0, clip_low=0.2, clip_high=0.28)
    assert torch.equal(positive.loss, plain.loss) and not positive.clipped_dual.any()
    with pytest.raises(ValueError):
        dapo.clipped_surrogate(torch.zeros(1), torch.zeros(1), torch.ones(1), dual_clip=1.0)


def test_huge_ratios_stay_finite():
    logp = torch.tensor([500.0, -500.0], requires_grad=True)
    out = dapo.clipped_surrogate(logp, torch.zeros(2), torch.tensor([1.0, -1.0]))
    out.loss.sum().backward()
    assert torch.isfinite(out.loss).all() and torch.isfinite(logp.grad).all()


def test_clip_counts():
    logp = torch.log(torch.tensor([[0.5, 1.5, 4.0], [0.5, 1.5, 9.0]]))
    adv = torch.tensor([[-1.0], [1.0]])
    out = dapo.clipped_surrogate(logp, torch.zeros_like(logp), adv, 0.2, 0.28, dual_clip=3.0)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    # row 0: r = 0.5 clipped low, r = 4 > c held by the dual clip; row 1: r = 1.5 clipped high, r = 9 is padding.
    assert {k: float(v) for k, v in dapo.clip_counts(out, mask).items()} == \
        {"clip_low": 1.0, "clip_high": 1.0, "clip_dual": 1.0}


# -- truncated importance weight ---------------------------------------------------------------------------------
def test_tis_weight_is_capped_and_constant():
    logp_old = torch.tensor([LOG(0.5), 0.0, LOG(1.5), LOG(3.0), 80.0], requires_grad=True)
    weight = dapo.truncated_importance_weight(logp_old, torch.zeros(5), cap=2.0)
    assert torch.allclose(weight, torch.tensor([0.5, 1.0, 1.5, 2.0, 2.0]))
    assert not weight.requires_grad
    with pytest.raises(ValueError):
        dapo.truncated_importance_weight(logp_old, torch.zeros(5), cap=0.0)


def test_tis_weight_scales_the_token_loss():
    logp = torch.zeros(3)
    weight = torch.tensor([0.5, 1.0, 2.0])
    loss, _ = dapo.token_loss(logp, logp, torch.tensor(1.0), weight)
    assert torch.allclose(loss, -weight)


# -- aggregation (Eq. 12) and overlong filtering -----------------------------------------------------------------
# Response a: 1 token (loss 4); response b: 3 tokens (losses 1, 2, 3).
TOKEN_LOSS = torch.tensor([[4.0, 99.0, 99.0], [1.0, 2.0, 3.0]])
MASK = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])


def test_token_level_versus_sample_level_on_unequal_lengths():
    # token: (4 + 1 + 2 + 3) / 4 tokens; sample: (4/1 + 6/3) / 2 responses.
    assert dapo.aggregate_loss(TOKEN_LOSS, MASK, "token").item() == pytest.approx(2.5)
    assert dapo.aggregate_loss(TOKEN_LOSS, MASK, "sample").item() == pytest.approx(3.0)


def test_token_level_weighs_every_token_equally():
    weights = {}
    for mode in ("token", "sample"):
        losses = TOKEN_LOSS.clone().requires_grad_(True)
        dapo.aggregate_loss(losses, MASK, mode).backward()
        weights[mode] = losses.grad
    assert torch.allclose(weights["token"], MASK / 4)
    # Sample level: the short response's token weighs 1/2, each of the long one's 1/6.
    assert torch.allclose(weights["sample"], torch.tensor([[1 / 2, 0, 0], [1 / 6, 1 / 6, 1 / 6]]))


@pytest.mark.parametrize("mode, whole", [("token", 2.5), ("sample", 3.0)])
def test_micro_batches_sum_to_the_mini_batch_loss(mode, whole):
    denominator = dapo.loss_denominator(MASK.sum(dim=-1), mode)
    parts = [dapo.aggregate_loss(TOKEN_LOSS[i : i + 1], MASK[i : i + 1], mode, denominator) for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole)
    # Normalising each micro-batch by its own count is wrong: token level would give 4/1 + 6/3.
    naive = sum(dapo.aggregate_loss(TOKEN_LOSS[i : i + 1], MASK[i : i + 1], mode).item() for i in range(2))
    if mode == "token":
        assert naive == pytest.approx(6.0)


def test_a_response_with_no_loss_token_counts_in_neither_normaliser():
    """An overlong-filtered response (paper Sec. 3.4) is not run; its group's mini-batch counts it as nothing."""
    kept = MASK[:1]
    assert dapo.loss_denominator([1, 0], "token") == 1
    assert dapo.loss_denominator([1, 0], "sample") == 1
    assert dapo.aggregate_loss(TOKEN_LOSS[:1], kept, "token", 1.0).item() == pytest.approx(4.0)
    assert dapo.aggregate_loss(TOKEN_LOSS[:1], kept, "sample", 1.0).item() == pytest.approx(4.0)


def test_empty_loss_is_zero():
    empty = torch.zeros_like(MASK)
    assert dapo.aggregate_loss(TOKEN_LOSS, empty, "token").item() == 0.0
    assert dapo.aggregate_loss(TOKEN_LOSS, empty, "sample").item() == 0.0
    with pytest.raises(ValueError):
        dapo.aggregate_loss(TOKEN_LOSS, MASK, "sequence")


# -- metrics and optional regularisers ---------------------------------------------------------------------------
def test_kl_k3():
    # q = 0.5, p = 0.25: r = 0.5, (r - 1) - log r = -0.5 + log 2.
    value = dapo.kl_k3(torch.tensor(LOG(0.5)), torch.tensor(LOG(0.25)))
    assert value.item() == pytest.approx(-0.5 + LOG(2))
    assert dapo.kl_k3(torch.tensor(-1.3), torch.tensor(-1.3)).item() == 0.0
    x = torch.linspace(-5, 5, 41)
    assert (dapo.kl_k3(torch.zeros_like(x), x) >= 0).all()


def test_k3_is_an_unbiased_kl_estimate():
    q = torch.tensor([0.5, 0.3, 0.2])
    p = torch.tensor([0.2, 0.3, 0.5])
    expected = dapo.kl_k3(q.log(), p.log()) @ q  # E_q[k3] = KL(q || p) exactly
    assert expected.item() == pytest.approx((q * (q / p).log()).sum().item(), rel=1e-6)


def test_token_entropy():
    logits = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.5, 0.25, 0.25, 1e-30]]))
    assert torch.allclose(dapo.token_entropy(logits), torch.tensor([LOG(4), 1.5 * LOG(2)]))
    assert dapo.token_entropy(torch.tensor([[0.0, -1e4, -1e4]])).item() == pytest.approx(0.0, abs=1e-6)


def test_kl_penalty_and_entropy_bonus_are_off_at_zero():
    logp = torch.tensor([-1.0, -2.0])
    base, _ = dapo.token_loss(logp, logp, torch.tensor(1.0))
    # Coefficient 0: no reference or entropy needed, nothing added.
    same, _ = dapo.token_loss(logp, logp, torch.tensor(1.0), kl_coef=0.0, entropy_coef=0.0)
    assert torch.equal(base, same)
    ref = torch.tensor([-1.5, -2.0])
    with_kl, _ = dapo.token_loss(logp, logp, torch.tensor(1.0), kl_coef=0.1, logp_ref=ref)
    assert torch.allclose(with_kl - base, 0.1 * dapo.kl_k3(logp, ref))
    entropy = torch.tensor([2.0, 0.5])
    with_h, _ = dapo.token_loss(logp, logp, torch.tensor(1.0), entropy_coef=0.01, entropy=entropy)
    assert torch.allclose(with_h - base, -0.01 * entropy)
    with pytest.raises(ValueError):
        dapo.token_loss(logp, logp, torch.tensor(1.0), kl_coef=0.1)
    with pytest.raises(ValueError):
        dapo.token_loss(logp, logp, torch.tensor(1.0), entropy_coef=0.1)


# -- the GRPO baseline is a config of the same functions ---------------------------------------------------------
def _objective(settings, logp, advantages, mask):
    cfg = settings.learner
    loss, _ = dapo.token_loss(
        logp, torch.zeros_like(logp), advantages, clip_low=cfg.loss.clip_low, clip_high=cfg.loss.clip_high,
        dual_clip=cfg.loss.dual_clip,
    )
    return loss, dapo.aggregate_loss(loss, mask, cfg.loss.loss_agg)


def test_grpo_baseline_differs_from_dapo_where_expected():
    dapo_cfg = load_settings("tiny-cpu", learner={"loss": {"clip_low": 0.2, "clip_high": 0.28, "loss_agg": "token"}})
    grpo_cfg = load_settings("tiny-cpu", learner={"loss": {"clip_high": 0.2, "loss_agg": "sample"},
                                                  "batch": {"dynamic_sampling": False}})
    # Response 0 (A = +1, 2 tokens): ratios 1.25 and 1.1; response 1 (A = -1, 4 tokens): ratios 0.7, 1.25, 1, 1.
    ratios = torch.tensor([[1.25, 1.1, 1.0, 1.0], [0.7, 1.25, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0], [-1.0]])
    dapo_tokens, dapo_loss = _objective(dapo_cfg, ratios.log(), advantages, mask)
    grpo_tokens, grpo_loss = _objective(grpo_cfg, ratios.log(), advantages, mask)
    # Per token, only the positive-advantage ratio in (1.2, 1.28] differs: GRPO clips it to 1.2, DAPO does not.
    differs = ~torch.isclose(dapo_tokens, grpo_tokens)
    assert differs.tolist() == [[True, False, False, False], [False] * 4]
    assert dapo_tokens[0, 0].item() == pytest.approx(-1.25) and grpo_tokens[0, 0].item() == pytest.approx(-1.2)
    # The lower clip (shared 0.2) holds 0.7 at 0.8 for both.
    assert dapo_tokens[1, 0].item() == grpo_tokens[1, 0].item() == pytest.approx(0.8)
    # Aggregation: DAPO (-1.25 - 1.1 + 0.8 + 1.25 + 1 + 1) / 6; GRPO ((-1.2 - 1.1)/2 + (0.8 + 1.25 + 1 + 1)/4) / 2.
    assert dapo_loss.item() == pytest.approx(1.7 / 6)
    assert grpo_loss.item() == pytest.approx((-1.15 + 4.05 / 4) / 2)
