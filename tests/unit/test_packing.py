"""Micro-batch plans, rank balance and the three layouts (learner/packing.py), without a model: every response
token's prediction comes from the position before it, in its own row."""

from __future__ import annotations

import random

import pytest
import torch

from learner.packing import Response, balance, bucketed, collate, lockstep, plan


def responses(count=23, seed=0, shared_prompts=True):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 50) for _ in range(rng.randint(1, 7))] for _ in range(4)]
    out = []
    for i in range(count):
        prompt = prompts[i % 4] if shared_prompts else [rng.randrange(2, 50) for _ in range(rng.randint(1, 7))]
        ids = [rng.randrange(2, 50) for _ in range(rng.randint(1, 12))]
        out.append(Response(i % 4, prompt, ids, torch.zeros(len(ids)), 0.0, False))
    return out


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("budget", [1, 20, 64, 10_000])
def test_plans_cover_every_response_once_within_the_budget(packed, budget):
    rows = responses()
    micro = plan(list(range(len(rows))), rows, budget, packed)
    assert sorted(i for m in micro for i in m) == list(range(len(rows)))
    for m in micro:
        lengths = [rows[i].length for i in m]
        cost = sum(lengths) if packed else max(lengths) * len(m)
        assert cost <= budget or len(m) == 1  # a sequence longer than the budget gets its own micro-batch
    if budget == 10_000:
        assert len(micro) == 1


def test_packing_fills_micro_batches_better_than_padding():
    rows = responses(count=64, seed=4)
    assert len(plan(list(range(64)), rows, 64, True)) < len(plan(list(range(64)), rows, 64, False))


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_balance_deals_tokens_evenly(world):
    rows = responses(count=41, seed=2)
    shards = balance(list(range(41)), rows, world)
    assert sorted(i for s in shards for i in s) == list(range(41))
    loads = [sum(rows[i].length for i in s) for s in shards]
    longest = max(r.length for r in rows)
    assert max(loads) - min(loads) <= longest  # greedy LPT: no rank more than one sequence ahead
    assert shards == balance(list(range(41)), rows, world)  # identical on every rank


def test_lockstep_gives_every_rank_the_same_number_of_passes():
    rows = responses(count=9, seed=1)
    per_rank = [[0, 1, 2, 3, 4, 5, 6, 7], [8]]
    steps = [lockstep(per_rank, rows, 12, True, rank) for rank in range(2)]
    assert len(steps[0]) == len(steps[1]) > 1
    assert all(real for _, real in steps[0])
    assert [real for _, real in steps[1]].count(True) == 1  # the rest are weight-0 passes


@pytest.mark.parametrize("packed", [True, False])
def test_lockstep_pads_with_the_shortest_response_on_every_rank(packed):
    """A rank dealt one very long response has few micro-batches; its padding passes must not run it again (a
    40k-token row three more times made the step 2.3x slower than the balance it was dealt)."""
    long = Response(0, [1, 2], list(range(3, 40_003)), torch.zeros(40_000), 1.0, False)
    short = [Response(1 + i, [1, 2], list(range(3, 4_003 + i)), torch.zeros(4_000 + i), 1.0, False)
             for i in range(15)]
    rows = [long, *short]
    per_rank = balance(list(range(16)), rows, 2)
    steps = [lockstep(per_rank, rows, 16_384, packed, rank) for rank in range(2)]
    assert len(steps[0]) == len(steps[1])
    fillers = [micro for rank in steps for micro, real in rank if not real]
    assert fillers and all(micro == [1] for micro in fillers)  # the shortest response alone, alike on both ranks


def check_predictions(batch, rows):
    """Each response token is predicted by the position right before it, in its own row."""
    indices = batch.indices
    for k in range(batch.targets.numel()):
        response = rows[indices[int(batch.token_response[k])]]
        slot = int(batch.token_slot[k])
        assert int(batch.targets[k]) == response.response_ids[slot]
        assert batch.response_mask[int(batch.token_response[k]), slot] == 1.0
        if batch.prompt is not None and k < batch.first_tokens:  # predicted by its prompt's last position
            prompt = batch.prompt.input_ids[int(batch.hidden_row[k])].tolist()
            assert prompt[-len(response.prompt_ids):] == response.prompt_ids
            assert int(batch.hidden_pos[k]) == len(prompt) - 1
            continue
        row = batch.input_ids[int(batch.hidden_row[k])].tolist()
        pos = int(batch.hidden_pos[k])
        assert row[pos + 1] == response.response_ids[slot]
        expected = response.response_ids[slot - 1] if slot else response.prompt_ids[-1]
        assert row[pos] == expected


