"""The learner's accelerate setup: the configurations the trainer refuses, and the CPUs its ranks share."""

from __future__ import annotations

import os

import torch

from services.cpus import usable_cpu_count


def out_of_memory(err: BaseException) -> bool:
    """A GPU's (torch.OutOfMemoryError), the host's (MemoryError), or PyTorch's CPU allocator's, which raises a
    plain RuntimeError."""
    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def check_accelerator(accelerator) -> None:
    """Refuse the accelerate configurations the trainer cannot run under."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError("DeepSpeed is not supported by the DAPO trainer (its engine owns gradient accumulation and "
                         "clipping); launch a multi-GPU accelerate config with learner.compute.fsdp: true instead")
    if accelerator.distributed_type == DistributedType.FSDP:  # its bf16 policy rounds the head's logprobs
        raise ValueError("accelerate's FSDP (distributed_type: FSDP) casts every sharded module's output to bf16, "
                         "the head's fp32 logprobs included: launch a multi-GPU accelerate config "
                         "(deploy/accelerate/fsdp.yaml) and set learner.compute.fsdp: true, the trainer shards the "
                         "model itself (learner/sharding.py)")
    if accelerator.gradient_accumulation_steps != 1:  # (ACCELERATE_GRADIENT_ACCUMULATION_STEPS in the environment)
        raise ValueError(f"accelerate's gradient accumulation ({accelerator.gradient_accumulation_steps} steps) would "
                         "divide every loss the trainer backpropagates by it (the clip threshold moves with it): the "
                         "trainer accumulates its micro-batches itself (learner.compute.micro_batch_tokens); unset "
                         "ACCELERATE_GRADIENT_ACCUMULATION_STEPS")


def share_cpu_threads(accelerator) -> None:
    """On CPU, the learner's CPUs (OMP_NUM_THREADS when set: the launcher's or the container's CPU limit, else the
    CPUs this process may run on, cut to its CPU quota) shared among this node's ranks: one intra-op thread per CPU."""
    if accelerator.device.type != "cpu":
        return
    cores = usable_cpu_count()
    budget = os.environ.get("OMP_NUM_THREADS")
    cores = int(budget) if budget and budget.isascii() and budget.isdigit() else cores
    local = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))
    torch.set_num_threads(max(1, cores // max(local, 1)))
