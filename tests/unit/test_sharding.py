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