@pytest.mark.parametrize("layout", ["packed", "padded", "shared"])
@pytest.mark.parametrize("bucket", [1, 16])
def test_layouts_point_at_the_position_before_each_token(layout, bucket):
    rows = responses(count=11, seed=3)
    batch = collate(rows, [4, 0, 7, 2, 9], layout, pad_token_id=0, bucket=bucket)
    check_predictions(batch, rows)
    assert batch.input_ids.shape[1] % bucket == 0
    assert batch.response_mask.sum() == batch.targets.numel() == sum(len(rows[i].response_ids) for i in [4, 0, 7, 2, 9])


def test_packed_rows_restart_their_positions_and_hold_no_padding_but_the_tail():
    rows = responses(count=6, seed=5, shared_prompts=False)
    batch = collate(rows, list(range(6)), "packed", pad_token_id=0, bucket=32)
    assert batch.attention_mask is None and batch.input_ids.shape[0] == 1
    positions = batch.position_ids[0].tolist()
    starts = [i for i, p in enumerate(positions) if p == 0]
    lengths = [b - a for a, b in zip(starts, starts[1:] + [len(positions)])]
    real = [r.length for r in rows]
    assert lengths[: len(rows)] == real and sum(real) == batch.real_tokens
    assert len(positions) == bucketed(sum(real), 32)
    assert all(positions[s + t] == t for s, n in zip(starts, lengths) for t in range(n))
    # The varlen kernel's boundaries (learner/attention.py) are the same rows, the padding tail one of its own.
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.cu_seqlens.tolist() == starts + [len(positions)] and batch.longest_row == max(lengths)
    exact = collate(rows, list(range(6)), "packed", pad_token_id=0, bucket=1)
    assert exact.cu_seqlens.tolist() == [0, *torch.tensor(real).cumsum(0).tolist()]  # no tail: no empty row


def test_bucketed():
    assert bucketed(1, 64) == 64 and bucketed(64, 64) == 64 and bucketed(65, 64) == 128 and bucketed(7, 1) == 7


@pytest.mark.parametrize("degree", [2, 3, 4])
def test_sequence_shares_split_a_pack_into_disjoint_parts_that_make_it_whole(degree):
    """Sequence parallelism's shares (learner/sequence_parallel.py): contiguous, equal token ranges of one pack;
    every response token is scored in exactly one share, from a position inside it; the row boundaries stay the
    pack's and each response's whole length is kept (the sample-level loss)."""
    rows = responses(count=9, seed=5)
    indices = list(range(len(rows)))
    whole = collate(rows, indices, "packed", pad_token_id=0, bucket=degree)
    shares = [collate(rows, indices, "packed", pad_token_id=0, bucket=degree, share=(degree, k)) for k in range(degree)]
    size = whole.input_ids.shape[1] // degree
    assert torch.equal(torch.cat([s.input_ids for s in shares], dim=1), whole.input_ids)
    assert torch.equal(torch.cat([s.position_ids for s in shares], dim=1), whole.position_ids)
    assert torch.equal(sum(s.response_mask for s in shares), whole.response_mask)
    scored = sorted((int(r), int(t)) for s in shares for r, t in zip(s.token_response, s.token_slot))
    assert scored == sorted(zip(whole.token_response.tolist(), whole.token_slot.tolist()))
    assert sum(s.real_tokens for s in shares) == whole.real_tokens
    for k, share in enumerate(shares):
        assert torch.equal(share.cu_seqlens, whole.cu_seqlens) and share.longest_row == whole.longest_row
        assert share.input_ids.shape[1] == size and bool(((share.hidden_pos >= 0) & (share.hidden_pos < size)).all())
        mine = (whole.hidden_pos >= k * size) & (whole.hidden_pos < (k + 1) * size)
        assert torch.equal(share.targets, whole.targets[mine])
        assert torch.equal(share.input_ids[0, share.hidden_pos], whole.input_ids[0, whole.hidden_pos[mine]])
        assert torch.equal(share.response_tokens, whole.response_mask.sum(dim=-1))
    assert any(k * size not in whole.cu_seqlens.tolist() for k in range(1, degree))  # a row crosses a share
    with pytest.raises(ValueError, match="packed micro-batches only"):
        collate(rows, indices, "padded", pad_token_id=0, share=(2, 0))
    with pytest.raises(ValueError, match="does not split"):
        collate(rows, indices, "packed", pad_token_id=0, bucket=1, share=(64, 0))


def test_balance_counts_a_long_rows_attention_as_well_as_its_tokens():
    """By tokens, rows of 90, 50, 50 and 40 deal 130 | 100; where attention costs as much as the matrix products at
    100 tokens, the 90-token row (171) outweighs the three others' tokens and gets a rank of its own."""
    rows = [Response(0, [], [2] * length, torch.zeros(length), 0.0, False) for length in (90, 50, 50, 40)]
    assert sorted(map(sorted, balance([0, 1, 2, 3], rows, 2))) == [[0, 3], [1, 2]]
    assert sorted(map(sorted, balance([0, 1, 2, 3], rows, 2, attention_crossover=100.0))) == [[0], [1, 2, 3]]
