"""Ulysses sequence parallelism (`learner.compute.sequence_parallel`): one packed micro-batch split over a group of
ranks, so that a response longer than one GPU's activations can hold still trains.

How (DeepSpeed-Ulysses, Jacobs et al. 2023; verl's DAPO-32B script runs a degree of 8):
- the ranks of a group (`degree` consecutive ranks) train on the same micro-batches; each runs a contiguous
  1/degree of the pack's tokens, its share (learner/packing.py `sequence_share`), through the model. Embeddings,
  norms, MLPs and the rotary embedding (which takes the share's own position ids) work per token, so they run on
  the share as they are;
- attention needs every key of a row: an all-to-all trades the sequence split for a head split (each rank then
  holds every token of 1/degree of the heads), the kernel runs on the whole pack's row boundaries, and a second
  all-to-all trades back (`attention_forward`). Both are differentiable (the backward is the opposite trade);
- the LM head scores the response tokens whose predicting position lies in the rank's share. The ranks' losses
  are disjoint parts of the micro-batch's sum over tokens, and DDP's or FSDP's gradient reduction adds them (the
  trainer scales each rank's loss by the world size, as for data-parallel ranks). A value of every token
  (`Trainer.logprobs`) is the sum over the group of each rank's part (`SequenceGroup.complete`).

Activations per rank are 1/degree of the pack's; parameters, gradients and AdamW state are sharded over every
rank (the groups' included) with `learner.compute.fsdp`, replicated without it (DDP). The query heads must split
evenly over the group; key/value heads too, or are repeated up to the degree (grouped-query models with fewer KV
heads than the degree). `pi_old` and the reference's logprobs are kept whole (`complete`): training cuts its packs
otherwise than the no-grad pass does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from learner import attention
from services.config import ConfigError

ULYSSES = "dapo_ulysses"

Attention = Callable[..., tuple[Tensor, Any]]  # transformers' attention interface


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: `degree` consecutive ranks, this one at `rank` in it."""

    degree: int = 1
    rank: int = 0
    process_group: Any = None  # torch.distributed's group of the ranks (None for a group of one)
    inner: Attention | None = None  # the kernel that runs on the whole pack, a slice of the heads

    def complete(self, values: Tensor) -> Tensor:
        """The whole micro-batch's per-token values from each rank's part (zero outside its tokens)."""
        if self.degree == 1:
            return values
        import torch.distributed as dist

        values = values.clone()
        dist.all_reduce(values, group=self.process_group)
        return values


def loaded_attention(implementation: str, degree: int) -> str:
    """The `attn_implementation` the learner's model loads with: the chosen kernel, or Ulysses around it."""
    if degree == 1:
        return implementation
    register()
    return ULYSSES


def join(model, degree: int, packed: bool, implementation: str, gpu: bool) -> SequenceGroup:
    """This rank's group for `model` (loaded with `loaded_attention`, or a caller's model, switched to it here),
    whose attention kernel is `implementation`; every rank calls it."""
    if degree == 1:
        return SequenceGroup()
    if not packed:
        raise ValueError("learner.compute.sequence_parallel splits packed micro-batches: set "
                         "learner.compute.packing: on")
    if gpu and implementation not in (attention.VARLEN, "flash_attention_2"):
        # SDPA on the pack's dense [T x T] mask in every layer would cost more than the shares save
        raise ValueError("learner.compute.sequence_parallel on a GPU runs a varlen flash kernel (bf16, torch >= "
                         "2.10 on Ampere or newer): learner.compute.attention is " + repr(implementation))
    check_heads(model.config, degree)
    model.config._attn_implementation = loaded_attention(implementation, degree)
    import torch.distributed as dist

    # The process group's world: accelerate's ranks, or the fake world `dapo plan` runs rank 0 of.
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    return group(degree, world, rank, inner_attention(implementation))


def group(degree: int, world: int, rank: int, inner: Attention | None) -> SequenceGroup:
    """This rank's group: ranks [k * degree, (k + 1) * degree). Every rank must call it (each new group is a
    collective over the default group), with the same degree."""
    if degree == 1:
        return SequenceGroup()
    if degree < 1 or world % degree:
        raise ValueError(f"learner.compute.sequence_parallel {degree} must divide the learner's {world} ranks")
    import torch.distributed as dist

    mine = None
    for first in range(0, world, degree):
        ranks = list(range(first, first + degree))
        made = dist.new_group(ranks)
        if rank in ranks:
            mine = made
    return SequenceGroup(degree, rank % degree, mine, inner)


