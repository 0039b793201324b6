"""Sequence parallelism's pure parts (learner/sequence_parallel.py): which models split over how many ranks, the
cost that balances ranks, and the sample-level loss over shares. The ranks themselves run in
tests/integration/test_ranks.py (2 and 4 gloo ranks against one process)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

from learner import dapo, sequence_parallel, throughput
from learner.plan import MODEL_CONFIGS


def shipped(name: str) -> SimpleNamespace:
    return SimpleNamespace(**json.loads((MODEL_CONFIGS / name).read_text()))


@pytest.mark.parametrize("model, degree, splits", [
    ("qwen2.5-32b.json", 8, True),  # 40 query heads, 8 KV heads: 5 and 1 a rank (verl's DAPO-32B degree)
    ("qwen2.5-32b.json", 16, False),  # 40 query heads do not split in 16
    ("qwen2.5-math-1.5b.json", 4, True),  # 12 and 2: each KV head repeated on 2 ranks
    ("qwen2.5-math-1.5b.json", 3, False),  # 2 KV heads do not divide 3, nor 3 them
    ("qwen2.5-math-1.5b.json", 8, False),
])
def test_the_heads_split_over_the_degree_or_the_config_is_refused(model, degree, splits):
    config = shipped(model)
    if splits:
        sequence_parallel.check_heads(config, degree)
    else:
        with pytest.raises(ValueError, match="do not split over that many ranks"):
            sequence_parallel.check_heads(config, degree)


@pytest.mark.parametrize("degree, processes, refusal", [
    (3, 3, "the model's 4 query and 2 key/value heads do not split"),  # the tiny model's heads
    (2, 3, "sequence_parallel 2 must divide the learner's processes (3)"),
    (2, 2, None),
])
def test_a_learner_refuses_its_compute_settings_before_it_loads_the_model(degree, processes, refusal):
    """A degree the heads cannot split failed after the model had loaded (minutes at 32B), as a crash (exit 1):
    restarted by `dapo run` until its limit, by Kubernetes for ever, loading the model each time."""
    from learner.service import refuse_before_load
    from services.config import ConfigError, load_settings

    settings = load_settings("tiny-cpu", learner={"compute": {"sequence_parallel": degree, "packing": "on"}})
    if refusal is None:
        refuse_before_load(settings, processes)
    else:
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            refuse_before_load(settings, processes)


def test_unpacked_rows_or_a_degree_that_does_not_divide_the_ranks_are_refused():
    model = SimpleNamespace(config=shipped("qwen2.5-32b.json"))
    with pytest.raises(ValueError, match="packing: on"):
        sequence_parallel.join(model, 8, packed=False, implementation="sdpa", gpu=False)
    with pytest.raises(ValueError, match="on a GPU runs a varlen flash kernel"):  # SDPA's dense mask per layer
        sequence_parallel.join(model, 8, packed=True, implementation="sdpa", gpu=True)
    with pytest.raises(ValueError, match="sequence_parallel 4 must divide the learner's 6 ranks"):
        sequence_parallel.group(4, world=6, rank=0, inner=None)
    assert sequence_parallel.join(None, 1, packed=False, implementation="sdpa", gpu=True).degree == 1  # off


def test_attention_costs_as_much_as_the_matrix_products_near_97k_tokens_at_32b():
    """N / (d L): 31.2 B body parameters, 40 x 128-wide query heads, 64 layers (the issue's 20 % at 20k tokens)."""
    config = shipped("qwen2.5-32b.json")
    body = 32_763_876_352 - 2 * config.vocab_size * config.hidden_size  # untied embeddings and head
    crossover = throughput.attention_crossover(config, body)
    assert 90_000 < crossover < 100_000
    assert 0.19 < 20_480 / crossover < 0.23


def test_the_sample_level_loss_of_the_shares_adds_up_to_the_whole():
    """Each response's mean over its tokens: a share holds part of them, so it divides by the whole length."""
    generator = torch.Generator().manual_seed(0)
    losses = torch.randn(3, 7, generator=generator)
    mask = torch.tensor([[1.0] * 7, [1.0] * 4 + [0.0] * 3, [1.0] * 2 + [0.0] * 5])
    whole = dapo.aggregate_loss(losses, mask, "sample", denominator=3)
    cut = torch.zeros_like(mask)
    cut[:, :3] = 1
    parts = [mask * cut, mask * (1 - cut)]
    shares = sum(dapo.aggregate_loss(losses, part, "sample", 3, lengths=mask.sum(dim=-1)) for part in parts)
    assert torch.allclose(shares, whole)
    unaware = sum(dapo.aggregate_loss(losses, part, "sample", 3) for part in parts)
    assert not torch.allclose(unaware, whole)  # without the lengths each share would be a mean of its own


def test_dapo_run_refuses_a_degree_that_does_not_divide_its_learner_processes(tmp_path):
    """Before anything starts: a learner that cannot make its groups would fail at every restart."""
    from cli.launcher import main
    from services.config import ConfigError, load_settings

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), learner={"compute": {"sequence_parallel": 2}})
    with pytest.raises(ConfigError, match="sequence_parallel 2 must divide the learner's processes"):
        main(settings, learner_procs=1, display=False)
    assert not any(tmp_path.iterdir())  # nothing started, nothing written


@pytest.mark.parametrize("checkpointing", ["off", "selective"])
def test_selective_checkpointing_keeps_the_exchanges_for_backward(checkpointing):
    """Ulysses' all-to-alls are network time on the critical path: `selective` keeps their outputs (as torchtitan
    keeps its collectives'), so backward sends no more of them than with checkpointing off (it sent q, k, v and the
    output again: as many as `full`). Counted on a fake process group of 2, where every collective returns at once."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import checkpoint

    from learner.activation_checkpointing import SELECTIVE_CONTEXT

    class CountExchanges(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += "all_to_all" in str(func)
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = sequence_parallel.SequenceGroup(2, 0, dist.group.WORLD, sequence_parallel.rows_sdpa)
        weight = torch.randn(8, 8, requires_grad=True)

        def layer(hidden):  # a rank's share of 6 tokens of a 12-token pack of two rows; 2 heads of 4
            q = (hidden @ weight).view(1, 6, 2, 4).transpose(1, 2)
            out, _ = sequence_parallel.attention_forward(None, q, q, q, None, sequence_group=group,
                                                         cu_seq_lens_q=torch.tensor([0, 5, 12], dtype=torch.int32))
            return out.reshape(1, 6, 8) @ weight

        hidden = torch.randn(1, 6, 8, requires_grad=True)
        out = layer(hidden) if checkpointing == "off" else checkpoint(layer, hidden, use_reentrant=False,
                                                                       context_fn=SELECTIVE_CONTEXT)
        with CountExchanges() as counted:
            out.sum().backward()
    finally:
        dist.destroy_process_group()
    assert counted.count == 4  # each exchange's backward sends its gradient back once: q, k, v, the output
