"""How much Redis the learner's `held` stream may need, against Redis' maxmemory (pure: no Redis, no model).

`held` keeps every informative group from the moment it is read until the checkpoint after the step that consumed
it (learner/workset.py), so between two checkpoints it holds up to checkpoint_every steps of groups, and the next
step's in hand. Redis runs with `maxmemory` and `noeviction`: a write beyond it is refused, so a learner whose
`held` outgrows it could neither hold the groups of its next step nor checkpoint to release the old ones. At
start the learner compares the largest `held` its settings allow with its share of maxmemory
(redis.held_memory_share): a single step that does not fit refuses the start, a checkpoint interval that does not
fit is a warning (the learner then checkpoints early, whenever Redis passes the share: `memory_pressed`).

A group's size is measured, not guessed: the wire bytes (`services.messages.to_wire`) of the largest group the run's
tasks allow, n samples of max_tokens tokens after a prompt of generator.max_prompt_tokens. Token ids and logprobs
take 8 bytes a token on the wire; the decoded text is counted at TEXT_BYTES_PER_TOKEN. It is an upper bound: real
responses are mostly shorter than max_tokens.
"""

from __future__ import annotations

from services.config import GROUP_STREAMS, Settings
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup, to_wire

TEXT_BYTES_PER_TOKEN = 4  # the decoded text of a BPE token of English or math: about 4 characters
REDIS_OVERHEAD = 1.1  # a stream entry's bytes in Redis over its wire bytes (measured: +8 % at 3.8 MB, jemalloc)
MB = 1024 * 1024


def largest_group_bytes(settings: Settings) -> int:
    """Wire bytes of the largest scored group the run's training tasks allow."""
    n, max_tokens = settings.sampling.n, settings.sampling.max_tokens
    prompt_tokens = settings.generator.max_prompt_tokens
    task = PromptTask(prompt_id="p", prompt="x" * (TEXT_BYTES_PER_TOKEN * prompt_tokens),
                      prompt_token_ids=[0] * prompt_tokens, ground_truth="0",
                      sampling=SamplingParams(n=n, max_tokens=max_tokens))
    sample = Sample(token_ids=[0] * max_tokens, logprobs=[0.0] * max_tokens,
                    text="x" * (TEXT_BYTES_PER_TOKEN * max_tokens), finish_reason="length")
    score = Score(reward=-1.0, correct=False, overlong=True, rule="none")
    rollout = RolloutGroup(task=task, policy_version=0, generator_id="g", samples=[sample] * n)
    return len(to_wire(ScoredGroup(rollout=rollout, scores=[score] * n)))


def held_groups(settings: Settings) -> tuple[int, int]:
    """(groups of one step, groups `held` keeps at most): checkpoint_every steps (every step of the run when 0,
    a checkpoint only at the end) and the next step's in hand."""
    learner = settings.learner
    steps = learner.checkpoints.every or learner.total_steps
    return learner.batch.prompts_per_step, learner.batch.prompts_per_step * (steps + 1)


def held_budget(settings: Settings, maxmemory: int, group_bytes: int) -> tuple[str, str]:
    """("ok" | "warn" | "refuse", the figures): `held` at its largest against redis.held_memory_share of
    `maxmemory` (bytes; 0: Redis has no limit)."""
    share = settings.redis.held_memory_share
    step, most = held_groups(settings)
    figure = (f"`held` keeps up to {most} groups between checkpoints ({step} a step x "
              f"{settings.learner.checkpoints.every or settings.learner.total_steps} steps + the next step's) of at "
              f"most {group_bytes / MB:.2f} MB each (n {settings.sampling.n} x max_tokens "
              f"{settings.sampling.max_tokens}): {most * group_bytes / MB:,.0f} MB")
    if maxmemory <= 0:
        return "warn", (f"Redis has no maxmemory: {figure}, and a Redis past its memory limit is killed (then "
                        "reloads its AOF into the same memory); set maxmemory with the policy noeviction "
                        "(docs/deploy.md)")
    budget = share * maxmemory
    against = f"against {share:g} of Redis' maxmemory {maxmemory / MB:,.0f} MB = {budget / MB:,.0f} MB"
    if step * group_bytes > budget:
        return "refuse", (f"one step's groups need up to {step * group_bytes / MB:,.0f} MB ({step} x "
                          f"{group_bytes / MB:.2f} MB) in `held`, {against}: the learner could not hold a step "
                          "before it checkpoints. Raise Redis' maxmemory (redis.embedded_maxmemory_mb for the "
                          "embedded server) or redis.held_memory_share, or lower learner.batch.prompts_per_step, "
                          "sampling.n or sampling.max_tokens")
    # The rest of maxmemory is the group streams' room: at their marks they must fit it, or a stall of the reward
    # workers or of the learner fills Redis before any generator waits (REDIS_OVERHEAD: Redis' allocator rounds up)
    warnings = []
    if most * group_bytes > budget:
        warnings.append(f"{figure}, {against}: the learner checkpoints early whenever Redis uses more "
                        "(redis.held_memory_share)")
    group_streams = sum(settings.streams.high_water_of(name) for name in GROUP_STREAMS)
    room = (1 - share) * maxmemory
    if group_streams * group_bytes * REDIS_OVERHEAD > room:
        fitting = int(room / (len(GROUP_STREAMS) * group_bytes * REDIS_OVERHEAD))
        warnings.append(f"`rollouts` and `scored` at their marks ({group_streams // len(GROUP_STREAMS)} groups "
                        f"each) need up to {group_streams * group_bytes * REDIS_OVERHEAD / MB:,.0f} MB, more than the "
                        f"{room / MB:,.0f} MB of Redis' maxmemory that `held` leaves them: a stall of the reward "
                        "workers or of the learner fills Redis before the generators wait, and the learner then trims "
                        f"finished groups; set streams.group_high_water to at most {max(fitting, 1)}")
    return ("warn", "; and ".join(warnings)) if warnings else ("ok", f"{figure}, {against}")


def eviction_refusal(policy: str) -> tuple[str, str]:
    """("ok" | "warn" | "refuse", why) for Redis' maxmemory-policy: a full Redis must refuse writes (noeviction);
    one that evicts keys accepts them and deletes the run's instead, with no error anywhere."""
    if policy == "noeviction":
        return "ok", ""
    if policy.startswith("allkeys"):
        return "refuse", (f"Redis evicts any key when full (maxmemory-policy {policy}): the run's streams, `held` "
                          "and `issued` would vanish without an error; set maxmemory-policy noeviction "
                          "(docs/deploy.md)")
    return "warn", (f"Redis evicts keys with a time to live when full (maxmemory-policy {policy}): the learner's "
                    "lease and the forward markers among them; set maxmemory-policy noeviction (docs/deploy.md)")


def memory_pressed(used: int, maxmemory: int, share: float) -> bool:
    """Redis uses its share for `held` (or more) of a maxmemory it has: time to checkpoint and release `held`."""
    return maxmemory > 0 and used >= share * maxmemory