def check_heads(config, degree: int) -> None:
    """The model's heads split over `degree` ranks: every query head group whole on one rank (ConfigError: a
    usage error, not restarted)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % degree or (kv % degree and degree % kv):
        raise ConfigError(f"learner.compute.sequence_parallel {degree}: the model's {heads} query and {kv} key/value "
                         "heads do not split over that many ranks (the degree must divide the query heads, and "
                         "divide or be a multiple of the key/value heads)")


def register() -> None:
    """Make `ULYSSES` a valid `attn_implementation` (no mask: the pack's row boundaries replace it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES, attention_forward)


def inner_attention(implementation: str) -> Attention:
    """The kernel each rank runs on its heads of the whole pack: PyTorch's varlen flash kernel where the trainer
    chose a varlen kernel (it takes the rows' boundaries), otherwise SDPA on a block-diagonal causal mask built from
    them (CPUs). flash-attn's transformers wrapper is not used: it picks its kernel by the model's attention name,
    which is Ulysses' here; PyTorch's own kernel is the same algorithm."""
    if implementation in (attention.VARLEN, "flash_attention_2"):
        if attention.kernel() is None:
            raise ValueError("learner.compute.sequence_parallel runs PyTorch's varlen flash kernel (torch >= 2.10), "
                             "not in this torch")
        return attention.varlen_attention_forward
    return rows_sdpa


def rows_sdpa(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *, scaling=None,
              cu_seq_lens_q: Tensor, sliding_window=None, softcap=None, s_aux=None, **kwargs) -> tuple[Tensor, None]:
    """Causal SDPA confined to each row of a pack: query [1, Hq, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, Hq, D], None). Dense `[T x T]` mask: for CPUs and tests; a GPU runs a varlen kernel."""
    if sliding_window is not None or softcap is not None or s_aux is not None:
        raise ValueError("sequence parallelism runs plain causal attention: this model asks for a sliding window, a "
                         "softcap or attention sinks")
    length = query.shape[2]
    row = torch.repeat_interleave(torch.arange(len(cu_seq_lens_q) - 1, device=query.device),
                                  torch.diff(cu_seq_lens_q.to(query.device)), output_size=length)
    mask = (row[:, None] == row[None, :]).tril()
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2), None


def attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, *,
                      sequence_group: SequenceGroup, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention interface on a rank's share: query [1, Hq, T/d, D], key/value [1, Hkv, T/d, D] ->
    ([1, T/d, Hq, D], None), attending over the whole pack (the forward's `cu_seq_lens_q` are the pack's)."""
    g = sequence_group
    if torch.is_autocast_enabled(query.device.type):  # the rotary embedding leaves q and k in fp32: half the bytes
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    kv_heads = key.shape[1]
    if kv_heads % g.degree:  # fewer KV heads than ranks: repeat each so that every rank gets its queries' one
        key, value = (t.repeat_interleave(g.degree // kv_heads, dim=1) for t in (key, value))
    q, k, v = (_sequence_to_heads(t, g) for t in (query, key, value))
    out, _ = g.inner(module, q, k, v, None, **kwargs)  # [1, T, H/d, D]
    return _heads_to_sequence(out, g), None


def _exchange(x: Tensor, g: SequenceGroup) -> Tensor:
    """Part j of `x` (its first dimension, split in `degree` equal parts) to rank j; the parts received, in rank
    order. Differentiable: the backward sends each gradient part back."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    out = all_to_all_single_autograd(x.contiguous(), None, None, g.process_group)
    return out.wait() if hasattr(out, "wait") else out


def _sequence_to_heads(x: Tensor, g: SequenceGroup) -> Tensor:
    """[1, H, T/d, D] (every head, this rank's tokens) -> [1, H/d, T, D] (this rank's heads, every token)."""
    _, heads, share, dim = x.shape
    parts = _exchange(x[0].reshape(g.degree, heads // g.degree, share, dim), g)  # [d(from rank), H/d, T/d, D]
    return parts.transpose(0, 1).reshape(1, heads // g.degree, g.degree * share, dim)


def _heads_to_sequence(x: Tensor, g: SequenceGroup) -> Tensor:
    """[1, T, H/d, D] (this rank's heads, every token) -> [1, T/d, H, D] (every head, this rank's tokens)."""
    _, length, heads, dim = x.shape
    parts = _exchange(x[0].reshape(g.degree, length // g.degree, heads, dim), g)  # [d(heads of rank), T/d, H/d, D]
    return parts.transpose(0, 1).reshape(1, length // g.degree, g.degree * heads, dim)
