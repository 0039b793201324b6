"""FSDP2 as the trainer applies it (learner.compute.fsdp): the learner's own `fully_shard`, not accelerate's.

Why the trainer shards the model itself. accelerate's FSDP2 with `mixed_precision: bf16` sets the parameter, the
gradient-reduction *and the output* dtype to bf16: every sharded module's output is cast, the root's included, and
the root's output is the chunked head's fp32 logprobs and entropies (learner/logprobs.py). Log-ratios rounded to
bf16 (about 0.016 nats at logp -3) are larger than what one update at lr 1e-6 moves them, so the ratios, the clip
decisions and the TIS weights would be noise. Here the policy is:

- parameters gathered in the compute dtype (bf16 on a GPU), master weights and AdamW state in fp32 (the shards);
- gradients reduce-scattered in fp32 (a sum over hundreds of ranks' bf16 gradients loses the small ones);
- outputs never cast: each layer returns what it computed, the head its fp32 logprobs.

The same code runs on CPU ranks over gloo (accelerate's multi-CPU mode is DDP, so its FSDP cannot be tested
without GPUs; this can: tests/integration/test_ranks.py).

Each decoder layer is one FSDP unit, then the root (embeddings, final norm, head). With `fsdp_shard_ranks` set,
the ranks form a 2-D mesh (replicate x shard): parameters are sharded within a group (a node's GPUs, over NVLink)
and replicated across groups (HSDP), so the all-gathers stay inside a node. `fsdp_offload` keeps the shards, their
gradients and AdamW state in host memory (FSDP2's CPUOffloadPolicy), for a model whose fp32 state does not fit.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from learner import activation_checkpointing

if TYPE_CHECKING:  # pragma: no cover
    from services.config import ComputeConfig


def precision_policy(compute_dtype: torch.dtype):
    """FSDP2's mixed precision of the learner: gather in the compute dtype, reduce in fp32, never cast outputs."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32, output_dtype=None)


def backend(device_type: str, offload: bool) -> str:
    """The process group's backend: NCCL on GPUs, gloo on CPUs, and both on GPUs with CPU offload, whose host shards
    take part in collectives (an offloaded gradient's norm, a host shard's gather) that NCCL cannot run."""
    if device_type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if offload else "nccl"


@functools.cache
def device_mesh(world: int, shard_ranks: int | None, device_type: str, offload: bool = False):
    """1-D mesh over every rank (FSDP), or replicate x shard (HSDP) with `shard_ranks` ranks per shard group; one
    per process and shape (`dapo plan` makes it before its fake tensors: a mesh holds real rank numbers)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if shard_ranks is not None and (shard_ranks < 1 or world % shard_ranks):
        raise ValueError(f"learner.compute.fsdp_shard_ranks {shard_ranks} must divide the learner's {world} ranks")
    if not dist.is_initialized():  # one process (FSDP for its CPU offload): a group of one, no rendezvous
        dist.init_process_group(backend(device_type, offload), store=dist.HashStore(), rank=0, world_size=1)
    if shard_ranks is None or shard_ranks == world:
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (world // shard_ranks, shard_ranks), mesh_dim_names=("replicate", "shard"))


def shard(model: nn.Module, compute: "ComputeConfig", compute_dtype: torch.dtype, mesh,
          device: torch.device) -> nn.Module:
    """`model` with every decoder layer and the root wrapped by `fully_shard` over `mesh` (`device_mesh`; in place,
    returned for clarity)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = precision_policy(compute_dtype)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if compute.fsdp_offload else OffloadPolicy()
    # fully_shard moves each shard to the mesh's device (kept in host memory with the offload policy)
    for layer in activation_checkpointing.decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, offload_policy=offload)
    # The root (embeddings, norm, head) stays gathered after the forward: the backward needs it at once.
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False)
    return model

