"""The DAPO objective as pure functions on tensors (Yu et al., 2025, arXiv 2503.14476).

Conventions
  * Per-token tensors are padded `[B, T]` (B responses, T response positions); `mask` is 1.0 on response tokens
    that count in the loss and 0.0 on padding.
  * Every loss here is a quantity to *minimise*: the negative of the paper's objective J.
  * Equation numbers refer to the paper: (9) ratio and group-relative advantage, (10) clip-higher, (11) dynamic
    sampling constraint, (12) token-level policy-gradient loss. Overlong reward shaping, Eq. (13), is a reward
    rule and lives with the reward worker; its companion, overlong *filtering* (Sec. 3.4), keeps truncated
    responses out of the loss: the trainer never runs them (`Response.filtered`), and `loss_denominator` does not
    count them.

Nothing here knows about models, batches or settings; `learner/trainer.py` composes these functions.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, Sequence

import torch
from torch import Tensor

LossAggregation = Literal["token", "sample"]

# exp() of a log-ratio beyond this is treated as this (exp(20) ~ 5e8): an overflow to inf would turn the
# zero-gradient branch of the clip into NaN (0 * inf). Same bound as verl.
MAX_LOG_RATIO = 20.0


# -- warm-up schedules -----------------------------------------------------------------------------------------
class LinearWarmup:
    """Factor (k + 1) / warmup_steps at the k-th rollout step (from 0) for the first warmup_steps steps, then 1.

    The learning rate's warm-up (a LambdaLR factor; paper §4.1: 20 steps) and the batch's (learner/batch.py).
    """

    def __init__(self, warmup_steps: int):
        self.warmup_steps = warmup_steps

    def __call__(self, step: int) -> float:
        if self.warmup_steps <= 0:
            return 1.0
        return min(1.0, (step + 1) / self.warmup_steps)


# -- advantages and dynamic sampling -----------------------------------------------------------------------------
def group_advantages(rewards: Tensor | Sequence[float], eps: float = 1e-6) -> Tensor:
    """Group-relative advantage of each response, Eq. (9): (R_i - mean(R)) / (std(R) + eps).

    std is the *sample* standard deviation (Bessel-corrected, `torch.std(unbiased=True)`), as in verl, the
    paper's reference implementation. A group of one has no baseline: its advantage is 0. A group whose rewards
    are all equal gets 0 for every response (it carries no gradient; dynamic sampling drops it anyway).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D (one group), got shape {tuple(r.shape)}")
    if r.numel() < 2:
        return torch.zeros_like(r, dtype=torch.float32)
    centred = r - r.mean()
    return (centred / (r.std(unbiased=True) + eps)).to(torch.float32)


FilterMetric = Literal["acc", "reward"]


def filter_values(correct: Sequence[bool], rewards: Sequence[float], metric: FilterMetric) -> list[float]:
    """What dynamic sampling looks at: each response's correctness (Eq. 11, verl `filter_groups.metric=acc`)
    or its shaped reward (`reward`, a variant that also keeps groups differing only in overlong penalty)."""
    if metric == "acc":
        return [1.0 if c else 0.0 for c in correct]
    if metric == "reward":
        return [float(r) for r in rewards]
    raise ValueError(f"unknown filter metric {metric!r} (acc | reward)")


def is_informative(values: Tensor | Sequence[float]) -> bool:
    """Dynamic sampling, the constraint of Eq. (11): a group is kept when its values are not all equal.

    On correctness (`filter_values(..., "acc")`) that is exactly 0 < |{o_i correct}| < G, the paper's rule. On
    rewards it differs once overlong shaping is on: 16 correct answers of which one ran 12 tokens into a
    4,096-token buffer have reward spread, and dividing by the tiny std turns that penalty into advantages of
    -3.75 and +0.25, a full-scale push against a correct answer. That is why the paper filters on accuracy.
    """
    v = torch.as_tensor(values, dtype=torch.float64)
    return bool(v.numel() > 1 and (v.max() - v.min()).item() > 0.0)


