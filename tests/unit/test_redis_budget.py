"""`held` against Redis' maxmemory (learner/redis_budget.py): the figures, and when the learner refuses or warns."""

from __future__ import annotations

import pytest

from learner.redis_budget import MB, eviction_refusal, held_budget, held_groups, largest_group_bytes, memory_pressed
from services.config import load_settings


def test_a_group_is_measured_on_the_wire_at_its_largest():
    settings = load_settings("dapo-qwen2.5-32b")
    group = largest_group_bytes(settings)
    tokens = settings.sampling.n * settings.sampling.max_tokens
    # 8 bytes a token (int32 id, float32 logprob) + 4 of text: the 0.75 MB at 16 x 4k tokens, x5 at 20k
    assert 12 * tokens < group < 12.1 * tokens + 20 * settings.generator.max_prompt_tokens
    smaller = load_settings("dapo-qwen2.5-32b", sampling={"max_tokens": 4096}, reward={"overlong_buffer": 1024})
    assert largest_group_bytes(smaller) == pytest.approx(0.75 * MB, rel=0.03)


def test_held_keeps_a_checkpoint_interval_of_steps_and_the_next_one():
    settings = load_settings("tiny-cpu", learner={"batch": {"prompts_per_step": 64}, "checkpoints": {"every": 10}})
    assert held_groups(settings) == (64, 64 * 11)
    at_the_end_only = load_settings("tiny-cpu", learner={"checkpoints": {"every": 0}, "total_steps": 100})
    assert held_groups(at_the_end_only)[1] == at_the_end_only.learner.batch.prompts_per_step * 101


def test_the_32b_recipe_is_refused_a_small_redis_and_warned_on_the_recipe_overlay_size():
    settings = load_settings("dapo-qwen2.5-32b")
    group = largest_group_bytes(settings)
    verdict, figures = held_budget(settings, 1536 * MB, group)  # the base manifests' Redis
    assert verdict == "refuse"
    assert "one step's groups need up to 1,929 MB (512 x 3.77 MB)" in figures
    assert "against 0.5 of Redis' maxmemory 1,536 MB = 768 MB" in figures
    verdict, figures = held_budget(settings, 9216 * MB, group)  # the 32B overlay's Redis
    assert verdict == "warn"
    assert "up to 5632 groups between checkpoints (512 a step x 10 steps + the next step's)" in figures
    assert "checkpoints early" in figures


def test_the_group_streams_at_their_marks_must_fit_what_held_leaves_of_redis():
    """At 2,048 entries each, `rollouts` and `scored` of the 32B recipe's groups (3.8 MB) take 17 GB: a stall of the
    reward workers filled the overlay's 9 GB Redis long before any generator waited on back-pressure."""
    unbounded = load_settings("dapo-qwen2.5-32b", streams={"group_high_water": None})
    group = largest_group_bytes(unbounded)
    verdict, figures = held_budget(unbounded, 9216 * MB, group)
    assert verdict == "warn" and "(2048 groups each)" in figures
    assert "set streams.group_high_water to at most 555" in figures
    assert "checkpoints early" in figures  # both warnings, not the first alone
    shipped = load_settings("dapo-qwen2.5-32b")
    assert shipped.streams.high_water_of("rollouts") == shipped.streams.high_water_of("scored") == 512
    assert shipped.streams.high_water_of("prompts") == 2048  # tasks are small: a step's pushes fit
    assert "group_high_water" not in held_budget(shipped, 9216 * MB, group)[1]


def test_a_small_run_fits_and_a_redis_without_maxmemory_is_warned_about():
    settings = load_settings("tiny-cpu")
    group = largest_group_bytes(settings)
    assert held_budget(settings, 1024 * MB, group)[0] == "ok"
    verdict, figures = held_budget(settings, 0, group)
    assert verdict == "warn" and figures.startswith("Redis has no maxmemory")
    assert held_budget(load_settings("tiny-cpu", redis={"held_memory_share": 0.01}), 1024 * MB, group)[0] == "warn"


def test_memory_is_pressed_at_the_share_of_a_maxmemory_redis_has():
    assert memory_pressed(500, 1000, 0.5) and not memory_pressed(499, 1000, 0.5)
    assert not memory_pressed(10**12, 0, 0.5)  # no maxmemory: nothing to measure against


def test_only_a_redis_that_refuses_writes_when_full_keeps_the_run():
    assert eviction_refusal("noeviction") == ("ok", "")
    for policy in ("allkeys-lru", "allkeys-lfu", "allkeys-random"):
        assert eviction_refusal(policy)[0] == "refuse"
    for policy in ("volatile-lru", "volatile-ttl", "volatile-random", "volatile-lfu"):
        verdict, why = eviction_refusal(policy)
        assert verdict == "warn" and "lease" in why
