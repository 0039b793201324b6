"""The learner's FSDP2 policy (learner/sharding.py): what it casts and what it never rounds."""

from __future__ import annotations

import pytest
import torch

from learner import sharding


def test_the_policy_computes_in_the_compute_dtype_reduces_in_fp32_and_never_casts_outputs():
    policy = sharding.precision_policy(torch.bfloat16)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, None)


def test_an_hsdp_shard_group_must_divide_the_ranks():
    with pytest.raises(ValueError, match="fsdp_shard_ranks 3 must divide the learner's 4 ranks"):
        sharding.device_mesh(4, 3, "cpu")


def test_cpu_offload_on_gpus_gets_a_cpu_backend_beside_nccl():
    """The offloaded gradients' norm and the host shards' gathers are collectives on CPU tensors: an NCCL-only
    group fails them ("No backend type associated with device type cpu")."""
    assert sharding.backend("cuda", offload=True) == "cuda:nccl,cpu:gloo"
    assert sharding.backend("cuda", offload=False) == "nccl"
    assert sharding.backend("cpu", offload=True) == sharding.backend("cpu", offload=False) == "gloo"


def test_the_published_weights_are_dealt_to_the_writing_ranks_by_size():
    from learner.publish import owners

    sizes = {"embed": 100, "layer.0": 40, "layer.1": 40, "norm": 1, "head": 60}
    dealt = owners(sizes, [0, 1])
    assert dealt == owners(dict(reversed(sizes.items())), [0, 1])  # the same on every rank, whatever the order
    load = [sum(sizes[n] for n, r in dealt.items() if r == rank) for rank in (0, 1)]
    assert sum(load) == 241 and max(load) <= 241 / 2 + 100
    assert set(owners(sizes, [4, 5, 6]).values()) == {4, 5, 6}  # HSDP: the first replica's ranks, by number
    assert set(owners({"only": 8}, [0, 1, 2]).values()) == {0}  # a rank may own nothing


def test_a_layer_is_written_whole_by_one_rank():
    """transformers splits some checkpoint tensors in memory (a fused qkv or gate_up projection): reverting them
    takes all the parts, which are of one layer."""
    from learner.publish import writing_unit

    layer = ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
             "model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.7.down_proj.weight")
    assert {writing_unit(name) for name in layer} == {"model.layers.3"}
    assert writing_unit("model.layers.13.mlp.up_proj.weight") == "model.layers.13"
    assert writing_unit("model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert writing_unit("lm_head.weight") == "lm_head.weight"