# -- the clipped surrogate ---------------------------------------------------------------------------------------
class Surrogate(NamedTuple):
    """Per-token clipped surrogate loss and where each clip was active (bool tensors, same shape)."""

    loss: Tensor
    clipped_low: Tensor  # A < 0 and ratio < 1 - eps_low: the clipped term wins, the gradient is zero
    clipped_high: Tensor  # A > 0 and ratio > 1 + eps_high: the clipped term wins, the gradient is zero
    clipped_dual: Tensor  # A < 0 and ratio > c: the loss is held at c * |A| (dual clip), the gradient is zero


def clipped_surrogate(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> Surrogate:
    """Clip-Higher, Eq. (10): -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, r = pi_theta / pi_old.

    Decoupling eps_high from eps_low (paper 0.28 vs 0.2; GRPO/PPO use 0.2 for both) lets low-probability tokens
    with positive advantage grow further before the clip stops them, which is what keeps entropy from collapsing.

    Dual clip (Ye et al., 2020; not in the paper's text, always on in verl, the paper's code, as
    `clip_ratio_c = 3`): for A < 0 the PPO loss -r A grows without bound in r; with a bound c > 1 the loss is
    min(PPO loss, c * |A|), so one stale, very unlikely-then-likely token cannot dominate the update.

    `advantages` broadcasts against `logp` (e.g. `[B, 1]` per response against `[B, T]` per token).
    """
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    log_ratio = (logp - logp_old).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    advantages = torch.as_tensor(advantages, dtype=ratio.dtype, device=ratio.device).expand_as(ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    positive, negative = advantages > 0, advantages < 0
    clipped_low = negative & (ratio < 1.0 - clip_low)
    clipped_high = positive & (ratio > 1.0 + clip_high)
    if dual_clip is None:
        clipped_dual = torch.zeros_like(clipped_low)
    else:
        bound = -advantages * dual_clip  # = c * |A| where A < 0
        clipped_dual = negative & (loss > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    return Surrogate(loss, clipped_low, clipped_high, clipped_dual)


def truncated_importance_weight(logp_old: Tensor, logp_behaviour: Tensor, cap: float) -> Tensor:
    """Per-token weight min(pi_old / mu, cap) correcting for the behaviour policy mu that actually sampled.

    Why: generators sample asynchronously (with up to `max_staleness` versions of lag) and with a different
    engine (vLLM kernels, precision), so the behaviour policy mu is not the learner's pi_old of Eq. (9). The
    surrogate's ratio is taken against pi_old, the learner's own recomputation at the start of the step, so the
    clip keeps its meaning (trust region around the learner's policy); this weight then re-weights each token
    from mu to pi_old (the "decoupled" PPO objective, Hilton et al. 2022; truncated as in TIS / IMPALA-style
    V-trace, so that a token mu found much less likely than pi_old cannot blow up the variance). It is a
    constant (no gradient). Synchronous and numerically identical engines give a weight of 1.

    min(exp(x), cap) is computed as exp(min(x, log cap)): no overflow for large x.
    """
    if cap <= 0:
        raise ValueError(f"tis cap must be positive, got {cap}")
    log_weight = (logp_old - logp_behaviour).detach().clamp(max=math.log(cap))
    return torch.exp(log_weight)


# -- aggregation -------------------------------------------------------------------------------------------------
def loss_denominator(loss_tokens: Tensor | Sequence[int], mode: LossAggregation) -> float:
    """What the summed loss of a mini-batch is divided by: its token count (Eq. 12) or its response count.

    `loss_tokens` holds each response's number of tokens in the loss; responses with none (all masked, e.g.
    overlong-filtered) do not count as responses. Computed once per mini-batch so that micro-batches (gradient
    accumulation, or ranks) share it.
    """
    counts = loss_tokens.tolist() if isinstance(loss_tokens, Tensor) else loss_tokens  # host numbers from here
    if mode == "token":
        return float(sum(counts))
    if mode == "sample":
        return float(sum(count > 0 for count in counts))
    raise ValueError(f"unknown loss aggregation {mode!r} (token | sample)")


def aggregate_loss(
    token_loss: Tensor, mask: Tensor, mode: LossAggregation, denominator: Tensor | float | None = None,
    lengths: Tensor | None = None,
) -> Tensor:
    """Reduce `[B, T]` per-token losses to a scalar.

    token  (DAPO, Eq. 12): sum over every token of every response / total token count. Each token weighs the
           same, so a long response weighs in proportion to its length.
    sample (GRPO, Sec. 2.2): mean over each response's tokens, then mean over responses. Each response weighs the
           same, so each token of a long response weighs less.
    `denominator` overrides the count (the whole mini-batch's, when `token_loss` is one micro-batch of it);
    a zero denominator (nothing in the loss) yields 0. `lengths` overrides each response's token count where
    `mask` holds only a share of its tokens (sequence parallelism: the shares' sums add up to the response's mean).
    """
    if denominator is None:
        denominator = loss_denominator(mask.sum(dim=-1), mode)
    # A host number stays one (dividing by it makes no tensor, so no copy to the device and no wait for it)
    denominator = max(denominator, 1.0) if isinstance(denominator, (int, float)) else denominator.clamp(min=1.0)
    masked = token_loss * mask
    if mode == "token":
        return masked.sum() / denominator
    if mode == "sample":
        lengths = mask.sum(dim=-1) if lengths is None else lengths
        per_response = masked.sum(dim=-1) / lengths.clamp(min=1.0)
        return per_response.sum() / denominator
    raise ValueError(f"unknown loss aggregation {mode!r} (token | sample)")


# -- optional regularisers (both 0 in the paper) -----------------------------------------------------------------
def kl_k3(logp_sampler: Tensor, logp_other: Tensor) -> Tensor:
    """Schulman's k3 per-token estimate of KL(q || p) from tokens drawn from q: (r - 1) - log r, r = p / q.

    Unbiased, always >= 0, low variance. `logp_sampler` = log q, `logp_other` = log p.
    """
    log_r = (logp_other - logp_sampler).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(log_r) - 1.0 - log_r


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution at each position: -sum p log p, from log p itself (logsumexp(z) -
    sum p z is the same in exact arithmetic, but cancels two numbers the size of the largest logit)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def token_loss(
    logp: Tensor,
    logp_old: Tensor,
    advantages: Tensor,
    tis_weight: Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    logp_ref: Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy: Tensor | None = None,
) -> tuple[Tensor, Surrogate]:
    """The per-token DAPO loss: tis_weight * clipped surrogate [+ kl_coef * KL to ref] [- entropy_coef * H].

    KL penalty (GRPO's k3 of KL(pi_theta || pi_ref)) and entropy bonus are both removed in the paper (Sec. 2.3);
    a coefficient of 0 adds nothing to the graph and needs neither `logp_ref` nor `entropy`.
    """
    surrogate = clipped_surrogate(logp, logp_old, advantages, clip_low, clip_high, dual_clip)
    loss = surrogate.loss if tis_weight is None else surrogate.loss * tis_weight
    if kl_coef:
        if logp_ref is None:
            raise ValueError("kl_coef > 0 needs the reference policy's logprobs")
        loss = loss + kl_coef * kl_k3(logp, logp_ref)
    if entropy_coef:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the token entropy (with gradient)")
        loss = loss - entropy_coef * entropy
    return loss, surrogate


# -- metrics -----------------------------------------------------------------------------------------------------
def clip_counts(surrogate: Surrogate, mask: Tensor) -> dict[str, Tensor]:
    """Loss tokens clipped at the low, the high and the dual bound (Clip-Higher diagnostics, Fig. 3).

    Counts, not fractions: the trainer sums them over micro-batches and ranks and divides by the token count.
    0-d tensors on the loss's device: reading them would wait for the GPU, which the trainer does once a step.
    """
    return {
        "clip_low": (surrogate.clipped_low * mask).sum(),
        "clip_high": (surrogate.clipped_high * mask).sum(),
        "clip_dual": (surrogate.clipped_dual * mask).sum(),
    }
